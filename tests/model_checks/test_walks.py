"""Walks over driver worlds (model_checks/walks.py): the data-loss bug of issue 17, planted back as a driver-table
mutant, is found by the checker with a short trace that replays from a fresh start and shows the loss again (and not
against the reference table); a simulation seed replays byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from model_checks.drivers import DRIVER_BOUNDS, DriverSystem, check, scenario, stuck
from model_checks.walks import replay, simulate
from versioned_lora.lifecycle.drivers import BUILDERS, GUARDS, Drivers


def test_the_refused_abort_fallback_is_found_with_a_short_trace_that_replays(
        script: Callable[[str], ModuleType]) -> None:
    mutant = script("mutate_drivers").refused_abort_cleans()
    planted = Drivers(mutant.rows, GUARDS, {**BUILDERS, **mutant.builders})
    budget = DRIVER_BOUNDS[0]
    result = check("abort_after_commit", budget, planted, DriverSystem(planted, probes=False))
    assert result.violation is not None and "committed_stays_loaded" in result.violation, result.violation
    assert len(result.trace) <= 12, result.trace
    start = scenario("abort_after_commit", budget)
    for drivers, bug in ((planted, True), (Drivers(), False)):
        system = DriverSystem(drivers, probes=False)
        enabled, problems = replay(start, result.trace, system.successors, lambda w, s=system: s.problems(w, start),
                                   stuck)
        shown = enabled and any("committed_stays_loaded" in p for p in problems)
        assert shown is bug, (drivers is planted, enabled, problems)
    print(f"found in {len(result.trace)} steps: " + " / ".join(result.trace))


def test_a_simulation_seed_replays_byte_for_byte() -> None:
    budget = DRIVER_BOUNDS[0]
    start = scenario("session_retry", budget)

    def run(seed: int) -> tuple[str, int, str | None]:
        system = DriverSystem()
        sim = simulate(start, system.successors, lambda w: system.problems(w, start), stuck, seed, runs=20, depth=60)
        return sim.digest, sim.steps, sim.violation

    first = run(7)
    assert first == run(7) and first[2] is None and first[1] > 100
    assert run(8)[0] != first[0]
