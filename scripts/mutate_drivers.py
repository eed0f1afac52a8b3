"""Seeded mutations of the driver table (spec/drivers.py), each run through the driver checker
(model_checks/drivers.py) on DRIVER_BOUNDS, stopping at its first killing check.

    python scripts/mutate_drivers.py --seed 1 --count 20 [--jobs J]

A check is one scenario under one bound. The unmutated table is run through every check first (the
baseline: which rows each fires, how many states it reaches); a mutant then runs first the checks that
reach a row it changed, cheapest first, and the rest after them (`order_for` says why that order cannot
change a verdict). Mutants run on J worker processes (default: one a core).

Operators keep every (phase, input) pair covered (deleting a row is left out: the uncovered-pair
ProtocolError catches that by construction): change_target (a row that moves goes to another phase of
its machine; one that starts sub-machines, to a phase that waits for their Settled), change_report
(another outcome, or none where it had one), drop_command, add_command (a command of the same machine's
rows for the same input kind), drop_guard, swap_guards (the guards of two rows of the same machine, input and sources
exchanged), over every row the bounds fire (DEFENSIVE_ROWS, which none fires, are left
out). Plus one fixed mutant, `refused_abort_cleans`: after a refused abort, the
driver cleans every engine it knows of, as the runtime's hand-written fallback did before (the data-loss
bug of issue 17).

A mutant is killed by a property violation (model_checks/drivers.py's properties, the registry's and
the engines' invariants, `finishes`); one that dies only by a ProtocolError is counted apart
(protocol_error_only). The last line: `driver_mutants=N killed=K protocol_error_only=P`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_checks.drivers import DEFENSIVE_ROWS, DIGESTS, DRIVER_BOUNDS, ENGINES, SCENARIOS, DriverSystem, check
from versioned_lora.lifecycle.drivers import (
    BUILDERS,
    GUARDS,
    Arm,
    CleanupEngineState,
    Drivers,
    Timer,
    _cleanup_command,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine
from versioned_lora.spec.drivers import (
    DRIVER_ROWS,
    PHASES,
    Driver,
    DriverOutcome,
    DriverRow,
    Input,
    uncovered_driver_pairs,
)
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.states import SAME

# 45 drawn (seed 1 draws two of the equivalent mutants below, left out: N = 46 with the fixed one; the sample moved
# when the lease keeper's and the publish driver's rows were added, and the count went from 35 to 45 with them). On
# this 2-core host the run took 852 s with one process and each mutant's checks
# in bound order, and 48 s with two workers and the checks that reach a changed row first (43 s of it the baseline);
# every verdict the same. At 45 draws with the lease and publish drivers: 80 s, 62.5 s of it the baseline (129
# checks).
COUNT = 45
# Commands the model cannot observe, left out of add_command and drop_command: DropLink has no reply and the
# model's engines no transfer group (tests/lifecycle/test_driver_table.py holds that bucket.deadline drops it).
UNOBSERVED_COMMANDS = frozenset({"drop_link"})
OPERATORS = ("change_target", "change_report", "drop_command", "add_command", "drop_guard", "swap_guards")
# The phases in which an answer to another call than the one the phase waits for can arrive: a cleanup
# answered after its deadline moved the engine to recording UNKNOWN. In every other phase one call of the
# driver is in flight, so an `answers_*` guard there only makes a stray input the ProtocolError (dropping
# it is like deleting a row, which the operators leave out).
TWO_CALLS_PHASES = frozenset({"RECORDING_UNKNOWN", "ABORTING", "CLOSING", "CLEANING_UP", "CLEANUP_FAILED",
                              "RELEASING"})  # a bind may land after the finish; a generation after its abort
# The commands that start per-engine sub-machines, whose Settled then reaches the coordinator.
STARTS_SUB_MACHINES = frozenset({"start_cleanups", "start_reclaims", "start_begins", "send_next_bucket", "start_ends",
                                 "open_request", "abort_requests", "open_rehydrates"})
UNCOVERED = frozenset(uncovered_driver_pairs())
# The coordinators that report to one caller: any of their rows may be mutated to report (a sub-machine's row reports
# only in a session: a generation's outcome, to its caller).
REPORTING = frozenset({Driver.STAGE, Driver.SETTLE, Driver.RECLAIM, Driver.SUPERVISE, Driver.RECOVER, Driver.LEASE})
# Hand verdicts: mutant -> why no behaviour can tell it apart. Left out of N.
EQUIVALENT: dict[str, str] = {
    "add_command unload.done: note_reclaimed": "note_reclaimed reads a confirm's registry answer; on the "
    "engine's reclaim answer it leaves the state as it is",
    "drop_guard clean.in_use: in_use": "differs from the table only on a cleanup refused for another reason "
    "than IN_USE, which only the producers of DEFENSIVE_ROWS (rehydrate attempts, forged ids) send",
    "add_command commit.deadline: disarm": "the row fires on the commit timer's Deadline: that timer is no "
    "longer armed, and disarming it does nothing",
    "drop_guard reclaiming.all_confirmed: reclaims_settled": "registry_says_reclaimed holds only once the registry "
    "counted every engine's confirm, so RECLAIMED is true whatever another sub-machine still waits for (a confirm "
    "retried after a lost reply is answered from the journal); only the report's list of engines that confirmed "
    "to this driver can be shorter, and a deadline can shorten it in the table too",
    "swap_guards clean.in_use <-> clean.refused": "the same as dropping clean.in_use's in_use guard (clean.refused, "
    "now guarded by in_use, is shadowed): it differs only on a refusal other than IN_USE, see above",
    "add_command claim.already_done: start_reclaims": "an answer that the version is already RECLAIMED names no "
    "engine to reclaim: the command starts no sub-machine, and the row ends the reclaim RECLAIMED either way",
    "drop_guard abort.already_clean: abort_says_clean": "the registry's abort answer names a cleanup or says "
    "FAILED_CLEAN: abort.loading cleans on every engine, abort.replay where a placement is still CLEANING (an "
    "ABORTED version keeps one until the last cleanup frees the slot), abort.replay_clean is FAILED_CLEAN; so "
    "abort.cleanup takes every answer the guard would refuse",
    "add_command reserve.unstageable: open_stages": "the row ends the staging STAGE_FAILED with nothing sent: the "
    "sub-machines the command records stay WAITING (a finished staging may hold WAITING ones: stage.failed), are "
    "sent nothing, and the caller's error reads only FAILED ones, so it names the reserve's answer either way",
    "add_command release.refused: disarm_bind": "the row ends the session CLOSED, a terminal phase whose executor "
    "cancels every timer still armed: disarming the bind's timer one step earlier changes nothing",
    "drop_guard unload.deadline: engine_timer": "a reclaim's engine sub-machine arms one timer, its engine timer, "
    "once for the unload and the confirm together (no retry pause): every Deadline that reaches UNLOADING or "
    "CONFIRMING is that timer's",
    "drop_command adopt.nothing: disarm_restarted": "the row ends the supervisor DONE, a terminal phase whose "
    "executor cancels every timer still armed: the same timer is cancelled one step later, with nothing between",
    "add_command closing.refused: disarm_bind": "the row ends the session CLOSED, a terminal phase whose executor "
    "cancels every timer still armed (as release.refused)",
    "add_command finish.again: disarm_bind": "no bind timer is armed in CLOSING or RELEASING: the way in from "
    "BINDING disarms it (finish.binding), from BIND_UNKNOWN it has fired already, and from OPEN or BOUND it was "
    "never armed or was disarmed by the bind's answer: disarming it does nothing",
    "add_command renew.renewed: disarm_acquire": "the acquire timer was disarmed when the lease was granted "
    "(acquire.granted), the only way into HOLDING before a renewal: disarming it again does nothing",
    "drop_guard reserve.replayed: reserved_answer": "every answer to a reserve is a `Reserved` (a `Rejected` reply is "
    "a Refusal input, lifecycle.drivers.input_kind): the guard differs only on an answer outside the registry port's "
    "contract",
    "drop_guard claim.already_done: claim_says_reclaimed": "a claim answer that names no engine says RECLAIMED: "
    "claim.retired names every engine, claim.replay every unconfirmed one (the last confirm makes the version "
    "RECLAIMED), claim.replay_done names none and says RECLAIMED",

}


@attrs.frozen
class Mutant:
    name: str
    rows: tuple[DriverRow, ...]
    builders: dict[str, object] = attrs.field(factory=dict, eq=False)


def _waits_for_settled(r: DriverRow, target: str) -> bool:
    phase = r.expanded_sources() if target == SAME else (target,)
    return all((r.machine, p, Input.SETTLED) not in UNCOVERED for p in phase)


def _replace(rows: tuple[DriverRow, ...], index: int, new: DriverRow) -> tuple[DriverRow, ...]:
    return (*rows[:index], new, *rows[index + 1:])


def draw(rng: random.Random) -> Mutant:
    rows = DRIVER_ROWS
    while True:
        op = rng.choice(OPERATORS)
        i = rng.randrange(len(rows))
        r = rows[i]
        if r.id in DEFENSIVE_ROWS:  # no bound fires it: a mutant of it says nothing about the checks
            continue
        if op == "change_target" and r.changes_state:
            # (a row with one source: SAME and that source are one target, so neither replaces the other)
            same = set(r.expanded_sources()) if len(r.expanded_sources()) == 1 else set()
            now = {r.target} | (same if r.target == SAME else set()) | ({SAME} if r.target in same else set())
            options = [p for p in (*PHASES[r.machine], SAME) if p not in now]
            if set(r.commands) & STARTS_SUB_MACHINES:
                # Its sub-machines' Settled must reach a phase that waits for them: anywhere else it is an
                # uncovered pair (NOT_POSSIBLE), so the mutant would only be the ProtocolError.
                options = [p for p in options if _waits_for_settled(r, p)]
            if not options:
                continue
            target = rng.choice(options)
            return Mutant(f"change_target {r.id}: {r.target} -> {target}",
                          _replace(rows, i, attrs.evolve(r, target=target)))
        if op == "change_report" and r.changes_state and (r.machine in REPORTING or r.report is not None):
            options = [None, *DriverOutcome]
            options.remove(r.report)
            report = rng.choice(options)
            return Mutant(f"change_report {r.id}: {r.report} -> {report}",
                          _replace(rows, i, attrs.evolve(r, report=report)))
        if op == "drop_command" and set(r.commands) - UNOBSERVED_COMMANDS:
            c = rng.choice(sorted(set(r.commands) - UNOBSERVED_COMMANDS))
            return Mutant(f"drop_command {r.id}: {c}",
                          _replace(rows, i, attrs.evolve(r, commands=tuple(x for x in r.commands if x != c))))
        if op == "add_command" and r.changes_state:
            # A command some row of the same machine builds from the same kind of input: a builder reads its
            # input (a registry answer, an engine receipt), so one added to a row of another input kind only
            # reads nothing there, and a timer armed again differs only in its length, which the model leaves out.
            pool = sorted({c for x in rows if x.machine is r.machine and x.input is r.input for c in x.commands}
                          - set(r.commands) - UNOBSERVED_COMMANDS)
            if pool:
                c = rng.choice(pool)
                return Mutant(f"add_command {r.id}: {c}",
                              _replace(rows, i, attrs.evolve(r, commands=(*r.commands, c))))
        if op == "drop_guard" and r.guards:
            g = rng.choice(r.guards)
            if g.startswith("answers_") and not set(r.expanded_sources()) & TWO_CALLS_PHASES:
                continue  # like deleting a row: the guard only turns an impossible input into the ProtocolError
            return Mutant(f"drop_guard {r.id}: {g}",
                          _replace(rows, i, attrs.evolve(r, guards=tuple(x for x in r.guards if x != g))))
        if op == "swap_guards" and r.guards:
            # Rows that compete for the same (phase, input) pairs: the union of their guards is unchanged, so
            # every pair stays covered. (Across other sources a swap opens a pair no row covers.)
            peers = [j for j, x in enumerate(rows) if j != i and x.machine is r.machine and x.input is r.input
                     and x.expanded_sources() == r.expanded_sources() and x.guards != r.guards]
            if peers:
                j = rng.choice(peers)
                swapped = _replace(rows, i, attrs.evolve(r, guards=rows[j].guards))
                swapped = _replace(swapped, j, attrs.evolve(rows[j], guards=r.guards))
                return Mutant(f"swap_guards {r.id} <-> {rows[j].id}", swapped)


def refused_abort_cleans() -> Mutant:
    """The pre-fix fallback: a refused abort ("no effects") cleans every engine the attempt was placed on."""

    def clean_everywhere(s, sub, i):  # type: ignore[no-untyped-def]
        name = lora_name(s.version, DIGESTS[s.version])
        engines = {e: CleanupEngineState("CLEANING", CleanupOnEngine(e, s.version, name, s.attempt_token), None)
                   for e in ENGINES}
        from immutables import Map

        # each cleanup under its deadline, as _start_cleanups arms it: the fallback differs only in whom it cleans
        commands = [c for name, x in sorted(engines.items())
                    for c in (_cleanup_command(x), Arm(Timer("engine", name), "cleanup"))]
        return attrs.evolve(s, engines=Map(engines)), tuple(commands)

    index = next(k for k, r in enumerate(DRIVER_ROWS) if r.id == "abort.refused")
    row = attrs.evolve(DRIVER_ROWS[index], target="CLEANING", commands=("disarm", "clean_everywhere"), report=None)
    return Mutant("refused_abort_cleans (fixed)", _replace(DRIVER_ROWS, index, row),
                  {"clean_everywhere": clean_everywhere})


# One check: (index into DRIVER_BOUNDS, scenario). A mutant's verdict is the same whatever order its checks run
# in (each check is deterministic and the verdict is "killed" as soon as any one finds a property violation), so
# the order is chosen for speed only.
Check = tuple[int, str]
ALL_CHECKS: tuple[Check, ...] = tuple((b, name) for b in range(len(DRIVER_BOUNDS)) for name in SCENARIOS)


def run(mutant: Mutant, order: tuple[Check, ...] = ALL_CHECKS) -> tuple[str, str]:
    """('killed' | 'protocol_error_only' | 'survived', detail), running `order`'s checks until one kills."""
    drivers = Drivers(mutant.rows, GUARDS, {**BUILDERS, **mutant.builders})  # type: ignore[dict-item]
    systems: dict[int, DriverSystem] = {}
    protocol = None
    for b, name in order:
        budget = DRIVER_BOUNDS[b]
        # No probes: they call the registry and the engines, whose table a driver mutant leaves as it is.
        result = check(name, budget, drivers, systems.setdefault(b, DriverSystem(drivers, probes=False)))
        if result.violation is None:
            continue
        if result.violation.startswith("ProtocolError"):
            protocol = protocol or f"{name}: {result.violation}"
            continue
        return "killed", f"{name} {budget}: {result.violation}"
    return ("protocol_error_only", protocol) if protocol else ("survived", "")


