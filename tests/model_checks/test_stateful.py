"""Hypothesis stateful testing over the table (model_checks/stateful.py): each step draws an enabled row.

Profiles: `ci` (default here) and `nightly` (HYPOTHESIS_PROFILE=nightly). The run prints how often
each row fired from randomly drawn steps and, apart, from the scripted scenario prefixes, and fails
unless every row of the table fired at least MIN_FIRINGS times from drawn steps alone (a scripted
firing never counts), apart from the rows in UNREACHABLE (provably unreachable from this machine,
each with its reason; none today). The ci profile is derandomized, so the counts are the same on
every run (the candidates are grouped in a stable order, whatever the hash seed); the printed per-row
minimum is the figure to quote.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from model_checks.stateful import Firings, build_machine
from versioned_lora.spec import ROWS

MIN_FIRINGS = 10
# Rows the stateful machine provably cannot fire, with the reason. Empty: every row is reachable.
UNREACHABLE: dict[str, str] = {}

settings.register_profile("ci", max_examples=1200, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=True, database=None)
settings.register_profile("nightly", max_examples=4000, stateful_step_count=120, deadline=None,
                          suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def test_table_machine_every_step_checked_and_rows_counted() -> None:
    firings = Firings()
    run_state_machine_as_test(build_machine(firings=firings), settings=settings.get_profile(PROFILE))
    drawn, scripted = firings.random, firings.scripted
    row_ids = [row.id for row in ROWS]
    assert set(drawn) | set(scripted) <= set(row_ids), "a firing names a row the table does not have"
    below = sorted((drawn[rid], rid) for rid in row_ids if drawn[rid] < MIN_FIRINGS)
    minimum = min((drawn[rid], rid) for rid in row_ids if rid not in UNREACHABLE)
    print(f"\nprofile {PROFILE}: rows fired from drawn steps {sum(1 for rid in row_ids if drawn[rid])}/{len(ROWS)}; "
          f"firings: drawn {sum(drawn.values())}, scripted prefixes {sum(scripted.values())} (not counted)")
    print(f"per-row minimum from drawn steps: {minimum[0]} ({minimum[1]})")
    print("per row (drawn/scripted/drawn steps enabled at):",
          " ".join(f"{rid}={drawn[rid]}/{scripted[rid]}/{firings.enabled[rid]}" for rid in row_ids))
    print(f"rows below {MIN_FIRINGS} drawn firings ({len(below)}):", " ".join(f"{rid}={n}" for n, rid in below))
    assert set(UNREACHABLE) <= set(row_ids), "UNREACHABLE names a row the table does not have"
    assert all(drawn[rid] == 0 for rid in UNREACHABLE), "a row listed as unreachable fired: drop it from the list"
    assert [(n, rid) for n, rid in below if rid not in UNREACHABLE] == []
