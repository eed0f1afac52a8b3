"""The checker's suite, CHECKER_BOUNDS (model_checks/suite.py): every entry steps the real driver machines, holds
safety and liveness, and together the entries fire every row of every table but the registry's rows no driver makes
(held exact: a row that starts or stops firing fails here). Every driver row fires: the defensive ones that no
one-driver bound fires are fired by a crowd or by the broken port (and the list of those is held exact too)."""

from __future__ import annotations

import pytest

from model_checks.crowd import DEFENSIVE_REACHED
from model_checks.drivers import (
    BROKEN_PORT_BOUNDS,
    BROKEN_PORT_ROWS,
    CORE_ROWS_NOT_REACHED,
    DEFENSIVE_ROWS,
    DIGESTS,
    DRIVER_BOUNDS,
    NO_DRIVER_MAKES,
    WINDOW_BOUNDS,
    WINDOW_SCENARIOS,
    B,
    Budget,
    C,
    Checked,
    D,
    DriverSystem,
    World,
    _received,
    names,
    scenario,
    search,
    stuck,
)
from model_checks.suite import CHECKER_BOUNDS, DEEP_ONLY, SMOKE_BOUNDS, Entry, report_line, rows_fired
from versioned_lora.lifecycle import CORE, Reserve
from versioned_lora.lifecycle.drivers import StageState
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.spec.drivers import DRIVER_ROWS
from versioned_lora.spec.model import occupied_slots
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import PlacementState
from versioned_lora.spec.table import ROWS


def test_every_entry_holds_and_together_they_fire_every_row_but_the_listed_ones(checked: dict[Entry, Checked]) -> None:
    assert {module for module, _, _ in CHECKER_BOUNDS} == {"drivers", "crowd"}  # nothing but the real drivers
    # make test's smoke checks every scenario of either module under some bound (model_checks/suite.py, DEEP_ONLY)
    assert {entry[:2] for entry in checked} == {entry[:2] for entry in CHECKER_BOUNDS}
    for entry, c in checked.items():
        assert c.result.violation is None, (entry, c.result.violation, c.result.trace)
    driver, calls, probed = rows_fired(list(checked.values()))
    unfired = DEFENSIVE_ROWS.keys() - DEFENSIVE_REACHED - BROKEN_PORT_ROWS
    assert {r.id for r in DRIVER_ROWS} - driver == unfired
    assert {r.id for r in ROWS} - (calls | probed) == set(NO_DRIVER_MAKES)
    broken = rows_fired([c for (_, _, budget), c in checked.items() if budget in BROKEN_PORT_BOUNDS])[0]
    assert broken >= BROKEN_PORT_ROWS and DEFENSIVE_ROWS.keys() >= BROKEN_PORT_ROWS  # fired by the broken port
    line = report_line(list(checked.values()))
    fired = len(DRIVER_ROWS) + len(ROWS) - len(unfired) - len(NO_DRIVER_MAKES)
    assert f" rows_fired={fired}/{len(DRIVER_ROWS) + len(ROWS)} violations=0 " in line, line
    print(line)


def test_a_three_engine_world_stages_on_every_engine_and_holds_the_barrier_across_them() -> None:
    """THREE_ENGINE_BOUNDS' worlds have three engines for real: B's staging reaches READY on E2 as well, and its
    bucket 1 waits for bucket 0 on all three (the property bucket_barrier holds in every world; here its precondition
    is shown reached: a world where bucket 0 landed on two engines and not yet on the third)."""
    budget = Budget(drops=0, dups=0, deadlines=0, cancels=0, engines=3)
    system = DriverSystem()
    start = scenario("stage", budget)
    ready_on: set[str] = set()
    partial: list[int] = []

    def look(w: World) -> None:
        ready_on.update(e for (v, e), p in w.registry.placements.items() if v == B and p.state is PlacementState.READY)
        if isinstance(w.driver, StageState) and w.driver.engines:
            partial.append(sum(1 for e in names(w) if _received(w, e, w.driver) >= 1))

    result = search("stage", start, system.successors, lambda w: system.problems(w, start), stuck, on_state=look)
    print(f"three engines, stage, no fault: {result.states} worlds")
    assert result.violation is None and len(start.engines) == 3
    assert ready_on == {"E0", "E1", "E2"}
    assert 2 in partial and 3 in partial


