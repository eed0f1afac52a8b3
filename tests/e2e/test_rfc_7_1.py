"""RFC §7.1, row by row, through the whole stack: the Ray registry actor, the Publisher, the Reclaimer, the
SessionBinder with agentic traffic and two real engines. Every intermediate state a row names is asserted
when it holds, not merely waited for.

Rows: 1 (B READY on E0 only, then both, commit), 2 (duplicate publication and content conflict), 3
(single-engine failure, manifest error, lost commit ACK), 4 (cleanup first, late begin/READY/receive of the old
attempt, duplicate receive), 5 (bind/close and cancel/complete concurrency), 6 (SGLang's native request
refcount: r1 ends by 500, 503, pre-dispatch 400, disconnect, abort or twice while r2 holds A), 7 (session refs
0 while the engine still holds a request), 8 (capacity, repeated reclaim, late unload receipt) and 9 (missing
exact version, bypass of management, the switch off). Every deadline of row 3 is `test_phase_deadlines.py`,
every lost reply `test_unknown_outcomes.py`. Row 6's 500 is injected (the engine's test-only `fail_request`
fault point): no request to the fixture text model makes SGLang 0.5.23 answer 500 on demand (its 500s are
multimodal-input and out-of-memory-after-retraction aborts); its 503 is SGLang's own, from inside the request
path.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from deployment import unloads
from engine_helpers import PROMPT, client_for, hold_scheduler, refcount, run, wait_until
from test_publication_e2e import LOGPROB_TOLERANCE, assert_matches_reference, deployed

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, loaded_adapter_slots
from versioned_lora.adapters.sglang_backend import SGLangBackend
from versioned_lora.adapters.sglang_client import EngineHTTPError, ManagedRefusal, SGLangClient
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.lifecycle import (
    BindFirst,
    CloseAndRelease,
    ConfirmReclaim,
    OpenSession,
    RecordPrepared,
    RecordReady,
    Rejected,
    VersionKey,
)
from versioned_lora.runtime.dispatch_gate import VersionUnavailable
from versioned_lora.runtime.interfaces import BackendFailure, BackendRequest, EngineRefused
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.runtime.session_binder import LateResponseDropped
from versioned_lora.spec.identities import LORA_NAME_PREFIX, lora_name
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import PlacementState, VersionState

TOOL = [401, 402, 403]  # a tool turn's tokens between generations


class Gate:
    """Fault injection (timing): the wrapped staging port's `method` waits until the test opens the gate."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner, self.method = inner, method
        self.opened = asyncio.Event()
        self.waiting = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        async def gated(*args: Any, **kwargs: Any) -> Any:
            self.waiting.set()
            await self.opened.wait()
            return await attribute(*args, **kwargs)

        return gated


async def placement(d: Any, version: Any, engine: str) -> PlacementState:
    return (await d.registry.publication_view()).versions[version].placements[engine].state


