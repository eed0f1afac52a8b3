"""Seeded mutations of the spec table, fed alike to the core (`Core(rows)`), the model checker and the
Hypothesis state machine; reports which of the two kills each mutant.

    python scripts/mutate_spec.py --seed 1 --count 40 [--jobs J]

Operators: drop_guard (remove one named guard of a row), swap_target (move a state-changing row to
another stored state of its machine), delete_row, drop_effect, drop_update. A mutant is killed only by
a property violation: the checker finds one (any invariant, a frame or target mismatch, a step
property of model_checks/step_properties.py, a ProtocolError for a pair the mutant no longer covers,
or a liveness obligation left open), or the Hypothesis run fails with one (PROPERTY_ERRORS). A run
stopped by any other exception (an assert inside an update the mutant reached, a KeyError in a
scripted step...) is reported apart as `crash` and not counted as a kill. The mutants are never
weakened to raise the rates; the checks are what was strengthened. Mutants no property kills are
listed for a hand verdict (EQUIVALENT below records the ones judged equivalent, with the reason).
The last line printed is the figures as JSON (SUMMARY_PREFIX); tests/model_checks/test_mutation.py
runs a seeded sample and asserts them.
"""

from __future__ import annotations

import argparse
import enum
import json
import multiprocessing
import os
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from model_checks.bfs import check
from model_checks.bounds import SYSTEM_BOUNDS, Bounds
from model_checks.liveness import check_liveness
from model_checks.stateful import PropertyViolation, build_machine
from model_checks.system import System
from versioned_lora.lifecycle import Core, InvariantViolation, ProtocolError
from versioned_lora.spec import ROWS
from versioned_lora.spec.states import SAME, wildcard_states

OPERATORS = ("drop_guard", "swap_target", "delete_row", "drop_effect", "drop_update")
# Safety: model_checks.bounds.SYSTEM_BOUNDS (together they fire every row of the reference table);
# liveness: the abort path.
LIVENESS_BOUNDS = Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=1, bootstrapped=True)
# Hand verdicts: mutant description -> why it cannot change any observable behaviour (state, answer,
# effects) of the core on any input. A mutant listed here is left out of both kill rates.
EQUIVALENT: dict[str, str] = {}
SUMMARY_PREFIX = "MUTATION SUMMARY "  # the last line: the figures as JSON, for tests/model_checks/test_mutation.py


def mutate(rng: random.Random) -> tuple[str, tuple]:
    while True:
        op = rng.choice(OPERATORS)
        i = rng.randrange(len(ROWS))
        row = ROWS[i]
        rows = list(ROWS)
        if op == "drop_guard" and row.guards:
            g = rng.choice(row.guards)
            rows[i] = attrs.evolve(row, guards=tuple(x for x in row.guards if x != g))
            return f"drop_guard {row.id} -{g}", tuple(rows)
        if op == "swap_target" and row.changes_state and row.target != SAME:
            choices = [s for s in wildcard_states(row.machine) if s != row.target]
            if choices:
                t = rng.choice(choices)
                rows[i] = attrs.evolve(row, target=t)
                return f"swap_target {row.id} {row.target}->{t}", tuple(rows)
        if op == "delete_row":
            del rows[i]
            return f"delete_row {row.id}", tuple(rows)
        if op == "drop_effect" and row.effects:
            x = rng.choice(row.effects)
            rows[i] = attrs.evolve(row, effects=tuple(e for e in row.effects if e != x))
            return f"drop_effect {row.id} -{x}", tuple(rows)
        if op == "drop_update" and row.updates:
            x = rng.choice(row.updates)
            rows[i] = attrs.evolve(row, updates=tuple(u for u in row.updates if u != x))
            return f"drop_update {row.id} -{x}", tuple(rows)


class Verdict(enum.Enum):
    PROPERTY = "KILL"  # a property violation: what a kill means
    CRASH = "crash"  # some other exception: reported apart, never counted as a kill
    LIVE = "live"


# What a failing Hypothesis run may raise that is a property violation: a step property or spec
# invariant (PropertyViolation), the core's invariant/frame check (InvariantViolation), a pair the
# mutant no longer covers (ProtocolError; the checker reports it as a violation too).
PROPERTY_ERRORS = (PropertyViolation, InvariantViolation, ProtocolError)


