"""The driver machines model-checked: the very `lifecycle.drivers` rows the runtime executes, composed
with the real registry and engine-side tables and a faulty network (stateright's actor model: the same
code is checked here and run on a real network by `runtime/driver_loop.py`).

A world is (registry, journal, engines, driver, network, armed timers, reports, budget, and a scenario's
scripted differences: `bad_probes`, `bad_manifests`, `bad_name`):

registry   the core's RegistryState (stepped by `CORE.step`, the table's rows)
journal    idempotency key -> the answer given (a retried key is answered from it, never re-applied)
engines    each engine's EngineAdapterState (stepped by `CORE.engine_step`)
driver     the driver's state (stepped by `DRIVERS.step`, or a mutant's rows)
network    in-flight requests (the driver's commands) and replies (the driver's next inputs), a multiset
timers     the timers the driver armed and has not disarmed
budget     faults left: drops (a request lost, or its reply lost after it was applied), dups (a
           request delivered twice: applied again, answered to no one), deadlines (a timer fires early,
           while its call may still be in flight), cancels (the caller stops waiting), crashes (an
           engine restarts and the registry adopts its new incarnation), releases (an in-flight
           request on an engine ends), breaks (a call is answered by a refusal no party here gives:
           `_breakable`)

Actions: deliver any in-flight message (a request to its registry or engine, a reply to the driver),
lose a request or its reply, or duplicate a request (budget), fire an armed timer (early: deadline
budget; when nothing is in flight it is a real timeout and free; the short retry pause is always
free), cancel, end a generation request. What the executor adds is exactly
`driver_loop.DriverLoop._outcome`: a registry answer is `Answer(Reply)`, an engine refusal
`Refusal`, a lost reply `Lost`; a staging call runs the adapter's BeginStaging / ReceiveBucket / EndStaging
under the incarnation the reserve named (`end` answers the engine's receipt, and is refused on the engines of
`World.bad_manifests`); the probe check answers whether the engine's probe matches (no, for the engines of
`World.bad_probes`); the engine's reclaim call runs the adapter's ReclaimAdapter and, once drained,
FinishUnload, and answers whether it is UNLOADED.

Probes (the calls no driver here makes): at every registry and engine state a world reaches, every late, duplicated,
stale, forged and other-epoch call that the table answers without a change (`lifecycle.enabled`'s faulty candidates)
is sent once, and its answer and effects are checked by the step properties (`model_checks/step_properties.py`);
they are self-loops, so they add no world. `CORE_ROWS_NOT_PROBED` is what the drivers' calls and the probes leave
unfired together.

Properties, on every reachable world:
  committed_stays_loaded   a version the registry committed and has not claimed for reclaim stays READY
                           on every engine where the registry has it READY (no cleanup, no unload)
  report_is_true           COMMITTED / FAILED_CLEAN / RECLAIMED / STAGED / REPLAYED are reported only when the registry
                           says so
  reports_fit_the_work     each driver reports only its own outcomes (a stage never COMMITTED, a settle never PENDING)
  only_unknown_before_the_end  a driver that is not done has reported nothing, except a committing settle's
                           UNKNOWN (its commit, reported unknown, is resolved and its answer carried out after it)
  unresolved_is_reported   a commit being resolved (COMMIT_UNRESOLVED) was reported UNKNOWN to its caller
  reports_what_it_knows    a reclaim the registry answered RECLAIMED never reports PENDING
  stage_names_its_attempt  a stage that failed or replayed names the registry's attempt (the one its caller aborts)
  rejected_changes_nothing a REJECTED reclaim sent nothing to any engine
  abort_never_commits      a settle started to abort (its staging failed) never sends a commit
  unknown_needs_a_fault    UNKNOWN is reported only after a fault (a loss, an early deadline, a cancel, a
                           restart), a request that never ends, or another process's call
  unknown_means_claim_unanswered  a reclaim reports UNKNOWN only while its claim's answer is unknown
  sub_state_is_true        an engine counted CLEANED / CONFIRMED / READY is recorded so in the registry, and one whose
                           cleanup the registry answered as recorded is counted CLEANED
  confirms_only_unloaded   a reclaim confirms an engine's unload only once the engine has the adapter UNLOADED
  commits_a_read_revision  a commit expects a revision the registry has had (the one its settle driver read)
  one_call_at_a_time       the driver never sends a call again while the same call is in flight (a retry
                           follows its Lost; checked where the network duplicates nothing)
  gives_up_only_at_its_deadline  a sub-machine never ends (UNCONFIRMED, FAILED) because its retry pause ended
  timers_follow_calls      no timer outlives the call it bounds (a finished sub-machine, or a coordinator
                           past its own call, has none armed; a coordinator's call timer is armed only while one
                           of the calls it bounds is in flight: TIMED_CALLS); a call in flight with no timer is
                           allowed only in the (machine, phase) pairs of UNBOUNDED_BY_DESIGN
  calls_under_a_deadline   a machine (the coordinator or a sub-machine) with a call of its own in flight
                           has a timer armed or its Deadline already in the inbox, except in
                           COMMIT_UNRESOLVED, where the commit is retried until answered by design
  waits_for_what_it_sends  a call a row sends is one the machine's new phase waits for (a row of that
                           phase answers it): a reply no row waits for only lands on a late row
  arms_what_it_acts_on     a coordinator's timer a row arms is one a row of the phase it moved to acts on when
                           it fires (a row that changes something, whose guard names no other timer)
  waits_on_a_call          a machine whose phase waits for a call's answer has that call in flight (its
                           request, or its reply or loss in the inbox), and one whose phase waits to retry has
                           its retry pause armed (or fired): it never waits on its deadline alone
  unknown_keeps_capacity   a settle that reported UNKNOWN never freed the slot on the strength of a guess
                           (the registry's slot is freed only by its own rows: checked by the registry's
                           invariants, which run on every registry state here too)
  bucket_barrier           (staging) bucket i+1 is sent to an engine only once bucket i landed on every engine
  staged_in_order          (staging) a bucket or an `end` reaches an engine only after its PREPARED was recorded
  ready_needs_the_probe    (staging) READY is never sent for an engine whose probe differs from the reference
  failure_is_recorded      (staging) an engine's sub-machine that FAILED says why (the publisher's error reads it),
                           and one that has not failed records no failure
  stage_fails_only_by_a_fault  STAGE_FAILED only after a fault, a restart, or a probe that differs
  (the staging properties that read the engines' or the registry's state are not checked after a restart, which
  resets both: what was true when it was counted need not be true after it)
  A session (SESSION_SCENARIOS: its caller asks a script of bind / generate / resolve / finish, each while the
  earlier ones may still be in flight, and may go away from a generation; `cancels` budget):
  carries_the_binding      every generation sent carries the lora_name the registry bound the session to
  dispatch_by_the_table    ... and goes only to engines where the registry has the version servable now (in a crowd,
                           an engine whose restart another driver adopted since the start: where its view said)
  nothing_after_finish     no dispatch view is read and no generation sent once the finish began
  unknown_blocks_the_next  no generation starts while an earlier one's outcome is unknown
  never_resent             a generation is sent only from its dispatch or after an engine refused the version
  close_after_drain        close_and_release is sent only once every generation ended (aborted, if live)
  bind_only_while_binding  the bind is sent only while the session waits for it
  report_is_true           BOUND names the registry's binding, and the session stays bound (or closes) after it;
                           CLOSED only once the registry closed it;
                           GENERATED only for a generation that was answered; DROPPED only for one that was sent;
                           SESSION_CLOSED only once the finish began
  told_once                when nothing can happen, every question the caller asked has been answered
  told_its_own_outcome     BOUND is told only to the bind's waiters and CLOSED only to a finish; a finish of a session
                           this driver closed is never told REJECTED
  sub_state_is_true        a generation is RESOLVED only from an unknown outcome being resolved, and ABORTED only once
                           an abort was sent to it
  cleanup_only_when_asked  the caller's local cleanup runs only for a session that asked for it
  generated_only_while_open  a response is told GENERATED only while the session is bound (after the close began it
                           is DROPPED)
  A restart supervisor (SUPERVISE_SCENARIOS: E0 restarted and holds nothing; its rehydrates run the stage driver,
  whose own rows the stage scenarios check, as one step here):
  rehydrates_what_is_owed  a rehydrate is sent only for a staging the registry's answer names for this engine,
                           never for an attempt its own Publisher stages
  never_restages_ready     no rehydrate is sent for a version READY there already
  report_is_true           RECONCILED only once every rehydrate ended, with the answer's stagings split exactly into
                           those rehydrated and those left to its own publication, every other effect left to its
                           own driver, and (nothing failed) every version owed READY there
  sub_state_is_true        a rehydrate counted READY is READY in the registry
  rehydrate_fails_only_by_a_fault, rejected_needs_a_fault   FAILED and REJECTED only after a fault or a restart
  A recovery (RECOVER_SCENARIOS: B's attempt left pending by a crashed publisher; its settle driver runs as one
  step, and may report UNKNOWN under the drops budget):
  settles_only_what_is_pending  a settle is sent only for an attempt LOADING or ABORTED in the registry
  commits_only_what_is_stored   a commit only for a LOADING attempt whose bytes the snapshot store holds
  never_commits_the_unstored    no version whose bytes the store lacks is ever committed
  settles_under_the_lease       every settle carries the fence of the lease this recovery holds
  report_is_true           RECOVERED only with nothing pending and the settle COMMITTED or FAILED_CLEAN as the
                           registry has it; a stored attempt READY everywhere is never aborted without a fault
  rejected_needs_a_fault   REJECTED only after a fault, or when another publisher holds the lease
  A lease keeper (LEASE_SCENARIOS: the registry's own expiry of fence 1 and an operator's take-over in flight
  from the start, landing in any order):
  renews_its_own_fence     every renewal sent names the holder and the fence it was granted, none before the grant
  report_is_true           LEASED only under a fence the registry granted
  takes_over_only_when_told  a keeper reads the live fence and sends a take-over only when its caller asked for one
  takes_over_what_it_read  ... and the fence it takes over is the one it read, a fence the registry granted
  lost_only_when_lost      a keeper counts its lease lost only once granted, and only while the registry no longer
                           has that fence live for it
  A publication (PUBLISH_SCENARIOS: publish B, or A again, or C at capacity; the stage and settle drivers run as one
  step each, their own rows checked by the stage and settle scenarios):
  commits_only_what_is_staged  a commit is sent only after the staging reported STAGED
  commits_only_what_is_stored  ... and only on the store's answer that it holds the bytes (not on a failed or late
                           write: never_commits_the_unstored holds the registry to it)
  settles_its_own_attempt  the settle names the attempt its staging reserved
  notes_its_answers        the settle's answer is noted as the publication's outcome, and nothing else changes it
  never_commits_a_failed_staging  a version whose staging failed is never committed
  report_is_true           REJECTED and REPLAYED only as the staging's noted outcome (its executor reads it),
                           COMMITTED and FAILED_CLEAN only as the settle's noted outcome
  committed_stays_loaded   (above) is checked for the placements of the incarnation each engine runs: a READY of
                           an incarnation it no longer runs counts for nothing (the restart not adopted yet)
  registry invariants      every invariant of spec/invariants.py on every registry state
  finishes                 a world where nothing can happen any more has the driver DONE, with a report

Liveness, over every world of a check once its safety holds (`search`, fairness.py): no weakly fair run stays
forever in a cycle of worlds where something is still owed (`owed`: a driver's end and report, a session's answer
to each question its caller asked, a lease keeper's answer to its acquire; it then renews while it holds the
lease). Every delivery, answer, request ending, caller's question, retry pause and timer that fires once nothing
else is in flight is fair; a fault (a loss, a duplicate, an early deadline, a cancel, a restart) never is. So a
poll or a retry that never ends is found (tests/model_checks/test_drivers.py), where `finishes` sees only worlds
where nothing can happen.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs
from immutables import Map

from model_checks.fairness import Edges, open_forever
from model_checks.step_properties import engine_step_problems, registry_step_problems
from versioned_lora.lifecycle import (
    CORE,
    Core,
    engine_step_violations,
    initial_engine_state,
    initial_state,
    registry_step_violations,
)
from versioned_lora.lifecycle.drivers import (
    DRIVERS,
    MACHINE_OF,
    AbortGeneration,
    Answer,
    Arm,
    Bind,
    Call,
    Cancel,
    CheckProbe,
    CleanupEngine,
    CleanupEngineState,
    Deadline,
    Disarm,
    Drivers,
    DropLink,
    Finish,
    Generate,
    HangUp,
    LeaseState,
    LocalCleanup,
    Lost,
    PendingAttempt,
    PublishState,
    ReadAttempt,
    ReadIncarnation,
    ReadLiveFence,
    ReadRevision,
    ReclaimEngine,
    ReclaimEngineState,
    ReclaimState,
    RecoverState,
    Refusal,
    Rehydrate,
    Reply,
    Report,
    Resolve,
    RunStage,
    SendGeneration,
    SessionState,
    SettleAttempt,
    SettleState,
    StageEngine,
    StageResult,
    StageState,
    Start,
    Submit,
    SuperviseState,
    TakeLease,
    Timer,
    ViewDispatch,
    ViewPending,
    ViewPlacement,
    WaitStored,
    committable,
    input_kind,
    is_done,
    keep_lease,
    publication,
    publish,
    reclaim,
    recover,
    reserve_key,
    restarted_key,
    session,
    settle,
    stage,
    subs_of,
    supervise,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine, LoadPinned, PhysicalUnload, StageOnEngine
from versioned_lora.lifecycle.enabled import (
    FORGED_RECLAIM_ID,
    STALE_TOKEN,
    AdapterPlan,
    EngineEventDomain,
    EventDomain,
    candidate_engine_events,
    candidate_events,
)
from versioned_lora.lifecycle.errors import ProtocolError
from versioned_lora.lifecycle.queries import servable_on
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.spec import LIVENESS
from versioned_lora.spec.drivers import (
    DRIVER_ROWS,
    SETTLES,
    TERMINAL,
    Driver,
    DriverOutcome,
    DriverRow,
    Input,
    SessionRefusal,
)
from versioned_lora.spec.events import (
    NO_FENCE,
    Abort,
    AcquireLease,
    AcquireRequest,
    BeginClose,
    BeginStaging,
    BindFirst,
    ClaimReclaim,
    CleanupAttempt,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    EndStaging,
    EngineRestarted,
    EngineStarted,
    ExpireLease,
    FinishUnload,
    LoadDone,
    LoadFailed,
    OpenSession,
    ReceiveBucket,
    ReclaimAdapter,
    RecordCleaned,
    RecordPrepared,
    RecordReady,
    ReleaseLease,
    ReleaseRequest,
    RenewLease,
    Reserve,
    TakeOverLease,
    UnloadDone,
    UnloadFailed,
)
from versioned_lora.spec.identities import SessionKey, VersionKey, lora_name, reclaim_id
from versioned_lora.spec.invariants import engine_violated, violated
from versioned_lora.spec.model import RegistryState, session_state
from versioned_lora.spec.states import AdapterState, PlacementState, VersionState
from versioned_lora.spec.table import ROWS

ENGINES = ("E0", "E1")  # a two-engine world's (Budget.engines names the size; `names` a world's engines)


def names(w: World) -> tuple[str, ...]:
    """The engines of world w, in order: E0, E1, ..."""
    return tuple(f"E{i}" for i in range(len(w.engines)))


def engine_index(engine: str) -> int:
    """Engine E<i>'s index in a world's engines."""
    return int(engine[1:])
A, B, C = VersionKey(0, "A"), VersionKey(0, "B"), VersionKey(0, "C")
D = VersionKey(0, "D")  # only at K = 3 (WINDOW_BOUNDS): the version refused once A, B and C hold the window
DIGESTS = {A: "a" * 64, B: "b" * 64, C: "c" * 64, D: "d" * 64}
# The phases that wait for a call without a deadline, on purpose: the commit whose outcome was reported
# unknown is retried under the same key until it is answered (RFC §3.4).
# (machine, phase) pairs that wait for a call with no timer of their own, on purpose (a phase name alone would let one
# machine's exemption cover another's phase of the same name). A commit reported unknown is retried under the same
# key until it is answered (RFC §3.4); the probe check is local work.
UNBOUNDED_BY_DESIGN = frozenset({(Driver.SETTLE, "COMMIT_UNRESOLVED"), (Driver.STAGE_ENGINE, "CHECKING")})
# A session's: the bind retried after its waiters were told UNKNOWN; the caller's own cleanup (local work); and a
# generation's calls, which the backend's own timeout ends (a generation may legitimately run for minutes).
UNBOUNDED_BY_DESIGN |= {(Driver.SESSION, "BIND_UNKNOWN"), (Driver.SESSION, "CLEANING_UP")}
UNBOUNDED_BY_DESIGN |= {(Driver.GENERATION, p) for p in ("VIEWING", "SENDING", "RESOLVING", "ABORTING")}
# A rehydrate's placement read (one registry read) and its staging (the stage driver it runs bounds each of its calls
# with its own deadlines).
UNBOUNDED_BY_DESIGN |= {(Driver.REHYDRATE, "VIEWING"), (Driver.REHYDRATE, "STAGING")}
# A recovery's read of the registry (one read), its lease (the acquire is retried under its own deadline inside
# the publisher's call, then Lost), and its settle (the settle driver bounds each of its calls).
UNBOUNDED_BY_DESIGN |= {(Driver.RECOVER, "VIEWING"), (Driver.RECOVER, "LEASING"), (Driver.RECOVER, "SETTLING")}
# A publication's stage and settle drivers (each bounds its own calls) and its wait for the snapshot store (its
# executor bounds it with Deadlines.store, then Lost).
UNBOUNDED_BY_DESIGN |= {(Driver.PUBLISH, "STAGING"), (Driver.PUBLISH, "STORING"), (Driver.PUBLISH, "SETTLING")}
# A lease keeper's renewal: the lease's ttl bounds it (a renewal answered too late is refused, lease.renew_lost).
UNBOUNDED_BY_DESIGN |= {(Driver.LEASE, "RENEWING")}
# A coordinator's timers that bound a call, and the calls each bounds (the close timer: begin_close, then the close;
# the commit timer: the revision read, then the commit):
# one is armed only while such a call is in flight. (A lease's "renew" is its period and "backoff" a retry pause:
# armed while nothing is.)
TIMED_CALLS = {"reserve": {"attempt", "reserve"}, "commit": {"revision", "commit"}, "abort": {"abort"},
               "claim": {"claim"}, "bind": {"bind"}, "close": {"begin_close", "close"}, "incarnation": {"incarnation"},
               "restarted": {"restarted"}, "acquire": {"live_fence", "acquire"}}
# The guards with which a row acts on a coordinator's timer, by the timer's name (lifecycle.drivers.GUARDS).
TIMER_GUARDS = {f"{name}_timer": name for name in ("engine", "abort", "backoff", "report", "bind", "close",
                                                  "incarnation", "restarted", "acquire", "renew")}
# The guard with which a row answers each call (lifecycle.drivers.GUARDS).
ANSWER_GUARD = {"reserve": "answers_reserve", "begin": "answers_begin", "prepared": "answers_prepared",
                "bucket": "answers_bucket", "end": "answers_end", "probe": "answers_probe", "ready": "answers_ready",
                "commit": "answers_commit", "abort": "answers_abort", "claim": "answers_claim",
                "cleanup": "answers_engine_cleanup", "cleaned": "answers_cleaned", "unknown": "answers_unknown",
                "reclaim": "answers_engine_reclaim", "confirm": "answers_confirm", "bind": "answers_bind",
                "begin_close": "answers_begin_close", "close": "answers_close", "local_cleanup": "answers_cleanup",
                "view": "answers_view", "generate": "answers_generate", "incarnation": "answers_incarnation",
                "restarted": "answers_restarted", "placement": "answers_placement", "rehydrate": "answers_rehydrate",
                "pending": "answers_pending", "lease": "answers_lease", "settle": "answers_settle",
                "acquire": "answers_acquire", "renew": "answers_renew", "stage": "answers_stage",
                "store": "answers_store", "revision": "answers_revision",
                "live_fence": "answers_live_fence", "attempt": "answers_attempt"}
STALE = "another publisher"  # the engine field of a call made by another process (its reply is not ours)
COMMITTED = frozenset({VersionState.PUBLISHED, VersionState.RETIRED})
ABORTED_STATES = frozenset({VersionState.ABORTED, VersionState.FAILED_CLEAN})
O = DriverOutcome  # noqa: E741
OUTCOMES = {StageState: {O.STAGED, O.STAGE_FAILED, O.REPLAYED, O.REJECTED, O.UNKNOWN},  # what each driver may report
            SettleState: {O.COMMITTED, O.FAILED_CLEAN, O.UNKNOWN},
            ReclaimState: {O.RECLAIMED, O.PENDING, O.REJECTED, O.UNKNOWN},
            SessionState: {O.BOUND, O.GENERATED, O.DROPPED, O.RESOLVED, O.CLOSED, O.REJECTED, O.UNKNOWN},
            SuperviseState: {O.RECONCILED, O.REJECTED, O.UNKNOWN},
            RecoverState: {O.RECOVERED, O.REJECTED, O.UNKNOWN},
            LeaseState: {O.LEASED, O.STOPPED, O.REJECTED, O.UNKNOWN},
            PublishState: {O.COMMITTED, O.FAILED_CLEAN, O.REPLAYED, O.REJECTED, O.UNKNOWN}}
CALLS = (Submit, StageEngine, CheckProbe, CleanupEngine, ReclaimEngine, ViewDispatch, SendGeneration, AbortGeneration,
         LocalCleanup, ReadIncarnation, ReadRevision, ReadLiveFence, ViewPlacement, Rehydrate, ViewPending, TakeLease,
         SettleAttempt, RunStage, WaitStored, ReadAttempt)  # commands that are one call each
LOCAL_WORK = (RunStage, WaitStored)
# Refusals no party of these worlds gives, which defensive rows answer (DEFENSIVE_ROWS): BROKEN_PORT_BOUNDS (budget
# `breaks`) sends one in place of a call's answer, so those rows are checked as every other row is.
# - A call whose port, as driver_loop.py executes it, only answers or is lost (a registry read, an engine's
#   incarnation read, a recovery's view, a driver run in the executor's own process): its refusal is a port outside
#   its contract.
# - An engine's reclaim, a reclaim's confirm, a cleanup's receipt: their refusal is caused by a party these worlds
#   leave out (a forged or replayed reclaim id that reached the engine first, issue 19; a restart that replaced the
#   attempt a receipt names).
OUT_OF_CONTRACT = (ReadRevision, ReadLiveFence, ReadAttempt, ReadIncarnation, ViewPending, ViewPlacement,
                   SettleAttempt, RunStage)
OTHER_PARTY = (ConfirmReclaim, RecordCleaned)  # the registry events whose refusal another party causes
BROKEN_PORT = "REFUSED_BY_NO_PARTY_HERE"


def _breakable(command: Any) -> bool:
    return isinstance(command, (*OUT_OF_CONTRACT, ReclaimEngine)) or (
        isinstance(command, Submit) and isinstance(command.event, OTHER_PARTY))


@attrs.frozen
class Budget:
    """The faults a world may still meet (see the module's docstring), and its one size: `engines`, how many engines
    it has (E0, E1, ...), which no step changes."""

    drops: int = 1
    dups: int = 1
    deadlines: int = 1
    cancels: int = 1
    crashes: int = 0
    releases: int = 0
    engines: int = 2
    breaks: int = 0  # a call answered by a refusal no party here gives (`_breakable`; BROKEN_PORT_BOUNDS)
    capacity: int = 2  # the registry's K, which no step changes (WINDOW_BOUNDS: K = 3)


@attrs.frozen(cache_hash=True)
class World:
    registry: Any
    journal: Map[str, Reply]
    engines: tuple[Any, ...]
    driver: Any
    # ("req", command) | ("rep", input) | ("dup", command): a network duplicate of a request, answered to no one
    net: tuple[tuple[str, Any], ...]
    timers: frozenset[Timer]
    reports: tuple[Report, ...]
    budget: Budget
    requests: tuple[tuple[int, str], ...] = ()  # generation requests holding a native ref: (engine index, lora)
    flags: tuple[str, ...] = ()  # problems seen while the driver reacted (checked with the state's)
    bad_probes: frozenset[str] = frozenset()  # engines whose `end` probe differs from the reference forward
    bad_manifests: frozenset[str] = frozenset()  # engines where a bucket landed corrupted: `end` does not verify
    bad_name: bool = False  # the publication's candidate carries another name than the registry reserves
    load_fails: frozenset[str] = frozenset()  # engines where SGLang's load fails (LoadFailed, issue 41)
    unload_fails: frozenset[str] = frozenset()  # engines where SGLang's next physical unload fails (once)
    started: bool = False  # Start was fed (it is fed once: a driver back in IDLE gets no second one)
    # A session's caller: the requests it will still make, in order (each may come while earlier ones are in
    # flight), and the subjects it asked about and has not been told about yet.
    caller: tuple[str, ...] = ()
    pending: frozenset[str] = frozenset()
    asked: frozenset[str] = frozenset()  # the request ids asked about so far (a caller may go away after its answer)
    unstored: frozenset[VersionKey] = frozenset()  # versions whose bytes the snapshot store lacks (a recovery's)
    crowded: bool = False  # other drivers share the registry and engines (model_checks/crowd.py): other processes


@attrs.frozen
class Receipt:
    """An engine's `end` answer as the stage driver reads it (the runtime's ReadyReceipt, minus the probe)."""

    incarnation: int
    digest: str


# ---------------------------------------------------------------- the engines' executor (issue 41)


def outcome_of(effect: Any, load_fails: bool = False, unload_fails: bool = False) -> Any:
    """What SGLang reports for an engine effect whose outcome is an input of the table (engine_side._carry_out):
    LoadDone or LoadFailed for a LoadPinned, UnloadDone or UnloadFailed for a PhysicalUnload; None for the others."""
    if isinstance(effect, LoadPinned):
        return (LoadFailed if load_fails else LoadDone)(effect.lora_name, effect.attempt_token)
    if isinstance(effect, PhysicalUnload):
        return (UnloadFailed if unload_fails else UnloadDone)(effect.lora_name)
    return None


def carried_out(step: Callable[[Any, Any], tuple[Any, Any, tuple[Any, ...]]], engine: Any, result: Any,
                effects: tuple[Any, ...]) -> tuple[Any, Any]:
    """An engine call's effects carried out where every load and unload succeeds: each outcome stepped, its row's
    effects next; the call's answer is the first refusal among the rows fired, else the last row's result (as
    engine_side._run answers)."""
    queue = list(effects)
    while queue:
        outcome = outcome_of(queue.pop(0))
        if outcome is not None:
            engine, answer, more = step(engine, outcome)
            result = result if isinstance(result, Rejected) else answer
            queue[:0] = more
    return engine, result


# ---------------------------------------------------------------- scenarios, built with the real tables


class _Setup:
    def __init__(self, *, leased: bool = False, epoch: int = 0, engines: int = 2, capacity: int = 2) -> None:
        """`leased`: the registry requires the publisher lease (as a deployment's does), HOLDER holds it under fence 1,
        and every Reserve and Commit here carries that fence. `epoch`: the registry's deployment epoch (the
        scenarios' versions and sessions are of epoch 0)."""
        self.names = tuple(f"E{i}" for i in range(engines))
        self.reg = initial_state(engines=self.names, capacity=capacity, epoch=epoch,
                                 incarnations={e: 1 for e in self.names}, publisher_lease=leased)
        self.engs = [initial_engine_state(e, 1) for e in self.names]
        self.tokens: dict[VersionKey, tuple[str, str]] = {}
        self.fence = self.reg_step(AcquireLease(HOLDER, 10.0)).fence if leased else NO_FENCE

    def reg_step(self, event: Any) -> Any:
        self.reg, result, _ = CORE.step(self.reg, event)
        assert not isinstance(result, Rejected), (event, result)
        return result

    def eng_step(self, i: int, event: Any) -> None:
        """One engine call, its loads and unloads carried out (they succeed)."""
        self.engs[i], result = carried_out(CORE.engine_step, *CORE.engine_step(self.engs[i], event))
        assert not isinstance(result, Rejected), (event, result)

    def reserve(self, v: VersionKey) -> tuple[str, tuple[StageOnEngine, ...]]:
        """Reserve v (nothing staged yet): its attempt token and the stage orders the registry issued with it."""
        self.reg, reserved, effects = CORE.step(self.reg, Reserve(v, DIGESTS[v]))
        assert not isinstance(reserved, Rejected), (v, reserved)
        return reserved.attempt_token, tuple(e for e in effects if isinstance(e, StageOnEngine))

    def stage(self, v: VersionKey, ready_on: tuple[int, ...] | None = None) -> None:
        """v reserved and begun on every engine, and READY on those of `ready_on` (default: every engine)."""
        reserved = self.reg_step(Reserve(v, DIGESTS[v], self.fence))
        name, token = reserved.lora_name, reserved.attempt_token
        self.tokens[v] = (name, token)
        for i, e in enumerate(self.names):
            self.eng_step(i, BeginStaging(name, token, 1, DIGESTS[v], 1))
            self.reg_step(RecordPrepared(v, token, e, 1, DIGESTS[v]))
            if ready_on is None or i in ready_on:
                self.eng_step(i, ReceiveBucket(name, token, 1, 0))
                self.eng_step(i, EndStaging(name, token, 1, True))
                self.reg_step(RecordReady(v, token, e, 1, DIGESTS[v]))

    def commit(self, v: VersionKey) -> None:
        self.reg_step(Commit(v, self.tokens[v][1], self.reg.default_revision, self.fence))

    def abort_and_clean(self, v: VersionKey) -> None:
        """v's attempt aborted and cleaned on every engine: FAILED_CLEAN."""
        name, token = self.tokens[v]
        self.reg_step(Abort(v, token))
        for i, e in enumerate(self.names):
            self.eng_step(i, CleanupAttempt(name, token))
            self.reg_step(RecordCleaned(v, token, e))


def _fill_window(s: _Setup, capacity: int) -> VersionKey:
    """With A the default: publish versions until the registry holds `capacity` (B; at K = 3, then C), each the new
    default; returns the next one, which the full window refuses at reserve."""
    window = (A, B, C, D)
    if not 2 <= capacity < len(window):
        raise ValueError(f"the scenarios fill windows of 2 or 3 versions, not {capacity}")
    for v in window[1:capacity]:
        s.stage(v)
        s.commit(v)
    return window[capacity]


def _world(setup: _Setup, driver: Any, budget: Budget, requests: tuple[tuple[int, str], ...] = ()) -> World:
    return World(setup.reg, Map(), tuple(setup.engs), driver, (), frozenset(), (), budget, requests)


BUCKETS = 2  # the stage scenarios' bucket count: the barrier between bucket 0 and bucket 1 is exercised


def scenario(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    s.stage(A)
    if name == "commit_bootstrap":  # a deployment's first publication: A READY everywhere, no default yet
        return _world(s, settle(A, s.tokens[A][1], commit=True), budget)
    s.commit(A)
    if name == "stage":  # publish B: read its last attempt (none), reserve under the key that derives, then stage it
        return _world(s, publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), BUCKETS, ""), budget)
    if name == "stage_probe_mismatch":  # B's attempt issued already (a rehydrate's start): staged, E1's probe differs
        token, orders = s.reserve(B)
        w = _world(s, stage(B, token, BUCKETS, orders), budget)
        return attrs.evolve(w, bad_probes=frozenset({"E1"}))
    if name == "stage_bad_manifest":  # publish B; a bucket lands corrupted on E1: its `end` is refused (RFC §7.1)
        w = _world(s, publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), BUCKETS, "reserve:B"), budget)
        return attrs.evolve(w, bad_manifests=frozenset({"E1"}))
    if name == "stage_load_fails":  # stage B; SGLang's load of it fails on E1: its `end` is refused LOAD_FAILED,
        # the stash freed there and nothing loaded (issue 41)
        token, orders = s.reserve(B)  # (B's attempt issued already, as stage_probe_mismatch's)
        return attrs.evolve(_world(s, stage(B, token, BUCKETS, orders), budget), load_fails=frozenset({"E1"}))
    if name == "reserve_retry":  # B's first attempt failed and was cleaned: publishing B again reserves afresh, under
        before = s.reg  # a key naming that attempt: the first reserve's key, journaled, answers with the old attempt
        s.stage(B)
        s.abort_and_clean(B)
        _, reserved, effects = CORE.step(before, Reserve(B, DIGESTS[B], s.fence))
        start = publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), BUCKETS, "")
        w = _world(s, start, budget)
        return attrs.evolve(w, journal=Map({reserve_key(start, ""): Reply(reserved, tuple(effects))}))
    if name == "reserve_name_mismatch":  # the candidate carries another name than the registry reserves
        w = _world(s, publication(B, DIGESTS[B], "not-" + lora_name(B, DIGESTS[B]), BUCKETS, "reserve:B"), budget)
        return attrs.evolve(w, bad_name=True)
    if name == "reserve_replay":  # A again, same content: the registry answers its finished publication
        return _world(s, publication(A, DIGESTS[A], lora_name(A, DIGESTS[A]), BUCKETS, "reserve:A-again"), budget)
    if name == "reserve_conflict":  # A again with other content: refused (VERSION_CONFLICT), nothing taken
        return _world(s, publication(A, DIGESTS[B], lora_name(A, DIGESTS[B]), BUCKETS, "reserve:A-other"), budget)
    if name == "reserve_at_capacity":  # B the default and A retired, both loaded on engines of capacity 2: C is
        refused = _fill_window(s, budget.capacity)  # refused at reserve (RFC §7.1: no begin reaches an engine);
        # at K = 3, A and B retired and C the default: D is
        return _world(s, publication(refused, DIGESTS[refused], lora_name(refused, DIGESTS[refused]), BUCKETS,
                                     f"reserve:{refused.version_id}"), budget)
    if name == "reserve_while_pending":  # B's attempt still pending (a crashed publisher's): C is refused at reserve
        s.reg_step(Reserve(B, DIGESTS[B]))
        return _world(s, publication(C, DIGESTS[C], lora_name(C, DIGESTS[C]), BUCKETS, "reserve:C"), budget)
    if name in ("reserve_no_lease", "commit_no_lease"):  # a deployment's registry: our publisher holds the lease
        # (fence 1) while an operator's take-over of it flies, landing before or after ours
        s = _Setup(leased=True, engines=budget.engines, capacity=budget.capacity)
        s.stage(A)
        s.commit(A)
        take_over = ("req", Submit(Call("take_over", STALE), TakeOverLease(RIVAL, s.fence, 10.0), "take_over:other"))
        if name == "reserve_no_lease":  # publish B under fence 1: its reserve is refused if the take-over came first
            start = publication(B, DIGESTS[B], lora_name(B, DIGESTS[B]), BUCKETS, "reserve:B", s.fence)
        else:  # B READY everywhere: its commit under fence 1 is refused if the take-over came first, then aborted
            s.stage(B)
            start = settle(B, s.tokens[B][1], commit=True, fence=s.fence)
        return attrs.evolve(_world(s, start, budget), net=(take_over,))
    if name == "commit":  # B READY everywhere: commit it (the lost-commit-reply story of RFC §3.4)
        s.stage(B)
        return _world(s, settle(B, s.tokens[B][1], commit=True), budget)
    if name == "commit_not_ready":  # B READY on E0 only: the commit is refused, then aborted and cleaned
        s.stage(B, ready_on=(0,))
        return _world(s, settle(B, s.tokens[B][1], commit=True), budget)
    if name == "abort":  # staging failed on B after READY everywhere: abort and clean both engines, while
        s.stage(B)  # E0 still runs B's probe request (its cleanup answers IN_USE until the request ends)
        s.eng_step(0, AcquireRequest(s.tokens[B][0]))
        requests = ((0, s.tokens[B][0]),)
        return _world(s, settle(B, s.tokens[B][1], commit=False), attrs.evolve(budget, releases=1), requests)
    if name == "abort_after_commit":  # a recovering publisher aborts B while the crashed one's commit of B
        s.stage(B)  # is still in flight: whichever lands first, a committed B is never cleaned
        token = s.tokens[B][1]
        stale = Submit(Call("commit", STALE), Commit(B, token, s.reg.default_revision), "commit:stale")
        w = _world(s, settle(B, token, commit=False), budget)
        return attrs.evolve(w, net=(("req", stale),))
    if name in ("abort_load_running", "abort_load_fails_running"):  # B READY on E0; E1's `end` verified B and its
        # load runs (slower than the end's deadline): the abort's cleanup meets it there, before or after the load's
        # outcome comes (which succeeds, or fails), and nothing stays pinned under a cleaned placement (issue 41)
        s.stage(B, ready_on=(0,))
        name_b, token = s.tokens[B]
        for event in (ReceiveBucket(name_b, token, 1, 0), EndStaging(name_b, token, 1, True)):
            s.engs[1], result, _ = CORE.engine_step(s.engs[1], event)  # the load itself not carried out
            assert not isinstance(result, Rejected), (event, result)
        outcome = (LoadFailed if name == "abort_load_fails_running" else LoadDone)(name_b, token)
        return attrs.evolve(_world(s, settle(B, token, commit=False), budget), net=(("sglang", (1, outcome)),))
    if name == "abort_unload_fails":  # B READY everywhere, aborted: SGLang's unload of it fails once on E1, which
        s.stage(B)  # keeps it accounted (UNLOAD_FAILED) and refuses the cleanup, typed; the next cleanup retries it
        w = _world(s, settle(B, s.tokens[B][1], commit=False), budget)
        return attrs.evolve(w, unload_fails=frozenset({"E1"}))
    if name == "abort_again":  # recovery aborts an attempt that is already FAILED_CLEAN: nothing to clean
        s.stage(B)
        s.abort_and_clean(B)
        return _world(s, settle(B, s.tokens[B][1], commit=False), budget)
    if name == "reclaim_default":  # A is the default: the claim is refused, nothing reaches an engine
        return _world(s, reclaim(A), budget)
    if name in ("reclaim", "reclaim_in_use"):
        session = SessionKey(0, 0, 0)
        if name == "reclaim_in_use":  # a session still bound to A: the claim is refused
            s.reg_step(OpenSession(session))
            s.reg_step(BindFirst(session))
        s.stage(B)
        s.commit(B)
        requests: tuple[tuple[int, str], ...] = ()
        if name == "reclaim":  # two requests on E0 still hold A's native refs: the unload waits for both (the
            s.eng_step(0, AcquireRequest(s.tokens[A][0]))  # first release drops one ref, release.one; the last
            s.eng_step(0, AcquireRequest(s.tokens[A][0]))  # lets the drain finish)
            requests = ((0, s.tokens[A][0]), (0, s.tokens[A][0]))
        return _world(s, reclaim(A), attrs.evolve(budget, releases=len(requests)), requests)
    if name == "reclaim_unload_fails":  # SGLang's unload of A fails once on E1: A stays accounted there
        s.stage(B)  # (UNLOAD_FAILED), the reclaim is not confirmed, and the reclaim sent again unloads it (issue 41)
        s.commit(B)
        return attrs.evolve(_world(s, reclaim(A), budget), unload_fails=frozenset({"E1"}))
    if name == "reclaim_done":  # a reclaim of a version every engine already confirmed: nothing is sent
        s.stage(B)
        s.commit(B)
        claimed = s.reg_step(ClaimReclaim(A))
        for i, e in enumerate(s.names):
            s.eng_step(i, ReclaimAdapter(s.tokens[A][0], claimed.reclaim_id))
            s.eng_step(i, FinishUnload(s.tokens[A][0], claimed.reclaim_id))
            s.reg_step(ConfirmReclaim(A, e, claimed.reclaim_id))
        return _world(s, reclaim(A), budget)
    if name in SESSION_SCENARIOS:
        return _session_world(name, budget)
    if name in SUPERVISE_SCENARIOS:
        return _supervise_world(name, budget)
    if name in RECOVER_SCENARIOS:
        return _recover_world(name, budget)
    if name in LEASE_SCENARIOS:
        return _lease_world(name, budget)
    if name in PUBLISH_SCENARIOS:
        return _publish_world(name, budget)
    raise ValueError(f"unknown scenario {name!r}; known: {SCENARIOS}")


