"""Test-only hold points inside the engine's own calls (issue 18): where a `kill -9` must land inside one
managed call, which no caller-side hold can reach, and one injected fault a real engine does not produce on
demand.

- ``load``: `end` verified the stash and the table moved the candidate on, and SGLang's load has not begun;
- ``probe``: the candidate is loaded pinned, and its probe request has not been sent;
- ``unload``: a reclaim drained every native reference, and SGLang's physical unload has not been asked for;
- ``fail_request`` (a fault, not a hold): the next request naming the version fails with an unexpected error
  inside the tokenizer manager, after SGLang acquired its LoRA reference and before it reaches the scheduler
  (`TokenizerManager._validate_one_request`, where our `generate_gate` check runs): SGLang answers it 500 and
  releases the reference on its own failure path (`_release_req_states_on_failure`).

A hold point exists only in an engine started with ``VERSIONED_LORA_TEST_HOLD_POINTS=1``; on any other engine
arming one is refused, typed (403 ``HOLD_POINTS_DISABLED``), and nothing here ever waits. Armed (``POST
/versioned_lora/test_hold`` with ``point`` and ``lora_name``, the token required like every managed endpoint),
the next call to reach that point for that exact name stops there, shows itself in ``/versioned_lora/status``
(``hold_points.held``), and waits until the test kills the engine or releases it (``release: true``). Only the
waiting call stops: the rest of the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from versioned_lora.sglang_patches.managed.fields import BadRequest
from versioned_lora.spec.wire import TEST_HOLD_POINTS_ENV, EngineRefusal

ENV = TEST_HOLD_POINTS_ENV
HOLDS_AT = ("load", "probe", "unload")
FAULTS = ("fail_request",)
# The injected failures of the engine's own load and unload (managed/faults.py), armed here too.
ENGINE_FAULTS = ("fail_load", "fail_unload")
POINTS = HOLDS_AT + FAULTS + ENGINE_FAULTS


class InjectedFailure(RuntimeError):
    """The `fail_request` fault: not a ValueError, so SGLang's handler answers it 500, not 400."""


class HoldPoints:
    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get(ENV) == "1" if enabled is None else enabled
        self._armed: dict[str, str] = {}  # point -> the name whose call stops there
        self._held: dict[str, str] = {}  # point -> the name whose call waits there now
        self._released: dict[str, asyncio.Event] = {}

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise BadRequest(EngineRefusal.HOLD_POINTS_DISABLED,
                             f"this engine was not started with {ENV}=1", 403, field="point")

    def arm(self, point: str, name: str) -> None:
        self._require_enabled()
        self._armed[point] = name

    def release(self, point: str) -> None:
        self._require_enabled()
        self._armed.pop(point, None)
        event = self._released.pop(point, None)
        if event is not None:
            event.set()

    def fail_request(self, names: object) -> None:
        """Called for every request the tokenizer manager checks; raises once for a request naming the armed
        version."""
        armed = self._armed.get("fail_request") if self.enabled else None
        if armed is None:
            return
        if armed in (names if isinstance(names, list) else [names]):
            del self._armed["fail_request"]
            raise InjectedFailure(f"injected failure (test-only fault point 'fail_request') for {armed!r}")

    def take(self, fault: str, name: str) -> bool:
        """Whether the engine fault `fault` is armed for exactly `name`. It stays armed until released: SGLang fails
        that operation for as long as the test needs (every retry too)."""
        return self.enabled and self._armed.get(fault) == name

    async def reach(self, point: str, name: str) -> None:
        """Called by the engine at `point` of a call for `name`; returns at once unless armed for exactly that."""
        if not self.enabled or self._armed.get(point) != name:
            return
        del self._armed[point]
        self._held[point] = name
        released = self._released[point] = asyncio.Event()
        try:
            await released.wait()
        finally:
            self._held.pop(point, None)

    def status(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "armed": dict(self._armed), "held": dict(self._held)}


HOLDS = HoldPoints()
