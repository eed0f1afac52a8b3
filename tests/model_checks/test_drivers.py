"""The driver machines, model-checked with the real registry and engine tables (model_checks/drivers.py).

Every scenario under every bound of DRIVER_BOUNDS completes without a violation; together they fire
every driver row but the listed defensive ones (and a defensive row that starts firing fails this test
too, so the list stays true) and every registry and engine row but CORE_ROWS_NOT_REACHED (held exact
too), and every one of those but CORE_ROWS_NOT_PROBED by the probes (held exact too); a lost reply and a fired
deadline are reached in every phase that waits for a call; liveness (the drivers' and the spec's) can fail where
safety does not; and the fixed
mutant of issue 17 (a refused abort cleans every engine) is killed by a property, not by a ProtocolError.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import attrs
import pytest

from model_checks.drivers import (
    CORE_ROWS_NOT_PROBED,
    CORE_ROWS_NOT_REACHED,
    DEFENSIVE_ROWS,
    DRIVER_BOUNDS,
    A,
    B,
    Budget,
    Checked,
    DriverSystem,
    check,
    scenario,
    search,
    spec_owed,
    stuck,
)
from model_checks.suite import Entry
from versioned_lora.lifecycle import Core
from versioned_lora.lifecycle.drivers import Drivers, Report
from versioned_lora.spec import ROWS
from versioned_lora.spec.drivers import DRIVER_ROWS, DriverOutcome

# For each phase that waits on a call: the row for its lost reply and the row for its fired deadline.
LOST_AND_DEADLINE = (
    ("begin.lost", "begin.deadline"), ("prepared.lost", "prepared.deadline"), ("bucket.lost", "bucket.deadline"),
    ("end.lost", "end.deadline"), ("ready.lost", "ready.deadline"),
    ("revision.lost", "revision.deadline"), ("commit.lost", "commit.deadline"), ("abort.lost", "abort.deadline"),
    ("clean.lost", "clean.deadline"),
    ("cleaned.lost", "cleaned.deadline"), ("unknown.lost", "unknown.deadline"), ("claim.lost", "claim.deadline"),
    ("unload.lost", "unload.deadline"), ("confirm.lost", "unload.deadline"),
    # the session's registry calls (a generation's calls end by the backend's own timeout: a lost reply)
    ("bind.lost", "bind.deadline"), ("closing.lost", "closing.deadline"), ("release.lost", "release.deadline"),
    # the restart supervisor's read and report (a rehydrate's calls end by the stage driver's own deadlines)
    ("incarnation.lost", "incarnation.deadline"), ("adopt.lost", "adopt.deadline"),
    # the lease keeper's acquire, and its read of the fence before it (a renewal's is its ttl)
    ("acquire.lost", "acquire.deadline"), ("live.lost", "live.deadline"),
    # a publication's read of its version's last attempt before the reserve (under the reserve's timer)
    ("attempt.lost", "attempt.deadline"),
)


def test_every_bound_holds_and_fires_every_row_but_the_defensive_ones(checked: dict[Entry, Checked]) -> None:
    fired: dict[str, int] = {}
    core: set[str] = set()  # the registry's and the engines' rows the worlds stepped through
    probed: set[str] = set()  # ... and those their probes fired
    for entry in [entry for entry in checked if entry[0] == "drivers" and entry[2] in DRIVER_BOUNDS]:
        result = checked[entry].result
        assert result.violation is None, (entry, result.violation, result.trace)
        assert result.states > 1
        for row, count in checked[entry].fired.items():
            fired[row] = fired.get(row, 0) + count
        core |= checked[entry].core_fired
        probed |= checked[entry].core_probed
    assert {r.id for r in DRIVER_ROWS} - fired.keys() == set(DEFENSIVE_ROWS)
    assert {r.id for r in ROWS} - core == CORE_ROWS_NOT_REACHED  # by the drivers' calls, held exact
    assert CORE_ROWS_NOT_REACHED - probed == CORE_ROWS_NOT_PROBED  # ... or by a probe
    for lost, deadline in LOST_AND_DEADLINE:
        assert fired.get(lost, 0) > 0 and fired.get(deadline, 0) > 0, (lost, deadline)


def test_a_probe_finds_a_table_that_lets_a_forged_receipt_through() -> None:
    """The probes can fail: without the row confirm.forged, a confirm under a reclaim id nobody issued falls to
    the rows that record a confirmation. The scenario's own calls carry the right id, so only a probe sends it."""
    mutant = Core(tuple(row for row in ROWS if row.id != "confirm.forged"))
    result = check("reclaim", Budget(drops=0, dups=0, deadlines=0, cancels=0), system=DriverSystem(core=mutant))
    assert result.violation is not None and "ConfirmReclaim" in result.violation, result.violation
    assert "a late, stale or forged call changed the state (confirm." in result.violation, result.violation


def test_liveness_finds_a_poll_that_never_ends() -> None:
    """Liveness can fail where no safety property does: with unload.done moved after unload.draining, every answer
    of the engine's reclaim, UNLOADED too, is taken for "still draining" and the unload is asked again. No state is
    wrong and none is stuck; the reclaim just never ends, in a cycle a weakly fair run can stay in (its deadline
    fires there only early, a fault)."""
    rows = tuple(row for row in DRIVER_ROWS if row.id != "unload.done")
    mutant = Drivers(rows + tuple(row for row in DRIVER_ROWS if row.id == "unload.done"))
    budget = Budget(drops=0, dups=0, deadlines=0, cancels=0)
    result = check("reclaim", budget, mutant, DriverSystem(mutant, probes=False))
    assert result.violation is not None and result.violation.startswith("liveness: its end and report, ")
    system = DriverSystem(mutant, probes=False)
    start = scenario("reclaim", budget)
    assert search("reclaim", start, system.successors, lambda w: system.problems(w, start), stuck).violation is None


