"""The registry actor's process `kill -9`'d at each registry step of a publication (after reserve, after each
READY, after commit), of a reclaim (after claim, after each confirm) and inside a bind/close batch (issue 18
part 2, the registry half). After each, the run goes on and ends in the very state the same run reaches
without the kill: version states, default and revision, placement states, capacity and session refs (tokens
and incarnations may differ); no session changed version.

Real Ray registry actor (restarted by Ray, recovering its journal), two real engines, Publisher, Reclaimer,
SessionBinder over a CoalescingRegistry (so closes travel in batches). The kill lands on its step on purpose:
`KillAt` arms the actor's test-only hold (`FaultyRegistryActor.arm_fault`, tests/registry_faults.py) just before the
call it targets, and kills the process while that call is held: after the call is journaled (`after_commit`), so only
its reply is lost, or in the middle of a batch (`mid_batch`), so the whole batch is lost. `RayRegistry` retries the
same key.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import PROMPT, run
from test_publication_e2e import deployed

from versioned_lora.lifecycle import (
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    RecordReady,
    Reserve,
)
from versioned_lora.runtime.coalescing import CoalescingRegistry
from versioned_lora.runtime.publisher import PublishStatus


class KillAt:
    """A registry port in front of the deployment's: before forwarding the first call `matches` picks, it arms
    the actor's hold at `point` and kills the actor's process (SIGKILL) once the hold is reached."""

    def __init__(self, inner: Any, handle: Any, workdir: Path, matches: Any, point: str = "after_commit") -> None:
        self.inner, self.handle, self.workdir, self.matches, self.point = inner, handle, workdir, matches, point
        self.killed: list[int] = []

    async def _armed(self, call: Any) -> Any:
        marker = self.workdir / f"held-{uuid.uuid4().hex[:8]}"
        await self.handle.arm_fault.remote(self.point, after_events=1, hold_s=120.0, marker=str(marker))

        async def kill_when_held() -> None:
            while not marker.exists():
                await asyncio.sleep(0.02)
            pid = int(marker.read_text())
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)

        killer = asyncio.create_task(kill_when_held())
        try:
            return await call  # RayRegistry retries the same key on the restarted actor
        finally:
            await asyncio.wait_for(killer, 60)

    async def submit(self, event: Any, key: str | None = None) -> Any:
        if not self.killed and self.point == "after_commit" and self.matches(event):
            return await self._armed(self.inner.submit(event, key=key))
        return await self.inner.submit(event, key=key)

    async def submit_batch(self, events: Any, key: str | None = None) -> Any:
        if not self.killed and self.point == "mid_batch" and len(events) > 1 and self.matches(events[0]):
            return await self._armed(self.inner.submit_batch(events, key=key))
        if not self.killed and self.point == "after_commit" and any(self.matches(e) for e in events):
            return await self._armed(self.inner.submit_batch(events, key=key))
        return await self.inner.submit_batch(events, key=key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _ready_on(engine: str) -> Any:
    return lambda event: isinstance(event, RecordReady) and event.engine == engine and event.version.version_id == "B"


KILL_POINTS: dict[str, tuple[str, Any]] = {
    "after_reserve": ("after_commit", lambda e: isinstance(e, Reserve) and e.version.version_id == "B"),
    "after_ready_E0": ("after_commit", _ready_on("E0")),
    "after_ready_E1": ("after_commit", _ready_on("E1")),
    "after_commit": ("after_commit", lambda e: isinstance(e, Commit) and e.version.version_id == "B"),
    "after_claim": ("after_commit", lambda e: isinstance(e, ClaimReclaim)),
    "after_confirm_E0": ("after_commit", lambda e: isinstance(e, ConfirmReclaim) and e.engine == "E0"),
    "after_confirm_E1": ("after_commit", lambda e: isinstance(e, ConfirmReclaim) and e.engine == "E1"),
    "inside_close_batch": ("mid_batch", lambda e: isinstance(e, BeginClose | CloseAndRelease)),
}


def canonical(view: Any) -> dict[str, Any]:
    """What must be equal with and without the kill (labels instead of epochs; no tokens or incarnations)."""
    return {
        "default": None if view.default is None else view.default.version_id,
        "revision": view.default_revision,
        "capacity_used": view.managed_count(),
        "versions": {
            key.version_id: (str(v.state), v.session_refs, {e: str(p.state) for e, p in sorted(v.placements.items())})
            for key, v in sorted(view.versions.items())
        },
    }


async def publish(d: Any, version: Any, candidate: Any) -> None:
    """Publish and, if a lost reply left the outcome unknown, resolve it the protocol's way: the same reserve
    again, or the same commit until answered."""
    outcome = await d.publisher.publish(version, candidate)
    if (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "RESERVE_OUTCOME_UNKNOWN"):
        outcome = await d.publisher.publish(version, candidate)
    if (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN"):
        outcome = await d.publisher.resolve()
    assert outcome is not None and outcome.committed, outcome


async def bound_versions(registry: Any, sessions: dict[str, Any]) -> dict[str, str]:
    """Each session's binding as the registry answers it (bind.replay: the same version, no new ref)."""
    return {name: (await registry.submit(BindFirst(key))).result.version.version_id for name, key in sessions.items()}


