"""SessionBinder against the registry actor on a real local Ray cluster (RFC §4, §7.1 bind/close rows).

The engine side is the scripted `GenerationBackend` double (backend_double.py), injected, so every test here
says `injected`: it records each request for the lora_path assertions, and injects what a real engine cannot do
on demand (a reply lost for one exact rid, a response held past its session's close).
`test_backend_double_conformance.py` holds the double to a real engine on every operation used here; the same
binding, dispatch and close rows run on two real engines in tests/e2e/test_rfc_7_1.py (rows 1, 5, 6, 7)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from backend_double import ScriptedBackend
from registry_helpers import A, B, claim, new_actor, publish, refs

from versioned_lora.adapters.ray_registry import RayRegistry
from versioned_lora.lifecycle import (
    BindFirst,
    CloseAndRelease,
    Closed,
    Reason,
    ReclaimEligible,
    RegistryState,
    Rejected,
    SessionKey,
    SessionState,
    VersionState,
)
from versioned_lora.runtime.dispatch_gate import DispatchGate, VersionUnavailable
from versioned_lora.runtime.interfaces import OutcomeUnknown
from versioned_lora.runtime.session_binder import (
    Binding,
    LateResponseDropped,
    NoPublishedVersion,
    SessionBinder,
    SessionClosed,
    UnresolvedOutcome,
)
from versioned_lora.spec.model import session_state

pytestmark = pytest.mark.usefixtures("ray_cluster")
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def state_of(handle: Any) -> RegistryState:
    state: RegistryState = ray.get(handle.state.remote())
    return state


def binder_for(registry: RayRegistry, backend: ScriptedBackend | None = None, shard: int = 0) -> SessionBinder:
    gate = DispatchGate(registry, max_staleness_s=0.0)  # exact: one registry read per dispatch
    return SessionBinder(registry, backend or ScriptedBackend(), epoch=0, shard=shard, gate=gate)


def test_injected_backend_64_concurrent_bind_first_with_cancelled_waiters_take_one_ref(tmp_path: Path) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        binder = binder_for(registry)
        key = binder.open("s-concurrent")
        waiters = [asyncio.create_task(binder.bind_first(key)) for _ in range(64)]
        await asyncio.sleep(0)  # every waiter is now parked on the shared task
        cancelled = waiters[::3]
        for waiter in cancelled:
            waiter.cancel()
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        bindings = {o for o in outcomes if isinstance(o, Binding)}
        assert all(w.cancelled() for w in cancelled)
        assert len([o for o in outcomes if isinstance(o, Binding)]) == 64 - len(cancelled)
        assert len(bindings) == 1 and next(iter(bindings)).version == A  # one version for all
        entry = binder.record(key)
        assert entry is not None and entry.loop is not None
        # One bind call (row bind.start once), answered once: cancelling waiters cancelled nothing.
        assert entry.loop.fired.count("bind.start") == 1 and entry.loop.fired.count("bind.bound") == 1
        assert refs(state_of(handle), A) == 1
        # Every later call (a tool turn, a retry) returns the same binding without a registry write.
        stats = ray.get(handle.journal_stats.remote())
        assert await binder.bind_first(key) == entry.binding
        assert ray.get(handle.journal_stats.remote())["last_seq"] == stats["last_seq"]

        # All waiters cancelled: the shared bind still completes, once.
        other = binder.open("s-all-cancelled")
        lone = [asyncio.create_task(binder.bind_first(other)) for _ in range(8)]
        await asyncio.sleep(0)
        for waiter in lone:
            waiter.cancel()
        await asyncio.gather(*lone, return_exceptions=True)
        loop = binder.record(other).loop  # type: ignore[union-attr]
        assert loop is not None
        while "bind.bound" not in loop.fired:  # the bind goes on with no waiter left
            await asyncio.sleep(0.01)
        assert (await binder.bind_first(other)).version == A and loop.fired.count("bind.start") == 1
        assert refs(state_of(handle), A) == 2

    run(scenario())


def test_injected_backend_close_before_open_duplicate_close_and_late_bind_change_no_refs(tmp_path: Path) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        binder = binder_for(registry)
        anchor = binder.open("anchor")  # seq 0 stays open, so later tombstones stay CLOSED (not compacted)
        with pytest.raises(NoPublishedVersion):
            await binder.bind_first(anchor)
        await publish(registry, A, revision=0)
        await binder.bind_first(anchor)

        # Close before open: a close for a key the registry never saw writes a tombstone ...
        early = SessionKey(0, 0, 1)
        report = await binder.finish(early)
        assert not report.released
        before = state_of(handle)
        assert session_state(before, early) is SessionState.CLOSED
        # ... and the open that arrives later cannot bind.
        binder._next_seq = 2
        binder.open("early", key=early)
        with pytest.raises(SessionClosed):
            await binder.bind_first(early)
        assert refs(state_of(handle), A) == refs(before, A) == 1

        # Duplicate close: concurrent finishers share one close; a later one releases nothing.
        key = binder.open("dup")
        await binder.bind_first(key)
        assert refs(state_of(handle), A) == 2
        first, second = await asyncio.gather(binder.finish(key), binder.finish(key))
        assert first is second and first.released
        assert refs(state_of(handle), A) == 1
        again = await binder.finish(key)
        assert not again.released
        direct = (await registry.submit(CloseAndRelease(key))).result
        assert direct == Closed(key, released=False)

        # Late bind after close, straight at the registry: refused, no ref, record stays CLOSED.
        late = (await registry.submit(BindFirst(key))).result
        assert isinstance(late, Rejected) and late.reason is Reason.SESSION_CLOSED
        with pytest.raises(SessionClosed):
            await binder.bind_first(key)  # the local record is gone: nothing is sent
        after = state_of(handle)
        assert refs(after, A) == 1
        assert session_state(after, key) is SessionState.CLOSED
        assert session_state(after, early) is SessionState.CLOSED

        # A bind racing the finish: either it bound and the close released it, or it was refused.
        racer = binder.open("racer")
        bind = asyncio.create_task(binder.bind_first(racer))
        await asyncio.sleep(0)
        report = await binder.finish(racer)
        outcome = (await asyncio.gather(bind, return_exceptions=True))[0]
        # Its waiter is told the session closed unless the bind answered first (finish.binding).
        assert not isinstance(outcome, Binding) or report.released
        assert refs(state_of(handle), A) == 1
        assert session_state(state_of(handle), racer) is SessionState.CLOSED

    run(scenario())


def test_injected_backend_requests_carry_the_bound_lora_path_across_a_commit(tmp_path: Path) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        backend = ScriptedBackend()
        binder = binder_for(registry, backend)
        old = binder.open("old")
        first = await binder.generate(old, [1, 2, 3], 4, rid="old/1")
        await publish(registry, B, revision=1)  # A -> RETIRED, default B
        new = binder.open("new")
        await binder.generate(new, [1, 2, 3], 4, rid="new/1")
        # The old session's tool turn and resume stay on A; the new session is on B.
        await binder.generate(old, [1, 2, 3, *first.output_ids, 9], 4, rid="old/2")
        paths = {c.rid: c.lora_path for c in backend.calls}
        a_path, b_path = binder.record(old).binding.lora_path, binder.record(new).binding.lora_path  # type: ignore[union-attr]
        assert a_path != b_path and "-A-" in a_path and "-B-" in b_path
        assert paths == {"old/1": a_path, "old/2": a_path, "new/1": b_path}
        state = state_of(handle)
        assert state.versions[A].state is VersionState.RETIRED and refs(state, A) == 1 and refs(state, B) == 1

        # Closing the last A session makes A reclaimable: the effect goes back to the caller.
        report = await binder.finish(old)
        assert report.released and ReclaimEligible(A) in report.effects

    run(scenario())


def test_injected_backend_dispatch_for_a_reclaiming_version_is_refused_before_leaving_the_process(
    tmp_path: Path,
) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        backend = ScriptedBackend()
        binder = binder_for(registry, backend)
        key = binder.open("s")
        await binder.generate(key, [5, 6], 2, rid="s/1")
        await publish(registry, B, revision=1)
        # Another finisher closes the session behind this binder's back; A becomes reclaimable.
        closed = (await registry.submit(CloseAndRelease(key))).result
        assert closed.released  # type: ignore[union-attr]
        await claim(registry, A)
        calls = len(backend.calls)
        with pytest.raises(VersionUnavailable) as info:
            await binder.generate(key, [5, 6, 7], 2, rid="s/2")
        assert info.value.state is VersionState.RECLAIMING
        assert len(backend.calls) == calls  # nothing reached the engine
        report = await binder.finish(key)
        assert not report.released  # released once, by the other finisher
        assert refs(state_of(handle), A) == 0

    run(scenario())


def test_injected_backend_unknown_outcome_is_never_resent_and_a_late_response_after_close_is_dropped(
    tmp_path: Path,
) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        backend = ScriptedBackend(fault=lambda r: "unknown" if r.rid == "s/lost" else None)
        binder = binder_for(registry, backend)
        key = binder.open("s")
        with pytest.raises(OutcomeUnknown):
            await binder.generate(key, [1, 2], 3, rid="s/lost")
        with pytest.raises(UnresolvedOutcome):
            await binder.generate(key, [1, 2], 3, rid="s/again")
        assert [c.rid for c in backend.calls] == ["s/lost"]  # sent exactly once, never resent
        await binder.resolve_unknown(key, "s/lost")
        assert backend.aborts == ["s/lost"]
        await binder.generate(key, [1, 2], 3, rid="s/retry")  # the agentic layer's retry, now allowed

        # A response held past the close: finish does not wait for it, and it is dropped on arrival.
        backend.held["s/slow"] = asyncio.Event()
        slow = asyncio.create_task(binder.generate(key, [1, 2, 3], 3, rid="s/slow"))
        while "s/slow" not in {c.rid for c in backend.calls}:
            await asyncio.sleep(0.001)
        report = await binder.finish(key)
        assert report.released and report.aborted == ("s/slow",)
        digest = await registry.state_digest()
        backend.held["s/slow"].set()
        with pytest.raises(LateResponseDropped):
            await slow
        assert binder.dropped_late_responses == 1
        assert await registry.state_digest() == digest  # nothing reopened, nothing released twice
        assert session_state(state_of(handle), key) in (SessionState.CLOSED, SessionState.COMPACTED)
        assert binder.record(key) is None

    run(scenario())

