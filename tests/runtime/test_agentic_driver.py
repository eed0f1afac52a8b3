"""The agentic driver (Relax's session service in small) on the real registry actor: sessions with tool
turns, retries after known failures, unknown outcomes resolved before a retry, temporary abort/resume,
a publication in the middle of the run, and finish; then A is reclaimable and refused for dispatch.

Faults are injected by the scripted backend double (a 503 or a lost reply for one exact rid), which
test_backend_double_conformance.py holds to a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from backend_double import ScriptedBackend
from registry_helpers import A, B, claim, new_actor, publish, refs

from versioned_lora.lifecycle import ReclaimEligible, RegistryEffect, SessionState, VersionState
from versioned_lora.runtime.agentic_driver import AgenticDriver, SessionScript
from versioned_lora.runtime.coalescing import CoalescingRegistry
from versioned_lora.runtime.dispatch_gate import DispatchGate
from versioned_lora.runtime.interfaces import BackendRequest
from versioned_lora.runtime.session_binder import SessionBinder
from versioned_lora.spec.model import session_state

pytestmark = pytest.mark.usefixtures("ray_cluster")
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def faults(request: BackendRequest) -> str | None:
    # Session ids ending in -f get a 503 on their first attempt of turn 1; -u lose the reply there.
    if request.rid.endswith("-f/t1/a0"):
        return "5xx"
    if request.rid.endswith("-u/t1/a0"):
        return "unknown"
    return None


def script(name: str, abort: bool) -> SessionScript:
    return SessionScript(name, prompt=(1, 2, 3, len(name)), turns=3, max_new_tokens=6,
                         abort_resume_turn=2 if abort else None, abort_after_s=0.3)


def test_injected_faults_driver_runs_sessions_through_a_publication_and_finishes_them(tmp_path: Path) -> None:
    handle, actor = new_actor(tmp_path)
    registry = CoalescingRegistry(actor)
    effects: list[RegistryEffect] = []

    async def scenario() -> None:
        await publish(actor, A, revision=0)
        kinds = ["", "-f", "-u"]
        old = [script(f"old{i}{kinds[i % 3]}", abort=i % 2 == 0) for i in range(12)]
        new = [script(f"new{i}{kinds[i % 3]}", abort=i % 2 == 1) for i in range(12)]
        # The first attempt of an aborting turn stalls after one token until its abort arrives, so the abort
        # is mid-generation however late a loaded machine delivers it. The abort is sent 0.3 s after the attempt
        # (AgenticDriver): an abort sent before the request itself left is dropped by the binder (nothing in flight
        # under that rid), and the stall then ends at its limit and the assertion below names the rid.
        aborting = {f"{s.session_id}/t{s.abort_resume_turn}/a0" for s in old + new if s.abort_resume_turn is not None}
        backend = ScriptedBackend(token_delay_s=0.001, fault=faults, stall=lambda r: r.rid in aborting)
        binder = SessionBinder(registry, backend, epoch=0, shard=7, gate=DispatchGate(registry),
                               on_effects=effects.extend)
        driver = AgenticDriver(binder)
        first_wave = asyncio.create_task(driver.run(old, concurrency=12))
        # Publish B while the first wave is in its turns: it stays on A; the second wave binds B.
        while sum(1 for e in binder.open_sessions.values() if e.binding) < len(old):
            await asyncio.sleep(0.001)
        await publish(actor, B, revision=1)
        transcripts = [*await first_wave, *await driver.run(new, concurrency=12)]

        for t in transcripts:
            assert t.error is None, (t.session_id, t.error)
            assert len(t.lora_paths) == 1  # one binding for every turn, retry and resume
            assert t.version == (A if t.session_id.startswith("old") else B)
            assert backend.lora_paths_of(t.session_id + "/") == set(t.lora_paths)
            assert t.close.released
            turns = {a.turn for a in t.attempts}
            assert turns == {0, 1, 2}
            kinds_seen = {a.kind for a in t.attempts}
            if t.session_id.endswith(("-f", "-u")):
                assert "retry" in kinds_seen
            if t.session_id.endswith("-u"):
                lost = f"{t.session_id}/t1/a0"
                assert [c.rid for c in backend.calls].count(lost) == 1  # never resent
                assert lost in backend.aborts  # resolved by abort before the retry
        aborted = [a for t in transcripts for a in t.attempts if a.outcome == "aborted"]
        resumed = [a for t in transcripts for a in t.attempts if a.kind == "resume"]
        assert {a.rid for a in aborted} == aborting and len(resumed) >= len(aborted)
        for t in transcripts:  # a resume continues from the prefix plus the partial output
            for before, after in zip(t.attempts, t.attempts[1:], strict=False):
                if before.outcome == "aborted":
                    assert after.kind == "resume" and after.prefix_len == before.prefix_len + len(before.output_ids)

        state = ray.get(handle.state.remote())
        assert refs(state, A) == 0 and refs(state, B) == 0
        assert all(session_state(state, t.key) in (SessionState.CLOSED, SessionState.COMPACTED) for t in transcripts)
        assert ReclaimEligible(A) in effects  # the last A session's close hands A to the Reclaimer
        assert registry.batches_sent > 0

        # After the claim, a new session bound to B runs; nothing may go out for A any more.
        await claim(actor, A)
        assert (await actor.version_states([A]))[A] is VersionState.RECLAIMING
        late = await driver.run([script("late", abort=False)])
        assert late[0].version == B and late[0].error is None
        assert all("-A-" not in c.lora_path for c in backend.calls if c.rid.startswith("late/"))

    run(scenario())