SESSION = SessionKey(0, 0, 0)
# A session's caller: what it asks, in order ("gen r0": a generation under request id r0). The session scenarios:
SESSION_SCENARIOS = {
    # bind, one generation, then finish twice (a second finish waits for the same close, or retries the cleanup)
    "session": (("bind", "gen r0", "finish", "finish"), {"cleanup": True}),
    # a generation after one whose outcome may be unknown, its resolution, and a request id used twice
    "session_retry": (("bind", "gen r0", "gen r1", "resolve r0", "resolve r0", "resolve r1", "finish"), {}),
    # both engines restarted and not yet rehydrated: the version is servable nowhere; a generation before the bind
    # is answered, a bind after it, and a request id used again
    "session_restarted": (("bind", "gen r0", "bind", "finish", "gen r0"), {}),
    # no default yet: the bind is refused; a bind and a generation after the finish
    "session_unpublished": (("bind", "finish", "bind", "gen r0"), {}),
    "session_close_only": (("finish",), {"close_only": True}),  # a session this process does not hold
    "session_other_epoch": (("finish",), {}),  # begin_close refused: another epoch's session
    "session_other_epoch_close": (("finish",), {"close_only": True}),  # and its close
    # another process (a failed-over replica of the session service) opens, binds and closes the same session under
    # keys of its own, in any order with ours: one shared bind, one ref released (open.unseen, open.replay, open.late,
    # bind.replay, begin_close.replay, close.replay). A session driver never opens (BindFirst creates the session);
    # OpenSession is the registry's API for the session service.
    "session_shared": (("bind", "finish"), {}),
}