async def scenario(d: Any, kill: KillAt | None) -> tuple[dict[str, Any], dict[str, str]]:
    """Publish A; bind three sessions to A; publish B; bind one to B; close A's sessions in one batch;
    reclaim A. Returns the final canonical state and each session's version."""
    registry = kill or d.registry
    d.publisher.registry = registry
    d.reclaimer.registry = registry
    binder = d.new_binder(d.backend, shard=1)
    binder._registry = CoalescingRegistry(registry)  # closes and binds travel in batches
    a_version, a = d.candidate("A")
    b_version, b = d.candidate("B")
    await publish(d, a_version, a)
    on_a = [binder.open(f"S{i}@E{i % 2}") for i in range(3)]
    for key in on_a:
        await binder.generate(key, PROMPT, 2)
    await publish(d, b_version, b)
    on_b = binder.open("Sb@E1")
    await binder.generate(on_b, PROMPT, 2)
    versions = await bound_versions(d.registry, {**{f"S{i}": key for i, key in enumerate(on_a)}, "Sb": on_b})
    await asyncio.gather(*(binder.finish(key) for key in on_a))  # closes travel in batches
    reclaimed = await d.reclaimer.reclaim(a_version)
    if str(reclaimed.status) != "RECLAIMED":  # a lost reply left it pending or unknown: the same claim again
        reclaimed = await d.reclaimer.reclaim(a_version)
    assert str(reclaimed.status) == "RECLAIMED", reclaimed
    versions |= {f"{name}_after": v for name, v in (await bound_versions(d.registry, {"Sb": on_b})).items()}
    await binder.finish(on_b)
    return canonical(await d.registry.publication_view()), versions


_BASELINE: list[tuple[dict[str, Any], dict[str, str]]] = []


def baseline(engines: Any, fixtures: Any, tmp_path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The same run without a kill, once per module."""
    if not _BASELINE:
        async def body() -> tuple[dict[str, Any], dict[str, str]]:
            async with deployed(engines, fixtures, tmp_path / "baseline") as d:
                return await scenario(d, None)

        _BASELINE.append(run(body()))
    return _BASELINE[0]


@pytest.mark.parametrize("where", list(KILL_POINTS))
def test_registry_actor_killed_at_each_step_ends_in_the_state_of_the_run_without_the_kill(
    engines, fixtures, tmp_path, where
) -> None:
    expected = baseline(engines, fixtures, tmp_path)
    point, matches = KILL_POINTS[where]

    async def body() -> tuple[dict[str, Any], dict[str, str], list[int]]:
        async with deployed(engines, fixtures, tmp_path) as d:
            kill = KillAt(d.registry, d.handle, tmp_path, matches, point)
            state, versions = await scenario(d, kill)
            return state, versions, kill.killed

    state, versions, killed = run(body())
    assert len(killed) == 1, f"the kill {where} did not happen"
    assert (state, versions) == expected
    assert versions == {"S0": "A", "S1": "A", "S2": "A", "Sb": "B", "Sb_after": "B"}
