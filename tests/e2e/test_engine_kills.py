"""Engine `kill -9` (server, scheduler and detokenizer) at each publication phase and during a reclaim drain, each
followed by reconciliation, through the whole stack: the Ray registry actor, the Publisher, the Reclaimer, the
SessionBinder and the session's two real engines.

Each kill lands in its phase on purpose: a test-only hold point stops the publisher (or the reclaim) at the named
phase, the test reads the phase from the killed engine's own status, and only then kills it. Between calls the
hold is on the publisher's side (a wrapped staging port or registry port, `Held`): begin: E1 answered PREPARED,
not reported yet; bucket: buckets 0 and 1 stashed on E1, the rest not sent; before_load: the stash complete and
hashed, `end` not sent, nothing loaded; ready: E1 loaded B and answered READY_LOCAL, not reported yet; commit:
READY on both, the commit not sent; after_commit: committed, no session bound to B yet; reclaim drain: E1
DRAINING A under a native reference. Inside one engine call the hold is in the engine patch
(`managed/hold_points.py`, `EngineHold`; the suite's engines are started with it, any other engine refuses to
arm one): load: `end` verified the stash, SGLang's load not begun; probe: B loaded pinned, its probe not sent;
unload: A drained and UNLOADING in the table (issue 41: UNLOADED only once SGLang's unload succeeded), SGLang's
physical unload not asked for.

After each kill: the old default serves on the surviving engine with unchanged numbers; nothing is unloaded while
a session or an engine request holds it; the restarted engine's new incarnation is adopted by the registry and
gets no request for a version until that version is rehydrated there; and once reconciled the registry's version
states, default and revision, placement states, capacity and session refs equal those of the same run without the
kill (`no_kill_states`, the run itself, done first). No session changes version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from deployment import Deployment, unloads
from engine_helpers import PROMPT, client_for, run, wait_until
from test_publication_e2e import assert_matches_reference, deployed

from versioned_lora.lifecycle import Commit, VersionKey
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import BackendRequest, OutcomeUnknown
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.runtime.supervisor import RestartSupervisor
from versioned_lora.spec.states import PlacementState, VersionState

ENGINE_HOLDS = ("load", "probe")  # phases held inside E1's own `end` (managed/hold_points.py)
HELD_AFTER_BUCKET = 1  # the bucket phase's kill lands with buckets 0 and 1 stashed on E1 (of 4)
RECLAIM_DEADLINE_S = 30.0


class Held:
    """Test-only hold point (timing injection): the wrapped port's `method` runs (the engine or registry answers),
    then its answer is held until the test opens the hold; with `before`, the call is held before it is sent.
    `when(*args)` picks the call that is held."""

    def __init__(self, inner: Any, method: str, when: Any = None, before: bool = False) -> None:
        self.inner, self.method, self.when, self.before = inner, method, when or (lambda *args: True), before
        self.opened = asyncio.Event()
        self.reached = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        async def held(*args: Any, **kwargs: Any) -> Any:
            if self.before and self.when(*args):
                self.reached.set()
                await self.opened.wait()
                return await attribute(*args, **kwargs)
            answer = await attribute(*args, **kwargs)
            if self.when(*args):
                self.reached.set()
                await self.opened.wait()
            return answer

        return held


class EngineHold:
    """A hold point inside E1's own call (managed/hold_points.py; the suite's engines run with them): armed for
    one name and point, `reached` is set once E1's status shows that call stopped there. The call stays stopped
    until the engine is killed; `opened` only mirrors `Held`'s interface."""

    def __init__(self, d: Deployment, engine: str, point: str, name: str) -> None:
        self.d, self.engine, self.point, self.name = d, engine, point, name
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    async def arm(self) -> None:
        async with client_for(self.d.clients[self.engine].base_url) as client:
            await client.managed("test_hold", point=self.point, lora_name=self.name)
        self._watch = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        async def held() -> bool:
            holds = (await self.d.clients[self.engine].status())["hold_points"]
            return bool(holds["held"].get(self.point) == self.name)

        await wait_until(held, timeout_s=180, poll_s=0.2)
        self.reached.set()


