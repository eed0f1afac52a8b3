"""The explicit-state checker: a bounded exhaustive run finds nothing, a planted protocol bug is
found with a short trace that replays against the core, and simulation seeds replay exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_checks import trace as traces
from model_checks.bfs import check
from model_checks.bounds import RECLAIM_WHILE_REHYDRATING, SYSTEM_BOUNDS, Bounds
from model_checks.liveness import check_liveness
from model_checks.report import SUMMARY_PREFIX, report_lines, rows_fired
from model_checks.simulate import simulate
from model_checks.system import System
from versioned_lora.lifecycle import Core
from versioned_lora.spec import ROWS

# Small enough for CI (a few seconds on a loaded core); the figures in model_checks/results/ use larger ones.
CI_BOUNDS = Bounds(engines=2, versions=3, sessions=1, drops=1, dups=0, crashes=0, failures=0, bootstrapped=True)


def test_bounded_check_finds_no_violation_and_reports_one_machine_line() -> None:
    system = System(CI_BOUNDS)
    result = check(system)
    assert result.violation is None and result.complete
    lines = report_lines(system, result)
    summary = [line for line in lines if line.startswith(SUMMARY_PREFIX)]
    assert len(summary) == 1 and "violations=0" in summary[0]
    assert lines[-1].startswith("rows never fired:")
    print("\n".join(lines))


def test_the_checker_bounds_together_fire_every_row_of_the_table() -> None:
    """100% of the table's rows fire in the checker: no single small bound reaches them all (the most
    is 120 of 125), the suite the mutation script uses does, each row on at least one bound."""
    never: set[str] | None = None
    for bounds in SYSTEM_BOUNDS:
        system = System(bounds)
        assert check(system).violation is None
        missed = set(rows_fired(system)[2])
        never = missed if never is None else never & missed
    assert never == set(), sorted(never or ())


def test_symmetry_reduces_and_keeps_the_verdict() -> None:
    bounds = Bounds(engines=2, versions=2, sessions=2, drops=0, dups=0, crashes=0, failures=0, bootstrapped=True,
                    session_aborts=0)
    with_sym = check(System(bounds))
    without = check(System(Bounds(**{**_asdict(bounds), "symmetry": False})))
    assert with_sym.violation is None and without.violation is None
    assert with_sym.distinct < without.distinct
    print(f"symmetry on: {with_sym.distinct} distinct; off: {without.distinct}")


@pytest.mark.parametrize("por", [True, False], ids=["por", "no-por"])
def test_planted_bug_release_on_abort_is_found_within_ten_steps_and_replays(tmp_path: Path, por: bool) -> None:
    system = System(Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=0,
                           bootstrapped=True, planted_bug="release_on_abort", por=por))
    result = check(system)
    assert result.violation is not None
    steps = len(result.violation.trace) - 1
    assert steps <= 10, steps
    assert any("live_session_holds_its_ref" in p for p in result.violation.problems)
    doc = traces.trace_document(system, result.violation.trace, result.violation.problems)
    path = tmp_path / "trace.json"
    traces.save(doc, path)
    ok, log, problems = traces.replay(path)
    assert ok and problems, log
    assert json.loads(path.read_text())["violation"] == list(result.violation.problems)
    print(f"planted bug found in {steps} steps")


def test_reclaim_while_rehydrating_bound_fires_reclaim_staging_and_kills_its_deletion() -> None:
    """The mutation script's bound for row reclaim.staging (the seed-3 checker survivor before it
    existed): the reference passes and fires the row; the table without it is a ProtocolError."""
    system = System(RECLAIM_WHILE_REHYDRATING)
    result = check(system)
    assert result.violation is None and not result.complete  # stopped at its depth bound
    assert system.k.row_counts[system.k.row_index["reclaim.staging"]] > 0
    mutant = Core(tuple(row for row in ROWS if row.id != "reclaim.staging"))
    found = check(System(RECLAIM_WHILE_REHYDRATING, mutant)).violation
    assert found is not None
    assert any("no row covers ReclaimAdapter in adapter:STAGING" in p for p in found.problems), found.problems


def test_simulation_seed_replays_byte_for_byte() -> None:
    bounds = Bounds(engines=2, versions=3, sessions=2, drops=1, dups=1, crashes=1, failures=1)
    first = simulate(System(bounds), seed=11, runs=20, depth=200)
    again = simulate(System(bounds), seed=11, runs=20, depth=200)
    other = simulate(System(bounds), seed=12, runs=20, depth=200)
    assert first.violation is None
    assert first.digest == again.digest and first.steps == again.steps
    assert first.digest != other.digest


def test_liveness_holds_on_a_small_bound() -> None:
    bounds = Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=1)
    result = check_liveness(System(bounds))
    assert not result.violations, result.violations[:3]
    print(f"liveness: {result.states} states, {result.sccs} SCCs, {result.seconds:.1f}s")


def _asdict(bounds: Bounds) -> dict[str, object]:
    import attrs

    return attrs.asdict(bounds)
