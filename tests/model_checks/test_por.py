"""Partial-order reduction (System.ample, bounds.por): on complete small bounds the reduced search
gives the same verdict, fires the same table rows and reaches the same (registry, engines) core
sub-state pairs as the full one, with fewer states; and the comparison itself fails on a deliberately
unsound reduction (so these checks can fail). The planted bug is found with POR and without it:
test_checker.py."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from model_checks.bfs import check
from model_checks.bounds import Bounds
from model_checks.report import rows_fired
from model_checks.system import ENGS, REG, System

# Complete bounds (each a few seconds at most). The publisher finishes every version in each, so
# class 1 applies in all of them; class 2 (a session whose request is gone) needs a drop or an
# engine crash, so it can apply only in the first and the fourth (test_ample_sets_are_successors_of_the_state
# shows it does in the fourth). The tests assert that POR removes states in each bound.
BOUNDS = (
    Bounds(engines=2, versions=3, sessions=1, drops=1, dups=0, crashes=0, failures=0, bootstrapped=True),
    Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=1, bootstrapped=True),
    Bounds(engines=1, versions=2, sessions=1, drops=0, dups=1, crashes=0, failures=0, bootstrapped=True),
    Bounds(engines=1, versions=2, sessions=1, drops=0, dups=0, crashes=1, failures=0, bootstrapped=True),
    Bounds(engines=2, versions=2, sessions=2, drops=0, dups=0, crashes=0, failures=0, bootstrapped=True,
           session_aborts=0),
)


def _run(bounds: Bounds, por: bool, system_class: type[System] = System) -> tuple[Any, System, set[tuple[Any, Any]]]:
    system = system_class(attrs.evolve(bounds, por=por))
    seen: set[tuple[Any, Any]] = set()
    return check(system, visit=lambda st: seen.add((st[REG], st[ENGS]))), system, seen


def _core_pairs(system: System, seen: set[tuple[Any, Any]]) -> set[tuple[Any, ...]]:
    """Interned ids differ between two runs: compare the core values they stand for."""
    k = system.k
    return {(k.reg_states[r], tuple(k.eng_states[e] for e in engs)) for r, engs in seen}


@pytest.mark.parametrize("bounds", BOUNDS, ids=lambda b: f"{b.engines}E{b.versions}V{b.sessions}S")
def test_por_keeps_verdict_rows_and_core_states(bounds: Bounds) -> None:
    bounds = attrs.evolve(bounds, symmetry=False)
    full, full_sys, full_seen = _run(bounds, por=False)
    red, red_sys, red_seen = _run(bounds, por=True)
    assert full.complete and red.complete
    assert full.violation is None and red.violation is None
    assert rows_fired(red_sys)[2] == rows_fired(full_sys)[2]
    assert _core_pairs(red_sys, red_seen) == _core_pairs(full_sys, full_seen)
    assert red.distinct < full.distinct
    print(f"por off: {full.distinct} distinct; on: {red.distinct}")


def test_por_with_symmetry_keeps_verdict_and_rows() -> None:
    bounds = BOUNDS[4]  # two sessions, so symmetry merges states
    assert bounds.symmetry
    full, full_sys, _ = _run(bounds, por=False)
    red, red_sys, _ = _run(bounds, por=True)
    assert full.violation is None and red.violation is None and full.complete and red.complete
    assert rows_fired(red_sys)[2] == rows_fired(full_sys)[2]
    assert red.distinct < full.distinct


def test_ample_sets_are_successors_of_the_state() -> None:
    """Every ample set is non-empty and a subset of `successors` (same labels, states, problems)."""
    system = System(attrs.evolve(BOUNDS[3], symmetry=False, por=False))
    states: list[Any] = []
    assert check(system, visit=states.append).complete
    classes = set()
    for st in states:
        amp = system.ample(st)
        if amp is None:
            continue
        full = system.successors(st)
        assert amp and all(s in full for s in amp)
        classes.update(label[0] for label, _, _ in amp)
    assert classes == {"pub", "session"}  # both reduced classes occur in this bound


def test_an_unsound_reduction_is_caught_by_the_comparison() -> None:
    """Expanding only the first successor of every state loses states and rows: the checks above
    would fail on it."""

    class FirstOnlyReduction(System):  # an interpreted subclass of the compiled System
        def ample(self, st: Any) -> Any:
            return self.successors(st)[:1] or None

    bounds = attrs.evolve(BOUNDS[0], symmetry=False)
    _, full_sys, full_seen = _run(bounds, por=False)
    _, bad_sys, bad_seen = _run(bounds, por=True, system_class=FirstOnlyReduction)
    assert rows_fired(bad_sys)[2] != rows_fired(full_sys)[2]
    assert _core_pairs(bad_sys, bad_seen) != _core_pairs(full_sys, full_seen)