def test_row_1_b_ready_on_e0_only_keeps_the_default_then_commit_binds_new_sessions_to_b(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            s_old = d.binder.open("S_old@E1")
            first = await d.binder.generate(s_old, PROMPT, 4)

            b_version, b = d.candidate("B")
            gate = Gate(d.ports["E1"], "end")  # E1's end waits: B becomes READY on E0 only
            d.publisher.engines["E1"] = gate
            publication = asyncio.create_task(d.publisher.publish(b_version, b))
            await asyncio.wait_for(gate.waiting.wait(), 120)

            async def e0_ready() -> bool:
                return await placement(d, b_version, "E0") is PlacementState.READY

            await wait_until(e0_ready, timeout_s=120)
            view = await d.registry.publication_view()
            assert view.versions[b_version].placements["E0"].state is PlacementState.READY
            assert view.versions[b_version].placements["E1"].state is not PlacementState.READY
            assert view.default == a_version and view.versions[b_version].state is VersionState.LOADING
            s_mid = d.binder.open("S_mid@E0")
            assert (await d.binder.bind_first(s_mid)).version == a_version  # S_mid = A, default unchanged
            mid = await d.binder.generate(s_mid, PROMPT, 4)
            assert_matches_reference(d, "A", PROMPT, mid.logprobs, mid.output_ids)

            gate.opened.set()
            outcome = await publication
            assert outcome.committed
            view = await d.registry.publication_view()
            assert view.default == b_version and view.versions[a_version].state is VersionState.RETIRED
            s_new = d.binder.open("S_new@E1")
            assert (await d.binder.bind_first(s_new)).version == b_version  # S_new = B
            new = await d.binder.generate(s_new, PROMPT, 4)
            assert_matches_reference(d, "B", PROMPT, new.logprobs, new.output_ids)

            # The old session's continuation, retry and resume stay on A, on both engines' copies of A.
            continued = [*PROMPT, *first.output_ids, *TOOL]
            again = await d.binder.generate(s_old, continued, 4)  # continuation after a tool turn
            assert_matches_reference(d, "A", continued, again.logprobs, again.output_ids)
            retry = await d.binder.generate(s_old, continued, 4)  # a retry: a new attempt, same binding
            assert (retry.output_ids, retry.logprobs) == (again.output_ids, again.logprobs)
            resumed = [*continued, *again.output_ids[:2]]  # a resume from a partial output
            resume = await d.binder.generate(s_old, resumed, 2)
            assert_matches_reference(d, "A", resumed, resume.logprobs, resume.output_ids)
            assert (await d.binder.bind_first(s_old)).version == a_version
            for key in (s_old, s_mid, s_new):
                await d.binder.finish(key)

    run(body())


def test_row_2_duplicate_publication_loads_nothing_again_and_other_content_is_always_a_conflict(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            before, view = await d.audit(), await d.registry.publication_view()
            # The same version with the content of B, named as the registry would name it.
            other = Candidate.build(lora_name(a_version, _digest_of(d, "B")), _snapshot_of(d, "B"), d.bucket_bytes)
            for attempt in range(2):
                replay = await d.publisher.publish(a_version, a)  # same version, same content
                assert (replay.status, replay.version_state) == (PublishStatus.REPLAYED, VersionState.PUBLISHED)
                conflict = await d.publisher.publish(a_version, other)  # same version, other content
                assert (conflict.status, conflict.reason) == (PublishStatus.REJECTED, "VERSION_CONFLICT"), attempt
            after = await d.registry.publication_view()
            assert (after.default, after.default_revision, after.managed_count()) == (
                view.default, view.default_revision, view.managed_count())  # no second slot, no second switch
            assert await d.audit() == before  # nothing begun, loaded or unloaded again on either engine

            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(b_version, b)).committed  # A is RETIRED now
            retired = await d.publisher.publish(a_version, other)
            assert (retired.status, retired.reason) == (PublishStatus.REJECTED, "VERSION_CONFLICT")  # always
            replay = await d.publisher.publish(a_version, a)
            assert (replay.status, replay.version_state) == (PublishStatus.REPLAYED, VersionState.RETIRED)
            assert (await d.registry.publication_view()).default == b_version  # a retired A never returns

    run(body())


def _snapshot_of(d: Any, label: str) -> Any:
    return snapshot_from_adapter_dir(d.fixtures.adapters[label])


def _digest_of(d: Any, label: str) -> str:
    return str(_snapshot_of(d, label).digest)


def test_row_3_one_engine_refusing_a_bad_manifest_keeps_the_default_and_frees_the_slot_once_both_are_clean(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            session = d.binder.open("S_a@E0")
            reference = await d.binder.generate(session, PROMPT, 4)

            b_version, b = d.candidate("B")
            tensors = dict(b.snapshot.tensors)
            first = b.plan.buckets[0].slots[0].name
            tensors[first] = tensors[first].clone()
            tensors[first].view(-1)[0] += 1.0  # E1 receives altered bytes under B's unchanged manifest
            e1 = d.ports["E1"]

            async def corrupted(candidate: Any, attempt_token: str, index: int) -> None:
                link = await e1.link()
                await e1._call(link.transfer_bucket(candidate, attempt_token, index, tensors=tensors))

            d.publisher.engines["E1"] = _Override(e1, transfer_bucket=corrupted)
            gate = Gate(d.ports["E0"], "cleanup")  # E0's cleanup confirms late: the slot must wait for it
            d.publisher.engines["E0"] = gate
            publication = asyncio.create_task(d.publisher.publish(b_version, b))
            await asyncio.wait_for(gate.waiting.wait(), 120)

            async def e1_clean() -> bool:
                return await placement(d, b_version, "E1") is PlacementState.CLEANED

            await wait_until(e1_clean, timeout_s=60)
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.ABORTED and view.default == a_version
            assert view.managed_count() == 2  # one engine clean is not enough to free the candidate's slot
            again = await d.binder.generate(session, PROMPT, 4)  # the old default serves, unchanged
            assert (again.output_ids, again.logprobs) == (reference.output_ids, reference.logprobs)

            gate.opened.set()
            outcome = await publication
            assert outcome.status is PublishStatus.FAILED_CLEAN and "MANIFEST_MISMATCH" in outcome.detail
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.managed_count() == 1
            for client in d.clients.values():
                states = {m["name"]: m["state"] for m in (await client.status())["managed"]}
                assert states[b.lora_name] == "CLEANED" and states[a.lora_name] == "READY"
            await d.binder.finish(session)

    run(body())


class _Override:
    """A staging port with some methods replaced (fault injection), the rest the wrapped port's."""

    def __init__(self, inner: Any, **methods: Any) -> None:
        self._inner, self._methods = inner, methods

    def __getattr__(self, name: str) -> Any:
        return self._methods[name] if name in self._methods else getattr(self._inner, name)


class HeldAfter:
    """Fault injection (timing): the wrapped staging port's `method` runs on the engine, then its answer is held
    until the test opens the gate (the engine did the work; the publisher hears of it late)."""

    def __init__(self, inner: Any, method: str, index: int | None = None) -> None:
        self.inner, self.method, self.index = inner, method, index
        self.opened = asyncio.Event()
        self.waiting = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        async def held(*args: Any, **kwargs: Any) -> Any:
            answer = await attribute(*args, **kwargs)
            if self.index is None or args[-1] == self.index:
                self.waiting.set()
                await self.opened.wait()
            return answer

        return held


async def _managed(client: Any, name: str) -> dict[str, Any] | None:
    return next((m for m in (await client.status())["managed"] if m["name"] == name), None)


def test_row_4_cleanup_first_then_late_begin_ready_and_receive_of_the_old_attempt_recreate_nothing(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            session = d.binder.open("S_a@E0")
            reference = await d.binder.generate(session, PROMPT, 4)

            b_version, b = d.candidate("B")
            last = b.bucket_count - 1
            assert last >= 1
            # E1's last bucket lands and its answer is held; then E1's end runs and its READY_LOCAL is held.
            bucket_gate = HeldAfter(d.ports["E1"], "transfer_bucket", index=last)
            end_gate = HeldAfter(bucket_gate, "end")
            d.publisher.engines["E1"] = end_gate
            publication = asyncio.create_task(d.publisher.publish(b_version, b))
            await asyncio.wait_for(bucket_gate.waiting.wait(), 120)
            token = (await d.registry.publication_view()).versions[b_version].attempt_token
            e1 = d.clients["E1"]

            # A duplicate receive of the live attempt (a retried request) answers from the stash: no collective.
            status = await e1.status()
            collectives = int(status["staging"]["collectives"])
            link = await d.ports["E1"].link()
            for index in (0, last):
                again = await link.receive_bucket_again(b, token, index)
                assert again["adapter"]["buckets_received"] == b.bucket_count
            status = await e1.status()
            assert int(status["staging"]["collectives"]) == collectives
            stashes = status["staging"]["stashes"].values()
            assert [sorted(s["received"]) for s in stashes] == [list(range(b.bucket_count))]

            bucket_gate.opened.set()
            await asyncio.wait_for(end_gate.waiting.wait(), 120)  # E1 answered READY_LOCAL; not reported yet

            async def e0_ready() -> bool:
                return await placement(d, b_version, "E0") is PlacementState.READY

            await wait_until(e0_ready, timeout_s=120)  # E0's end is over: nothing of it races the cleanup
            view = await d.registry.publication_view()
            assert view.versions[b_version].placements["E1"].state is not PlacementState.READY
            assert view.versions[b_version].state is VersionState.LOADING and view.default == a_version
            assert (await _managed(e1, b.lora_name))["state"] == "READY"
            unloads_before = unloads(await d.audit())

            # The cleanup arrives first: the attempt is aborted and both engines clean it.
            assert await d.publisher.abort_and_clean(b_version, token, {}) is PublishStatus.FAILED_CLEAN
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.default == a_version
            assert view.managed_count() == 1
            assert {e: n - unloads_before[e] for e, n in unloads(await d.audit()).items()} == {"E0": 1, "E1": 1}
            audit = await d.audit()

            # The old attempt's READY arrives late (the held end returns): refused, nothing re-created.
            end_gate.opened.set()
            outcome = await publication
            assert outcome.status is PublishStatus.FAILED_CLEAN and not outcome.committed
            # Late begin, receive and end of the old attempt, straight at the engines: refused, nothing created.
            for name, port in d.ports.items():
                for late in (port.begin(b, token), port.end(b, token)):
                    with pytest.raises(EngineRefused) as refused:
                        await late
                    assert refused.value.reason == Reason.STALE_ATTEMPT, name
                with pytest.raises(ManagedRefusal) as refused_receive:
                    await (await port.link()).receive_bucket_again(b, token, 0)
                assert refused_receive.value.reason == Reason.STALE_ATTEMPT, name
            # Late registry reports of the old attempt change nothing.
            incarnations = (await d.registry.publication_view()).incarnations
            for late_event in (RecordPrepared(b_version, token, "E1", incarnations["E1"], b.digest),
                               RecordReady(b_version, token, "E1", incarnations["E1"], b.digest)):
                answer = await d.registry.submit(late_event)
                assert isinstance(answer.result, Rejected) and answer.journal_seq is None, late_event

            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.managed_count() == 1
            assert view.default == a_version
            for client in d.clients.values():
                status = await client.status()
                assert status["staging"]["stashes"] == {}
                assert (await _managed(client, b.lora_name))["state"] == "CLEANED"
                assert b.lora_name not in {entry["name"] for entry in status["adapters"]}
            after = await d.audit()
            # Since the cleanup: the late begins reached each engine (counted, refused), nothing loaded or unloaded.
            assert {e: {k: after[e][k] - audit[e][k] for k in ("managed_begin", "physical_load", "physical_unload")}
                    for e in after} == {e: {"managed_begin": 1, "physical_load": 0, "physical_unload": 0}
                                        for e in after}
            again = await d.binder.generate(session, PROMPT, 4)  # the old default serves, unchanged
            assert (again.output_ids, again.logprobs) == (reference.output_ids, reference.logprobs)
            await d.binder.finish(session)

    run(body())


def test_row_5_bind_close_and_cancel_complete_concurrency_one_binding_one_ref_closed_stays_closed(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed

            async def refs() -> int:
                return int((await d.registry.publication_view()).versions[a_version].session_refs)

            # 16 first generations of one session at once, every third cancelled while it waits for the bind:
            # one binding task, one session ref; cancelling a waiter cancels nothing the others share.
            key = d.binder.open("S_many@E0")
            turns = [asyncio.create_task(d.binder.generate(key, PROMPT, 2)) for _ in range(16)]
            await asyncio.sleep(0)
            for turn in turns[::3]:
                turn.cancel()
            outcomes = await asyncio.gather(*turns, return_exceptions=True)
            served = [o for o in outcomes if not isinstance(o, BaseException)]
            assert len(served) == 16 - len(turns[::3]) and all(t.cancelled() for t in turns[::3])
            assert len({(o.output_ids, o.logprobs) for o in served}) == 1  # all on the one bound version
            entry = d.binder.record(key)
            assert entry is not None and entry.loop is not None and entry.loop.fired.count("bind.start") == 1
            assert (await d.binder.bind_first(key)).version == a_version and await refs() == 1

            # A generation in flight when the session closes: its response is dropped, nothing reopens.
            slow = asyncio.create_task(d.binder.generate(key, PROMPT, 600, sampling={"ignore_eos": True}, rid="slow"))
            # Sent to the engine, not only dispatched: a close landing while the dispatch view is read is refused
            # before anything is sent (row view.closing, SESSION_CLOSED), which is not this case.
            while (phase := slow_phase(entry)) in (None, "VIEWING"):
                await asyncio.sleep(0.01)
            assert phase == "SENDING", phase
            report = await d.binder.finish(key)
            assert report.released and await refs() == 0
            try:
                await slow
                dropped = False
            except LateResponseDropped:
                dropped = True
            except BackendFailure:  # the close's abort reached the engine first: ended there, never delivered
                dropped = True
            assert dropped and d.binder.record(key) is None
            # Late open, bind and close for the closed key: refused or replayed, the ref is never taken again.
            for late in (OpenSession(key), BindFirst(key), CloseAndRelease(key)):
                answer = await d.registry.submit(late)
                assert answer.journal_seq is None, late  # changed nothing
            assert await refs() == 0

            # Close racing the first bind of a fresh session: whichever lands first, exactly one release.
            racer = d.binder.open("S_race@E1")
            bind = asyncio.create_task(d.binder.generate(racer, PROMPT, 2))
            finish = asyncio.create_task(d.binder.finish(racer))
            await asyncio.gather(bind, finish, return_exceptions=True)
            assert await refs() == 0
            again = await d.registry.submit(BindFirst(racer))
            assert isinstance(again.result, Rejected) and str(again.result.reason) == "SESSION_CLOSED"

    run(body())


def slow_phase(entry: Any) -> str | None:
    """The phase of the session's request "slow" in its driver (None before it opened)."""
    request = entry.state.requests.get("slow") if entry.state is not None else None
    return None if request is None else str(request.phase)


class PriorityFor:
    """An engine client whose requests with a rid in `rids` carry a top-level `priority`: the test engines
    (--abort-on-priority-when-disabled) then end them with SGLang's own 503 from inside the request path, after
    the tokenizer manager acquired the LoRA reference (Scheduler._set_or_validate_priority). The session layer's
    BackendRequest has no such field; every other request and call is the wrapped client's, unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rids: set[str] = set()

    async def generate(self, *args: Any, rid: str | None = None, **kwargs: Any) -> Any:
        if rid in self.rids:
            kwargs["extra_fields"] = {"priority": 1}
        return await self.inner.generate(*args, rid=rid, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


R2_TOKENS = 2000  # r2 outlives every r1 ending (a disconnect is noticed by SGLang seconds later) ...
R1_TOKENS = 1900  # in flight for seconds even at the ~400 tokens/s an idle host decodes
MAX_TRIALS = 3  # ... unless a loaded host stretches r1's ending past r2's ~5-10 s of decoding: then repeat


class R2EndedFirst(Exception):
    """r2 (the request that must hold A while r1 ends) finished its tokens before r1's ending was checked against
    it. Counts of 0 then say nothing about r1's release, so the trial is void and repeated with new sessions (at
    most MAX_TRIALS; every void trial is printed). A clean-clone CI run met this once: r1's 4-token generation
    and late abort took ~10 s on the loaded host while r2 decoded its 2000 tokens."""


def _ended(task: asyncio.Task[Any]) -> str:
    """How r2's request ended, for the trace of row 6."""
    if task.cancelled():
        return "r2 cancelled"
    if task.exception() is not None:
        return f"r2 failed: {task.exception()!r}"[:300]
    return f"r2 ended: {task.result().finish_reason}, {len(task.result().output_ids)} tokens"


def test_row_6_native_refcount_r1_ends_by_500_503_400_disconnect_abort_or_twice_r2_keeps_exactly_one(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            clients = [PriorityFor(client) for client in d.clients.values()]
            backend = SGLangBackend(clients, route=d.route, names=list(d.clients))
            binder = d.new_binder(backend, shard=1)
            e0 = d.clients["E0"]

            async def counts() -> tuple[int, int, int | None]:
                """A's native refcount on E0 (SGLang's LoRARegistry counter), the patch's mirror of it, and the
                introspection endpoint's read of the same counter."""
                view = await _managed(e0, a.lora_name)
                assert view is not None
                return int(view["native_refcount"]), int(view["mirrored_refcount"]), await refcount(e0, a.lora_name)

            # Every change of the three counts, with its time: a failure says what the counts went through.
            start = time.monotonic()
            changes: list[tuple[float, object]] = []

            async def counts_are(n: int) -> bool:
                now = await counts()
                if not changes or changes[-1][1] != now:
                    changes.append((round(time.monotonic() - start, 3), now))
                return now == (n, n, n)

            # The r2 of the trial under way: while it is set, a settle or an exact check that finds r2 ended on its
            # own raises R2EndedFirst (the trial shows nothing; see the class).
            trial: dict[str, asyncio.Task[Any] | None] = {"r2": None}

            def r2_ended_first(what: str) -> None:
                r2_task = trial["r2"]
                if r2_task is not None and r2_task.done():
                    raise R2EndedFirst(f"{what}: {_ended(r2_task)}")

            async def settle(n: int, what: str) -> None:
                async def reached() -> bool:
                    if await counts_are(n):
                        return True
                    r2_ended_first(what)
                    return False

                # A liveness bound, not a speed target: each poll is two engine round trips (one through the
                # scheduler), so polls are spaced a little.
                await wait_until(reached, timeout_s=120, poll_s=0.1,
                                 last=lambda: f"{what}: (s, (native, mirrored, introspected)) {changes[-8:]}")

            async def exactly(n: int, what: str) -> None:
                now = await counts()
                if now != (n, n, n):
                    r2_ended_first(what)
                assert now == (n, n, n), (what, now, changes)

            async def in_flight(key: Any, rid: str) -> asyncio.Task[Any]:
                task = asyncio.create_task(binder.generate(key, PROMPT, R1_TOKENS, sampling={"ignore_eos": True},
                                                           rid=rid))
                await settle(2, f"{rid} in flight")
                return task

            async def ends_by_500(key: Any, rid: str) -> None:
                # An injected fault (managed/hold_points.py, 'fail_request'; a real engine gives no 500 on demand):
                # the next request naming A fails inside the tokenizer manager after SGLang acquired its reference,
                # and SGLang answers 500 from its own failure path, which releases the reference.
                async with client_for(e0.base_url) as control:
                    await control.managed("test_hold", point="fail_request", lora_name=a.lora_name)
                with pytest.raises(BackendFailure) as failed:
                    await binder.generate(key, PROMPT, 8, rid=rid)
                assert failed.value.status_code == 500

            async def ends_by_503(key: Any, rid: str) -> None:
                clients[0].rids.add(rid)
                with pytest.raises(BackendFailure) as failed:
                    await binder.generate(key, PROMPT, 8, rid=rid)
                assert failed.value.status_code == 503

            async def ends_before_dispatch_400(key: Any, rid: str) -> None:
                with pytest.raises(BackendFailure) as failed:  # over the context: refused before scheduling
                    await binder.generate(key, PROMPT * 200, 4, rid=rid)
                assert failed.value.status_code == 400

            async def ends_by_client_disconnect(key: Any, rid: str) -> None:
                task = await in_flight(key, rid)
                task.cancel()  # the session layer's caller goes away: the HTTP connection closes
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert set(binder.record(key).unknown) == {rid}  # never resent; resolved below, after the count
                await settle(1, f"{rid} after its client went away")
                await binder.resolve_unknown(key, rid)  # an abort for a request SGLang already ended: no release

            async def ends_by_abort(key: Any, rid: str) -> None:
                task = await in_flight(key, rid)
                await binder.abort(key, rid)
                assert (await task).finish_reason == "abort"

            async def ends_twice(key: Any, rid: str) -> None:
                done = await binder.generate(key, PROMPT, 4, rid=rid)  # finishes...
                assert done.finish_reason in ("stop", "length")
                await backend.abort(rid)  # ...and a late abort of the same rid is a second terminal
                # SGLang releases a finished request's reference in a task of its own, which may run after the
                # reply: wait for it, then check that the late abort released nothing more.
                await settle(1, f"{rid} finished, then aborted late")
                await asyncio.sleep(0.3)
                await exactly(1, f"{rid} finished, then aborted late")
                again = f"{rid}-aborted"
                task = await in_flight(key, again)
                await binder.abort(key, again)  # aborted...
                assert (await task).finish_reason == "abort"
                await backend.abort(again)  # ...and aborted once more

            endings = {
                "500_injected": ends_by_500,
                "503": ends_by_503,
                "pre_dispatch_400": ends_before_dispatch_400,
                "client_disconnect": ends_by_client_disconnect,
                "abort": ends_by_abort,
                "duplicate_terminal": ends_twice,
            }

            async def one_trial(ending: str, end_r1: Any, name: str) -> None:
                r2_key = binder.open(f"S_r2_{name}@E0")
                r2_rid = f"S_r2_{name}@E0/r2"
                r1_key = binder.open(f"S_r1_{name}@E0")
                r2 = asyncio.create_task(binder.generate(r2_key, PROMPT, R2_TOKENS, sampling={"ignore_eos": True},
                                                         rid=r2_rid))
                r2.add_done_callback(lambda task: changes.append((round(time.monotonic() - start, 3), _ended(task))))
                ended_clean = False
                trial["r2"] = r2
                try:
                    await settle(1, f"r2 of {name} in flight")
                    await end_r1(r1_key, f"S_r1_{name}@E0/r1")
                    # r1 released exactly once: r2's single reference is left, native and mirrored alike.
                    await settle(1, f"r1 ended by {ending}")
                    await asyncio.sleep(0.3)
                    await exactly(1, f"r1 ended by {ending}")
                    trial["r2"] = None
                    assert not r2.done(), ending
                    await binder.abort(r2_key, r2_rid)  # r2 ends too (temporary abort: its session keeps A)
                    assert (await r2).finish_reason == "abort"
                    await settle(0, f"r2 of {name} aborted")
                    print(f"row 6, {name}: {changes}")
                    await exactly(0, f"r2 of {name} aborted")
                    ended_clean = True
                finally:
                    trial["r2"] = None
                    changes.clear()
                    if not ended_clean:  # a failure or a void trial: nothing of it may stay in flight
                        for rid in (r2_rid, f"S_r1_{name}@E0/r1", f"S_r1_{name}@E0/r1-aborted"):
                            await backend.abort(rid)
                        await asyncio.gather(r2, return_exceptions=True)
                    for key in (r1_key, r2_key):  # finish() also ends what a session left issued or unknown
                        await binder.finish(key)

            void: list[str] = []
            for ending, end_r1 in endings.items():
                for attempt in range(1, MAX_TRIALS + 1):
                    try:
                        await one_trial(ending, end_r1, ending if attempt == 1 else f"{ending}_{attempt}")
                        break
                    except R2EndedFirst as exc:
                        void.append(str(exc))
                        await settle(0, f"after the void trial {ending} #{attempt}")
                else:
                    pytest.fail(f"r2 ended before r1's ending could be checked in {MAX_TRIALS} trials of {ending}: "
                                f"{void}")
            print(f"row 6: void trials (r2 ended first, repeated): {void}")
            assert (await d.registry.publication_view()).versions[a_version].session_refs == 0

            # Nothing leaked and nothing was released twice: once A is retired, its reclaim does not wait on a
            # reference and unloads it exactly once on each engine.
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(b_version, b)).committed
            before = unloads(await d.audit())
            reclaimed = await asyncio.wait_for(d.reclaimer.reclaim(a_version), 60)
            assert reclaimed.status is ReclaimStatus.RECLAIMED and set(reclaimed.confirmed) == {"E0", "E1"}
            assert {e: n - before[e] for e, n in unloads(await d.audit()).items()} == {"E0": 1, "E1": 1}

    run(body())


def test_row_7_session_refs_zero_but_engine_refs_positive_keeps_a_pinned_until_the_request_ends(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            session = d.binder.open("S_a@E0")
            await d.binder.generate(session, PROMPT, 2)
            assert (await d.publisher.publish(b_version, b)).committed
            await d.binder.finish(session)  # session refs of A: 0
            assert (await d.registry.publication_view()).versions[a_version].session_refs == 0

            # A request for A still in flight on E0 (e.g. one the session layer sent before a close it did not
            # see): SGLang's native refcount holds A there.
            in_flight = asyncio.create_task(d.backend.generate(BackendRequest(
                "late/held", tuple(PROMPT), a.lora_name, 1500, {"ignore_eos": True}, frozenset({"E0"}))))
            client = d.clients["E0"]

            async def held() -> bool:
                view = next(m for m in (await client.status())["managed"] if m["name"] == a.lora_name)
                return int(view["native_refcount"]) == 1

            await wait_until(held, timeout_s=60)
            # The test holds the request in flight with SGLang's in-place pause of E0's scheduler (the request keeps
            # its place in the running batch and its reference), so the reclaim lands while the request holds A
            # however slow the host: a clean-clone CI run saw the 1500 tokens end before a loaded Ray actor's claim
            # reached E0, and the row then showed nothing. The library itself never pauses an engine.
            await hold_scheduler(client, True)
            try:
                before = (await d.audit())["E0"]["physical_unload"]
                reclaim = asyncio.create_task(d.reclaimer.reclaim(a_version))

                async def draining() -> bool:
                    view = next(m for m in (await client.status())["managed"] if m["name"] == a.lora_name)
                    return str(view["state"]) == "DRAINING"

                await wait_until(draining, timeout_s=60)
                adapter = next(m for m in (await client.status())["managed"] if m["name"] == a.lora_name)
                assert adapter["state"] == "DRAINING" and adapter["pinned"] and adapter["native_refcount"] == 1
                assert (await d.audit())["E0"]["physical_unload"] == before  # not unloaded under a request
                assert not reclaim.done() and not in_flight.done()
            finally:
                await hold_scheduler(client, False)

            finished = await in_flight
            assert len(finished.output_ids) == 1500  # served to the end by A
            outcome = await reclaim
            assert outcome.status is ReclaimStatus.RECLAIMED and set(outcome.confirmed) == {"E0", "E1"}
            assert (await d.audit())["E0"]["physical_unload"] == before + 1  # exactly once, after it ended

    run(body())


def test_row_8_capacity_repeated_reclaim_and_late_unload_receipt(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            c_version, c = d.candidate("C")
            assert (await d.publisher.publish(a_version, a)).committed
            assert (await d.publisher.publish(b_version, b)).committed

            audit = await d.audit()
            refused = await d.publisher.publish(c_version, c)  # capacity=2: refused before any begin or NCCL
            assert (refused.status, refused.reason) == (PublishStatus.REJECTED, "CAPACITY_ERROR")
            assert {e: n["managed_begin"] for e, n in (await d.audit()).items()} == {
                e: n["managed_begin"] for e, n in audit.items()}

            gate = Gate(d.ports["E1"], "reclaim")  # E1's unload receipt is late
            d.reclaimer.engines["E1"] = gate
            reclaim = asyncio.create_task(d.reclaimer.reclaim(a_version))
            await asyncio.wait_for(gate.waiting.wait(), 60)

            async def e0_confirmed() -> bool:
                view = await d.registry.publication_view()
                return view.versions[a_version].state is VersionState.RECLAIMING and (
                    (await d.audit())["E0"]["physical_unload"] == audit["E0"]["physical_unload"] + 1)

            await wait_until(e0_confirmed, timeout_s=60)
            await asyncio.sleep(1.0)  # E0's confirm lands; E1's is still outstanding
            assert (await d.registry.publication_view()).versions[a_version].state is VersionState.RECLAIMING
            still = await d.publisher.publish(c_version, c)  # one engine confirmed is not enough
            assert (still.status, still.reason) == (PublishStatus.REJECTED, "CAPACITY_ERROR")

            gate.opened.set()
            done = await reclaim
            assert done.status is ReclaimStatus.RECLAIMED and set(done.confirmed) == {"E0", "E1"}
            after = await d.audit()
            assert {e: after[e]["physical_unload"] - audit[e]["physical_unload"] for e in after} == {"E0": 1, "E1": 1}

            again = await d.reclaimer.reclaim(a_version)  # repeated reclaim: the same claim, nothing unloaded
            assert again.status is ReclaimStatus.RECLAIMED and again.reclaim_id == done.reclaim_id
            late = await d.registry.submit(ConfirmReclaim(a_version, "E1", done.reclaim_id or ""))  # late receipt
            assert str(late.result.state) == "RECLAIMED" and late.journal_seq is None  # changed nothing
            assert await d.audit() == after

            accepted = await d.publisher.publish(c_version, c)  # both confirmed: C reserves now
            assert accepted.committed

    run(body())


async def _stock_transcript(client: Any, fixtures: Any, name: str) -> list[tuple[Any, ...]]:
    """The stock LoRA path on `name` (an ordinary, unmanaged name): load, generate, overwrite the same name with
    other weights, generate, unload, generate after the unload, unload again. Each step's answer: an error's
    status code and message, or a generation's tokens and logprobs, or the load/unload reply."""
    steps: list[tuple[Any, ...]] = []

    async def step(label: str, work: Any) -> None:
        try:
            answer = await work
        except EngineHTTPError as error:
            steps.append((label, "error", error.status_code, _without_managed(error.body)))
            return
        if hasattr(answer, "output_ids"):
            steps.append((label, "generated", tuple(answer.output_ids), tuple(answer.logprobs)))
        else:
            steps.append((label, "answered", bool(answer.get("success")), str(answer.get("message", ""))))

    await step("load A", client.load_lora_adapter(name, str(fixtures.adapters["A"])))
    await step("generate", client.generate(PROMPT, name, 6))
    await step("load B under the same name", client.load_lora_adapter(name, str(fixtures.adapters["B"])))
    await step("generate after the overwrite", client.generate(PROMPT, name, 6))
    await step("unload", client.unload_lora_adapter(name))
    await step("generate after the unload", client.generate(PROMPT, name, 6))
    await step("unload again", client.unload_lora_adapter(name))
    return steps


def _without_managed(body: str) -> Any:
    """An error body with the managed adapters left out of the `loaded_adapters` it lists: what else the managed
    engine holds (version B here) is its state, not the stock path's answer."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if isinstance(parsed, dict) and isinstance(parsed.get("loaded_adapters"), dict):
        parsed["loaded_adapters"] = {name: path for name, path in parsed["loaded_adapters"].items()
                                     if not name.startswith(LORA_NAME_PREFIX)}
    return parsed


def _assert_same_transcript(stock: list[tuple[Any, ...]], patched: list[tuple[Any, ...]]) -> None:
    """Same answers step by step; generations: the same tokens, logprobs within the suite's tolerance (two
    processes of the same CPU engine; the clean-baseline comparison of test_publication_e2e uses the same)."""
    assert [s[:2] for s in stock] == [p[:2] for p in patched], (stock, patched)
    for s, p in zip(stock, patched, strict=True):
        if s[1] == "generated":
            assert s[2] == p[2], (s, p)
            assert max(abs(x - y) for x, y in zip(s[3], p[3], strict=True)) <= LOGPROB_TOLERANCE, (s, p)
        else:
            assert s[2:] == p[2:], (s, p)


def test_row_9_missing_exact_version_is_an_error_managed_versions_resist_bypass_and_the_switch_off_is_stock(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        # The switch off: an engine without the managed patch set (only `cpu`, which this CPU host needs to run
        # SGLang at all). It starts while the managed part below runs.
        stock = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                           log_path=tmp_path / "stock.log", patches=("cpu",)))
        starting = asyncio.create_task(asyncio.to_thread(stock.start))
        try:
            async with deployed(engines, fixtures, tmp_path) as d:
                await _row_9_managed(d, fixtures)
                await starting
                name = f"plain-{d.epoch}"  # the same ordinary name on both: the answers may name it
                async with SGLangClient(stock.url, timeout_s=600.0) as stock_client:
                    off = await _stock_transcript(stock_client, fixtures, name)
                on = await _stock_transcript(d.clients["E0"], fixtures, name)
        finally:
            if not starting.done():
                await asyncio.gather(starting, return_exceptions=True)
            await asyncio.to_thread(stock.stop)
        # What stock 0.5.23 answers, checked against the weights: A's generation is A's reference forward.
        generated = next(s for s in off if s[0] == "generate")
        expected = d.reference.score(snapshot_from_adapter_dir(fixtures.adapters["A"]), PROMPT, list(generated[2]))
        assert max(abs(e - x) for e, x in zip(expected, generated[3], strict=True)) <= LOGPROB_TOLERANCE
        assert off[0] == ("load A", "answered", True, off[0][3]) and off[4][:3] == ("unload", "answered", True)
        # The managed engine serves an ordinary name exactly as the switched-off engine does.
        _assert_same_transcript(off, on)

    run(body())


async def _row_9_managed(d: Any, fixtures: Any) -> None:
    a_version, a = d.candidate("A")
    assert (await d.publisher.publish(a_version, a)).committed
    session = d.binder.open("S_a@E0")
    reference = await d.binder.generate(session, PROMPT, 4)
    b_version, b = d.candidate("B")
    assert (await d.publisher.publish(b_version, b)).committed

    # Bypass: the stock load, overwrite and unload of a managed name are refused on both engines.
    c = snapshot_from_adapter_dir(fixtures.adapters["C"])
    audit = await d.audit()
    for client in d.clients.values():
        for managed in (a, b):
            for bypass in (client.load_lora_adapter(managed.lora_name, str(fixtures.adapters["C"])),
                           client.load_lora_adapter_from_tensors(managed.lora_name, c.tensors, c.adapter_config()),
                           client.unload_lora_adapter(managed.lora_name)):
                with pytest.raises(EngineHTTPError, match="MANAGED_ADAPTER") as refused:
                    await bypass
                assert refused.value.status_code == 400
    # LRU: A and B (pinned) and ordinary X0..Xn fill E0's K + 1 slots; loading Y evicts X0, never a managed one.
    e0 = d.clients["E0"]
    xs = [f"plain-x{i}-{d.epoch}" for i in range(loaded_adapter_slots(d.engines.e0.config.capacity) - 2)]
    y = f"plain-y-{d.epoch}"
    for x in xs:
        assert (await e0.load_lora_adapter(x, str(fixtures.adapters["C"])))["success"]
        await e0.generate(PROMPT, x, 2)
    assert (await e0.load_lora_adapter(y, str(fixtures.adapters["C"])))["success"]
    assert {entry["name"] for entry in (await e0.status())["adapters"]} == {a.lora_name, b.lora_name, *xs[1:], y}
    for plain in (*xs[1:], y):
        assert (await e0.unload_lora_adapter(plain))["success"]
    for client in d.clients.values():
        states = {m["name"]: m["state"] for m in (await client.status())["managed"]}
        assert (states[a.lora_name], states[b.lora_name]) == ("READY", "READY")
    after = await d.audit()
    assert {e: (after[e]["physical_unload"], after[e]["managed_begin"]) for e in after} == {
        e: (audit[e]["physical_unload"], audit[e]["managed_begin"]) for e in audit}  # no managed unload or begin
    again = await d.binder.generate(session, PROMPT, 4)  # the retired A still serves its session, unchanged
    assert (again.output_ids, again.logprobs) == (reference.output_ids, reference.logprobs)

    # The exact version missing: A reclaimed. No fallback to the base or the latest, no implicit reload.
    await d.binder.finish(session)
    assert (await d.reclaimer.reclaim(a_version)).status is ReclaimStatus.RECLAIMED
    late = d.binder.open("S_late@E0")
    with pytest.raises(VersionUnavailable):
        await d.binder.gate.check(a_version)  # the session layer refuses it before it leaves the process
    loads = {e: n["physical_load"] for e, n in (await d.audit()).items()}
    never = lora_name(VersionKey(d.epoch, "never-published"), a.digest)
    for engine in ("E0", "E1"):
        for missing in (a.lora_name, never):
            with pytest.raises(BackendFailure) as failed:  # below the session layer, straight at the engine
                await d.backend.generate(BackendRequest(f"late/{engine}", tuple(PROMPT), missing, 4, {},
                                                        frozenset({engine})))
            assert failed.value.engine == engine and failed.value.status_code in (400, 409), failed.value
            if missing == a.lora_name:
                assert failed.value.reason == Reason.VERSION_UNAVAILABLE
    for client in d.clients.values():
        assert not {a.lora_name, never} & {entry["name"] for entry in (await client.status())["adapters"]}
    assert {e: n["physical_load"] for e, n in (await d.audit()).items()} == loads  # nothing loaded again
    served = await d.binder.generate(late, PROMPT, 4)  # a new session binds the default, B
    assert (await d.binder.bind_first(late)).version == b_version
    assert_matches_reference(d, "B", PROMPT, served.logprobs, served.output_ids)
    await d.binder.finish(late)
