"""Several drivers in one world: the driver machines model-checked side by side against one registry and one
set of engines, as the runtime runs them (a Publisher's settle while sessions bind, a Reclaimer while a session
closes), each over its own faulty channel.

`model_checks/drivers.py` checks one driver per world, whatever else happens arriving only as a scenario's
setup or one stale call. Here a world is a `Crowd`: the shared part (registry, journal, engines, fault budget,
requests holding an engine) and one `Lane` per driver (its state, its in-flight calls and replies, its timers,
its reports, its caller). Nothing is written twice: lane i's moves are exactly `DriverSystem.successors` of the
one-driver world lane i sees (`view`), merged back (`merge`), so every row, every executor answer and every
fault is the one-driver checker's; the global moves (an engine restart, a request ending) come out of every
lane's view alike and are kept once. The budget is shared: one drop is one drop, whichever lane it hits.

Properties: every property of `DriverSystem.problems`, on every lane's view of every reachable world, and
`finishes`/`told_once` over all lanes. The properties that say "only after a fault" (`unknown_needs_a_fault`,
`stage_fails_only_by_a_fault`, `rejected_needs_a_fault`, ...) count another lane's calls as another process's
(`World.crowded`), as the one-driver scenarios do for a stale call: here, another driver may refuse or outpace
this one with no fault at all, so those are held in the one-driver worlds only.

What the first crowd found (rehydrate_while_generating): a session may read the dispatch view (E0 and E1), the
supervisor's report of E0's restart be adopted, and the generation then go to E0 under the older view. Routing
by the table holds at the view, not at delivery: E0, holding nothing at its new incarnation, refuses, and the
session re-dispatches the same binding (`generate.redispatch`). So in a crowd `dispatch_by_the_table` leaves out
an engine whose restart another lane adopted since the start: a send there goes where its view answered (row
`view.servable`), and an engine serves only what its table holds (tests/model_checks/test_crowd.py reaches the
window).

What reclaim_while_rehydrating reaches that no one-driver world does: E0's supervisor rehydrating A while a
session's close frees A and a Reclaimer claims it, so the claim lands between the rehydrate's begin and its PREPARED
(rows prepared.reclaiming, begin.reclaimed) and the unload meets an adapter still STAGING (reclaim.staging): the
case the retired hand-written checker's (system.py's) RECLAIM_WHILE_REHYDRATING bound was written for.

What zombie_stage reaches: a publisher that stalled past its lease still runs its stage driver for B's first
attempt while the new holder's settle driver aborts and cleans that attempt and, once it is done (`Lane.after`: one
process runs its drivers one after the other), its publication reserves and stages B again. The zombie's begin,
bucket and end meet the newer attempt on the engine (rows begin.other_attempt, bucket.other_attempt,
end.other_attempt), its PREPARED and READY meet the abort or the newer placement (prepared.late, ready.late,
prepared.stale_attempt, ready.stale_attempt), and no engine stages or serves the old attempt once the newer one is
placed. The zombie stages on E0 only: on both engines the fault-free search reaches 50,772 states (5,024 on E0
only) and no other row. In a crowd, what a driver counted or reported of its own attempt stays true of that attempt
after another process aborted it or reserved the version again; the properties that compare it with the registry's
current version and placement (`_moved_on`, `_superseded` in drivers.py) skip those, in crowds only.

What zombie_settle reaches: the same stalled publisher's settle driver commits its attempt (READY everywhere before
the new holder aborted, cleaned and reserved B again) while the newer attempt stages and is committed. The zombie's
commit is refused before the newer commit lands (commit.stale_attempt) and after it (commit.stale_after_commit), its
abort that follows is refused too (abort.stale_attempt), and B is committed only under the newer attempt.

What zombie_epoch reaches: a process of the previous deployment epoch, still running against the next epoch's
registry, has its reserve, PREPARED, commit, abort and claim refused (reserve.other_epoch, prepared.unknown,
commit.unknown, abort.unknown, claim.unknown). It also shows what no property here catches: the engine accepts the
zombie's `begin` (nothing on the engine side knows the epoch, and a begin needs no capability), and nothing ever
cleans that stash, since the registry, which knows no such attempt, issues no cleanup for it.

What zombie_abort reaches: the stalled publisher aborts its own attempt (READY everywhere, but its bytes never reached
the snapshot store, so it is never committed) while the new holder aborts and cleans it too and then publishes B
again. The zombie's cleanup of the old attempt can reach an engine where the newer one is staging
(cleanup.other_attempt: refused, nothing unloaded) and its receipt of that unknown outcome then meets the newer
placement (unknown.stale_attempt: refused, the newer placement kept).

    python -m model_checks.crowd [--drops 1] [--dups 0] [--deadlines 0] [--cancels 0]

Last line: `crowd_rows_fired=a/b core_rows_fired=c/d rows_fired=(a+c)/(b+d) states=… violations=…`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from model_checks.drivers import (
    DIGESTS,
    DRIVERS,
    SESSION,
    A,
    B,
    Budget,
    CheckResult,
    DriverSystem,
    World,
    _Setup,
    _world,
    driver_owed,
    fair,
    rows_line,
    search,
    spec_owed,
    stuck,
)
from versioned_lora.lifecycle import CORE
from versioned_lora.lifecycle.drivers import (
    Drivers,
    is_done,
    publication,
    reclaim,
    session,
    settle,
    stage,
    supervise,
)
from versioned_lora.lifecycle.effects import StageOnEngine
from versioned_lora.spec.events import AcquireRequest, BindFirst, EngineStarted, OpenSession
from versioned_lora.spec.identities import lora_name

LANE_FIELDS = ("driver", "net", "timers", "reports", "flags", "started", "caller", "pending", "asked")


@attrs.frozen(cache_hash=True)
class Lane:
    """One driver and what only it sees: its calls and replies in flight, its timers, its reports, its caller."""

    driver: Any
    net: tuple[tuple[str, Any], ...] = ()
    timers: frozenset[Any] = frozenset()
    reports: tuple[Any, ...] = ()
    flags: tuple[str, ...] = ()
    started: bool = False
    caller: tuple[str, ...] = ()
    pending: frozenset[str] = frozenset()
    asked: frozenset[str] = frozenset()
    # The lane whose driver must be done before this one starts (-1: none): one process's drivers run one after
    # the other (a recovering publisher settles the old attempt, then publishes again), other processes' alongside.
    after: int = -1


@attrs.frozen(cache_hash=True)
class Crowd:
    shared: World  # its lane fields are empty: each lane holds its own
    lanes: tuple[Lane, ...]


_EMPTY = {field: attrs.fields_dict(World)[field].default for field in LANE_FIELDS if field != "driver"}


def view(c: Crowd, i: int) -> World:
    """The one-driver world lane i sees: the shared part, its own lane, and the others as other processes."""
    lane = c.lanes[i]
    return attrs.evolve(c.shared, crowded=True, **{f: getattr(lane, f) for f in LANE_FIELDS})


def merge(c: Crowd, i: int, w: World) -> Crowd:
    lane = attrs.evolve(c.lanes[i], **{f: getattr(w, f) for f in LANE_FIELDS})
    shared = attrs.evolve(w, driver=None, crowded=False, **_EMPTY)
    return Crowd(shared, (*c.lanes[:i], lane, *c.lanes[i + 1:]))


# ---------------------------------------------------------------- scenarios, built with the real tables


def _crowd(s: _Setup, budget: Budget, lanes: tuple[Lane, ...], requests: tuple[tuple[int, str], ...] = ()) -> Crowd:
    return Crowd(_world(s, None, budget, requests), lanes)


def _session_lane(script: tuple[str, ...], **options: bool) -> Lane:
    return Lane(session(SESSION, **options), started=True, caller=script)


def scenario(name: str, budget: Budget) -> Crowd:
    if name == "zombie_epoch":  # a process of the deployment's previous epoch runs on against the registry of the
        s = _Setup(epoch=1)  # next: it publishes B, stages and settles an attempt of B it held, then reclaims A, one
        token = "attempt@0-9"  # driver after the other; every call names an epoch-0 version and is refused
        orders = (StageOnEngine("E0", B, lora_name(B, DIGESTS[B]), token, 1, DIGESTS[B]),)
        lanes = (Lane(publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), 1, "reserve:B")),
                 Lane(stage(B, token, 1, orders), after=0), Lane(settle(B, token, commit=True), after=1),
                 Lane(reclaim(A), after=2))
        return _crowd(s, budget, lanes)
    s = _Setup()
    s.stage(A)
    s.commit(A)
    if name == "commit_while_binding":  # B READY everywhere, committed while a session binds and generates:
        s.stage(B)  # the bind lands on A or on B, and its generation goes where that version is servable
        committing = Lane(settle(B, s.tokens[B][1], commit=True))
        return _crowd(s, budget, (committing, _session_lane(("bind", "gen r0", "finish"))))
    if name == "publish_while_bound":  # B reserved and staged while a session binds to A and generates
        staging = Lane(publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), 1, "reserve:B"))
        return _crowd(s, budget, (staging, _session_lane(("bind", "gen r0", "finish"))))
    if name == "reclaim_while_closing":  # B the default; a session still bound to A closes while A is reclaimed,
        s.reg_step(OpenSession(SESSION))  # and one of A's requests still runs on E0: the claim is refused until
        s.reg_step(BindFirst(SESSION))  # the close, and the unload waits for the request
        s.stage(B)
        s.commit(B)
        s.eng_step(0, AcquireRequest(s.tokens[A][0]))
        lanes = (Lane(reclaim(A)), _session_lane(("finish",), close_only=True))
        return _crowd(s, attrs.evolve(budget, releases=1), lanes, ((0, s.tokens[A][0]),))
    if name == "rehydrate_while_generating":  # E0 restarted and holds nothing, its restart not yet reported: its
        s.engs[0] = CORE.engine_step(s.engs[0], EngineStarted(2))[0]  # supervisor reports and rehydrates A while
        lanes = (Lane(supervise("E0")), _session_lane(("bind", "gen r0", "finish")))  # a session generates
        return _crowd(s, budget, lanes)
    if name == "reclaim_while_rehydrating":  # A retired, still bound by a session, B the default; E0 restarted and
        s.reg_step(OpenSession(SESSION))  # holds nothing: its supervisor rehydrates A and B while the session closes
        s.reg_step(BindFirst(SESSION))  # and A is reclaimed
        s.stage(B)
        s.commit(B)
        s.engs[0] = CORE.engine_step(s.engs[0], EngineStarted(2))[0]
        lanes = (Lane(supervise("E0")), _session_lane(("finish",), close_only=True), Lane(reclaim(A)))
        return _crowd(s, budget, lanes)
    if name == "abort_while_committing":  # B READY everywhere: one publisher commits it while another (recovering
        s.stage(B)  # it after a lease takeover) aborts the same attempt: a committed B is never cleaned
        token = s.tokens[B][1]
        lanes = (Lane(settle(B, token, commit=True)), Lane(settle(B, token, commit=False)))
        return _crowd(s, budget, lanes)
    if name == "zombie_stage":  # B's first attempt went to a publisher that stalled past its lease; its stage driver
        token, orders = s.reserve(B)  # runs on (a zombie) while the new holder aborts and cleans that attempt, then
        # publishes B again: every call of the zombie meets a newer attempt
        lanes = (Lane(stage(B, token, 1, orders[:1])), Lane(settle(B, token, commit=False)),
                 Lane(publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), 1, "reserve:B-again"), after=1))
        return _crowd(s, budget, lanes)
    if name == "zombie_abort":  # B staged READY everywhere but its bytes never reached the snapshot store, so its
        s.stage(B)  # publisher, stalled past its lease, aborts it at last while the new holder aborts and cleans it
        first = s.tokens[B][1]  # too, then publishes B again: the zombie's cleanups land beside the newer attempt
        lanes = (Lane(settle(B, first, commit=False)), Lane(settle(B, first, commit=False)),
                 Lane(publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), 1, "reserve:B-again"), after=1))
        return _crowd(s, budget, lanes)
    if name == "zombie_settle":  # B's first attempt was staged READY, then its publisher stalled past its lease: the
        s.stage(B)  # new holder aborted and cleaned it and reserved B again. The zombie now commits its attempt
        first = s.tokens[B][1]  # while the new attempt stages and, once staged, is committed by its own publisher
        s.abort_and_clean(B)
        token, orders = s.reserve(B)
        lanes = (Lane(settle(B, first, commit=True)), Lane(stage(B, token, 1, orders)),
                 Lane(settle(B, token, commit=True), after=1))
        return _crowd(s, budget, lanes)
    raise ValueError(f"unknown scenario {name!r}; known: {SCENARIOS}")


DEFAULT_BUDGET = Budget()
SCENARIOS = ("commit_while_binding", "publish_while_bound", "reclaim_while_closing", "rehydrate_while_generating",
             "reclaim_while_rehydrating", "abort_while_committing", "zombie_stage", "zombie_settle", "zombie_epoch",
             "zombie_abort")
# The bounds `make check-deep` runs every scenario under; `make test` leaves most scenarios' early-deadline bound to it
# (model_checks/suite.py, DEEP_ONLY).
CROWD_BOUNDS = (  # a session's cancels as well take publish_while_bound from 111k states (35 s) to 555k (177 s)
    Budget(drops=1, dups=0, deadlines=0, cancels=0),
    Budget(drops=0, dups=0, deadlines=1, cancels=0),
)
FAULT_FREE = Budget(drops=0, dups=0, deadlines=0, cancels=0)
# The bounds a scenario runs under where not every bound of CROWD_BOUNDS: the zombies are themselves the fault (a
# process stalled past its lease, or of a past epoch), and a fault more multiplies their interleavings without
# reaching another row. zombie_stage: under the early deadline 117,781 states (54 s on this host) against the loss
# bound's 27,575 (12 s); under a duplicate 92,578 (42 s), adding cleanup.other_attempt, which zombie_abort reaches
# fault-free. zombie_abort: 14,096 states fault-free (6.5 s); under one loss 89,430 (44 s), under one early
# deadline 434,687 (228 s), the same rows.
OWN_BOUNDS = {"zombie_stage": CROWD_BOUNDS[:1], "zombie_abort": (FAULT_FREE,)}
CHECKS = tuple((name, budget) for name in SCENARIOS for budget in OWN_BOUNDS.get(name, CROWD_BOUNDS))

# Rows of drivers.CORE_ROWS_NOT_REACHED (no one-driver world reaches them) that CHECKS reach, held exact by
# test_crowd.py: a reclaim meeting a rehydrate still staging (reclaim_while_rehydrating), a zombie's calls meeting
# a newer attempt or an aborted one (zombie_stage), and a zombie's commit and abort of an attempt the registry has
# replaced, before and after the newer one is committed (zombie_settle), a previous epoch's process's calls
# (zombie_epoch), and a zombie's cleanup of its own aborted attempt meeting the newer one (zombie_abort).
REACHED_TOGETHER = frozenset({
    "reclaim.staging", "prepared.reclaiming", "begin.reclaimed",
    "begin.other_attempt", "bucket.other_attempt", "end.other_attempt", "prepared.stale_attempt",
    "ready.stale_attempt", "prepared.late", "ready.late",
    "commit.stale_attempt", "commit.stale_after_commit", "abort.stale_attempt", "cleanup.unstarted",
    "reserve.other_epoch", "prepared.unknown", "commit.unknown", "abort.unknown", "claim.unknown",
    "cleanup.other_attempt", "unknown.stale_attempt",
})

# Defensive driver rows (drivers.DEFENSIVE_ROWS: no one-driver world fires them) that a crowd fires: zombie_abort's
# UNKNOWN receipt refused (its cleanup refused on an engine where the newer attempt stages, clean.refused, is no longer
# defensive: abort_unload_fails fires it alone).
DEFENSIVE_REACHED = frozenset({"unknown.refused"})

# ---------------------------------------------------------------- the search


def successors(system: DriverSystem, c: Crowd) -> Iterator[tuple[str, Crowd]]:
    for i, lane in enumerate(c.lanes):
        if not lane.started and lane.after >= 0 and not is_done(c.lanes[lane.after].driver):
            continue  # its process is still running the driver before it
        for label, w in system.successors(view(c, i)):
            yield f"L{i} {label}", merge(c, i, w)


def problems(system: DriverSystem, c: Crowd, start: Crowd) -> list[str]:
    out = []
    for i in range(len(c.lanes)):
        out += [f"L{i} {p}" for p in system.problems(view(c, i), view(start, i))]
    return out


def _stuck(c: Crowd) -> list[str]:
    """A crowd where nothing can happen any more: each lane as a one-driver world would be judged."""
    return [f"L{i} {p}" for i in range(len(c.lanes)) for p in stuck(view(c, i))]


def _owed(c: Crowd) -> frozenset[str]:
    """What a crowd still owes (liveness): what each lane's driver owes its caller, and the spec's obligations its
    drivers work on, less those a lane's driver handed over (drivers.spec_owed)."""
    lanes = frozenset(f"L{i} {x}" for i in range(len(c.lanes)) for x in driver_owed(view(c, i)))
    return lanes | spec_owed(c.shared.registry, tuple((lane.driver, lane.reports) for lane in c.lanes))


