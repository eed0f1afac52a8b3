"""Seeded mutations of the spec table, fed alike to the core (`Core(rows)`), the model checker and the
Hypothesis state machine; reports which of the two kills each mutant.

    python scripts/mutate_spec.py --seed 1 --count 40 [--bound ci]

Operators: drop_guard (remove one named guard of a row), swap_target (move a state-changing row to
another stored state of its machine), delete_row, drop_effect, drop_update. A mutant is killed when
the checker finds a violation (any invariant, a frame or target mismatch, a step property of
model_checks/step_properties.py, or a ProtocolError for a pair the mutant no longer covers) or the
Hypothesis run (the ci profile's size) fails. The mutants are never weakened to raise the rates; the
checks are what was strengthened. Mutants neither kills are listed for a
hand verdict (EQUIVALENT below records the ones judged equivalent, with the reason).
"""

from __future__ import annotations

import argparse
import random
import time

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from model_checks.bfs import check
from model_checks.bounds import CHECKER_BOUNDS, Bounds
from model_checks.liveness import check_liveness
from model_checks.stateful import build_machine
from model_checks.system import System
from versioned_lora.lifecycle import Core
from versioned_lora.spec import ROWS
from versioned_lora.spec.states import SAME, wildcard_states

OPERATORS = ("drop_guard", "swap_target", "delete_row", "drop_effect", "drop_update")
# Safety: model_checks.bounds.CHECKER_BOUNDS (together they fire every row of the reference table);
# liveness: the abort path.
LIVENESS_BOUNDS = Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=1, bootstrapped=True)
# Hand verdicts: mutant description -> why it cannot change any observable behaviour (state, answer,
# effects) of the core on any input. A mutant listed here is left out of both kill rates.
EQUIVALENT: dict[str, str] = {}


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


def checker_kills(core: Core) -> bool:
    try:
        if any(check(System(bounds, core)).violation is not None for bounds in CHECKER_BOUNDS):
            return True
        return bool(check_liveness(System(LIVENESS_BOUNDS, core)).violations)
    except Exception:  # the mutant crashed the environment (e.g. a ProtocolError while bootstrapping)
        return True


def hypothesis_kills(core: Core, examples: int) -> bool:
    profile = settings(max_examples=examples, stateful_step_count=50, deadline=None, derandomize=True,
                       suppress_health_check=list(HealthCheck), database=None, print_blob=False,
                       phases=[Phase.explicit, Phase.generate])  # no shrinking: only kill or not
    try:
        run_state_machine_as_test(build_machine(core), settings=profile)
    except Exception:
        return True
    return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--examples", type=int, default=500)  # the ci profile: 500 x 50 steps
    ns = p.parse_args()
    rng = random.Random(ns.seed)
    seen: set[str] = set()
    results = []
    while len(results) < ns.count:
        name, rows = mutate(rng)
        if name in seen:
            continue
        seen.add(name)
        started = time.perf_counter()
        core = Core(rows)
        c, h = checker_kills(core), hypothesis_kills(core, ns.examples)
        results.append((name, c, h))
        print(f"{name:<70} checker={'KILL' if c else 'live'} hypothesis={'KILL' if h else 'live'} "
              f"({time.perf_counter() - started:.1f}s)", flush=True)
    equivalent = [r for r in results if r[0] in EQUIVALENT]
    scored = [r for r in results if r[0] not in EQUIVALENT]
    ck, hk = sum(r[1] for r in scored), sum(r[2] for r in scored)
    print(f"mutants={len(results)} equivalent={len(equivalent)} checker_killed={ck}/{len(scored)} "
          f"hypothesis_killed={hk}/{len(scored)}")
    for name, c, h in results:
        if not c and not h and name not in EQUIVALENT:
            print(f"  survived both (needs a hand verdict): {name}")


if __name__ == "__main__":
    main()