def test_the_window_bound_holds_three_versions_and_refuses_the_fourth_at_reserve(
        checked: dict[Entry, Checked]) -> None:
    """WINDOW_BOUNDS' worlds are K = 3 for real: a publication at capacity starts with A, B and C held (C the
    default), and the registry refuses D's reserve for capacity, where at K = 2 it refuses C with A and B held. The
    report line says which capacities the suite checked."""
    window = Budget(drops=1, dups=0, deadlines=1, cancels=1, capacity=3)
    assert window in WINDOW_BOUNDS and all(("drivers", name, window) in CHECKER_BOUNDS for name in WINDOW_SCENARIOS)
    for budget, refused, held in ((window, D, 3), (Budget(), C, 2)):
        world = scenario("reserve_at_capacity", budget)
        assert world.registry.config.capacity == budget.capacity and occupied_slots(world.registry) == held
        _, result, _ = CORE.step(world.registry, Reserve(refused, DIGESTS[refused]))
        assert isinstance(result, Rejected) and result.reason is Reason.CAPACITY_ERROR, result
    assert " capacities=2,3 " in report_line(list(checked.values()))


@pytest.mark.deep  # make check-deep: every entry of CHECKER_BOUNDS
def test_every_entry_holds_and_the_smoke_fires_every_row_the_whole_suite_fires(
        checked_in_full: dict[Entry, Checked]) -> None:
    """The whole suite, DEEP_ONLY's largest worlds among it, holds safety and liveness; and `make test`'s SMOKE_BOUNDS
    fire every row the whole suite fires, of each table and in each group whose rows a test holds exact, so leaving
    DEEP_ONLY to this run loses no row from `make test`."""
    assert set(SMOKE_BOUNDS) | DEEP_ONLY == set(CHECKER_BOUNDS) and not set(SMOKE_BOUNDS) & DEEP_ONLY
    bad = {entry: c.result.violation for entry, c in checked_in_full.items() if c.result.violation is not None}
    assert bad == {}, bad

    def rows(entries: list[Entry], group: str) -> set[str]:
        """What a test of `make test` holds exact about `group`'s entries: every row fired (driver, core by a call or
        a probe; the one-driver bounds' core rows by call and by probe apart), the crowd's rows no one-driver world
        reaches (test_crowd.py), the broken port's defensive rows (above)."""
        driver, calls, probed = rows_fired([checked_in_full[entry] for entry in entries])
        if group == "one driver":
            return {f"driver {r}" for r in driver} | {f"call {r}" for r in calls} | {f"probe {r}" for r in probed}
        if group == "crowd":
            return calls & CORE_ROWS_NOT_REACHED
        if group == "broken port":
            return driver & BROKEN_PORT_ROWS
        return {f"driver {r}" for r in driver} | {f"core {r}" for r in calls | probed}

    groups = {
        "all": list(CHECKER_BOUNDS),
        "one driver": [e for e in CHECKER_BOUNDS if e[0] == "drivers" and e[2] in DRIVER_BOUNDS],
        "crowd": [e for e in CHECKER_BOUNDS if e[0] == "crowd"],
        "broken port": [e for e in CHECKER_BOUNDS if e[0] == "drivers" and e[2] in BROKEN_PORT_BOUNDS],
    }
    for group, entries in groups.items():
        smoke = [e for e in entries if e not in DEEP_ONLY]
        assert rows(smoke, group) == rows(entries, group), (group, sorted(rows(entries, group) - rows(smoke, group)))
    print(report_line(list(checked_in_full.values())))
