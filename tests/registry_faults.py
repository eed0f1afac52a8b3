"""The registry actor, held at a point of a call on a test's request (an injected fault, test-only): a real process
cannot be made to stop at an exact point of a call on demand, so the actor pauses there, writes its pid to a marker
file, and the test kill -9s it. The production class (`RegistryCore._reached`) does nothing at those points.

Tests create the actor with `actor_class=FaultyRegistryActor` (`create_registry_actor`, or a `Stack` subclass's
`registry_actor`), then `handle.arm_fault.remote(point, ...)`. The class is pickled by value, so the actor's worker
process needs no import path to the tests."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import attrs
import ray.cloudpickle

from versioned_lora.adapters.ray_registry import RegistryActor

# Where an armed fault holds the actor (RegistryCore._reached's points).
FAULT_POINTS = ("mid_batch", "before_commit", "after_commit")


@attrs.define
class Fault:
    point: str
    after_events: int
    hold_s: float
    marker: str | None

    def hit(self) -> None:
        if self.marker:
            # Written aside and renamed: a reader polling for the file never sees it empty.
            staged = Path(f"{self.marker}.tmp")
            staged.write_text(str(os.getpid()))
            staged.replace(self.marker)
        time.sleep(self.hold_s)


class FaultyRegistryActor(RegistryActor):
    fault: Fault | None = None

    def arm_fault(self, point: str, after_events: int = 1, hold_s: float = 30.0, marker: str | None = None) -> None:
        """Hold the next call at `point` (after `after_events` events for mid_batch) for `hold_s` seconds, writing
        this process's pid to `marker` first. Not persisted: a restart disarms it."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; one of {FAULT_POINTS}")
        self.fault = Fault(point, after_events, hold_s, marker)

    def _reached(self, point: str, events_done: int = 0) -> None:
        fault = self.fault
        if fault is None or fault.point != point or (point == "mid_batch" and events_done != fault.after_events):
            return
        self.fault = None
        fault.hit()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