@attrs.frozen
class Baseline:
    """What the unmutated table does in one check: the rows it fires and the states it reaches."""

    fired: frozenset[str]
    states: int


def baseline(check_id: Check) -> Baseline:
    b, name = check_id
    system = DriverSystem(probes=False)  # (as `run`)
    result = check(name, DRIVER_BOUNDS[b], system=system)
    return Baseline(frozenset(system.fired), result.states)


def order_for(mutant: Mutant, baselines: dict[Check, Baseline]) -> tuple[Check, ...]:
    """Every check, those that can tell the mutant apart first, cheapest first. A mutant changes rows of some
    (machine, input) pairs; a check whose unmutated run fires no row of those pairs never reaches one of them,
    so there the mutant steps exactly as the table does. Those checks still run (last, in the usual order), so
    a survivor is tried everywhere."""
    changed = {(r.machine, r.input) for r, o in zip(mutant.rows, DRIVER_ROWS, strict=True) if r != o}
    pair_of = {r.id: (r.machine, r.input) for r in DRIVER_ROWS}

    def reaches(c: Check) -> bool:
        return any(pair_of[row] in changed for row in baselines[c].fired)

    first = sorted((c for c in ALL_CHECKS if reaches(c)), key=lambda c: baselines[c].states)
    return (*first, *(c for c in ALL_CHECKS if not reaches(c)))


