"""Hypothesis stateful testing over the table (model_checks/stateful.py): each step draws an enabled row.

Profiles: `ci` (default here) and `nightly` (HYPOTHESIS_PROFILE=nightly). The run prints how often
each row fired and fails unless every row of the table fired at least MIN_FIRINGS times, apart from
the rows in UNREACHABLE (provably unreachable from this machine, each with its reason; none today).
The ci profile is derandomized, so the counts are the same on every run (measured minimum: 20, for
end.bad_manifest; about 45 s on the shared 2-core box).
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from model_checks.stateful import build_machine
from versioned_lora.spec import ROWS

MIN_FIRINGS = 10
# Rows the stateful machine provably cannot fire, with the reason. Empty: every row is reachable.
UNREACHABLE: dict[str, str] = {}

settings.register_profile("ci", max_examples=500, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=True)
settings.register_profile("nightly", max_examples=2000, stateful_step_count=120, deadline=None,
                          suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def test_table_machine_every_step_checked_and_rows_counted() -> None:
    counts: Counter[str] = Counter()
    machine = build_machine(counts=counts)
    run_state_machine_as_test(machine, settings=settings.get_profile(PROFILE))
    below = sorted((counts[row.id], row.id) for row in ROWS if counts[row.id] < MIN_FIRINGS)
    fired = sum(1 for row in ROWS if counts[row.id])
    print(f"\nrows fired {fired}/{len(ROWS)}; total firings {sum(counts.values())}")
    print("per row:", " ".join(f"{row.id}={counts[row.id]}" for row in ROWS))
    print(f"rows below {MIN_FIRINGS} firings ({len(below)}):", " ".join(f"{rid}={n}" for n, rid in below))
    assert set(UNREACHABLE) <= {row.id for row in ROWS}, "UNREACHABLE names a row the table does not have"
    assert all(counts[rid] == 0 for rid in UNREACHABLE), "a row listed as unreachable fired: drop it from the list"
    assert [(n, rid) for n, rid in below if rid not in UNREACHABLE] == []