def check(name: str, budget: Budget = DEFAULT_BUDGET, drivers: Drivers = DRIVERS, system: DriverSystem | None = None,
          max_states: int = 2_000_000, on_state: Callable[[Crowd], None] | None = None) -> CheckResult:
    """Breadth-first over every crowd reachable from the scenario (each handed to `on_state`, if given); stops at
    the first violation."""
    system = system or DriverSystem(drivers)
    start = scenario(name, budget)
    return search(name, start, lambda c: successors(system, c), lambda c: problems(system, c, start), _stuck,
                  max_states, on_state, fair=lambda label: fair(label.partition(" ")[2]), owed=_owed)


def check_all(budget: Budget = DEFAULT_BUDGET, drivers: Drivers = DRIVERS,
              on_result: Callable[[CheckResult], None] | None = None) -> tuple[list[CheckResult], DriverSystem]:
    system = DriverSystem(drivers)
    results = []
    for name in SCENARIOS:
        results.append(check(name, budget, drivers, system))
        if on_result:
            on_result(results[-1])
    return results, system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Model-check several driver machines in one world.")
    for field, default in (("drops", 1), ("dups", 0), ("deadlines", 0), ("cancels", 0), ("crashes", 0)):
        parser.add_argument(f"--{field}", type=int, default=default)
    args = parser.parse_args(argv)
    budget = Budget(args.drops, args.dups, args.deadlines, args.cancels, args.crashes)
    results, system = check_all(budget, on_result=lambda r: print(
        f"{r.scenario:22s} states={r.states:7d} {r.seconds:6.1f}s {r.violation or 'ok'}", flush=True))
    print(f"{rows_line('crowd', system)} states={sum(r.states for r in results)} "
          f"violations={sum(1 for r in results if r.violation)}")
    return 1 if any(r.violation for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