def test_the_spec_liveness_is_owed_by_the_driver_whose_work_it_is_until_handed_over() -> None:
    """drivers.spec_owed: a settle driver that ended while its attempt is still open owes attempt_terminates (the
    search then finds it owed forever), unless its report handed the attempt over (UNKNOWN); a reclaim owes
    retired_unused_version_reclaimed for its version, unless its report handed it to the reclaimer's next pass
    (REJECTED, PENDING, UNKNOWN); a stage driver owes nothing of the spec (its caller settles); and no driver owes
    another version's obligations. (On the reference drivers the report properties already imply these: a report of
    COMMITTED or FAILED_CLEAN is checked true, so this is the spec's liveness carried over, not a new catch.)"""
    w = scenario("commit", Budget())
    token = w.driver.attempt_token
    done = attrs.evolve(w.driver, phase="DONE")
    attempt = f"attempt_terminates ('attempt', {B!r}, {token!r})"
    assert spec_owed(w.registry, ((done, (Report(DriverOutcome.COMMITTED),)),)) == {attempt}
    assert spec_owed(w.registry, ((done, (Report(DriverOutcome.UNKNOWN),)),)) == frozenset()
    assert spec_owed(w.registry, ((attrs.evolve(done, attempt_token="attempt@0-9"), ()),)) == frozenset()
    r = scenario("reclaim", Budget())  # A retired, no session holds it
    gone = f"retired_unused_version_reclaimed ('reclaim', {A!r})"
    assert spec_owed(r.registry, ((r.driver, (Report(DriverOutcome.RECLAIMED),)),)) == {gone}
    for over in (DriverOutcome.REJECTED, DriverOutcome.PENDING, DriverOutcome.UNKNOWN):
        assert spec_owed(r.registry, ((r.driver, (Report(over),)),)) == frozenset()
    staging = scenario("stage_probe_mismatch", Budget())
    assert spec_owed(staging.registry, ((staging.driver, (Report(DriverOutcome.STAGED),)),)) == frozenset()


def test_a_check_reaches_the_same_worlds_whatever_ran_before_it_in_the_process() -> None:
    """The process's cache of checked steps (DriverSystem._fire, keyed by equal states) changes no verdict and no
    world: abort after commit_not_ready once reached 3,286 worlds against 3,097 alone, because a cached step that
    changed nothing handed back another world's equal registry, which the journal took for a change."""
    budget = DRIVER_BOUNDS[1]
    alone = check("abort", budget, system=DriverSystem(core=Core(ROWS)))  # a Core that is not CORE: a cache of its own
    check("commit_not_ready", budget)  # fills the process's shared cache
    after = check("abort", budget)
    assert alone.violation is None and after.violation is None
    assert after.states == alone.states == 3097, (after.states, alone.states)


def test_the_refused_abort_fallback_is_killed_by_a_property(script: Callable[[str], ModuleType]) -> None:
    """On the scenario that states the bug (an abort answered after the commit), under each bound; the seed run
    below judges this mutant too, with the rest of its sample."""
    mutate = script("mutate_drivers")
    order = tuple((b, "abort_after_commit") for b in range(len(DRIVER_BOUNDS)))
    verdict, detail = mutate.run(mutate.refused_abort_cleans(), order)
    assert verdict == "killed", detail
    assert "committed_stays_loaded" in detail  # the data loss itself: a committed default unloaded


@pytest.mark.deep  # make check-deep; make test's smoke is the fixed mutant above
@pytest.mark.timeout(2400)  # the suite's 900 s guard: this campaign ran past it alone on the 2-core host
def test_every_mutant_drawn_on_seed_1_is_killed_by_a_property() -> None:
    """Issue 17's bar on a fixed seed: K = N with no mutant dying only by the ProtocolError, and at most 10%
    of the draws argued equivalent. The script itself runs, in a process of its own without the suite's
    coverage tracer (under it the run took about five times as long), on a worker a core. It took about 50 s before
    issue 41's effect-outcome worlds; with them it ran past 600 s beside another campaign and past 900 s alone, so
    the guard is 2,400 s."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "mutate_drivers.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE_")}  # pytest-cov's subprocess hook
    done = subprocess.run([sys.executable, str(script), "--seed", "1"], env=env, capture_output=True, text=True,
                          timeout=2300, check=True)
    lines = done.stdout.splitlines()
    verdicts = [line.split()[0] for line in lines if line and not line.startswith(("seconds=", "driver_mutants="))]
    last = dict(item.split("=") for item in lines[-1].split())
    n, killed, protocol = int(last["driver_mutants"]), int(last["killed"]), int(last["protocol_error_only"])
    equivalent = verdicts.count("equivalent")
    assert n == verdicts.count("killed") + verdicts.count("survived") + verdicts.count("protocol_error_only"), lines
    assert n >= 13 and killed == n and protocol == 0, lines
    assert equivalent <= 0.1 * (n + equivalent), lines