def _states(view: Any) -> dict[str, Any]:
    """What must equal the run without the kill: per version (by label) its state, its placements' states and its
    session refs; the default's label, the revision, the managed count. Tokens and incarnations may differ."""
    return {
        "versions": {key.version_id: (version.state, {e: p.state for e, p in sorted(version.placements.items())},
                                      version.session_refs)
                     for key, version in sorted(view.versions.items(), key=lambda item: item[0].version_id)},
        "default": None if view.default is None else view.default.version_id,
        "revision": view.default_revision,
        "managed": view.managed_count(),
    }


async def _engine_view(d: Deployment, engine: str, name: str) -> dict[str, Any] | None:
    return next((m for m in (await d.clients[engine].status())["managed"] if m["name"] == name), None)


async def _reconcile_e1(d: Deployment, engines: Any) -> None:
    """Restart E1; the registry adopts its new incarnation; every version it must hold is rehydrated there, and
    until then no request for that version goes to E1."""
    engines.e1.restart()
    incarnation = int((await d.clients["E1"].status())["incarnation"])
    await d.publisher.sync_incarnations()
    view = await d.registry.publication_view()
    assert view.incarnations["E1"] == incarnation
    held = [key for key, version in view.versions.items()
            if version.state in (VersionState.PUBLISHED, VersionState.RETIRED)]
    dispatch = await d.registry.dispatch_view(held)
    for key in held:
        assert view.versions[key].placements["E1"].state is not PlacementState.READY, key
        assert dispatch[key].engines == {"E0"}, key  # E1 gets no request for it before its rehydrate
    sent = d.backend.sent["E1"]
    probe = d.binder.open("S_probe@E1")  # routed to E1 by name, sent to E0: E1 holds nothing yet
    await d.binder.generate(probe, PROMPT, 2)
    assert d.backend.sent["E1"] == sent
    await d.binder.finish(probe)
    # The restart supervisor stages what the registry's answer to E1's incarnation names, from the snapshot store;
    # cleanups and reclaims E1 is owed are left to `recover` and `reclaim` (below, and in the callers).
    reconciled = await RestartSupervisor(d.publisher).reconcile("E1")
    assert sorted(reconciled.rehydrated) == sorted(held) and not reconciled.failed, reconciled
    dispatch = await d.registry.dispatch_view(held)
    assert all(dispatch[key].engines == {"E0", "E1"} for key in held)


