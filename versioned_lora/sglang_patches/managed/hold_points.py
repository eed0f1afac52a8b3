"""Patch set "test_faults": the engine-side hold points and injected faults that tests use (issue 18), loaded only
when a test names the set in ``VERSIONED_LORA_PATCHES`` (issue 41: never in `DEFAULT_PATCHES`; the suite's engines
are started with ``tests/engine_helpers.TEST_PATCHES``). On any other engine this module stays inert: every hook
the engine's code calls here returns at once, no ``/versioned_lora/test_hold`` route exists, and the status has no
``hold_points`` section (its ``patch_sets`` lists what was loaded).

Hold points (a call of the engine's stops there, for exactly one armed name, until released or killed):

- ``load``: `end` verified the stash and the table moved the candidate on, and SGLang's load has not begun;
- ``probe``: the candidate is loaded pinned, and its probe request has not been sent;
- ``unload``: a reclaim drained every native reference, and SGLang's physical unload has not been asked for.

Faults (`FAULTS`, a registry: the next call naming the armed version fails once, then the fault is disarmed):

- ``fail_request``: the next request naming the version fails with an unexpected error inside the tokenizer
  manager, after SGLang acquired its LoRA reference and before it reaches the scheduler
  (`TokenizerManager._validate_one_request`, where our `generate_gate` check runs): SGLang answers it 500 and
  releases the reference on its own failure path (`_release_req_states_on_failure`).

Faults of what the engine serves (`served_faults.SCHEDULER_FAULTS`: ``flip_pool_byte``, ``alter_alpha``,
``drop_module``): armed here too, carried out by the scheduler process, where SGLang's LoRA memory pool and the load
from the stash are.

A new fault is one entry in `FAULTS` and one ``if HOLDS.trip("<fault>", name): raise ...`` where the engine's code
should fail. Armed through ``POST /versioned_lora/test_hold`` (``point``, ``lora_name``; ``release: true`` ends a
hold or disarms), the token required like every managed endpoint; ``/versioned_lora/status`` shows
``hold_points`` (``armed``, ``held``). Only the waiting call stops: the rest of the engine keeps serving.
"""

from __future__ import annotations

import asyncio
from typing import Any

from versioned_lora.sglang_patches.managed import fields
from versioned_lora.sglang_patches.managed.fields import BadRequest
from versioned_lora.sglang_patches.managed.served_faults import SCHEDULER_FAULTS
from versioned_lora.spec.wire import EngineRefusal

PATCH_SET = "test_faults"
HOLDS_AT = ("load", "probe", "unload")
# name -> what it does; `HoldPoints.trip` fires one of them once for its armed name.
FAULTS: dict[str, str] = {
    "fail_request": "the next /generate naming the version fails 500 inside the tokenizer manager",
}
# The injected failures of the engine's own load and unload (managed/faults.py), armed here too: they stay armed
# until released (`HoldPoints.take`), so every retry of that operation fails as long as the test needs.
ENGINE_FAULTS = ("fail_load", "fail_unload")
# The injected faults of what the engine serves (managed/served_faults.py), armed here, carried out by the scheduler.
SERVED_FAULTS = SCHEDULER_FAULTS


def points() -> tuple[str, ...]:
    return HOLDS_AT + tuple(FAULTS) + ENGINE_FAULTS + SERVED_FAULTS


class InjectedFailure(RuntimeError):
    """The `fail_request` fault: not a ValueError, so SGLang's handler answers it 500, not 400."""


class HoldPoints:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled  # set by the patch set's `apply`, in the server process only
        self._armed: dict[str, str] = {}  # point -> the name whose call stops there
        self._held: dict[str, str] = {}  # point -> the name whose call waits there now
        self._released: dict[str, asyncio.Event] = {}

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise BadRequest(EngineRefusal.HOLD_POINTS_DISABLED,
                             f"this engine was not started with the {PATCH_SET} patch set", 403, field="point")

    def arm(self, point: str, name: str) -> None:
        self._require_enabled()
        self._armed[point] = name

    def release(self, point: str) -> None:
        self._require_enabled()
        self._armed.pop(point, None)
        event = self._released.pop(point, None)
        if event is not None:
            event.set()

    def trip(self, fault: str, names: object) -> bool:
        """True, once, for a call that names the version `fault` is armed for (a name or a list of names)."""
        armed = self._armed.get(fault) if self.enabled else None
        if armed is None or armed not in (names if isinstance(names, list) else [names]):
            return False
        del self._armed[fault]
        return True

    def fail_request(self, names: object) -> None:
        """Called for every request the tokenizer manager checks; raises once for a request naming the armed
        version."""
        if self.trip("fail_request", names):
            raise InjectedFailure(f"injected failure (test-only fault 'fail_request') for {names!r}")

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

_HOLD_FIELDS = frozenset({"point", "lora_name", "release"})


def test_hold(body: dict[str, Any]) -> Any:
    """``POST /versioned_lora/test_hold``: arm (or release) a hold point or a fault."""
    from versioned_lora.sglang_patches.managed.endpoints import _managed_name

    fields.only(body, _HOLD_FIELDS, "test_hold")
    point = fields.string(body, "point", fields.TOKEN_RE, max_len=16)
    if point not in points():
        raise BadRequest(EngineRefusal.MALFORMED_REQUEST, f"field 'point' must be one of {list(points())}",
                         field="point")
    if fields.boolean(body, "release", default=False):
        HOLDS.release(point)
    else:
        HOLDS.arm(point, _managed_name(body))
    return HOLDS.status()


def apply(role: str) -> None:
    """Enable the hooks and serve their route, in the server process (the hooks all run there but the served faults'
    scheduler half, installed in the scheduler process)."""
    from versioned_lora.sglang_patches.managed import served_faults

    if role == "scheduler":
        served_faults.install_scheduler()
    if role != "server":
        return
    from versioned_lora.sglang_patches import introspection
    from versioned_lora.sglang_patches.managed import endpoints

    served_faults.install_server()

    HOLDS.enabled = True
    endpoints.add_managed_route("test_hold", test_hold)
    introspection.STATUS_EXTENSIONS.append(lambda _tm: {"hold_points": HOLDS.status()})