def _describe(exc: BaseException) -> str:
    """The exception and where it was raised (an `assert` carries no message)."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"{type(exc).__name__}{at}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def checker_verdict(core: Core) -> tuple[Verdict, str]:
    """A violation found by the safety BFS over any of SYSTEM_BOUNDS or by liveness is a property
    kill. An exception escaping the checker on some bounds (e.g. an assert inside an update that
    the mutant reached, or a bootstrap that finds no clean move) does not stop the other bounds; it
    is the verdict only when no bounds find a violation."""
    crash = ""
    for bounds in SYSTEM_BOUNDS:
        try:
            violation = check(System(bounds, core)).violation
        except Exception as exc:
            crash = crash or _describe(exc)
            continue
        if violation is not None:
            return Verdict.PROPERTY, "; ".join(violation.problems)[:160]
    try:
        liveness = check_liveness(System(LIVENESS_BOUNDS, core)).violations
    except Exception as exc:
        return Verdict.CRASH, crash or _describe(exc)
    if liveness:
        return Verdict.PROPERTY, f"liveness: {liveness[0][0]}"
    return (Verdict.CRASH, crash) if crash else (Verdict.LIVE, "")


def hypothesis_verdict(core: Core, examples: int) -> tuple[Verdict, str]:
    profile = settings(max_examples=examples, stateful_step_count=50, deadline=None, derandomize=True,
                       suppress_health_check=list(HealthCheck), database=None, print_blob=False,
                       report_multiple_bugs=False,  # one exception to classify, not a group
                       phases=[Phase.explicit, Phase.generate])  # no shrinking: only kill or not
    try:
        run_state_machine_as_test(build_machine(core), settings=profile)
    except PROPERTY_ERRORS as exc:
        return Verdict.PROPERTY, _describe(exc)
    except Exception as exc:
        return Verdict.CRASH, _describe(exc)
    return Verdict.LIVE, ""


@attrs.frozen
class Outcome:
    mutant: str
    checker: Verdict
    hypothesis: Verdict
    why: str  # the first property violation or exception, checker's first
    seconds: float


def draw(seed: int, count: int) -> list[tuple[str, tuple]]:
    """`count` distinct mutants drawn from Random(seed), in draw order."""
    rng = random.Random(seed)
    seen: set[str] = set()
    mutants: list[tuple[str, tuple]] = []
    while len(mutants) < count:
        name, rows = mutate(rng)
        if name not in seen:
            seen.add(name)
            mutants.append((name, rows))
    return mutants


# The parent draws the mutants; forked workers inherit them and are handed only an index.
_WORK: tuple[list[tuple[str, tuple]], int] = ([], 0)


def judge(index: int) -> Outcome:
    mutants, examples = _WORK
    name, rows = mutants[index]
    started = time.perf_counter()
    core = Core(rows)
    (c, c_why), (h, h_why) = checker_verdict(core), hypothesis_verdict(core, examples)
    return Outcome(name, c, h, c_why or h_why, time.perf_counter() - started)


def run(seed: int, count: int, examples: int, jobs: int = 1, emit: Callable[[str], None] = print) -> list[Outcome]:
    """`count` distinct mutants drawn from Random(seed), each judged by the checker and Hypothesis, on `jobs`
    worker processes (a mutant's verdict does not depend on which process judges it or when)."""
    global _WORK
    _WORK = (draw(seed, count), examples)
    outcomes: list[Outcome] = []
    with multiprocessing.get_context("fork").Pool(max(1, jobs)) as workers:
        for outcome in workers.imap(judge, range(count)):
            outcomes.append(outcome)
            emit(f"{outcome.mutant:<70} checker={outcome.checker.value} hypothesis={outcome.hypothesis.value} "
                 f"({outcome.seconds:.1f}s) {outcome.why}")
    return outcomes


def summary(outcomes: list[Outcome]) -> dict[str, int | list[str]]:
    """Kill counts over the mutants not judged equivalent. A mutant counts as killed only by a property
    violation; `*_crash_only` counts the ones the side stopped only by another exception."""
    scored = [o for o in outcomes if o.mutant not in EQUIVALENT]
    by_property = [o for o in scored if Verdict.PROPERTY in (o.checker, o.hypothesis)]
    unkilled = [o for o in scored if o not in by_property]
    return {
        "mutants": len(outcomes),
        "equivalent": len(outcomes) - len(scored),
        "scored": len(scored),
        "checker_killed": sum(o.checker is Verdict.PROPERTY for o in scored),
        "checker_crash_only": sum(o.checker is Verdict.CRASH for o in scored),
        "hypothesis_killed": sum(o.hypothesis is Verdict.PROPERTY for o in scored),
        "hypothesis_crash_only": sum(o.hypothesis is Verdict.CRASH for o in scored),
        "killed": len(by_property),
        "crash_only": sum(Verdict.CRASH in (o.checker, o.hypothesis) for o in unkilled),
        "survived": sum(o.checker is Verdict.LIVE and o.hypothesis is Verdict.LIVE for o in scored),
        "crash_only_mutants": sorted(o.mutant for o in unkilled if Verdict.CRASH in (o.checker, o.hypothesis)),
        "survivors": sorted(o.mutant for o in unkilled if Verdict.CRASH not in (o.checker, o.hypothesis)),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--examples", type=int, default=500)  # 500 x 50 steps
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one a core)")
    ns = p.parse_args()
    started = time.perf_counter()
    outcomes = run(ns.seed, ns.count, ns.examples, ns.jobs)
    figures = summary(outcomes)
    print(f"mutants={figures['mutants']} equivalent={figures['equivalent']} "
          f"checker_killed={figures['checker_killed']}/{figures['scored']} "
          f"(crash only: {figures['checker_crash_only']}) "
          f"hypothesis_killed={figures['hypothesis_killed']}/{figures['scored']} "
          f"(crash only: {figures['hypothesis_crash_only']}) "
          f"killed_by_a_property={figures['killed']}/{figures['scored']} crash_only={figures['crash_only']} "
          f"survived={figures['survived']} ({time.perf_counter() - started:.1f}s)")
    for o in outcomes:
        if o.mutant in figures["crash_only_mutants"]:
            print(f"  stopped only by an exception, no property (needs a hand verdict): {o.mutant} {o.why}")
        elif o.mutant in figures["survivors"]:
            print(f"  survived both (needs a hand verdict): {o.mutant}")
    print(SUMMARY_PREFIX + json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
