"""RFC §7.1, row by row, through the whole stack: the Ray registry actor, the Publisher, the Reclaimer, the
SessionBinder with agentic traffic and two real engines. Every intermediate state a row names is asserted
when it holds, not merely waited for.

Rows here: 1 (B READY on E0 only, then both, commit), 2 (duplicate publication and content conflict), 3
(single-engine failure, manifest error, lost commit ACK), 5 (bind/close and cancel/complete concurrency), 7
(session refs 0 while the engine still holds a request) and 8 (capacity, repeated reclaim, late unload
receipt). Every deadline of row 3 is `test_phase_deadlines.py`, every lost reply `test_unknown_outcomes.py`.
Rows 4, 6 and 9 are still covered below the whole stack only (engine-level and runtime tests); see issue 18.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine_helpers import PROMPT, run, wait_until
from test_publication_e2e import assert_matches_reference, deployed

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.lifecycle import BindFirst, CloseAndRelease, ConfirmReclaim, OpenSession, Rejected
from versioned_lora.runtime.interfaces import BackendFailure, BackendRequest
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.runtime.session_binder import LateResponseDropped
from versioned_lora.spec.identities import lora_name
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
    from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir

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
            assert entry is not None and entry.bind_task is not None and not entry.bind_task.cancelled()
            assert (await d.binder.bind_first(key)).version == a_version and await refs() == 1

            # A generation in flight when the session closes: its response is dropped, nothing reopens.
            slow = asyncio.create_task(d.binder.generate(key, PROMPT, 600, sampling={"ignore_eos": True}))
            while not entry.issued:
                await asyncio.sleep(0.01)
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
