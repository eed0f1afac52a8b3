"""Issue 22, part 3: the checker at three engines fires every row the two-engine bounds fire, and finds no
violation there (model_checks.bounds.THREE_ENGINE_BOUNDS)."""

from __future__ import annotations

import time

from model_checks.bfs import check
from model_checks.bounds import CHECKER_BOUNDS, THREE_ENGINE_BOUNDS
from model_checks.system import System


def _fired(system: System) -> set[str]:
    return {system.k.core.rows[i].id for i, count in enumerate(system.k.row_counts) if count}


def test_three_engine_bounds_complete_and_fire_every_row_the_two_engine_bounds_fire() -> None:
    two = [bounds for bounds in CHECKER_BOUNDS if bounds.engines == 2]
    assert len(THREE_ENGINE_BOUNDS) == len(two) >= 3 and {b.engines for b in THREE_ENGINE_BOUNDS} == {3}
    fired_at_two: set[str] = set()
    fired_at_three: set[str] = set()
    for small, large in zip(two, THREE_ENGINE_BOUNDS, strict=True):
        system = System(small)
        assert check(system).violation is None
        rows_two = _fired(system)
        system = System(large)
        started = time.monotonic()
        result = check(system)
        assert result.violation is None and result.complete, large.describe()
        rows_three = _fired(system)
        # Each bound at three engines reaches at least what the same bound reaches at two.
        assert rows_two <= rows_three, (large.describe(), sorted(rows_two - rows_three))
        print(f"{large.describe()}: {result.distinct} distinct, {len(rows_three)} rows, "
              f"{time.monotonic() - started:.1f} s")
        fired_at_two |= rows_two
        fired_at_three |= rows_three
    assert fired_at_two <= fired_at_three, sorted(fired_at_two - fired_at_three)
    assert len(fired_at_two) > 100  # the two-engine suite fires most of the table: this compares something
