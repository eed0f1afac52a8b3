"""Seeded mutations of the spec table, fed alike to the core (`Core(rows)`), the model checker and the
Hypothesis state machine; reports which of the two kills each mutant.

    python scripts/mutate_spec.py --seed 1 --count 40 [--jobs J] [--baseline FILE]

The checker is the checker's suite, CHECKER_BOUNDS (model_checks/suite.py): the real driver machines, alone and side by
side, at two engines and three, with the mutant as the table of the registry and the engines their worlds step and
their probes are sent to. The reference table is run through every entry first (the baseline: which registry and engine
rows each fires, by a call or a probe, and how many worlds it reaches; `--baseline` reads it from a file that
`write_baseline` wrote, as tests/model_checks/test_mutation.py does from the suite it ran already); a mutant then runs
first the entries whose baseline fired the row it changes, fewest worlds first, then the others. The first property
violation kills it; the first other exception ends its checker run as a crash (never a kill: running the rest of the
suite after it would cost each such mutant the whole suite, about six minutes of one core).

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

from model_checks import crowd, drivers, suite
from model_checks.stateful import PropertyViolation, build_machine
from versioned_lora.lifecycle import Core, InvariantViolation, ProtocolError
from versioned_lora.spec import ROWS
from versioned_lora.spec.states import SAME, wildcard_states

OPERATORS = ("drop_guard", "swap_target", "delete_row", "drop_effect", "drop_update")
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


Baseline = list[tuple[int, list[str], int]]  # (index in CHECKER_BOUNDS, registry/engine rows it fired, worlds)


def baseline_of(checked: list[drivers.Checked]) -> Baseline:
    """The reference table's baseline, from CHECKER_BOUNDS checked in order (suite.run)."""
    return [(i, sorted(c.core_fired | c.core_probed), c.result.states) for i, c in enumerate(checked)]


def write_baseline(checked: list[drivers.Checked], path: Path) -> None:
    path.write_text(json.dumps(baseline_of(checked)))


def order_for(baseline: Baseline, row: str) -> list[suite.Entry]:
    """The entries whose baseline fired `row`, fewest worlds first; then the others, likewise."""
    ranked = sorted(baseline, key=lambda b: (row not in b[1], b[2]))
    return [suite.CHECKER_BOUNDS[i] for i, _, _ in ranked]


def checker_verdict(core: Core, entries: list[suite.Entry]) -> tuple[Verdict, str]:
    """The checker's suite on the mutant, entry by entry until one finds a property violation (an invariant or a
    step property of a step a world made or a probe sent, a ProtocolError for a pair the mutant no longer covers,
    a driver property, liveness). The search reports an exception a step raised as "Name: message"; one that is not
    a ProtocolError or a StepPropertyViolation (an assert inside a result builder the mutant reached) is a crash."""
    for module, scenario, budget in entries:
        checker = drivers.check if module == "drivers" else crowd.check
        try:
            violation = checker(scenario, budget, system=drivers.DriverSystem(core=core)).violation
        except Exception as exc:  # raised outside the search's own try (a property's code, a scenario's setup)
            return Verdict.CRASH, f"{module}/{scenario}: {_describe(exc)}"
        if violation is None:
            continue
        exception = violation.split(":", 1)[0]
        if exception.isidentifier() and exception != "ProtocolError" and exception.endswith(("Error", "Exception")):
            return Verdict.CRASH, f"{module}/{scenario}: {violation}"[:160]
        return Verdict.PROPERTY, f"{module}/{scenario} {budget}: {violation}"[:200]
    return Verdict.LIVE, ""


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


# The parent draws the mutants and holds the baseline; forked workers inherit both and are handed only an index.
_WORK: tuple[list[tuple[str, tuple]], int, Baseline] = ([], 0, [])


def judge(index: int) -> Outcome:
    mutants, examples, baseline = _WORK
    name, rows = mutants[index]
    started = time.perf_counter()
    core = Core(rows)
    c, c_why = checker_verdict(core, order_for(baseline, name.split()[1]))
    h, h_why = hypothesis_verdict(core, examples)
    return Outcome(name, c, h, c_why or h_why, time.perf_counter() - started)


def run(seed: int, count: int, examples: int, jobs: int = 1, emit: Callable[[str], None] = print,
        baseline: Baseline | None = None) -> list[Outcome]:
    """`count` distinct mutants drawn from Random(seed), each judged by the checker and Hypothesis, on `jobs`
    worker processes (a mutant's verdict does not depend on which process judges it or when). Without a baseline,
    the reference table is run through CHECKER_BOUNDS first."""
    global _WORK
    if baseline is None:
        reference = suite.run(jobs=jobs)
        assert not any(c.result.violation for c in reference), "the reference table fails the checker's suite"
        baseline = baseline_of(reference)
    _WORK = (draw(seed, count), examples, baseline)
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
    p.add_argument("--baseline", type=Path, default=None, help="the reference's baseline (write_baseline's file)")
    ns = p.parse_args()
    started = time.perf_counter()
    baseline = json.loads(ns.baseline.read_text()) if ns.baseline else None
    outcomes = run(ns.seed, ns.count, ns.examples, ns.jobs, baseline=baseline)
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
