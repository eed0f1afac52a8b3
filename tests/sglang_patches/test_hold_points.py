"""The test-only hold points (managed/hold_points.py) by themselves: off unless enabled, a hold stops only the
call for its exact point and name, shows in the status while it waits, and ends when released. (Held calls on
real engines, killed where they wait: tests/e2e/test_engine_kills.py; refused on an engine started without
them: tests/sglang_patches/test_capabilities_engine.py.)"""

from __future__ import annotations

import asyncio

import pytest

from versioned_lora.sglang_patches.managed.fields import BadRequest
from versioned_lora.sglang_patches.managed.hold_points import FAULTS, HoldPoints, InjectedFailure, points

NAME, OTHER = "relax_policy_lora@1-A-0123456789ab", "relax_policy_lora@1-B-0123456789ab"


def test_off_unless_the_engine_was_started_with_them() -> None:
    """Off until the test-only patch set's `apply` enables them (no environment variable does)."""
    holds = HoldPoints()
    for call in (lambda: holds.arm("load", NAME), lambda: holds.release("load")):
        with pytest.raises(BadRequest) as refused:
            call()
        assert (refused.value.code, refused.value.status) == ("HOLD_POINTS_DISABLED", 403)
    asyncio.run(asyncio.wait_for(holds.reach("load", NAME), 1))  # nothing waits
    holds._armed["fail_request"] = NAME  # even armed by hand, a disabled fault never fires
    assert not holds.trip("fail_request", NAME)
    holds.fail_request(NAME)


def test_a_fault_is_one_registry_entry_and_trips_once_for_its_name() -> None:
    """How a later fault is added (a failed load, a failed unload): an entry in FAULTS, armed by name, `trip`ped by
    the engine's code where it should fail."""
    assert set(FAULTS) <= set(points()) and "fail_request" in FAULTS
    holds = HoldPoints(enabled=True)
    holds.arm("fail_request", NAME)
    assert not holds.trip("fail_request", OTHER) and holds.trip("fail_request", [OTHER, NAME])
    assert not holds.trip("fail_request", NAME)  # once


def test_a_hold_stops_only_its_point_and_name_until_released() -> None:
    holds = HoldPoints(enabled=True)

    async def body() -> None:
        holds.arm("probe", NAME)
        await asyncio.wait_for(holds.reach("probe", OTHER), 1)  # another name passes
        await asyncio.wait_for(holds.reach("load", NAME), 1)  # another point passes
        waiting = asyncio.create_task(holds.reach("probe", NAME))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert holds.status() == {"enabled": True, "armed": {}, "held": {"probe": NAME}}
        holds.release("probe")
        await asyncio.wait_for(waiting, 1)
        assert holds.status() == {"enabled": True, "armed": {}, "held": {}}
        await asyncio.wait_for(holds.reach("probe", NAME), 1)  # a hold stops one call, once

    asyncio.run(body())


def test_the_fail_request_fault_fails_one_request_naming_its_version() -> None:
    holds = HoldPoints(enabled=True)
    holds.fail_request(NAME)  # not armed: inert
    holds.arm("fail_request", NAME)
    holds.fail_request(OTHER)
    holds.fail_request(None)  # a base request
    with pytest.raises(InjectedFailure) as failed:
        holds.fail_request([OTHER, NAME])  # a batch naming it
    assert not isinstance(failed.value, ValueError)  # SGLang answers a ValueError 400, anything else 500
    holds.fail_request(NAME)  # once
    assert holds.status()["armed"] == {}


def test_the_injected_engine_faults_fail_their_name_until_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """managed/faults.py (issue 41): `fail_load` and `fail_unload` fire for their exact name on every call until
    released, and never on an engine started without hold points."""
    from versioned_lora.sglang_patches.managed import faults, hold_points

    monkeypatch.setattr(hold_points, "HOLDS", HoldPoints(enabled=False))
    assert not faults.trip(faults.FAIL_LOAD, NAME)
    with pytest.raises(BadRequest):
        hold_points.HOLDS.arm(faults.FAIL_LOAD, NAME)
    monkeypatch.setattr(hold_points, "HOLDS", HoldPoints(enabled=True))
    hold_points.HOLDS.arm(faults.FAIL_UNLOAD, NAME)
    assert not faults.trip(faults.FAIL_UNLOAD, OTHER) and not faults.trip(faults.FAIL_LOAD, NAME)
    assert faults.trip(faults.FAIL_UNLOAD, NAME) and faults.trip(faults.FAIL_UNLOAD, NAME)  # every call, a retry too
    hold_points.HOLDS.release(faults.FAIL_UNLOAD)
    assert not faults.trip(faults.FAIL_UNLOAD, NAME)
    assert set(faults.ENGINE_FAULTS) <= set(hold_points.points())  # armed through the same test endpoint