def draw_set(seed: int, count: int) -> tuple[list[Mutant], list[str]]:
    """The fixed mutant and `count` distinct drawn ones; beside them, the drawn mutants argued equivalent
    (each once), which are left out of N."""
    rng = random.Random(seed)
    mutants = [refused_abort_cleans()]
    seen = {m.name for m in mutants}
    equivalent: list[str] = []
    while len(mutants) < count + 1:
        m = draw(rng)
        if m.name in EQUIVALENT:
            if m.name not in equivalent:
                equivalent.append(m.name)
        elif m.name not in seen:
            seen.add(m.name)
            mutants.append(m)
    return mutants, equivalent


# The parent process draws the mutants and measures the baselines; forked workers inherit both (a mutant's
# builders are closures, which do not pickle), so a worker is handed only an index.
_WORK: tuple[list[Mutant], dict[Check, Baseline]] = ([], {})


def _verdict(index: int) -> tuple[str, str, float]:
    mutants, baselines = _WORK
    started = time.monotonic()
    verdict, detail = run(mutants[index], order_for(mutants[index], baselines))
    return verdict, detail, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    global _WORK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes (default: one a core)")
    args = parser.parse_args(argv)
    mutants, equivalent = draw_set(args.seed, args.count)
    for name in equivalent:
        print(f"{'equivalent':20s}         {name}: {EQUIVALENT[name]}")
    killed = protocol = 0
    started = time.monotonic()
    with multiprocessing.get_context("fork").Pool(max(1, args.jobs)) as workers:
        baselines = dict(zip(ALL_CHECKS, workers.map(baseline, ALL_CHECKS, chunksize=1), strict=True))
        print(f"baseline {time.monotonic() - started:6.1f}s  {len(ALL_CHECKS)} checks of the unmutated table",
              flush=True)
        _WORK = (mutants, baselines)
    # This pool's workers were forked before _WORK was set: the mutants run on a second pool, forked after it.
    with multiprocessing.get_context("fork").Pool(max(1, args.jobs)) as workers:
        for m, (verdict, detail, seconds) in zip(mutants, workers.imap(_verdict, range(len(mutants))), strict=True):
            killed += verdict == "killed"
            protocol += verdict == "protocol_error_only"
            print(f"{verdict:20s} {seconds:6.1f}s  {m.name}  {detail[:160]}", flush=True)
    print(f"seconds={time.monotonic() - started:.0f}")
    print(f"driver_mutants={len(mutants)} killed={killed} protocol_error_only={protocol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