async def _publish_b_and_reclaim_a(
    d: Deployment, engines: Any, kill_phase: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Publish A, bind S_old to A, publish B (killing E1 at `kill_phase`, then reconciling), bind S_new to B; then
    close S_old and reclaim A. Returns the registry's states after B's publication and after A's reclaim."""
    a_version, a = d.candidate("A")
    b_version, b = d.candidate("B")
    assert (await d.publisher.publish(a_version, a)).committed
    s_old = d.binder.open("S_old@E0")
    first = await d.binder.generate(s_old, PROMPT, 4)

    if kill_phase is not None:
        await _killed_publication(d, engines, kill_phase, a_version, (b_version, b), s_old, first)
    else:
        assert (await d.publisher.publish(b_version, b)).committed

    s_new = d.binder.open("S_new@E1")
    assert (await d.binder.bind_first(s_new)).version == b_version
    new = await d.binder.generate(s_new, PROMPT, 4)
    assert_matches_reference(d, "B", PROMPT, new.logprobs, new.output_ids)
    assert (await d.binder.bind_first(s_old)).version == a_version  # no session changed version
    again = await d.binder.generate(s_old, PROMPT, 4)
    assert (again.output_ids, again.logprobs) == (first.output_ids, first.logprobs)
    published = _states(await d.registry.publication_view())

    await d.binder.finish(s_old)
    assert (await d.reclaimer.reclaim(a_version)).status is ReclaimStatus.RECLAIMED
    reclaimed = _states(await d.registry.publication_view())
    await d.binder.finish(s_new)
    return published, reclaimed


async def _killed_publication(
    d: Deployment, engines: Any, phase: str, a_version: VersionKey, candidate: tuple[VersionKey, Any], s_old: Any,
    first: Any,
) -> None:
    b_version, b = candidate
    hold: Held | EngineHold
    if phase in ("commit", "after_commit"):
        # commit: READY on both, the commit held before it is sent; after_commit: committed, its answer held, no
        # session bound to B yet
        hold = Held(d.registry, "submit", when=lambda event, *rest: isinstance(event, Commit),
                    before=phase == "commit")
        d.publisher.registry = hold
    elif phase in ENGINE_HOLDS:
        hold = EngineHold(d, "E1", phase, b.lora_name)  # inside E1's `end`
        await hold.arm()
    else:
        hold = {
            "begin": Held(d.ports["E1"], "begin"),  # E1 answered PREPARED; not reported yet
            "bucket": Held(d.ports["E1"], "transfer_bucket",  # buckets 0 and 1 stashed, 2 and 3 not sent
                           when=lambda candidate, token, index: index == HELD_AFTER_BUCKET),
            "before_load": Held(d.ports["E1"], "end", before=True),  # stash complete and hashed; no end yet
            "ready": Held(d.ports["E1"], "end"),  # E1 loaded B and answered READY_LOCAL; not reported yet
        }[phase]
        d.publisher.engines["E1"] = hold
    publication = asyncio.create_task(d.publisher.publish(b_version, b))
    await asyncio.wait_for(hold.reached.wait(), 180)

    # The phase, read from E1 itself before the kill.
    on_e1 = await _engine_view(d, "E1", b.lora_name)
    assert on_e1 is not None
    expected = {
        "begin": ("STAGING", 0),
        "bucket": ("STAGING", HELD_AFTER_BUCKET + 1),
        "before_load": ("STAGING", b.bucket_count),
        "load": ("LOADING", b.bucket_count),  # the table awaits the load's outcome; SGLang's load not begun
        "probe": ("READY", b.bucket_count),  # loaded pinned; the probe not sent
        "ready": ("READY", b.bucket_count),
        "commit": ("READY", b.bucket_count),
        "after_commit": ("READY", b.bucket_count),
    }[phase]
    assert (on_e1["state"], on_e1["buckets_received"]) == expected, on_e1
    view = await d.registry.publication_view()
    if phase == "after_commit":
        assert view.versions[b_version].state is VersionState.PUBLISHED and view.default == b_version
    else:
        assert view.versions[b_version].state is VersionState.LOADING
    if phase in ("before_load", "load"):
        assert await d.clients["E1"].adapter(b.lora_name) is None  # not loaded
    if phase == "probe":
        assert on_e1["pinned"] and on_e1["probe"] is None and await d.clients["E1"].adapter(b.lora_name)
    if phase == "commit":
        assert {e: p.state for e, p in view.versions[b_version].placements.items()} == {
            "E0": PlacementState.READY, "E1": PlacementState.READY}

    engines.e1.kill_hard()
    hold.opened.set()
    outcome = await publication
    view = await d.registry.publication_view()
    if phase in ("ready", "commit", "after_commit"):
        # The registry did not know of the kill: E1's READY_LOCAL counted, the commit landed. E1's new incarnation
        # invalidates that READY below, and B is rehydrated there before E1 gets a request for it.
        assert outcome.committed, outcome
        assert view.default == b_version
    else:
        assert outcome.status is PublishStatus.UNKNOWN, outcome  # E1's cleanup cannot be confirmed
        assert view.versions[b_version].state is VersionState.ABORTED and view.default == a_version
        assert view.managed_count() == 2  # the candidate keeps its slot until both engines confirm
    again = await d.binder.generate(s_old, PROMPT, 4)  # the old default on the surviving E0, unchanged
    assert (again.output_ids, again.logprobs) == (first.output_ids, first.logprobs)

    d.publisher.engines["E1"] = d.ports["E1"]
    d.publisher.registry = d.registry
    await _reconcile_e1(d, engines)
    if phase not in ("ready", "commit", "after_commit"):
        recovered = await d.publisher.recover()  # B's cleanup finished on E1's new incarnation
        assert [o.status for o in recovered] == [PublishStatus.FAILED_CLEAN]
        view = await d.registry.publication_view()
        assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.managed_count() == 1
        for client in d.clients.values():
            assert (await client.status())["staging"]["stashes"] == {}
        assert (await d.publisher.publish(b_version, b)).committed  # the same version, a new attempt


async def _finish_the_claim_on_the_new_incarnation(
    d: Deployment, engines: Any, a_version: VersionKey, outcome: Any, before: dict[str, int], s_new: Any
) -> dict[str, Any]:
    """After a kill left A's reclaim PENDING on E1: reconcile E1 (B rehydrated before it gets a request for B),
    finish the same claim on E1's new incarnation, check E0 unloaded A exactly once and S_new still serves B
    exactly; the registry's states once reclaimed."""
    await _reconcile_e1(d, engines)
    again = await d.reclaimer.reclaim(a_version)
    assert again.status is ReclaimStatus.RECLAIMED and set(again.confirmed) == {"E0", "E1"}
    assert again.reclaim_id == outcome.reclaim_id
    assert unloads(await d.audit())["E0"] == before["E0"] + 1  # E0: exactly once
    served = await d.binder.generate(s_new, PROMPT, 4)
    assert_matches_reference(d, "B", PROMPT, served.logprobs, served.output_ids)
    reclaimed = _states(await d.registry.publication_view())
    await d.binder.finish(s_new)
    return reclaimed


def _with_a_absent_on_e1(no_kill: dict[str, Any]) -> dict[str, Any]:
    """The one documented difference from the run without the kill: E1's new incarnation never held A, and the
    registry says so (a RECLAIMING version's placement on a restarted engine becomes ABSENT:
    registry_rules.replace_placements_on_engine), where the run without the kill keeps E1's last placement of
    A, READY, as history."""
    state, placements, refs = no_kill["versions"]["A"]
    assert placements["E1"] is PlacementState.READY
    return {**no_kill, "versions": {**no_kill["versions"],
                                    "A": (state, {**placements, "E1": PlacementState.ABSENT}, refs)}}


@pytest.fixture(scope="module")
def no_kill_states(
    engines, fixtures, tmp_path_factory, ray_cluster
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The same run without any kill: what every killed run must reconcile to."""

    async def body() -> tuple[dict[str, Any], dict[str, Any]]:
        async with deployed(engines, fixtures, tmp_path_factory.mktemp("no-kill")) as d:
            return await _publish_b_and_reclaim_a(d, engines, None)

    yield run(body())


@pytest.mark.parametrize("phase", ["begin", "bucket", "before_load", "load", "probe", "ready", "commit",
                                   "after_commit"])
def test_engine_killed_at_each_publication_phase_reconciles_to_the_run_without_the_kill(
    engines, fixtures, tmp_path, no_kill_states, phase: str
) -> None:
    async def body() -> tuple[dict[str, Any], dict[str, Any]]:
        async with deployed(engines, fixtures, tmp_path) as d:
            assert d.candidate("B")[1].bucket_count > HELD_AFTER_BUCKET + 1
            return await _publish_b_and_reclaim_a(d, engines, phase)

    assert run(body()) == no_kill_states


def test_engine_killed_during_a_reclaim_drain_unloads_nothing_under_the_request_and_reconciles(
    engines, fixtures, tmp_path, no_kill_states
) -> None:
    async def body() -> dict[str, Any]:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            s_old = d.binder.open("S_old@E0")
            await d.binder.generate(s_old, PROMPT, 4)
            assert (await d.publisher.publish(b_version, b)).committed
            s_new = d.binder.open("S_new@E1")
            assert (await d.binder.bind_first(s_new)).version == b_version
            await d.binder.finish(s_old)  # session refs of A: 0

            # A request for A still in flight on E1 holds SGLang's native reference there.
            in_flight = asyncio.create_task(d.backend.generate(BackendRequest(
                "late/held", tuple(PROMPT), a.lora_name, 1500, {"ignore_eos": True}, frozenset({"E1"}))))

            async def native_refs_on_e1() -> int:
                view = await _engine_view(d, "E1", a.lora_name)
                return -1 if view is None else int(view["native_refcount"])

            async def held() -> bool:
                return await native_refs_on_e1() == 1

            await wait_until(held, timeout_s=60)
            before = unloads(await d.audit())
            # A bound on E1's reclaim call that the drain below stays within (it ends with the kill, seconds in);
            # past it, the lost call is an unconfirmed engine and the reclaim is PENDING.
            d.reclaimer.deadlines = Deadlines(reclaim=RECLAIM_DEADLINE_S)
            reclaim = asyncio.create_task(d.reclaimer.reclaim(a_version))

            async def draining() -> bool:
                view = await _engine_view(d, "E1", a.lora_name)
                return view is not None and view["state"] == "DRAINING"

            await wait_until(draining, timeout_s=60)
            on_e1 = await _engine_view(d, "E1", a.lora_name)
            assert on_e1 is not None and (on_e1["state"], on_e1["pinned"], on_e1["native_refcount"]) == (
                "DRAINING", True, 1)  # the phase, read from E1 before the kill
            assert unloads(await d.audit())["E1"] == before["E1"]  # not unloaded under the request
            engines.e1.kill_hard()
            with pytest.raises(OutcomeUnknown):
                await in_flight
            outcome = await reclaim
            assert outcome.status is ReclaimStatus.PENDING and "E1" not in outcome.confirmed, outcome
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.RECLAIMING and view.managed_count() == 2

            return await _finish_the_claim_on_the_new_incarnation(d, engines, a_version, outcome, before, s_new)

    assert run(body()) == _with_a_absent_on_e1(no_kill_states[1])


def test_engine_killed_during_the_physical_unload_unloads_nothing_twice_and_reconciles(
    engines, fixtures, tmp_path, no_kill_states
) -> None:
    """The kill lands inside E1's reclaim call: A drained (no request holds it) and the table moved it to
    UNLOADING, SGLang's physical unload not yet asked for (the `unload` hold point). E0 unloads A exactly once;
    E1's new incarnation never held A; the same claim finishes there."""

    async def body() -> dict[str, Any]:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            s_old = d.binder.open("S_old@E0")
            await d.binder.generate(s_old, PROMPT, 4)
            assert (await d.publisher.publish(b_version, b)).committed
            s_new = d.binder.open("S_new@E1")
            assert (await d.binder.bind_first(s_new)).version == b_version
            await d.binder.finish(s_old)  # session refs of A: 0, and no request holds A anywhere

            before = unloads(await d.audit())
            hold = EngineHold(d, "E1", "unload", a.lora_name)
            await hold.arm()
            d.reclaimer.deadlines = Deadlines(reclaim=RECLAIM_DEADLINE_S)
            reclaim = asyncio.create_task(d.reclaimer.reclaim(a_version))
            await asyncio.wait_for(hold.reached.wait(), 180)

            on_e1 = await _engine_view(d, "E1", a.lora_name)
            assert on_e1 is not None and (on_e1["state"], on_e1["native_refcount"]) == ("UNLOADING", 0), on_e1
            assert await d.clients["E1"].adapter(a.lora_name) is None  # unregistered: no request can name it
            assert unloads(await d.audit())["E1"] == before["E1"]  # the physical unload not asked for yet
            engines.e1.kill_hard()
            outcome = await reclaim
            assert outcome.status is ReclaimStatus.PENDING and "E1" not in outcome.confirmed, outcome
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.RECLAIMING and view.managed_count() == 2

            return await _finish_the_claim_on_the_new_incarnation(d, engines, a_version, outcome, before, s_new)

    assert run(body()) == _with_a_absent_on_e1(no_kill_states[1])  # as in the drain test
