"""Deadlines of a publication's and a reclaim's phases (RFC §7.3), and the retry of one registry call under
its idempotency key until its answer is known or its deadline passed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import attrs

from versioned_lora.runtime.interfaces import RegistryPort, RegistryUnavailable


@attrs.frozen
class Deadlines:
    """Seconds. Fixed before a run (RFC §7.3); `max_no_progress_s` bounds the time between two
    completed steps of one publication, whatever phase it is in."""

    reserve: float = 10.0
    # The publisher lease's acquire (with the read of its fence before it): a deadline of its own, not bounded by a
    # publication's no-progress clock, so a publisher idle for long acquires as a fresh one does.
    acquire: float = 10.0
    begin: float = 30.0
    bucket: float = 30.0
    end: float = 120.0
    # The wait, after the last engine's `end`, for the candidate's snapshot to be in the snapshot store (written
    # beside the staging, so usually none); a store that cannot take it fails the attempt before its commit.
    store: float = 60.0
    commit: float = 10.0
    abort: float = 10.0  # an abort's answer; past it (a lost reply) the outcome is UNKNOWN and nothing is cleaned
    report: float = 10.0  # an engine's cleanup receipt (CLEANED or UNKNOWN) reaching the registry
    cleanup: float = 60.0
    reclaim: float = 600.0
    max_no_progress: float = 120.0
    retry_pause: float = 0.1  # between two cleanups of a candidate a request still holds (IN_USE)


class PhaseDeadlineMissed(Exception):
    """`bound` says which limit fired: the phase's own deadline, or the run's `max_no_progress`."""

    def __init__(self, phase: str, seconds: float, bound: str = "deadline") -> None:
        if bound == "deadline":
            super().__init__(f"phase {phase} missed its {seconds:.1f}s deadline")
        else:
            super().__init__(f"phase {phase} missed its {bound} bound ({seconds:.1f}s since the last progress)")
        self.phase = phase
        self.bound = bound


async def submit_until_known(registry: RegistryPort, event: Any, key: str, deadline_s: float | None) -> Any:
    """Submit, and after a lost reply submit again under the same key until the answer is known: the
    registry answers a replayed key from its journal, so the event is applied at most once. Past
    `deadline_s` (None: never) the last RegistryUnavailable is raised: the outcome is unknown."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    backoff = 0.05
    while True:
        try:
            return await registry.submit(event, key=key)
        except RegistryUnavailable:
            if deadline is not None and time.monotonic() > deadline:
                raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
