"""Issue 17: how far the driver checker is from replacing system.py's as the checker of the core. The core mutants of
`scripts/mutate_spec.py` (the same draw: same seed, same count) are judged by the driver checker alone: the entries of
CHECKER_BOUNDS (model_checks/suite.py: every one-driver scenario at two engines and at three, every crowd check), with
the mutant as the registry's and the engines' table the worlds step and the probes are sent to (the scenarios' starting
worlds are built with the reference table, as each scenario states them). The first violation kills the mutant. The
reference table is run through every entry first (the baseline: which registry and engine rows each fires, by a call or
a probe, and how many worlds it reaches); a mutant then runs first the entries whose baseline fired the row it changes,
fewest worlds first, and the rest after them. The order changes no verdict: a mutant that survives runs every entry,
and one that is killed is killed by some entry whichever order they run in. As in mutate_spec.py, a ProtocolError (a
pair the mutant no longer covers) counts as a kill, and so does a step that breaks what system.py's kernel checks of
every step (drivers.StepPropertyViolation); any other exception is reported apart as `crash`, never as a kill.
mutate_spec.py's own verdicts (system.py's checker and Hypothesis) are its committed results; this script does not
repeat them.

    python scripts/core_mutants_on_drivers.py --seed 1 --count 40 [--jobs J]

One line per mutant, then the last line:
    core_mutants=N driver_checker_killed=K crash_only=C survived=S seconds=T
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from model_checks import crowd, suite
from model_checks.drivers import DriverSystem, check
from versioned_lora.lifecycle import Core

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutate_spec import draw

_MUTANTS: list[tuple[str, tuple]] = []  # drawn in the parent; forked workers inherit them
_ORDER: dict[str, list[suite.Entry]] = {}  # mutated row -> the entries in the order a mutant of it runs them


def order_for(baseline: list[tuple[suite.Entry, set[str], int]], row: str) -> list[suite.Entry]:
    """The entries whose baseline fired `row` (a call or a probe), fewest worlds first; then the others, likewise."""
    ranked = sorted(baseline, key=lambda b: (row not in b[1], b[2]))
    return [entry for entry, _, _ in ranked]


def judge(index: int) -> tuple[str, str, str, float]:
    """(mutant, verdict, why, seconds): verdict `killed`, `crash` or `survived`."""
    name, rows = _MUTANTS[index]
    started = time.perf_counter()
    core = Core(rows)
    crash = ""
    for module, scenario, budget in _ORDER.get(name.split()[1], list(suite.CHECKER_BOUNDS)):
        checker = check if module == "drivers" else crowd.check
        try:
            violation = checker(scenario, budget, system=DriverSystem(core=core)).violation
        except Exception as exc:  # raised outside the search's own try (a property's code, a scenario's setup)
            crash = crash or f"{module}/{scenario}: {type(exc).__name__}: {exc}"[:200]
            continue
        if violation is None:
            continue
        # The search reports an exception raised by a step as "Name: message": a ProtocolError (an uncovered pair) and
        # a StepPropertyViolation (a step's invariant, frame or step property) are property kills; others crash.
        exception = violation.split(":", 1)[0]
        if exception.isidentifier() and exception != "ProtocolError" and exception.endswith(("Error", "Exception")):
            crash = crash or f"{module}/{scenario}: {violation}"[:200]
            continue
        return name, "killed", f"{module}/{scenario} {budget}: {violation}"[:240], time.perf_counter() - started
    return name, "crash" if crash else "survived", crash, time.perf_counter() - started


def main() -> int:
    global _MUTANTS
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one a core)")
    ns = p.parse_args()
    started = time.perf_counter()
    _MUTANTS = draw(ns.seed, ns.count)
    reference = suite.run(jobs=ns.jobs)
    assert not any(c.result.violation for c in reference), "the reference table fails a check"
    baseline = [(entry, c.core_fired | c.core_probed, c.result.states)
                for entry, c in zip(suite.CHECKER_BOUNDS, reference, strict=True)]
    for name, _ in _MUTANTS:
        _ORDER.setdefault(name.split()[1], order_for(baseline, name.split()[1]))
    print(f"baseline: {len(baseline)} entries, {time.perf_counter() - started:.0f}s", flush=True)
    verdicts: list[str] = []
    with multiprocessing.get_context("fork").Pool(max(1, ns.jobs)) as workers:
        for name, verdict, why, seconds in workers.imap(judge, range(len(_MUTANTS))):
            verdicts.append(verdict)
            print(f"{verdict:<9} {seconds:7.1f}s  {name:<60} {why}", flush=True)
    print(f"core_mutants={len(verdicts)} driver_checker_killed={verdicts.count('killed')} "
          f"crash_only={verdicts.count('crash')} survived={verdicts.count('survived')} "
          f"seconds={time.perf_counter() - started:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