def _session_world(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    if name != "session_unpublished":
        s.stage(A)
        s.commit(A)
    if name == "session_restarted":
        for e in s.names:
            s.reg_step(EngineRestarted(e, 2))
        s.engs = [CORE.engine_step(eng, EngineStarted(2))[0] for eng in s.engs]
    key = SessionKey(1, 0, 0) if name.startswith("session_other_epoch") else SESSION
    script, options = SESSION_SCENARIOS[name]
    w = _world(s, session(key, **options), budget)
    if name == "session_shared":
        others = (("open", OpenSession(key)), ("bind", BindFirst(key)), ("begin_close", BeginClose(key)),
                  ("close", CloseAndRelease(key)))
        net = _sorted(("req", Submit(Call(op, STALE), event, f"{op}:other")) for op, event in others)
        w = attrs.evolve(w, net=net)
    return attrs.evolve(w, started=True, caller=script)


# E0 restarted (incarnation 2) and holds nothing; its supervisor reports it and rehydrates what the answer names.
SUPERVISE_SCENARIOS = (
    "supervise",  # A (a session's binding) and B (the default) owed: two rehydrates
    "supervise_own",  # the first publication (B) in flight in this process: its attempt is left to it, nothing owed
    "supervise_again",  # a second reconcile of the same incarnation: the journal's answer, A READY there already
)


def _supervise_world(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    if name != "supervise_own":
        s.stage(A)
        s.commit(A)
    own: frozenset[str] = frozenset()
    if name == "supervise_own":  # the first publication, B, reserved and begun on both engines by this process
        reserved = s.reg_step(Reserve(B, DIGESTS[B]))
        s.tokens[B] = (reserved.lora_name, reserved.attempt_token)
        for i, e in enumerate(s.names):
            s.eng_step(i, BeginStaging(reserved.lora_name, reserved.attempt_token, 1, DIGESTS[B], 1))
            s.reg_step(RecordPrepared(B, reserved.attempt_token, e, 1, DIGESTS[B]))
        own = frozenset({reserved.attempt_token})
    else:  # a session still bound to A, and B the default: E0 owes both
        s.reg_step(OpenSession(SESSION))
        s.reg_step(BindFirst(SESSION))
        s.stage(B)
        s.commit(B)
    s.engs[0] = CORE.engine_step(s.engs[0], EngineStarted(2))[0]
    journal: Map[str, Reply] = Map()
    if name == "supervise_again":  # the first reconcile adopted incarnation 2 and rehydrated A; B's failed
        key = restarted_key("E0", 2)
        s.reg, result, effects = CORE.step(s.reg, EngineRestarted("E0", 2))
        journal = journal.set(key, Reply(result, effects))
        order = next(e for e in effects if isinstance(e, StageOnEngine) and e.version == A)
        s.eng_step(0, BeginStaging(order.lora_name, order.attempt_token, 2, order.digest, 1))
        s.reg_step(RecordPrepared(A, order.attempt_token, "E0", 2, order.digest))
        s.eng_step(0, ReceiveBucket(order.lora_name, order.attempt_token, 2, 0))
        s.eng_step(0, EndStaging(order.lora_name, order.attempt_token, 2, True))
        s.reg_step(RecordReady(A, order.attempt_token, "E0", 2, order.digest))
    return attrs.evolve(_world(s, supervise("E0", own), budget), journal=journal)


# A publisher crashed with B's attempt pending (B READY everywhere, not committed); the next one recovers it.
RECOVER_SCENARIOS = (
    "recover",  # B's bytes are in the snapshot store: committed
    "recover_unstored",  # they are not (the publisher died before writing them): aborted and cleaned, never committed
    "recover_aborted",  # B was aborted, its cleanups still owed: aborted again, cleaned
    "recover_leased",  # another publisher holds the lease (its attempt in flight looks the same): left as it is
    "recover_none",  # nothing pending: no lease is taken
)
HOLDER = "recovering-publisher"
RIVAL = "rival-publisher"


def _recover_world(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    s.stage(A)
    s.commit(A)
    if name != "recover_none":
        s.stage(B)
    if name == "recover_aborted":
        s.reg_step(Abort(B, s.tokens[B][1]))
    if name == "recover_leased":
        s.reg_step(AcquireLease(RIVAL, 10.0))
    w = _world(s, recover(), budget)
    return attrs.evolve(w, unstored=frozenset({B}) if name == "recover_unstored" else frozenset())


# The publisher lease (RFC §3: one publisher at a time). A keeper acquires and renews it while other parties' calls on
# the lease are in flight from the start, landing in any order: the registry's own timer expiring fence 1 (the first
# fence granted), and an operator's take-over of fence 1 for another publisher.
LEASE_SCENARIOS = (
    "lease",  # ours is the first grant (fence 1); a rival takes it over and then releases fence 2
    "lease_take_over",  # the rival holds fence 1; our keeper takes it over while a third party's take-over of it flies
)
THIRD = "third-publisher"


def _lease_world(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    s.stage(A)
    s.commit(A)
    others: list[tuple[str, Any]] = [("expire", ExpireLease(1))]
    if name == "lease":
        keeper = keep_lease(HOLDER, 10.0)
        others += [("take_over", TakeOverLease(RIVAL, 1, 10.0)), ("release", ReleaseLease(RIVAL, 2))]
    else:
        s.reg_step(AcquireLease(RIVAL, 10.0))
        keeper = keep_lease(HOLDER, 10.0, take_over=True)
        others += [("take_over", TakeOverLease(THIRD, 1, 10.0))]
    net = _sorted(("req", Submit(Call(op, STALE), event, f"{op}:other")) for op, event in others)
    return attrs.evolve(_world(s, keeper, budget), net=net)


# One publication end to end (publish B, A the default): the staging's outcome and the store's write decide between
# commit and abort (the stage and settle drivers run as one step each here; their own scenarios check their rows).
PUBLISH_SCENARIOS = (
    "publish",  # staged and stored: committed
    "publish_bad_manifest",  # a bucket lands corrupted on E1: its `end` is refused, so B is aborted and cleaned
    "publish_unstored",  # the store cannot take B's bytes: B is aborted, never committed
    "publish_replay",  # A again, same content: REPLAYED, nothing staged
    "publish_at_capacity",  # B the default and A retired, both loaded: C is refused at reserve
)


def _publish_world(name: str, budget: Budget) -> World:
    s = _Setup(engines=budget.engines, capacity=budget.capacity)
    s.stage(A)
    s.commit(A)
    version = {"publish_replay": A}.get(name, B)
    if name == "publish_at_capacity":
        version = _fill_window(s, budget.capacity)
    w = _world(s, publish(version, lora_name(version, DIGESTS[version]), NO_FENCE, DIGESTS[version]), budget)
    return attrs.evolve(w, bad_manifests=frozenset({"E1"}) if name == "publish_bad_manifest" else frozenset(),
                        unstored=frozenset({version}) if name == "publish_unstored" else frozenset())


CALLER_INPUTS = {"bind": lambda rid: (Bind(), "bind"), "gen": lambda rid: (Generate(rid), rid),
                 "resolve": lambda rid: (Resolve(rid), rid), "finish": lambda rid: (Finish(), "finish")}


SCENARIOS = ("stage", "stage_probe_mismatch", "stage_bad_manifest", "reserve_retry", "reserve_name_mismatch",
             "reserve_replay", "reserve_conflict", "reserve_at_capacity", "reserve_while_pending", "reserve_no_lease",
             "commit", "commit_bootstrap", "commit_no_lease", "commit_not_ready", "abort", "abort_after_commit",
             "abort_again", "reclaim_default", "reclaim", "reclaim_in_use", "reclaim_done", "stage_load_fails",
             "abort_load_running", "abort_load_fails_running", "abort_unload_fails", "reclaim_unload_fails",
             *SESSION_SCENARIOS,
             *SUPERVISE_SCENARIOS, *RECOVER_SCENARIOS, *LEASE_SCENARIOS, *PUBLISH_SCENARIOS)

# ---------------------------------------------------------------- successors


def _sorted(items: Any) -> tuple[Any, ...]:
    return tuple(sorted(items, key=repr))


class DriverSystem:
    """The worlds' successors and properties. `core`: the registry's and the engines' table the worlds step (the
    reference's, or a mutant's: which calls are probes is always the reference's say). `probes`: send them (off only
    where nothing but the driver table differs from the reference: the probes' verdicts depend on the core alone)."""

    def __init__(self, drivers: Drivers = DRIVERS, core: Core = CORE, probes: bool = True) -> None:
        self.drivers, self.core, self.probes = drivers, core, probes
        self.fired: dict[str, int] = {}
        self.core_fired: dict[str, int] = {}  # the registry's and the engines' rows the worlds stepped through
        self.core_probed: dict[str, int] = {}  # ... and those the probes fired (self-loops: see probe_problems)
        # a registry or engine state probed -> (what its probes broke, the rows they fired); the reference table's
        # verdicts are shared by every check a process runs (_PROBED)
        self._probed: dict[Any, tuple[tuple[str, ...], tuple[str, ...]]] = _PROBED if core is CORE else {}
        self._fired: dict[tuple[Any, Any], tuple[Any, tuple[str, ...], bool]] = _FIRED if core is CORE else {}
        self._awaited_by_phase: dict[tuple[Any, str], frozenset[str]] = {}
        self._acting_by_phase: dict[tuple[Any, str, Input], tuple[DriverRow, ...]] = {}

    # ---- the registry's and an engine's table, counting the row each step fires; each step is checked (invariants,
    # step invariants, the frame and the `also` moves, the step properties)
    def _step(self, registry: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
        return self._fire(registry, event)

    def _engine_step(self, engine: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
        return self._fire(engine, event)

    def _carried_out(self, w: World, i: int, engine: Any, result: Any,
                     effects: tuple[Any, ...]) -> tuple[Any, Any, World]:
        """Engine i's executor after a step (engine_side._carry_out): each load and unload reports its outcome as this
        world's SGLang gives it (a load fails on an engine of `load_fails`, an unload fails once on one of
        `unload_fails`), each a step of the table whose row's effects run next; the call's answer is the first refusal
        among the rows fired, else the last row's result (as engine_side._run answers)."""
        queue = list(effects)
        name = f"E{i}"
        while queue:
            effect = queue.pop(0)
            unload_fails = isinstance(effect, PhysicalUnload) and name in w.unload_fails
            outcome = outcome_of(effect, load_fails=name in w.load_fails, unload_fails=unload_fails)
            if outcome is None:
                continue
            if unload_fails:
                w = attrs.evolve(w, unload_fails=w.unload_fails - {name})
            engine, answer, more = self._engine_step(engine, outcome)
            result = result if isinstance(result, Rejected) else answer
            queue[:0] = more
        return engine, result, w

    def _fire(self, state: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
        got = self._fired.get((state, event))
        if got is None:
            if isinstance(state, RegistryState):
                fired = self.core.step_traced(state, event)
                problems = (registry_step_violations(state, event, fired, self.core)
                            + registry_step_problems(state, event, fired.state, fired.result, fired.effects))
            else:
                fired = self.core.engine_step_traced(state, event)
                problems = (engine_step_violations(state, event, fired, self.core)
                            + engine_step_problems(state, event, fired.state, fired.result, fired.effects))
            got = self._fired[(state, event)] = fired, tuple(problems), fired.state is state
        fired, problems, unchanged = got
        self.core_fired[fired.row.id] = self.core_fired.get(fired.row.id, 0) + 1
        if problems:
            raise StepPropertyViolation(f"{event} ({fired.row.id}): {'; '.join(problems)}")
        # A step that changed nothing hands back the caller's own state object, as the table does: `_serve` journals
        # a call only when the state is another object (as RegistryCore does). The cache is keyed by equality, so its
        # entry may hold an equal state made by another world, which must not pass for a change.
        return (state if unchanged else fired.state), fired.result, fired.effects

    # ---- the driver reacts to one input: its commands join the network, timers, reports
    def _feed(self, w: World, inp: Any) -> tuple[World, tuple[str, ...]]:
        step = self.drivers.step(w.driver, inp)
        for row in step.fired:
            self.fired[row] = self.fired.get(row, 0) + 1
        net, timers, reports = list(w.net), set(w.timers), list(w.reports)
        flags = list(w.flags)
        for c in step.commands:
            # Only the driver's own copies count ("req", and the "rep" answering it), not a network duplicate.
            if isinstance(c, CALLS) and any(
                    (kind == "req" and m.call == c.call) or (kind == "rep" and getattr(m, "call", None) == c.call)
                    for kind, m in w.net):
                flags.append(f"one_call_at_a_time: {c.call} sent again while in flight")
            if isinstance(c, Arm):
                timers.add(c.timer)
            elif isinstance(c, Disarm):
                timers.discard(c.timer)
            elif isinstance(c, Report):
                reports.append(c)
            elif isinstance(c, DropLink):
                pass  # local to the executor: the model's engines have no transfer group
            elif isinstance(c, HangUp):  # the executor cancels the call: its outcome never reaches the driver
                net = [(kind, m) for kind, m in net if getattr(m, "call", None) != c.call]
            else:
                net.append(("req", c))
        flags += _confirm_and_commit_flags(w, step.commands)
        for name, sub in subs_of(step.state).items():  # a record the registry answered is a record made
            was = subs_of(w.driver).get(name)
            if isinstance(sub, CleanupEngineState) and was is not None and was.phase == "RECORDING" and (
                    sub.phase == "UNCONFIRMED" and input_kind(inp) is Input.ANSWER):  # (a Rejected reply refuses)
                flags.append(f"sub_state_is_true: {name}'s cleanup was recorded, and it counted UNCONFIRMED")
        for c in step.commands:
            if isinstance(c, CALLS) and not self._waits_for(step.state, c.call):
                flags.append(f"waits_for_what_it_sends: {c.call} sent, and no row of the phase it moved to "
                             f"answers it")
            if isinstance(c, Arm) and not c.timer.engine and not self._acts_on(step.state, c.timer.name):
                flags.append(f"arms_what_it_acts_on: {c.timer.name} timer armed, and no row of "
                             f"{step.state.phase} acts on it")
        if isinstance(inp, Deadline) and inp.timer.name == "backoff":  # a retry pause is no deadline
            for name, sub in subs_of(step.state).items():
                was = subs_of(w.driver).get(name)
                if was is not None and sub.phase != was.phase and sub.phase in TERMINAL[MACHINE_OF[type(sub)]]:
                    flags.append(f"gives_up_only_at_its_deadline: {name} went {was.phase} -> {sub.phase} when its "
                                 "retry pause ended")
        if isinstance(step.state, SessionState):
            flags += _session_flags(w.driver, step.state, step.commands, w.registry)
        if isinstance(step.state, SuperviseState):
            flags += _supervise_flags(w, step.state, step.commands)
        if isinstance(step.state, RecoverState):
            flags += _recover_flags(w, step.commands)
        if isinstance(step.state, PublishState):
            flags += _publish_flags(w, w.driver, step.state, step.commands, inp)
        if is_done(step.state):  # the loop ends: its timers are cancelled, late replies land nowhere
            timers.clear()
        pending = w.pending - {c.subject for c in step.commands if isinstance(c, Report)}
        w = attrs.evolve(w, driver=step.state, net=_sorted(net), timers=frozenset(timers), reports=tuple(reports),
                         flags=tuple(flags), pending=pending)
        return w, step.fired

    def _waits_for(self, driver: Any, call: Call) -> bool:
        machine = driver if not call.engine else subs_of(driver).get(call.engine)
        return machine is not None and call.op in self._awaited(machine)

    def _acting(self, machine: Any, kind: Input) -> tuple[DriverRow, ...]:
        """The rows of the machine's phase for `kind` that change something (the table's own index, filtered once
        per phase: the properties ask on every world)."""
        key = (MACHINE_OF[type(machine)], machine.phase, kind)
        rows = self._acting_by_phase.get(key)
        if rows is None:
            rows = self._acting_by_phase[key] = tuple(r for r in self.drivers.rows_for(*key) if r.changes_state)
        return rows

    def _awaited(self, machine: Any) -> frozenset[str]:
        """The calls whose answer a row of the machine's phase acts on (rows that change something)."""
        key = (MACHINE_OF[type(machine)], machine.phase)
        if key not in self._awaited_by_phase:
            rows = self._acting(machine, Input.ANSWER)
            self._awaited_by_phase[key] = frozenset(
                op for op, guard in ANSWER_GUARD.items() if any(guard in r.guards for r in rows))
        return self._awaited_by_phase[key]

    def _acts_on(self, machine: Any, timer: str) -> bool:
        """A row of the machine's phase changes something when the timer named `timer` fires (a row whose guard
        names another timer does not count)."""
        return any(all(TIMER_GUARDS.get(g, timer) == timer for g in r.guards)
                   for r in self._acting(machine, Input.DEADLINE))

    def _retries_on_backoff(self, machine: Any) -> bool:
        """The machine's phase retries its call when the retry pause fires (a row of it acts on that timer)."""
        return any("backoff_timer" in r.guards for r in self._acting(machine, Input.DEADLINE))

    # ---- a request reaches the registry or an engine: the real tables answer
    def _serve(self, w: World, command: Any) -> tuple[World, Any]:
        if isinstance(command, Submit):
            hit = w.journal.get(command.key)
            if hit is not None:
                return w, Answer(command.call, hit)
            registry, result, effects = self._step(w.registry, command.event)
            reply = Reply(result, effects)
            # As RegistryCore: a call that changed nothing (a keep row) is answered without a journal row, so the
            # same key again is answered afresh (a lease renewal's key names its fence, not its turn).
            journal = w.journal if registry is w.registry else w.journal.set(command.key, reply)
            return attrs.evolve(w, registry=registry, journal=journal), Answer(command.call, reply)
        if isinstance(command, CheckProbe):
            return w, Answer(command.call, command.engine not in w.bad_probes)
        if isinstance(command, ViewDispatch):  # the gate: the registry's own answer
            servable = frozenset(e for e in names(w) if servable_on(w.registry, command.version, e))
            return w, Answer(command.call, servable)
        if isinstance(command, ReadRevision):
            return w, Answer(command.call, w.registry.default_revision)
        if isinstance(command, ReadLiveFence):  # as the publication view's lease_fence
            return w, Answer(command.call, w.registry.lease.fence)
        if isinstance(command, ReadAttempt):  # as the publication view's version
            held = w.registry.versions.get(command.version)
            return w, Answer(command.call, "" if held is None else held.attempt_token)
        if isinstance(command, ViewPlacement):
            return w, Answer(command.call, w.registry.placements[(command.version, command.engine)].state)
        if isinstance(command, Rehydrate):
            return self._rehydrate(w, command)
        if isinstance(command, ViewPending):  # the executor's answer: every version, with the store's say
            return w, Answer(command.call, tuple(PendingAttempt(k, v.state, v.attempt_token, v.lora_name,
                                                                k not in w.unstored)
                                                 for k, v in sorted(w.registry.versions.items())))
        if isinstance(command, TakeLease):
            registry, result, _ = self._step(w.registry, AcquireLease(HOLDER, 10.0))
            outcome = Refusal(command.call, str(result.reason)) if isinstance(result, Rejected) else Answer(
                command.call, result)
            return attrs.evolve(w, registry=registry), outcome
        if isinstance(command, SettleAttempt):
            return self._settle(w, command)
        if isinstance(command, RunStage):
            return self._run_stage(w, command)
        if isinstance(command, WaitStored):  # the store's write, started beside the staging
            failed = w.driver.version in w.unstored
            return w, Refusal(command.call, "STORE_FAILED") if failed else Answer(command.call)
        if isinstance(command, ReadIncarnation):
            return w, Answer(command.call, w.engines[engine_index(command.engine)].incarnation)
        if isinstance(command, (AbortGeneration, LocalCleanup)):
            return w, Answer(command.call)  # an abort of an ended or unknown request is harmless
        if isinstance(command, SendGeneration):  # the first engine the request may go to runs it to its end
            engine_name = sorted(command.engines)[0]
            i = engine_index(engine_name)
            engine, result, _ = self._engine_step(w.engines[i], AcquireRequest(command.lora_name))
            if isinstance(result, Rejected):
                return w, Refusal(command.call, str(result.reason), origin=engine_name)
            engine, _, _ = self._engine_step(engine, ReleaseRequest(command.lora_name))
            return attrs.evolve(w, engines=(*w.engines[:i], engine, *w.engines[i + 1:])), Answer(command.call, "ok")
        i = engine_index(command.engine)
        engine = w.engines[i]
        if isinstance(command, StageEngine):
            order = w.driver.engines[command.engine].order
            name, token, inc = order.lora_name, order.attempt_token, order.incarnation
            event: Any = {"begin": lambda: BeginStaging(name, token, inc, order.digest, w.driver.bucket_count),
                          "bucket": lambda: ReceiveBucket(name, token, inc, command.index),
                          "end": lambda: EndStaging(name, token, inc, command.engine not in w.bad_manifests)
                          }[command.call.op]()
            engine, result, w = self._carried_out(w, i, *self._engine_step(engine, event))
            if isinstance(result, Rejected):
                outcome: Any = Refusal(command.call, str(result.reason))
            else:
                outcome = Answer(command.call, Receipt(engine.incarnation, order.digest)
                                 if command.call.op == "end" else None)
        elif isinstance(command, CleanupEngine):
            engine, result, w = self._carried_out(
                w, i, *self._engine_step(engine, CleanupAttempt(command.lora_name, command.attempt_token)))
            rejected = isinstance(result, Rejected)
            outcome = Refusal(command.call, str(result.reason)) if rejected else Answer(command.call)
        else:
            assert isinstance(command, ReclaimEngine)
            engine, result, w = self._carried_out(
                w, i, *self._engine_step(engine, ReclaimAdapter(command.lora_name, command.reclaim_id)))
            if isinstance(result, Rejected):
                outcome = Refusal(command.call, str(result.reason))
            else:
                adapter = engine.adapters.get(command.lora_name)
                if adapter is not None and adapter.state is AdapterState.UNREGISTERED:
                    engine, _, w = self._carried_out(
                        w, i, *self._engine_step(engine, FinishUnload(command.lora_name, command.reclaim_id)))
                adapter = engine.adapters.get(command.lora_name)
                outcome = Answer(command.call, adapter is not None and adapter.state is AdapterState.UNLOADED)
        engines = (*w.engines[:i], engine, *w.engines[i + 1:])
        return attrs.evolve(w, engines=engines), outcome

    def _rehydrate(self, w: World, command: Rehydrate) -> tuple[World, Any]:
        """The stage driver a rehydrate runs, as one step (its own rows are checked by the stage scenarios):
        begin, the one bucket and end on the engine, PREPARED and READY recorded; the first refusal ends it there,
        keeping what happened before it, as a failed staging does."""
        o = command.order
        i = engine_index(o.engine)
        engine, registry = w.engines[i], w.registry
        steps: tuple[tuple[str, Any], ...] = (
            ("engine", BeginStaging(o.lora_name, o.attempt_token, o.incarnation, o.digest, 1)),
            ("registry", RecordPrepared(o.version, o.attempt_token, o.engine, o.incarnation, o.digest)),
            ("engine", ReceiveBucket(o.lora_name, o.attempt_token, o.incarnation, 0)),
            ("engine", EndStaging(o.lora_name, o.attempt_token, o.incarnation, o.engine not in w.bad_manifests)),
            ("registry", RecordReady(o.version, o.attempt_token, o.engine, o.incarnation, o.digest)))
        outcome: Any = Answer(command.call, True)
        for party, event in steps:
            if party == "engine":
                after, result, w = self._carried_out(w, i, *self._engine_step(engine, event))
            else:
                after, result, _ = self._step(registry, event)
            if isinstance(result, Rejected):
                outcome = Refusal(command.call, str(result.reason))
                break
            engine, registry = (after, registry) if party == "engine" else (engine, after)
        return attrs.evolve(w, engines=(*w.engines[:i], engine, *w.engines[i + 1:]), registry=registry), outcome

    def _reserve(self, w: World) -> tuple[World, Any, tuple[Any, ...]]:
        d = w.driver
        registry, result, effects = self._step(w.registry, Reserve(d.version, DIGESTS[d.version], d.fence))
        return attrs.evolve(w, registry=registry), result, effects

    def _run_stage(self, w: World, command: RunStage) -> tuple[World, Any]:
        """The stage driver a publication runs, as one step (its own rows are checked by the stage scenarios): the
        reserve, then on every engine its answer names begin, the one bucket and end, PREPARED and READY recorded
        (as a rehydrate does); answered with the outcome the stage driver would report."""
        w, result, effects = self._reserve(w)
        if isinstance(result, Rejected):
            return w, Answer(command.call, StageResult(DriverOutcome.REJECTED, ""))
        token = result.attempt_token
        if result.state is not VersionState.LOADING:
            return w, Answer(command.call, StageResult(DriverOutcome.REPLAYED, token))
        failed = result.lora_name != w.driver.lora_name
        for order in () if failed else (e for e in effects if isinstance(e, StageOnEngine)):
            w, staged = self._rehydrate(w, Rehydrate(Call("rehydrate", order.attempt_token), order))
            failed |= isinstance(staged, Refusal)
        return w, Answer(command.call, StageResult(DriverOutcome.STAGE_FAILED if failed else DriverOutcome.STAGED,
                                                   token))

    def _settle(self, w: World, command: SettleAttempt) -> tuple[World, Any]:
        """The settle driver a recovery runs, as one step (its own rows are checked by the commit and abort
        scenarios): the commit, or after its refusal (or without one) the abort and each cleanup its answer names;
        answered with the outcome the settle driver would report."""
        a, registry, engines = command.attempt, w.registry, list(w.engines)
        if command.commit:
            registry, result, _ = self._step(registry, Commit(a.version, a.attempt_token, registry.default_revision,
                                                              command.fence))
            if not isinstance(result, Rejected):
                return attrs.evolve(w, registry=registry), Answer(command.call, DriverOutcome.COMMITTED)
        registry, result, effects = self._step(registry, Abort(a.version, a.attempt_token))
        if not isinstance(result, Rejected):
            for cleanup in (e for e in effects if isinstance(e, CleanupOnEngine)):
                i = engine_index(cleanup.engine)
                engines[i], cleaned, w = self._carried_out(w, i, *self._engine_step(
                    engines[i], CleanupAttempt(cleanup.lora_name, cleanup.attempt_token)))
                if not isinstance(cleaned, Rejected):
                    registry, _, _ = self._step(registry, RecordCleaned(a.version, a.attempt_token, cleanup.engine))
        clean = registry.versions[a.version].state is VersionState.FAILED_CLEAN
        return attrs.evolve(w, registry=registry, engines=tuple(engines)), Answer(
            command.call, DriverOutcome.FAILED_CLEAN if clean else DriverOutcome.UNKNOWN)

    def successors(self, w: World) -> Iterator[tuple[str, World]]:
        if not w.started:  # the executor's first input, once (spec/drivers.NOT_POSSIBLE)
            yield "start", attrs.evolve(self._feed(w, Start())[0], started=True)
            return
        b = w.budget
        for index, message in enumerate(w.net):
            if index and w.net[index - 1] == message:
                continue
            rest = w.net[:index] + w.net[index + 1:]
            kind, payload = message
            base = attrs.evolve(w, net=rest)
            if b.breaks and kind == "req" and _breakable(payload):
                broken = ("rep", Refusal(payload.call, BROKEN_PORT))
                yield f"break {payload}", attrs.evolve(base, net=_sorted((*base.net, broken)),
                                                       budget=attrs.evolve(b, breaks=b.breaks - 1))
            if kind == "sglang":  # what SGLang did with an engine's effect, reported after the call that commanded it
                i, outcome = payload  # (a load slower than the `end` that started it): a step of that engine's table
                engine, _, served = self._carried_out(base, i, *self._engine_step(base.engines[i], outcome))
                yield f"sglang E{i} {outcome}", attrs.evolve(
                    served, engines=(*served.engines[:i], engine, *served.engines[i + 1:]))
                continue
            if kind == "rep":
                yield f"deliver {payload}", self._feed(base, payload)[0]
            else:
                served, reply = self._serve(base, payload)
                # Another process's call, or the network's duplicate of ours (the caller reads one answer per
                # call, from its own copy): applied, answered to no one.
                if payload.call.engine == STALE or kind == "dup":
                    yield f"serve {kind} {payload}", served
                    continue
                yield f"serve {payload}", attrs.evolve(served, net=_sorted((*served.net, ("rep", reply))))
                if isinstance(payload, RunStage) and b.drops:  # inside the stage driver: the reserve landed, its
                    # reply lost past its deadline (row reserve.deadline): the driver reports UNKNOWN
                    reserved, _, _ = self._reserve(base)
                    unknown = ("rep", Answer(payload.call, StageResult(DriverOutcome.UNKNOWN, "")))
                    yield f"stage unknown {payload}", attrs.evolve(
                        reserved, net=_sorted((*reserved.net, unknown)), budget=attrs.evolve(b, drops=b.drops - 1))
                if isinstance(payload, SettleAttempt) and b.drops:  # inside the settle driver: its last call's
                    # reply lost past its deadline (it landed): the driver reports UNKNOWN
                    unknown = ("rep", Answer(payload.call, DriverOutcome.UNKNOWN))
                    yield f"settle unknown {payload}", attrs.evolve(
                        served, net=_sorted((*served.net, unknown)), budget=attrs.evolve(b, drops=b.drops - 1))
                if b.drops:
                    spent = attrs.evolve(b, drops=b.drops - 1)
                    # the reply is lost after the call was applied, or the request itself never arrived
                    yield f"lose reply {payload}", attrs.evolve(
                        served, net=_sorted((*served.net, ("rep", Lost(payload.call)))), budget=spent)
                    yield f"lose request {payload}", attrs.evolve(
                        base, net=_sorted((*base.net, ("rep", Lost(payload.call)))), budget=spent)
            # A request delivered twice; inputs are local and never duplicated, nor is running a stage driver or
            # waiting for the store (work in the executor's own process; the stage scenarios duplicate its calls)
            if b.dups and kind == "req" and not isinstance(payload, LOCAL_WORK):
                yield f"dup {message}", attrs.evolve(w, net=_sorted((*w.net, ("dup", payload))),
                                                     budget=attrs.evolve(b, dups=b.dups - 1))
        # A timer that fires puts its Deadline in the driver's inbox (the network here): it may be there
        # already when the reply it was meant to bound arrives, and is then answered by a "late" row.
        quiet = all(kind == "rep" and isinstance(p, Deadline) for kind, p in w.net)  # only timers are left
        for timer in sorted(w.timers):
            fired = attrs.evolve(w, timers=w.timers - {timer}, net=_sorted((*w.net, ("rep", Deadline(timer)))))
            if timer.name == "backoff" or quiet:
                yield f"fire {timer}", fired
            elif b.deadlines:
                yield f"fire early {timer}", attrs.evolve(fired, budget=attrs.evolve(b, deadlines=b.deadlines - 1))
        if w.caller:  # a session's caller asks its next question (earlier ones may still be in flight)
            what, _, rid = w.caller[0].partition(" ")
            inp, subject = CALLER_INPUTS[what](rid)
            asked = w.asked | ({rid} if rid else set())
            fed, _ = self._feed(attrs.evolve(w, caller=w.caller[1:], pending=w.pending | {subject}, asked=asked), inp)
            yield f"ask {w.caller[0]}", fed
        if b.cancels and isinstance(w.driver, SessionState):  # a generation's caller goes away (maybe just after
            for rid in sorted(w.asked):  # its answer came: the executor feeds its Cancel all the same)
                fed, _ = self._feed(attrs.evolve(w, pending=w.pending - {rid},
                                                 budget=attrs.evolve(b, cancels=b.cancels - 1)), Cancel(rid))
                yield f"cancel {rid}", fed
        elif b.cancels and not is_done(w.driver):
            yield "cancel", attrs.evolve(w, net=_sorted((*w.net, ("rep", Cancel()))),
                                         budget=attrs.evolve(b, cancels=b.cancels - 1))
        if b.crashes:  # an engine restarts, and its supervisor reports the new incarnation to the registry
            for i, e in enumerate(names(w)):
                inc = w.engines[i].incarnation + 1
                engine, _, _ = self._engine_step(w.engines[i], EngineStarted(inc))
                registry, _, _ = self._step(w.registry, EngineRestarted(e, inc))
                yield f"restart {e}", attrs.evolve(
                    w, engines=(*w.engines[:i], engine, *w.engines[i + 1:]), registry=registry,
                    requests=tuple(r for r in w.requests if r[0] != i), budget=attrs.evolve(b, crashes=b.crashes - 1))
        for index, (i, lora) in enumerate(w.requests):
            engine, _, _ = self._engine_step(w.engines[i], ReleaseRequest(lora))
            yield f"release E{i} {lora}", attrs.evolve(
                w, engines=(*w.engines[:i], engine, *w.engines[i + 1:]),
                requests=w.requests[:index] + w.requests[index + 1:])

    # ---------------------------------------------------------------- properties

    # ---- probes: what the tables answer, without a change, to a call no driver here makes
    def probe_problems(self, state: Any) -> tuple[str, ...]:
        """Every late, duplicated, stale, forged or other-epoch call the table answers without a change
        (`lifecycle.enabled`'s faulty candidates), sent to one registry or engine state the worlds reached: each is
        a self-loop, so only its row's answer and effects are checked (the step
        properties) and its row counted (`core_probed`); under a mutant table, one that changes the state, or that no
        row answers, is a problem too. Once per distinct state. A call whose reference row changes the state is no
        probe: such a call is an honest one, which only a driver decides to send."""
        if not self.probes:
            return ()
        got = self._probed.get(state)
        if got is None:
            rows: dict[str, int] = {}
            got = self._probed[state] = tuple(_probe(state, self.core, rows)), tuple(rows)
        problems, rows_fired = got
        for row in rows_fired:  # (counted once per distinct state a check reaches)
            self.core_probed[row] = self.core_probed.get(row, 0) + 1
        return problems

    def problems(self, w: World, start: World) -> list[str]:
        out = [*_invariant_problems(w.registry, violated, "registry"),
               *(p for e in w.engines for p in _invariant_problems(e, engine_violated, "engine"))]
        out += [p for state in (w.registry, *w.engines) for p in self.probe_problems(state)]
        reg = w.registry
        for v, version in reg.versions.items():
            if version.state not in COMMITTED:
                continue
            for (pv, e), placement in reg.placements.items():
                engine = w.engines[engine_index(e)]
                # (a READY of an incarnation the engine no longer runs counts for nothing: a restart not adopted yet)
                if pv != v or placement.state is not PlacementState.READY or (
                        placement.incarnation != engine.incarnation):
                    continue
                adapter = engine.adapters.get(version.lora_name)
                if adapter is None or adapter.state is not AdapterState.READY:
                    out.append(f"committed_stays_loaded: {v.version_id} is {version.state} and READY on {e} in "
                               f"the registry, but {'absent' if adapter is None else adapter.state} there")
        if isinstance(w.driver, SettleState) and not w.driver.commit and any(
                kind == "req" and isinstance(c, Submit) and isinstance(c.event, Commit) and c.call.engine != STALE
                for kind, c in w.net):
            out.append("abort_never_commits: a settle started to abort (staging failed) sent a commit")
        d = w.driver
        waiting = {"CLEANING": Timer("abort"), "RECLAIMING": Timer("claim"), "ADOPTING": Timer("incarnation"),
                   "REHYDRATING": Timer("restarted")}.get(d.phase)
        if waiting is not None and waiting in w.timers:
            out.append(f"timers_follow_calls: {d.phase} still has the {waiting.name} timer armed")
        in_flight = {m.call.op for kind, m in w.net if kind in ("req", "rep") and getattr(m, "call", None) is not None
                     and m.call.engine == ""}
        for timer in w.timers:
            if not timer.engine and timer.name in TIMED_CALLS and not TIMED_CALLS[timer.name] & in_flight:
                out.append(f"timers_follow_calls: {d.phase} has the {timer.name} timer armed and none of "
                           f"{'/'.join(sorted(TIMED_CALLS[timer.name]))} in flight")
        for name, sub in subs_of(d).items():
            if sub.phase in SETTLES[MACHINE_OF[type(sub)]] and any(t.engine == name for t in w.timers):
                out.append(f"timers_follow_calls: {name} is {sub.phase} with a timer still armed")
        for name, machine in [] if is_done(d) else [("", d), *subs_of(d).items()]:  # done: its loop has ended
            if machine.phase in TERMINAL[MACHINE_OF[type(machine)]]:
                continue
            calls = {m.call.op for kind, m in w.net
                     if kind in ("req", "rep") and getattr(m, "call", None) is not None and m.call.engine == name}
            if isinstance(machine, SessionState) and machine.phase not in ("BINDING", "BIND_UNKNOWN"):
                calls.discard("bind")  # a bind sent before the finish lands late (finish.binding): not waited on
            if isinstance(machine, SettleState) and machine.phase != "VIEWING":
                calls.discard("revision")  # a read the deadline gave up on lands late (revision.deadline): harmless
            awaited = self._awaited(machine)
            if awaited and not awaited & calls:
                out.append(f"waits_on_a_call: {name or 'the coordinator'} is {machine.phase}, waiting for "
                           f"{'/'.join(sorted(awaited))}, with none in flight")
            if name and self._retries_on_backoff(machine) and Timer("backoff", name) not in w.timers and (
                    ("rep", Deadline(Timer("backoff", name))) not in w.net):
                out.append(f"waits_on_a_call: {name} is {machine.phase}, waiting to retry, with no retry pause "
                           f"armed (only its deadline)")
            bounded = any(t.engine == name for t in w.timers) or any(
                kind == "rep" and isinstance(m, Deadline) and m.timer.engine == name for kind, m in w.net)
            told = any(r.outcome is DriverOutcome.UNKNOWN and r.subject == "finish" for r in w.reports)
            if isinstance(machine, SessionState) and machine.phase in ("CLOSING", "RELEASING") and told:
                bounded = True  # its caller was told UNKNOWN; the same call is retried until answered
            if calls and not bounded and (MACHINE_OF[type(machine)], machine.phase) not in UNBOUNDED_BY_DESIGN:
                out.append(f"calls_under_a_deadline: {name or 'the coordinator'} is {machine.phase} with a call in "
                           f"flight and no timer armed")
        target = getattr(w.driver, "version", None)
        out += self._stage_problems(w, start)
        out += _session_problems(w, start)
        out += _supervise_problems(w, start)
        out += _recover_problems(w, start)
        out += _lease_problems(w)
        out += _publish_problems(w, start)
        for name, sub in subs_of(d).items():
            if isinstance(sub, CleanupEngineState) and sub.phase == "CLEANED":
                placement = reg.placements.get((target, name))
                if _superseded(w, placement, sub.order.attempt_token):
                    continue  # a newer attempt of the version owns the placement now (crowd.zombie_stage)
                if placement is None or placement.state is not PlacementState.CLEANED:
                    out.append(f"sub_state_is_true: {name} counted CLEANED, the registry has "
                               f"{None if placement is None else placement.state}")
            if isinstance(sub, ReclaimEngineState) and sub.phase == "CONFIRMED" and (
                    name not in reg.versions[target].reclaim_confirmed):
                out.append(f"sub_state_is_true: {name} counted CONFIRMED, the registry has no confirm from it")
        out += list(w.flags)
        state = reg.versions[target].state if target in reg.versions else None
        if d.phase == "COMMIT_UNRESOLVED" and not w.reports:
            out.append("unresolved_is_reported: the commit's outcome is being resolved, and its caller was not told")
        if isinstance(d, ReclaimState) and any(e.reclaimed for e in d.engines.values()) and any(
                r.outcome is DriverOutcome.PENDING for r in w.reports):
            out.append("reports_what_it_knows: a reclaim told RECLAIMED by the registry reported PENDING")
        moved_on = _moved_on(w, d)
        if isinstance(d, StageState) and not moved_on and d.version in reg.versions and any(
                r.outcome in (DriverOutcome.STAGE_FAILED, DriverOutcome.REPLAYED) for r in w.reports) and (
                d.attempt_token != reg.versions[d.version].attempt_token):
            out.append(f"stage_names_its_attempt: reported with attempt {d.attempt_token!r}, the registry's is "
                       f"{reg.versions[d.version].attempt_token!r} (the caller aborts or reports that one)")
        resolves = isinstance(d, SettleState) and d.commit  # a commit reported unknown is resolved (and cleaned)
        keeps = d.phase in ("HOLDING", "RENEWING")  # a lease keeper reports LEASED, then renews until it is stopped
        if not is_done(d) and w.reports and not isinstance(d, SessionState) and not (
                keeps and [r.outcome for r in w.reports] == [DriverOutcome.LEASED]) and (not resolves or any(
                r.outcome is not DriverOutcome.UNKNOWN for r in w.reports)):
            out.append(f"only_unknown_before_the_end: reported {w.reports[0].outcome} while still {d.phase}")
        for report in w.reports:
            if report.outcome not in OUTCOMES[type(d)]:
                out.append(f"reports_fit_the_work: a {type(d).__name__} reported {report.outcome}")
            if report.outcome is DriverOutcome.STAGE_FAILED and _fault_free(w, start) and not (
                    w.bad_probes or w.bad_manifests or w.bad_name):
                out.append("stage_fails_only_by_a_fault: STAGE_FAILED reported although nothing was lost, fired "
                           "early, cancelled or restarted, every manifest verifies and every probe matches")
            wanted = {DriverOutcome.COMMITTED: COMMITTED, DriverOutcome.FAILED_CLEAN: {VersionState.FAILED_CLEAN},
                      DriverOutcome.RECLAIMED: {VersionState.RECLAIMED},
                      # claimed, some engine not confirmed (its last confirm may have landed, unanswered)
                      DriverOutcome.PENDING: {VersionState.RECLAIMING, VersionState.RECLAIMED},
                      DriverOutcome.REPLAYED: set(VersionState) - {VersionState.LOADING}}.get(report.outcome)
            if wanted is not None and state not in wanted and not moved_on:
                out.append(f"report_is_true: reported {report.outcome} while the registry has {state}")
            if report.outcome is DriverOutcome.UNKNOWN and _fault_free(w, start):
                out.append("unknown_needs_a_fault: UNKNOWN reported although no message was lost, no deadline "
                           "fired early, nothing was cancelled or restarted")
            if report.outcome is DriverOutcome.UNKNOWN and isinstance(d, ReclaimState) and d.reclaim_id is not None:
                out.append("unknown_means_claim_unanswered: a reclaim whose claim was answered reported UNKNOWN")
            if report.outcome is DriverOutcome.REJECTED and isinstance(d, ReclaimState) and d.engines:
                out.append("rejected_changes_nothing: a REJECTED reclaim sent calls to engines")
        return out


    def _stage_problems(self, w: World, start: World) -> list[str]:
        """The staging properties: the barrier, calls in the engine's order, READY only after a matching probe
        and only when true, a failed engine says why, STAGED only when the registry has READY from every engine."""
        d, out = w.driver, []
        if not isinstance(d, StageState):
            return out
        reg = w.registry
        restarted = w.budget.crashes != start.budget.crashes  # a restart resets the engine and its placement
        for kind, c in w.net:
            if kind != "req" or restarted:
                continue
            if isinstance(c, StageEngine) and c.call.op == "bucket" and c.index > 0:
                behind = [e for e in names(w) if _received(w, e, d) < c.index]
                if behind:
                    out.append(f"bucket_barrier: bucket {c.index} sent to {c.engine} before bucket {c.index - 1} "
                               f"landed on {behind}")
            if isinstance(c, StageEngine) and c.call.op in ("bucket", "end") and not _prepared(w, d, c.engine):
                out.append(f"staged_in_order: {c.call.op} sent to {c.engine} before its PREPARED was recorded")
            if isinstance(c, Submit) and isinstance(c.event, RecordReady) and c.event.engine in w.bad_probes:
                out.append(f"ready_needs_the_probe: READY sent for {c.event.engine}, whose probe differs")
        for name, sub in d.engines.items():
            if sub.phase == "FAILED" and sub.failure is None:
                out.append(f"failure_is_recorded: {name} FAILED without saying why (the caller's error reads it)")
            if sub.phase != "FAILED" and sub.failure is not None:
                out.append(f"failure_is_recorded: {name} is {sub.phase} and records a failure ({sub.failure})")
        if restarted:  # what was counted READY before the restart was true then; the restart moved it since
            return out
        version = reg.versions.get(d.version)
        if w.crowded and version is not None and (version.state in ABORTED_STATES or _moved_on(w, d)):
            return out  # what it counted and reported was true; another process has aborted the attempt since
        for name, sub in d.engines.items():
            placement = reg.placements.get((d.version, name))
            if sub.phase == "READY" and (placement is None or placement.state is not PlacementState.READY):
                out.append(f"sub_state_is_true: {name} counted READY, the registry has "
                           f"{None if placement is None else placement.state}")
        for report in w.reports:
            if report.outcome is DriverOutcome.STAGED and not all(
                    (p := reg.placements.get((d.version, e))) is not None and p.state is PlacementState.READY
                    for e in d.engines):
                out.append("report_is_true: STAGED reported while some engine is not READY in the registry")
        return out


def _confirm_and_commit_flags(w: World, commands: tuple[Any, ...]) -> list[str]:
    """A reclaim confirms only what its engine unloaded; a commit expects a revision the registry has had (the one
    its settle driver read), never one made up."""
    out = []
    for c in commands:
        if isinstance(c, Submit) and isinstance(c.event, ConfirmReclaim):
            name = w.registry.versions[c.event.version].lora_name
            adapter = w.engines[engine_index(c.event.engine)].adapters.get(name)
            if adapter is not None and adapter.state is not AdapterState.UNLOADED:
                out.append(f"confirms_only_unloaded: {c.event.engine}'s unload confirmed while it is {adapter.state}")
        if isinstance(c, Submit) and isinstance(c.event, Commit) and not (
                0 <= c.event.expected_default_revision <= w.registry.default_revision):
            out.append(f"commits_a_read_revision: a commit expects revision {c.event.expected_default_revision}, "
                       f"the registry's is {w.registry.default_revision}")
    return out


def _session_flags(before: Any, after: SessionState, commands: tuple[Any, ...], registry: Any) -> list[str]:
    """What a session's step sent, judged against the state it was in (checked with the world's)."""
    out = []
    for rid, g in after.requests.items():  # RESOLVED says its caller's Resolve ended an unknown outcome
        was = before.requests.get(rid)
        if g.phase == "RESOLVED" and (was is None or was.phase not in ("RESOLVED", "UNKNOWN", "RESOLVING")):
            out.append(f"sub_state_is_true: {rid} went {None if was is None else was.phase} -> RESOLVED, no "
                       "resolution of an unknown outcome")
        if g.phase == "ABORTED" and (was is None or was.phase not in ("ABORTED", "ABORTING", "RESOLVING")):
            out.append(f"sub_state_is_true: {rid} went {None if was is None else was.phase} -> ABORTED, no abort "
                       "sent to it")
    for c in commands:
        if isinstance(c, LocalCleanup) and not after.cleanup:
            out.append("cleanup_only_when_asked: the caller's local cleanup run for a session that asked for none")
        if isinstance(c, Report) and c.outcome is DriverOutcome.GENERATED and before.phase != "BOUND":
            out.append(f"generated_only_while_open: {c.subject}'s response told GENERATED while the session is "
                       f"{before.phase} (a response after the close began is DROPPED)")
        if isinstance(c, (ViewDispatch, SendGeneration)) and after.phase != "BOUND":
            out.append(f"nothing_after_finish: {type(c).__name__} for {c.call.engine} while {after.phase}")
        if isinstance(c, SendGeneration):
            was = before.requests.get(c.call.engine)
            if was is None or was.phase not in ("VIEWING", "SENDING"):
                out.append(f"never_resent: {c.call.engine} sent from {None if was is None else was.phase}")
            if c.lora_name != after.lora_name or not c.engines:
                out.append(f"carries_the_binding: {c.call.engine} sent as {c.lora_name!r} to {sorted(c.engines)}")
        if isinstance(c, ViewDispatch) and any(g.phase in ("UNKNOWN", "RESOLVING") for g in before.requests.values()):
            out.append(f"unknown_blocks_the_next: {c.call.engine} opened while an earlier outcome is unknown")
        if isinstance(c, Submit) and isinstance(c.event, CloseAndRelease) and any(
                g.phase not in TERMINAL[MACHINE_OF[type(g)]] for g in after.requests.values()):
            out.append("close_after_drain: close_and_release sent while a generation is live")
        if isinstance(c, Report) and c.subject == "finish" and c.outcome is DriverOutcome.REJECTED and (
                before.phase == "CLOSED") and session_state(registry, after.session).name in ("CLOSED", "COMPACTED"):
            out.append("report_is_true: a finish of a session this driver closed was told REJECTED")
        # (the registry's refusal says the same where another process began the close: session_shared)
        closing = session_state(registry, after.session).name in ("FINALIZING", "CLOSED", "COMPACTED", "OTHER_EPOCH")
        if isinstance(c, Report) and c.reason == SessionRefusal.SESSION_CLOSED and after.phase in (
                "OPEN", "BINDING", "BIND_UNKNOWN", "BOUND") and not closing:
            out.append(f"report_is_true: {c.subject} told SESSION_CLOSED while the session is {after.phase}, and "
                       "open in the registry")
        if isinstance(c, Submit) and isinstance(c.event, BindFirst) and after.phase not in ("BINDING", "BIND_UNKNOWN"):
            out.append(f"bind_only_while_binding: bind sent in {after.phase}")
    return out


def _session_problems(w: World, start: World) -> list[str]:
    d, out, reg = w.driver, [], w.registry
    if not isinstance(d, SessionState):
        return out
    record = reg.sessions.get(d.session)
    restarted = w.budget.crashes != start.budget.crashes
    live = session_state(reg, d.session).name in ("BOUND", "FINALIZING")  # a tombstone drops the binding
    adopted = {e for e in names(w) if w.crowded and reg.incarnations[e] != start.registry.incarnations[e]}
    for kind, c in w.net:
        if kind == "req" and isinstance(c, SendGeneration) and live:
            bound = None if record is None else record.version
            if bound is None or c.lora_name != reg.versions[bound].lora_name:
                out.append(f"carries_the_binding: {c.call.engine} carries {c.lora_name!r}, the registry bound "
                           f"{bound}")
            # Not after a restart; and in a crowd (model_checks/crowd.py) not for an engine whose new incarnation
            # another driver (its supervisor) had adopted since the start: the adoption may land between the view
            # and the send, and then the send goes where its view answered (view.servable), the engine that no
            # longer holds the version refuses it (its table), and the session re-dispatches (generate.redispatch).
            elif not restarted and not (c.engines - adopted) <= {e for e in names(w) if servable_on(reg, bound, e)}:
                out.append(f"dispatch_by_the_table: {c.call.engine} sent to {sorted(c.engines)}, not servable there")
    for rid, g in d.requests.items():
        if not g.engines <= set(names(w)) or not g.refused <= g.engines:
            out.append(f"sub_state_is_true: {rid} records engines {sorted(g.engines)} (refused {sorted(g.refused)}): "
                       "not the view's answer")
    if d.phase in ("OPEN", "BINDING", "BIND_UNKNOWN") and any(r.outcome is DriverOutcome.BOUND for r in w.reports):
        out.append(f"report_is_true: BOUND reported, and the session is {d.phase} (it would refuse a generation as "
                   "not bound, or bind again)")
    subjects = {DriverOutcome.BOUND: "bind", DriverOutcome.CLOSED: "finish"}
    for report in w.reports:
        if subjects.get(report.outcome, report.subject) != report.subject:
            out.append(f"told_its_own_outcome: {report.subject} told {report.outcome}")
        if report.outcome is DriverOutcome.BOUND and live and record is not None and (
                record.version != d.version or d.version is None):
            out.append(f"report_is_true: BOUND to {d.version} reported, the registry has "
                       f"{None if record is None else record.version}")
        if report.outcome is DriverOutcome.CLOSED and (record is not None and record.state.name != "CLOSED"):
            out.append(f"report_is_true: CLOSED reported, the registry's session is {record.state}")
        if report.outcome is DriverOutcome.DROPPED and (
                (g := d.requests.get(report.subject)) is None or not g.engines):
            out.append(f"report_is_true: {report.subject} DROPPED (a response not delivered), it was never sent")
        if report.outcome is DriverOutcome.GENERATED and (
                (g := d.requests.get(report.subject)) is None or g.phase != "DONE"):
            out.append(f"report_is_true: {report.subject} GENERATED, its generation is "
                       f"{None if g is None else g.phase}")
    return out


def _supervise_flags(w: World, after: SuperviseState, commands: tuple[Any, ...]) -> list[str]:
    """What a supervisor's step sent, judged against the world it was sent in."""
    out = []
    for c in commands:
        if not isinstance(c, Rehydrate):
            continue
        o, sub = c.order, after.rehydrates.get(c.order.attempt_token)
        if o.engine != after.engine or o.attempt_token in after.own or sub is None or sub.order != o:
            out.append(f"rehydrates_what_is_owed: {o.version} on {o.engine} under {o.attempt_token!r} is not one of "
                       f"the answer's stagings for {after.engine} outside its own")
        placement = w.registry.placements.get((o.version, o.engine))
        if placement is not None and placement.state is PlacementState.READY:
            out.append(f"never_restages_ready: {o.version} rehydrated on {o.engine}, READY there already")
    return out


def _supervise_problems(w: World, start: World) -> list[str]:
    d, out, reg = w.driver, [], w.registry
    if not isinstance(d, SuperviseState):
        return out
    restarted = w.budget.crashes != start.budget.crashes  # a restart after the start moves what was true
    faulted = not _fault_free(w, start)
    for r in d.rehydrates.values():
        placement = reg.placements.get((r.order.version, r.order.engine))
        if r.phase == "READY" and not restarted and (placement is None or placement.state is not PlacementState.READY):
            out.append(f"sub_state_is_true: {r.order.version} counted READY on {d.engine}, the registry has "
                       f"{None if placement is None else placement.state}")
        if r.phase == "FAILED" and not faulted:
            out.append(f"rehydrate_fails_only_by_a_fault: {r.order.version} FAILED ({r.failure}) with no fault")
        if r.phase == "FAILED" and r.failure is None:
            out.append(f"failure_is_recorded: {r.order.version} FAILED without saying why")
    for report in w.reports:
        if report.outcome is DriverOutcome.REJECTED and not faulted:
            out.append("rejected_needs_a_fault: REJECTED reported although nothing was lost, fired early or restarted")
        if report.outcome is not DriverOutcome.RECONCILED:
            continue
        answer = w.journal.get(restarted_key(d.engine, d.incarnation))
        owed = {e for e in answer.effects if isinstance(e, StageOnEngine)} if answer is not None else None
        taken = {r.order for r in d.rehydrates.values()}
        left = {e for e in d.left if isinstance(e, StageOnEngine)}
        if owed is None or owed != taken | left or taken & left or any(e.attempt_token not in d.own for e in left):
            out.append(f"report_is_true: RECONCILED, but the answer's stagings {owed} are not rehydrated {taken} "
                       f"and left to its own publication {left} exactly")
        if answer is not None and set(answer.effects) - owed != set(d.left) - left:
            out.append("report_is_true: RECONCILED without leaving every other effect to its own driver")
        if any(r.phase not in TERMINAL[MACHINE_OF[type(r)]] for r in d.rehydrates.values()):
            out.append("report_is_true: RECONCILED while a rehydrate is still running")
        if not restarted and not any(r.phase == "FAILED" for r in d.rehydrates.values()) and any(
                (p := reg.placements.get((o.version, d.engine))) is None or p.state is not PlacementState.READY
                for o in taken):
            out.append("report_is_true: RECONCILED with nothing failed, but a version owed is not READY there")
    return out


def _recover_flags(w: World, commands: tuple[Any, ...]) -> list[str]:
    """What a recovery's step sent, judged against the registry it was sent to."""
    out = []
    reg = w.registry
    for c in commands:
        if not isinstance(c, SettleAttempt):
            continue
        version = reg.versions.get(c.attempt.version)
        state = None if version is None else version.state
        if state not in (VersionState.LOADING, VersionState.ABORTED):
            out.append(f"settles_only_what_is_pending: {c.attempt.version} settled while {state}")
        if c.commit and (c.attempt.version in w.unstored or state is not VersionState.LOADING):
            out.append(f"commits_only_what_is_stored: {c.attempt.version} committed, its bytes "
                       f"{'missing from' if c.attempt.version in w.unstored else 'in'} the store, while {state}")
        if reg.lease.holder != HOLDER or reg.lease.fence != c.fence:
            out.append(f"settles_under_the_lease: {c.attempt.version} settled, the lease is {reg.lease}")
    return out


def _recover_problems(w: World, start: World) -> list[str]:
    d, out, reg = w.driver, [], w.registry
    if not isinstance(d, RecoverState):
        return out
    for v in w.unstored:
        if reg.versions[v].state in COMMITTED:
            out.append(f"never_commits_the_unstored: {v} is {reg.versions[v].state}, its bytes are not in the store")
    for report in w.reports:
        pending = [k for k, v in reg.versions.items() if v.state in (VersionState.LOADING, VersionState.ABORTED)]
        if report.outcome is DriverOutcome.RECOVERED and (pending or (d.attempt is not None and d.outcome not in (
                DriverOutcome.COMMITTED, DriverOutcome.FAILED_CLEAN))):
            out.append(f"report_is_true: RECOVERED with {pending} pending, the settle's outcome {d.outcome}")
        leased = start.registry.lease.holder == RIVAL
        if report.outcome is DriverOutcome.REJECTED and _fault_free(w, start) and not leased:
            out.append("rejected_needs_a_fault: REJECTED although nothing failed and nobody else holds the lease")
    restarted = w.budget.crashes != start.budget.crashes
    if d.attempt is not None and d.outcome not in (None, DriverOutcome.UNKNOWN) and not restarted:
        state = reg.versions[d.attempt.version].state
        wanted = COMMITTED if d.outcome is DriverOutcome.COMMITTED else {VersionState.FAILED_CLEAN}
        if state not in wanted:
            out.append(f"report_is_true: settled {d.outcome}, the registry has {state}")
        if d.outcome is DriverOutcome.FAILED_CLEAN and committable(d.attempt) and _fault_free(w, start):
            out.append("report_is_true: a stored attempt READY everywhere was aborted with no fault")
    return out


def _publish_flags(w: World, before: PublishState, after: PublishState, commands: tuple[Any, ...],
                   inp: Any) -> list[str]:
    """What a publication's step sent: a commit only of a staging that succeeded, and only on the store's answer
    that it holds the bytes (a write that failed or timed out may have left nothing to rehydrate from); and what it
    noted: the settle's answer, as its outcome, and nothing else (its executor reads the outcome from the state)."""
    out = []
    settled = before.phase == "SETTLING" and isinstance(inp, Answer) and inp.call.op == "settle"
    if after.outcome is not (inp.value if settled else before.outcome):
        out.append(f"notes_its_answers: the settle's outcome noted went {before.outcome} -> {after.outcome} on {inp}")
    for c in commands:
        if isinstance(c, SettleAttempt) and c.commit and after.stage is not DriverOutcome.STAGED:
            out.append(f"commits_only_what_is_staged: a commit sent after the staging's {after.stage}")
        if isinstance(c, SettleAttempt) and c.commit and not (isinstance(inp, Answer) and inp.call.op == "store"):
            out.append(f"commits_only_what_is_stored: a commit sent on {inp}, not on the store's answer")
        if isinstance(c, SettleAttempt) and c.attempt.attempt_token != after.attempt_token:
            out.append(f"settles_its_own_attempt: {c.attempt.attempt_token!r}, the staging's was "
                       f"{after.attempt_token!r}")
    return out


def _publish_problems(w: World, start: World) -> list[str]:
    """A publication commits nothing whose staging failed or whose bytes the store lacks, and fails its staging only
    by a fault or a corrupted bucket."""
    d, out, reg = w.driver, [], w.registry
    if not isinstance(d, PublishState):
        return out
    state = reg.versions[d.version].state if d.version in reg.versions else None
    if d.version in w.unstored and state in COMMITTED:
        out.append(f"never_commits_the_unstored: {d.version} is {state}, its bytes are not in the store")
    if d.stage is DriverOutcome.STAGE_FAILED and state in COMMITTED and start.registry.versions.get(d.version) is None:
        out.append(f"never_commits_a_failed_staging: {d.version} is {state} after its staging failed")
    for report in w.reports:  # the outcome reported is the one the state notes (the staging's, or the settle's)
        if report.outcome in (DriverOutcome.REJECTED, DriverOutcome.REPLAYED) and d.stage is not report.outcome:
            out.append(f"report_is_true: {report.outcome} reported, the staging's outcome noted is {d.stage}")
        if report.outcome in (DriverOutcome.COMMITTED, DriverOutcome.FAILED_CLEAN) and d.outcome is not report.outcome:
            out.append(f"report_is_true: {report.outcome} reported, the settle's outcome noted is {d.outcome}")
    if d.stage is DriverOutcome.STAGE_FAILED and _fault_free(w, start) and not w.bad_manifests:
        out.append("stage_fails_only_by_a_fault: the staging failed although nothing was lost and every manifest "
                   "verifies")
    return out


def _lease_problems(w: World) -> list[str]:
    """A lease keeper renews only the fence it was granted, reports LEASED only under a fence the registry granted,
    and learns it lost the lease (a renewal refused) only once that fence is dead in the registry (fences only grow,
    so it stays dead)."""
    d, out, lease = w.driver, [], w.registry.lease
    if not isinstance(d, LeaseState):
        return out
    for kind, c in w.net:
        if kind == "req" and isinstance(c, Submit) and isinstance(c.event, RenewLease) and c.call.engine != STALE and (
                d.fence == NO_FENCE or c.event != RenewLease(d.holder, d.fence)):
            out.append(f"renews_its_own_fence: {c.event} sent by a keeper granted fence {d.fence}")
    if any(r.outcome is DriverOutcome.LEASED for r in w.reports) and not NO_FENCE < d.fence <= lease.fence:
        out.append(f"report_is_true: LEASED under fence {d.fence}; the registry granted fences up to {lease.fence}")
    if d.lost and d.fence == NO_FENCE:
        out.append("lost_only_when_lost: a keeper never granted the lease counts it lost")
    for kind, c in w.net:  # (another party's take-over, in flight from the start, is sent as STALE)
        takes_over = isinstance(c, Submit) and c.call.engine != STALE and isinstance(c.event, TakeOverLease)
        if kind == "req" and takes_over and not d.take_over:
            out.append(f"takes_over_only_when_told: {c} sent by a keeper told to acquire, not to take over")
        if kind == "req" and takes_over and c.event.fence != d.live:
            out.append(f"takes_over_what_it_read: {c.event} sent, the fence read was {d.live!r}")
    if not isinstance(d.live, int) or d.live > lease.fence:
        out.append(f"takes_over_what_it_read: live fence {d.live!r} noted (take-over: {d.take_over}; the registry "
                   f"granted fences up to {lease.fence})")
    if d.lost and (lease.holder, lease.fence) == (d.holder, d.fence):
        out.append(f"lost_only_when_lost: a renewal was refused, the registry has fence {d.fence} live for {d.holder}")
    return out


def _moved_on(w: World, d: Any) -> bool:
    """Another process reserved the driver's version again since the driver's attempt (a crowd only: in a one-driver
    world the version's attempt changes only by the driver's own reserve): what the driver reports is true of its
    own attempt, which the registry's version no longer names."""
    token = getattr(d, "attempt_token", "")
    version = w.registry.versions.get(getattr(d, "version", None))
    return w.crowded and bool(token) and version is not None and version.attempt_token != token


def _superseded(w: World, placement: Any, token: str) -> bool:
    """In a crowd, the registry's placement belongs to another attempt than `token`, the one the driver works for:
    a newer one, reserved by another process after this attempt ended (the driver is a zombie's,
    crowd.zombie_stage). In a one-driver world nothing else re-places the version: never."""
    return w.crowded and bool(token) and placement is not None and placement.attempt_token not in (None, token)


def _received(w: World, engine: str, d: StageState) -> int:
    adapter = w.engines[engine_index(engine)].adapters.get(d.engines[engine].order.lora_name)
    if adapter is None:
        return 0
    return adapter.bucket_count if adapter.state is AdapterState.READY else adapter.buckets_received


def _prepared(w: World, d: StageState, engine: str) -> bool:
    """The driver's PREPARED for `engine` was recorded (in a crowd, a placement a newer attempt owns now was past it:
    the driver went on only on its own PREPARED's answer, which the one-driver worlds check against the placement)."""
    placement = w.registry.placements.get((d.version, engine))
    return placement is not None and (placement.state is not PlacementState.BEGUN or
                                      _superseded(w, placement, d.engines[engine].order.attempt_token))


def _fault_free(w: World, start: World) -> bool:
    """No fault was spent, no request held an engine (it may never end), and no other process was calling."""
    spent = attrs.evolve(w.budget, releases=0) != attrs.evolve(start.budget, releases=0)
    return not spent and not start.requests and not start.net and not w.crowded and not start.load_fails \
        and not start.unload_fails


@attrs.frozen
class CheckResult:
    scenario: str
    states: int
    seconds: float
    violation: str | None
    trace: tuple[str, ...]


def search(name: str, start: Any, successors: Callable[[Any], Iterator[tuple[str, Any]]],
           problems: Callable[[Any], list[str]], stuck: Callable[[Any], list[str]], max_states: int = 2_000_000,
           on_state: Callable[[Any], None] | None = None, fair: Callable[[str], bool] | None = None,
           owed: Callable[[Any], frozenset[str]] | None = None) -> CheckResult:
    """Breadth-first over every state reachable from `start` (each handed to `on_state`, if given); stops at the
    first problem. `stuck` names what is wrong with a state where nothing can happen any more (if anything).

    Liveness, when `owed` is given: once every state is explored and none has a problem, the graph's strongly
    connected components are searched for one a weakly fair run can stay in forever (`fair` says which labels are
    fair actions, a fault never is; without it every action is) while something is owed in all of its states
    (fairness.open_forever): a poll or a retry that a fair run never leaves. `stuck` covers the states where nothing
    can happen at all."""
    started = time.monotonic()
    parent: dict[Any, tuple[Any, str]] = {start: (None, "")}
    index: dict[Any, int] = {start: 0}
    states = [start]  # in the order they are explored (breadth first), so edges[i] is states[i]'s
    edges: Edges = []

    def trace(state: Any) -> tuple[str, ...]:
        steps = []
        node = state
        while node is not None:
            prev, label = parent[node]
            if label:
                steps.append(label)
            node = prev
        return tuple(reversed(steps))

    queue = deque([start])
    while queue:
        state = queue.popleft()
        if on_state is not None:
            on_state(state)
        found = problems(state)
        succ = []
        try:
            succ = list(successors(state))
        except Exception as exc:  # a ProtocolError (uncovered pair) or a bug the table let through
            found.append(f"{type(exc).__name__}: {exc}")
        if not succ and not found:
            found = stuck(state)
        if found:
            return CheckResult(name, len(parent), time.monotonic() - started, found[0], trace(state))
        out = []
        for label, nxt in succ:
            if nxt not in parent:
                parent[nxt] = (state, label)
                queue.append(nxt)
                if owed is not None:
                    index[nxt] = len(states)
                    states.append(nxt)
                if len(parent) > max_states:
                    raise RuntimeError(f"{name}: more than {max_states} states")
            if owed is not None:
                out.append((index[nxt], label if fair is None or fair(label) else None))
        edges.append(out)
    if owed is not None:
        for still_owed, scc in open_forever(edges, lambda i: owed(states[i])):
            what = ", ".join(sorted(map(str, still_owed)))
            return CheckResult(name, len(parent), time.monotonic() - started, f"liveness: {what} owed forever in "
                               f"a cycle of {len(scc)} states a weakly fair run can stay in", trace(states[scc[0]]))
    return CheckResult(name, len(parent), time.monotonic() - started, None, ())


# Which actions are fair (taken eventually while enabled): every delivery, every answer, a timer that fires when
# nothing else is in flight, the short retry pause, a caller's question, a request ending. A fault never is.
UNFAIR = ("stage unknown ", "settle unknown ", "lose reply ", "lose request ", "dup ", "fire early ", "cancel",
          "restart ", "break ")


def fair(label: str) -> bool:
    return not label.startswith(UNFAIR)


def driver_owed(w: World) -> frozenset[str]:
    """What a world's driver still owes its caller: a session each question its caller asked and has no answer to,
    a lease keeper the answer to its acquire (it then renews for as long as it holds the lease), any other driver its
    end and its report."""
    if isinstance(w.driver, SessionState):
        return frozenset(w.pending)
    if isinstance(w.driver, LeaseState):
        return frozenset() if w.reports else frozenset({"the lease's answer"})
    return frozenset() if is_done(w.driver) and w.reports else frozenset({"its end and report"})


# The registry's own liveness (spec LIVENESS: every attempt ends committed or FAILED_CLEAN; every RETIRED version no
# session holds ends RECLAIMED), carried by the drivers whose work it is: a settle's and a publication's attempt, the
# attempt a recovery settles under the lease it took, a reclaim's version. Some reports hand the rest of the work to
# a later run that a world of these drivers does not hold: UNKNOWN (a commit's resolution, a recovery under the next
# lease) and PENDING (the reclaimer's next pass), and a reclaim's REJECTED (refused while a session still held the
# version: the next pass claims it once they closed). A stage driver owes none: its caller settles the attempt.
# The retired hand-written checker (system.py) checked these on its own publisher and reclaimer jobs.
HANDS_OVER = frozenset({DriverOutcome.UNKNOWN, DriverOutcome.PENDING})
RECLAIM_HANDS_OVER = HANDS_OVER | {DriverOutcome.REJECTED}


def works_on(driver: Any) -> frozenset[Any]:
    """The spec obligations (LIVENESS's, as `Liveness.obligations` names them) that `driver` discharges."""
    if isinstance(driver, (SettleState, PublishState)) and driver.attempt_token:
        return frozenset({("attempt", driver.version, driver.attempt_token)})
    if isinstance(driver, RecoverState) and driver.attempt is not None and driver.fence != NO_FENCE:
        return frozenset({("attempt", driver.attempt.version, driver.attempt.attempt_token)})
    if isinstance(driver, ReclaimState):
        return frozenset({("reclaim", driver.version)})
    return frozenset()


def hands_over(driver: Any, reports: Sequence[Report]) -> bool:
    over = RECLAIM_HANDS_OVER if isinstance(driver, ReclaimState) else HANDS_OVER
    return any(r.outcome in over for r in reports)


def spec_owed(registry: RegistryState, lanes: Sequence[tuple[Any, Sequence[Report]]]) -> frozenset[str]:
    """The spec LIVENESS obligations open in `registry` that the drivers of `lanes` (each with its reports) work on,
    except those a driver handed over."""
    handed = frozenset().union(*(works_on(d) for d, reports in lanes if hands_over(d, reports)))
    mine = frozenset().union(*(works_on(d) for d, reports in lanes)) - handed
    return frozenset(f"{lv.name} {ob}" for lv in LIVENESS for ob in lv.obligations(registry) if ob in mine)


def owed(w: World) -> frozenset[str]:
    """What a world still owes (liveness): its driver's answers (driver_owed), and the spec's obligations on the
    versions it works on (spec_owed)."""
    return driver_owed(w) | spec_owed(w.registry, ((w.driver, w.reports),))


def stuck(w: World) -> list[str]:
    """What is wrong with a world where nothing can happen any more: a session must have answered its caller, any
    other driver must be done with a report."""
    if isinstance(w.driver, SessionState):  # a session runs until closed
        return [f"told_once: nothing can happen and {sorted(w.pending)} was never answered"] if w.pending else []
    if is_done(w.driver) and w.reports:
        return []
    return [f"finishes: nothing can happen and the driver is {w.driver.phase}"]


_PROBED_VERSIONS = tuple((key, DIGESTS[key]) for key in (A, B, C))
_PROBED: dict[Any, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # the reference table's probes, per process
_FIRED: dict[tuple[Any, Any], tuple[Any, tuple[str, ...], bool]] = {}  # ... and its checked steps (DriverSystem._fire)


# The spec's invariants of each registry and engine state reached, per process: the spec's, so whatever table made the
# state (a mutant's too), and many worlds share one registry or engine state.
_INVARIANTS: dict[Any, tuple[str, ...]] = {}


def _invariant_problems(state: Any, violated_by: Callable[[Any], tuple[str, ...]], what: str) -> tuple[str, ...]:
    got = _INVARIANTS.get(state)
    if got is None:
        got = _INVARIANTS[state] = tuple(f"{what} invariant: {p}" for p in violated_by(state))
    return got


class StepPropertyViolation(Exception):
    """A registry or engine step that a world's call made broke what is checked of every step (_fire). Raised
    out of the successors: the search reports it at the world whose call made the step."""


def _probe(state: Any, core: Core, counts: dict[str, int]) -> Iterator[str]:
    """The probes of one registry or engine state (DriverSystem.probe_problems) under `core`: count each row fired,
    yield what its step breaks."""
    if isinstance(state, RegistryState):
        domain = EventDomain(_PROBED_VERSIONS, tuple(state.sessions) or (SESSION,), max_incarnation=0)
        events: tuple[Any, ...] = candidate_events(state, domain)
        fired_row, step, step_problems = CORE.fired_row, core.step_traced, registry_step_problems
    else:
        tokens = {a.attempt_token for a in state.adapters.values() if a.attempt_token} | {STALE_TOKEN}
        plans = tuple(AdapterPlan(lora_name(k, d), d, BUCKETS) for k, d in _PROBED_VERSIONS)
        rids = (*(reclaim_id(k) for k, _ in _PROBED_VERSIONS), FORGED_RECLAIM_ID)
        domain_e = EngineEventDomain(plans, tuple(sorted(tokens)), rids, max_incarnation=0)
        events = candidate_engine_events(state, domain_e)
        fired_row, step, step_problems = CORE.engine_fired_row, core.engine_step_traced, engine_step_problems
    for event in events:
        try:
            # (under the reference table its own step says which row answers: one dispatch, not two)
            reference = step(state, event) if core is CORE else None
            if (reference.row if reference is not None else fired_row(state, event)).changes_state:
                continue
        except ProtocolError:
            continue  # not a call the reference table answers here: nobody may send it
        try:
            fired = reference if reference is not None else step(state, event)
        except ProtocolError as exc:
            yield f"probe {event}: {exc}"
            continue
        counts[fired.row.id] = counts.get(fired.row.id, 0) + 1
        if fired.state != state:
            yield f"probe {event}: a late, stale or forged call changed the state ({fired.row.id})"
        for problem in step_problems(state, event, fired.state, fired.result, fired.effects):
            yield f"probe {event}: {problem}"


def check(name: str, budget: Budget = Budget(), drivers: Drivers = DRIVERS, system: DriverSystem | None = None,
          max_states: int = 2_000_000) -> CheckResult:
    """Breadth-first over every world reachable from the scenario; stops at the first violation."""
    system = system or DriverSystem(drivers)
    start = scenario(name, budget)
    return search(name, start, system.successors, lambda w: system.problems(w, start), stuck, max_states,
                  fair=fair, owed=owed)


@attrs.frozen
class Checked:
    """One scenario checked under one budget, with the rows its worlds fired (what `check_each` hands back)."""

    budget: Budget
    result: CheckResult
    fired: dict[str, int]  # the driver table's rows
    core_fired: frozenset[str]  # the registry's and the engines' rows the drivers' calls fired
    core_probed: frozenset[str]  # ... and those the probes fired


def _check_one(task: tuple[str, str, Budget]) -> Checked:
    module, name, budget = task
    system = DriverSystem()
    # By name: model_checks.crowd imports this module, so this one cannot import it at its top.
    checker: Callable[..., CheckResult] = check if module == "drivers" else importlib.import_module(
        f"model_checks.{module}").check
    result = checker(name, budget, system=system)
    return Checked(budget, result, dict(system.fired), frozenset(system.core_fired), frozenset(system.core_probed))


def check_each(tasks: list[tuple[str, Budget]], module: str = "drivers", jobs: int | None = None) -> list[Checked]:
    """Every (scenario, budget) of `tasks` checked, in order: `module` is `drivers` (one-driver worlds) or `crowd`
    (check_entries)."""
    return check_entries([(module, name, budget) for name, budget in tasks], jobs)


def check_entries(entries: Sequence[tuple[str, str, Budget]], jobs: int | None = None) -> list[Checked]:
    """Every (module, scenario, budget) of `entries` checked, in order, on `jobs` worker processes (default: one a
    core). Each check is independent (a fresh DriverSystem), so the verdicts are those of a serial run. Workers start
    from a fork server, not from the caller's process."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(entries)))
    if jobs == 1:
        return [_check_one(entry) for entry in entries]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(_check_one, entries))


# The bounds `make test` runs (tests/model_checks/test_drivers.py) and the mutants are run on: together they
# fire every driver row except DEFENSIVE_ROWS.
DRIVER_BOUNDS = (
    Budget(drops=1, dups=0, deadlines=1, cancels=1),
    Budget(drops=1, dups=1, deadlines=0, cancels=0),
    Budget(drops=0, dups=0, deadlines=1, cancels=0, crashes=1),
)
# The same worlds at three engines (issue 22's sizes, for the drivers): a barrier, a quorum of READY, a cleanup, a
# reclaim and a restart that span three engines, one fault kind each (a loss; a deadline that fires early; an engine
# restart). With two kinds at once the stage scenarios grow about twentyfold (stage under a loss and an early
# deadline: 57,565 worlds at three engines, against 3,110 and 9,785 under either one).
THREE_ENGINE_BOUNDS = (
    Budget(drops=1, dups=0, deadlines=0, cancels=0, engines=3),
    Budget(drops=0, dups=0, deadlines=1, cancels=0, engines=3),
    Budget(drops=0, dups=0, deadlines=0, cancels=0, crashes=1, engines=3),
)
# A window of K = 3 versions (issue 46): the registry holds three, so a publication at capacity finds A and B
# retired and C the default, and D is refused at reserve before any begin; a reclaim of A or a publication happens
# with two other versions held. DRIVER_BOUNDS' first budget, on the scenarios whose worlds change with K (8,248
# worlds in about 8 s, most of them the reclaim's).
WINDOW_BOUNDS = (Budget(drops=1, dups=0, deadlines=1, cancels=1, capacity=3),)
WINDOW_SCENARIOS = ("reserve_at_capacity", "publish_at_capacity", "publish", "reclaim", "reclaim_in_use")
# One refusal no party here gives (`_breakable`), and a deadline that may fire early (so the refusal may come late):
# fires the defensive rows of BROKEN_PORT_ROWS.
BROKEN_PORT_BOUNDS = (Budget(drops=0, dups=0, deadlines=1, cancels=0, breaks=1),)
BROKEN_PORT_ROWS = frozenset({"revision.refused", "live.refused", "attempt.refused", "incarnation.refused",
                              "pending.refused", "placement.refused", "settle.refused", "publish.stage_refused",
                              "publish.settle_refused", "unload.refused", "unload.late_refusal", "confirm.refused",
                              "cleaned.refused"})
# Rows neither DRIVER_BOUNDS nor THREE_ENGINE_BOUNDS fires (clean.refused left the list with issue 41's effect
# outcomes: abort_unload_fails fires it, an unload that fails during the cleanup refused UNLOAD_FAILED). Five
# answer a refusal that only a party these scenarios leave out produces (a rehydrate attempt that changes an
# engine's attempt under a pending cleanup; a forged or replayed reclaim id, issue 19); they keep the resource: each
# ends its engine UNCONFIRMED. The rest answer an input
# that no executor following driver_loop.py produces (a port outside its contract): each ends the wait for that call
# at once (REJECTED, UNKNOWN, an abort, a failed rehydrate). The crowd fires one
# (crowd.DEFENSIVE_REACHED) and BROKEN_PORT_BOUNDS the other thirteen (BROKEN_PORT_ROWS).
DEFENSIVE_ROWS = {
    "revision.refused": "a registry read is answered or lost; a typed refusal of it is a port outside its contract",
    "live.refused": "the same, for a lease keeper's read of the lease's fence",
    "attempt.refused": "the same, for a publication's read of its version's last attempt (the reserve's key)",
    "cleaned.refused": "cleaned.stale_attempt: a restart replaced the attempt after the engine cleaned it",
    "unknown.refused": "unknown.stale_attempt: the same, for an UNKNOWN receipt",
    "unload.refused": "reclaim.forged: another reclaim id reached the engine first",
    "unload.late_refusal": "the same refusal arriving after the deadline",
    "confirm.refused": "confirm.forged / confirm.not_claimed: a receipt under another reclaim id",
    "incarnation.refused": "an engine port answers its incarnation or is unreachable (Lost); a typed refusal of the "
    "read is an executor's port outside its contract",
    "placement.refused": "a rehydrate's read of the registry's placement is answered or lost; a typed refusal of it "
    "is a port outside its contract",
    "pending.refused": "the recovery's read of the registry's versions answers or is lost; a typed refusal of it is "
    "an executor's port outside its contract",
    "settle.refused": "a settle driver answers with its outcome (or its executor fails: Lost), never a refusal",
    "publish.stage_refused": "a stage driver answers with its outcome (or its executor fails: Lost), never a refusal",
    "publish.settle_refused": "the same, for a publication's settle driver",
}


# The registry's and the engines' rows no one-driver world's calls step through on DRIVER_BOUNDS (55 of 160). Most
# answer another process's stale, forged or late call, or a replay (here the journal answers a retried key whose
# first call changed the state before the registry sees it, as the registry actor's journal does).
# tests/model_checks/test_drivers.py holds this set exact, so a scenario that reaches one of them must take it out.
# The crowd's calls reach 21 of them (crowd.REACHED_TOGETHER, held exact by test_crowd.py), and the probes all but
# CORE_ROWS_NOT_PROBED (below).
CORE_ROWS_NOT_REACHED = frozenset({
    "reserve.other_epoch", "commit.unknown", "commit.stale_after_commit", "commit.stale_attempt",
    "commit.revision_moved", "abort.unknown", "abort.stale_attempt",
    "claim.unknown", "claim.replay", "prepared.unknown", "prepared.stale_attempt", "prepared.digest_mismatch",
    "prepared.reclaiming", "prepared.late", "ready.unknown", "ready.stale_attempt", "ready.digest_mismatch",
    "ready.reclaiming", "ready.late", "unknown.unknown_version", "unknown.stale_attempt", "unknown.pending",
    "cleaned.unknown_version", "cleaned.stale_attempt", "cleaned.replay", "cleaned.live_attempt", "open.other_epoch",
    "confirm.unknown", "confirm.not_claimed", "confirm.forged", "confirm.replay", "begin.other_attempt",
    "begin.reclaimed", "bucket.other_attempt", "bucket.out_of_order", "end.other_attempt", "end.incomplete",
    "cleanup.unstarted", "cleanup.other_attempt", "cleanup.reclaimed", "release.duplicate",
    "reclaim.forged", "reclaim.staging", "unload.forged", "unload.in_use", "unload.replay", "unload.not_reclaiming",
    "started.stale",
    # issue 41's outcome rows that no call of these worlds makes: a second end while the first one's load runs, a
    # begin while an attempt is undone, a reclaim meeting a running load, and outcomes no effect of a row awaits
    # (a load's outcome for another attempt, loaded.other_attempt and load_failed.other_attempt, is reached by the
    # drivers' calls: test_drivers.py holds this set exact)
    "end.loading", "begin.while_cleaning", "reclaim.settling", "loaded.unawaited",
    "load_failed.unawaited", "unloaded.unawaited", "unload_failed.unawaited",
})


# Of CORE_ROWS_NOT_REACHED, the rows the probes (DriverSystem.probe_problems) do not fire either on DRIVER_BOUNDS:
# moves, which only a call makes (held exact by tests/model_checks/test_drivers.py). The probes fire the other 45:
# every late, forged, stale, foreign and replayed call the table answers without a change, at every registry and
# engine state the worlds reach. Two of these the crowd's drivers reach (crowd.REACHED_TOGETHER); no driver makes
# the third (NO_DRIVER_MAKES), so it is the one row of the table no driver world reaches.
CORE_ROWS_NOT_PROBED = frozenset({"cleanup.unstarted", "reclaim.staging", "unknown.pending"})
NO_DRIVER_MAKES = {
    "unknown.pending": "RecordUnknown of an attempt still staging: a stage driver whose engine call's outcome is "
    "unknown fails the attempt, which its settle driver aborts; only a cleanup records UNKNOWN (unknown.settled)",
}


def check_all(budget: Budget = Budget(), drivers: Drivers = DRIVERS,
              on_result: Callable[[CheckResult], None] | None = None) -> tuple[list[CheckResult], DriverSystem]:
    system = DriverSystem(drivers)
    results = []
    for name in SCENARIOS:
        results.append(check(name, budget, drivers, system))
        if on_result:
            on_result(results[-1])
    return results, system


def rows_line(prefix: str, system: DriverSystem) -> str:
    """The report's rows: the driver table's and the core's (registry and engine side) this checker fired, by the
    drivers' calls or by the probes, and all of them together; `core_rows_by_calls`: those the drivers' calls
    fired."""
    driver, calls = len(system.fired), len(system.core_fired)
    core = len(system.core_fired.keys() | system.core_probed.keys())
    return (f"{prefix}_rows_fired={driver}/{len(DRIVER_ROWS)} core_rows_fired={core}/{len(ROWS)} "
            f"core_rows_by_calls={calls}/{len(ROWS)} rows_fired={driver + core}/{len(DRIVER_ROWS) + len(ROWS)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Model-check the driver machines against the real tables.")
    for field, default in (("drops", 1), ("dups", 1), ("deadlines", 1), ("cancels", 1), ("crashes", 0), ("breaks", 0)):
        parser.add_argument(f"--{field}", type=int, default=default)
    args = parser.parse_args(argv)
    budget = Budget(args.drops, args.dups, args.deadlines, args.cancels, args.crashes, breaks=args.breaks)
    results, system = check_all(budget, on_result=lambda r: print(
        f"{r.scenario:18s} states={r.states:7d} {r.seconds:6.1f}s {r.violation or 'ok'}"))
    print(f"{rows_line('driver', system)} states={sum(r.states for r in results)} "
          f"violations={sum(1 for r in results if r.violation)}")
    return 1 if any(r.violation for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
