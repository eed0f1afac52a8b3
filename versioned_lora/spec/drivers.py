"""The driver table: every decision of the processes that carry the protocol out is one row here.

Theory of operation (read this with `spec/table.py`, whose style it follows). The registry and the
engines decide what may happen; a *driver* carries one piece of work out against them: it sends calls,
waits, and decides what to do with each answer. Those decisions lose data when they are made by hand
(a cleanup derived from a view unloaded a just-committed default), so they are rows too, and the
runtime's `Publisher` (staging, then commit or abort and cleanup), `Reclaimer`, `SessionBinder` and
`RestartSupervisor` only execute what a row commands.

A driver is sans-I/O: `step(state, input) -> (state, commands)` (`versioned_lora.lifecycle.drivers`).

* Inputs are what can happen to a driver: `Start` (the caller asks for the work), `Answer` (a call's
  reply), `Refusal` (a certain, typed refusal: nothing changed there), `Lost` (the call may or may not
  have landed: a lost reply, an unreachable engine), `Deadline` (a timer the driver armed fired; it may
  fire while the call's reply is still in flight), `Cancel` (the caller gave up waiting) and `Settled`
  (internal: a per-engine sub-machine reached a terminal state and its coordinator looks again).
* Commands are what a driver asks the executor to do, one I/O each: an engine's staging call (begin, one
  bucket, end), the probe check of an `end` receipt, dropping a transfer group that may hold a half-done
  collective, a registry call (under an
  idempotency key derived from the driver's state, never from a clock or a uuid, so a retry is the
  same call and a late reply lands on a "late" row), an engine call, arming or disarming a timer (the
  driver holds no clock), and `Report` (tell the caller how the work ended; the driver may go on, e.g.
  resolving a commit whose outcome it reported as unknown).
* Shape: a coordinator per piece of work and one sub-machine per engine (`*_ENGINE`); an input naming
  an engine steps that engine's sub-machine, and when the sub-machine enters a phase of `SETTLES` (a terminal
  one, or staging's WAITING) its coordinator is stepped with `Settled`, whose rows decide what comes next:
  the stage coordinator holds RFC §3.2's barrier that way (bucket i has landed on every engine before bucket
  i+1 goes to any), and decides the staging only once every engine has settled, so no engine's call is still
  running when the abort's cleanup reaches it.

Reading a row: when an input of kind `input` reaches a driver of `machine` whose phase is one of
`sources`, the rows for that (machine, phase, input) are tried top to bottom; the first whose `guards`
all hold fires: the phase becomes `target` (SAME: unchanged), the named `commands` are built from the
state and the input, and `report` (if any) is the outcome told to the caller. A row whose `target` is
SAME and that has no commands and no report changes nothing: the answer to a late, duplicated or stale
input. Only such rows may use the wildcard source. A (phase, input) pair that no row covers is a bug in
the executor and raises the one `ProtocolError`.

A driver in a terminal phase is finished: its executor cancels every timer it still has armed, so rows
into a terminal phase disarm nothing. A running coordinator receives only its own timers (an engine's reach
that engine's sub-machine): the commit's, then (after a refused commit) the abort's, or the claim's. Only
ABORTING can see a timer of an earlier call (the commit's, fired while its refusal was already in the
inbox), so only abort.deadline names its timer; the stale one lands on settle.late_timer.

What "unknown" means here (RFC §3.4, DESIGN.md §1): a call whose outcome is unknown keeps the resource
and the capacity. A commit that may have landed is never aborted; an abort whose reply is lost or that
was refused cleans nothing; a claim whose reply is lost reclaims nothing. The model checker
(`model_checks/drivers.py`) runs these very rows against the real registry and engine tables.
"""

from __future__ import annotations

from enum import StrEnum

import attrs

from versioned_lora.spec.states import SAME, WILDCARD


class Driver(StrEnum):
    STAGE = "stage"  # one attempt: reserve, then begin, bucket after bucket, end, on every target engine
    STAGE_ENGINE = "stage_engine"  # one engine's begin (and PREPARED), each bucket, end, probe and READY
    SETTLE = "settle"  # a staged publication's end game: commit and its resolution, or abort and cleanup
    CLEANUP_ENGINE = "cleanup_engine"  # one engine's cleanup of an aborted attempt, and its report
    RECLAIM = "reclaim"  # one reclaim: claim, then every engine the claim names
    RECLAIM_ENGINE = "reclaim_engine"  # one engine's unload under the reclaim id, and its confirm
    SESSION = "session"  # one agentic session: its one shared bind, its generations, its close (RFC §4)
    GENERATION = "generation"  # one generation of a session (a request id): dispatch view, send, unknown, abort
    SUPERVISE = "supervise"  # one engine after a restart: its incarnation reported, every version it owes rehydrated
    REHYDRATE = "rehydrate"  # one version the restarted engine owes: the registry's placement read, then staged
    RECOVER = "recover"  # the attempt a crashed publisher left: the lease, then committed or aborted
    LEASE = "lease"  # the publisher lease: acquired (or taken over), then renewed while a publication runs
    PUBLISH = "publish"  # one publication end to end: staged, its bytes stored, then committed or aborted and cleaned


class Input(StrEnum):
    START = "Start"
    ANSWER = "Answer"
    REFUSAL = "Refusal"
    LOST = "Lost"
    DEADLINE = "Deadline"
    CANCEL = "Cancel"
    SETTLED = "Settled"
    # A session's caller (SessionBinder's methods): each asks once and is told once (a Report to its subject).
    BIND = "Bind"
    GENERATE = "Generate"
    RESOLVE = "Resolve"
    FINISH = "Finish"


class DriverOutcome(StrEnum):
    """What a driver reports to its caller (the runtime maps these onto its public outcome enums)."""

    STAGED = "STAGED"  # READY recorded from every target engine: the attempt may be committed
    REPLAYED = "REPLAYED"  # the reserve was an idempotent replay of a publication that already ended
    STAGE_FAILED = "STAGE_FAILED"  # some engine's staging failed: certainly not committed, abort it
    COMMITTED = "COMMITTED"
    FAILED_CLEAN = "FAILED_CLEAN"  # aborted, and every engine's cleanup recorded: the slot is free
    UNKNOWN = "UNKNOWN"  # an outcome that may have landed without its answer: resource and capacity kept
    RECLAIMED = "RECLAIMED"
    PENDING = "PENDING"  # claimed; some engine has not confirmed (reclaim again to finish)
    REJECTED = "REJECTED"  # certainly refused before anything changed
    # A session's outcomes, each told to one subject (the bind's waiters, a request id's, the finish's).
    BOUND = "BOUND"  # the session's one binding is known
    GENERATED = "GENERATED"  # the generation's response, for its caller
    DROPPED = "DROPPED"  # the session began closing: the generation's response (if any) is not delivered
    RESOLVED = "RESOLVED"  # the unknown generation was ended on the engine (or nothing was unknown under that id)
    CLOSED = "CLOSED"  # close_and_release answered: the session's ref is released (once)
    # A restart supervisor's outcome.
    RECONCILED = "RECONCILED"  # the incarnation adopted; each version owed is READY there or failed (and says why)
    # A recovery's outcome.
    RECOVERED = "RECOVERED"  # the attempt left pending (if any) is settled: committed, or aborted and clean
    # A lease keeper's outcomes.
    LEASED = "LEASED"  # the lease is held under the fence the state names; renewed until the caller stops it
    STOPPED = "STOPPED"  # the caller stopped the keeper: no renewal is sent any more (the lease stays until its ttl)


class SessionRefusal(StrEnum):
    """Why a session refused its caller's request, before anything left the process (REJECTED's reason)."""

    NOT_BOUND = "NOT_BOUND"  # a generation before the session's bind is known (the binder binds first)
    UNRESOLVED_OUTCOME = "UNRESOLVED_OUTCOME"  # an earlier generation's outcome is unknown: resolve it first
    SESSION_CLOSED = "SESSION_CLOSED"  # the session is closing or closed: nothing is dispatched
    NOT_SERVABLE = "NOT_SERVABLE"  # the registry's dispatch view: the version is servable on no engine now
    VIEW_UNAVAILABLE = "VIEW_UNAVAILABLE"  # the dispatch view could not be read: nothing was sent
    RID_IN_USE = "RID_IN_USE"  # a request id this session used already
    CLEANUP_FAILED = "CLEANUP_FAILED"  # the caller's own local cleanup raised: nothing released; finish again


PHASES: dict[Driver, tuple[str, ...]] = {
    # VIEWING: a publication's version read from the registry first (its last attempt names the reserve's key).
    Driver.STAGE: ("IDLE", "VIEWING", "RESERVING", "BEGINNING", "TRANSFERRING", "ENDING", "DONE"),
    # WAITING: for the coordinator's next call (the first one, or the next after PREPARED recorded or the current
    # bucket landed: RFC §3.2's barrier).
    Driver.STAGE_ENGINE: ("WAITING", "BEGINNING", "PREPARING", "SENDING", "ENDING", "CHECKING", "RECORDING",
                          "READY", "FAILED"),
    # COMMIT_UNRESOLVED: the commit's outcome was reported unknown; the same commit is retried until answered.
    # VIEWING: the default's revision, which the commit expects, read from the registry (nothing sent yet).
    Driver.SETTLE: ("IDLE", "VIEWING", "COMMITTING", "COMMIT_UNRESOLVED", "ABORTING", "CLEANING", "DONE"),
    Driver.CLEANUP_ENGINE: ("CLEANING", "WAITING_IDLE", "RECORDING", "RECORDING_UNKNOWN", "CLEANED", "UNCONFIRMED"),
    Driver.RECLAIM: ("IDLE", "CLAIMING", "RECLAIMING", "DONE"),
    Driver.RECLAIM_ENGINE: ("UNLOADING", "CONFIRMING", "CONFIRMED", "UNCONFIRMED"),
    # BIND_UNKNOWN: the bind's deadline fired while its call (retried after each loss) may still land: nothing is
    # dispatched until it is answered. ABORTING: begin_close answered; each live generation is being aborted.
    Driver.SESSION: ("OPEN", "BINDING", "BIND_UNKNOWN", "BOUND", "CLOSING", "ABORTING", "CLEANING_UP",
                     "CLEANUP_FAILED", "RELEASING", "CLOSED"),
    # UNKNOWN: the engine may have accepted it (its reply lost, its caller gone): never resent; `Resolve` aborts it.
    Driver.GENERATION: ("VIEWING", "SENDING", "UNKNOWN", "RESOLVING", "ABORTING", "DONE", "FAILED", "RESOLVED",
                        "ABORTED"),
    # ASKING: the engine's incarnation; ADOPTING: EngineRestarted, whose answer names what the engine owes.
    Driver.SUPERVISE: ("IDLE", "ASKING", "ADOPTING", "REHYDRATING", "DONE"),
    # VIEWING: the registry's placement (READY there already: nothing to stage); STAGING: the stage driver runs.
    Driver.REHYDRATE: ("VIEWING", "STAGING", "READY", "FAILED"),
    # VIEWING: the attempts pending in the registry (and whether the snapshot store holds each one's bytes);
    # LEASING: the publisher lease; SETTLING: the settle driver commits or aborts it.
    Driver.RECOVER: ("IDLE", "VIEWING", "LEASING", "SETTLING", "DONE"),
    # HOLDING: the renewal timer armed; RENEWING: a renewal in flight.
    Driver.LEASE: ("IDLE", "VIEWING", "ACQUIRING", "HOLDING", "RENEWING", "DONE"),
    # STAGING: the stage driver runs; STORING: the bytes written beside the staging are waited for; SETTLING: the
    # settle driver commits or aborts the attempt.
    Driver.PUBLISH: ("IDLE", "STAGING", "STORING", "SETTLING", "DONE"),
}
# The phases in which a sub-machine is finished with its engine (its coordinator is told `Settled`).
TERMINAL: dict[Driver, frozenset[str]] = {
    Driver.STAGE: frozenset({"DONE"}),
    Driver.STAGE_ENGINE: frozenset({"READY", "FAILED"}),
    Driver.SETTLE: frozenset({"DONE"}),
    Driver.CLEANUP_ENGINE: frozenset({"CLEANED", "UNCONFIRMED"}),
    Driver.RECLAIM: frozenset({"DONE"}),
    Driver.RECLAIM_ENGINE: frozenset({"CONFIRMED", "UNCONFIRMED"}),
    Driver.SESSION: frozenset({"CLOSED"}),
    Driver.GENERATION: frozenset({"DONE", "FAILED", "RESOLVED", "ABORTED"}),
    Driver.SUPERVISE: frozenset({"DONE"}),
    Driver.REHYDRATE: frozenset({"READY", "FAILED"}),
    Driver.RECOVER: frozenset({"DONE"}),
    Driver.LEASE: frozenset({"DONE"}),
    Driver.PUBLISH: frozenset({"DONE"}),
}
# The phases whose entry tells the coordinator `Settled`: the terminal ones, and for staging WAITING too (the
# RFC §3.2 barrier: the coordinator sends the next call once every engine is WAITING).
SETTLES: dict[Driver, frozenset[str]] = {**TERMINAL, Driver.STAGE_ENGINE: frozenset({"WAITING", "READY", "FAILED"})}
# The inputs each machine can receive: every (phase, input) pair of these is covered by a row.
INPUTS: dict[Driver, tuple[Input, ...]] = {
    Driver.STAGE: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE, Input.CANCEL,
                   Input.SETTLED),
    Driver.STAGE_ENGINE: (Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE),
    Driver.SETTLE: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE, Input.CANCEL,
                    Input.SETTLED),
    Driver.CLEANUP_ENGINE: (Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE),
    Driver.RECLAIM: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE, Input.CANCEL,
                     Input.SETTLED),
    Driver.RECLAIM_ENGINE: (Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE),
    Driver.SESSION: (Input.BIND, Input.GENERATE, Input.RESOLVE, Input.FINISH, Input.ANSWER, Input.REFUSAL,
                     Input.LOST, Input.DEADLINE, Input.CANCEL, Input.SETTLED),
    Driver.GENERATION: (Input.GENERATE, Input.RESOLVE, Input.CANCEL, Input.ANSWER, Input.REFUSAL, Input.LOST),
    Driver.SUPERVISE: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE, Input.CANCEL,
                       Input.SETTLED),
    # No deadline of its own: the placement read is one registry read, and the stage driver that a rehydrate runs
    # bounds each of its calls with its own deadlines.
    Driver.REHYDRATE: (Input.ANSWER, Input.REFUSAL, Input.LOST),
    # No deadline of its own either: the lease keeper bounds its acquire, and each settle driver its own.
    Driver.RECOVER: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.CANCEL),
    Driver.LEASE: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.DEADLINE, Input.CANCEL),
    # No deadline of its own: the stage and settle drivers bound each of their calls, and the executor the store's
    # wait (Deadlines.store, then Lost).
    Driver.PUBLISH: (Input.START, Input.ANSWER, Input.REFUSAL, Input.LOST, Input.CANCEL),
}


@attrs.frozen
class DriverRow:
    id: str
    machine: Driver
    sources: tuple[str, ...]
    input: Input
    target: str
    guards: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()
    report: DriverOutcome | None = None
    doc: str = ""
    # A session's report names its subject: "bind", "finish", or "request" (the request id the input names). A
    # generation's is its request id. Other drivers report to their one caller ("").
    to: str = ""
    reason: str | None = None  # a fixed reason for the report (a session's own refusal); else the input's

    @property
    def changes_state(self) -> bool:
        return self.target != SAME or bool(self.commands) or self.report is not None

    def expanded_sources(self) -> tuple[str, ...]:
        return PHASES[self.machine] if self.sources == (WILDCARD,) else self.sources


def row(id: str, machine: Driver, sources: str, input: Input, target: str, *, guards: tuple[str, ...] = (),
        commands: tuple[str, ...] = (), report: DriverOutcome | None = None, doc: str = "", to: str = "",
        reason: str | None = None) -> DriverRow:
    return DriverRow(id, machine, tuple(sources.split()), input, target, guards, commands, report, doc, to, reason)


def late(id: str, machine: Driver, sources: str, input: Input, doc: str = "") -> DriverRow:
    """A row that changes nothing: the answer to a late, duplicated or stale input."""
    return DriverRow(id, machine, tuple(sources.split()), input, SAME, doc=doc)


SG, SN = Driver.STAGE, Driver.STAGE_ENGINE
SE, CE, RC, RE = Driver.SETTLE, Driver.CLEANUP_ENGINE, Driver.RECLAIM, Driver.RECLAIM_ENGINE
SS, GN = Driver.SESSION, Driver.GENERATION
SV, RH, RV, LS, PB = Driver.SUPERVISE, Driver.REHYDRATE, Driver.RECOVER, Driver.LEASE, Driver.PUBLISH
R = SessionRefusal
OPEN_PHASES = "OPEN BINDING BIND_UNKNOWN BOUND"  # a session before its finish began
CLOSING_PHASES = "CLOSING ABORTING CLEANING_UP CLEANUP_FAILED RELEASING CLOSED"  # from its finish on
ALL_GENERATION_PHASES = " ".join(PHASES[Driver.GENERATION])
I = Input  # noqa: E741 - the table reads better with a one-letter namespace
O = DriverOutcome  # noqa: E741

# fmt: off
DRIVER_ROWS: tuple[DriverRow, ...] = (
    # ================================================================ stage
    row("reserve.start", SG, "IDLE", I.START, "RESERVING", guards=("needs_reserve", "has_reserve_key"),
        commands=("submit_reserve", "arm_reserve"),
        doc="A publication of content whose reserve's outcome was left unknown (reserve.deadline): the same key "
            "again, so the registry answers it from the journal."),
    row("reserve.view", SG, "IDLE", I.START, "VIEWING", guards=("needs_reserve",),
        commands=("read_attempt", "arm_reserve"),
        doc="A publication: first read the version's last attempt in the registry (one read, under the reserve's "
            "deadline). The reserve's key names it, so a version aborted and cleaned since is reserved under a new "
            "key, and a retry of this reserve under the same one (never from a clock or a uuid)."),
    row("attempt.read", SG, "VIEWING", I.ANSWER, "RESERVING", guards=("answers_attempt",),
        commands=("note_reserve_key", "submit_reserve"),
        doc="Reserve under the key the read derives (reserve_key)."),
    row("attempt.lost", SG, "VIEWING", I.LOST, SAME, guards=("answers_attempt",), commands=("read_attempt",),
        doc="Nothing was sent: read again (after the executor's pause) until the reserve's deadline."),
    row("attempt.refused", SG, "VIEWING", I.REFUSAL, "DONE", guards=("answers_attempt",),
        commands=("disarm_reserve",), report=O.REJECTED,
        doc="A read is answered or lost; a refusal of it is a port outside its contract. Nothing was reserved."),
    row("attempt.deadline", SG, "VIEWING", I.DEADLINE, "DONE", report=O.UNKNOWN,
        doc="No reserve was sent, and no key is known: the caller is told its deadline passed, as at "
            "reserve.deadline; publishing again reads afresh."),
    row("attempt.cancel", SG, "VIEWING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: nothing was sent."),
    row("stage.start", SG, "IDLE", I.START, "BEGINNING", commands=("start_begins",),
        doc="A rehydrate (the attempt is the registry's already, on one restarted engine): `begin` at once."),
    row("reserve.reserved", SG, "RESERVING", I.ANSWER, "BEGINNING",
        guards=("answers_reserve", "reserved_loading", "names_match"),
        commands=("disarm_reserve", "open_stages", "start_begins"),
        doc="`begin` on every engine the answer names (its StageOnEngine effects), at once."),
    row("reserve.unstageable", SG, "RESERVING", I.ANSWER, "DONE", guards=("answers_reserve", "reserved_loading"),
        commands=("note_attempt",), report=O.STAGE_FAILED,
        doc="Reserved under another name than the candidate's (or on no engine): nothing is staged; the attempt "
            "is live, so the caller aborts it."),
    row("reserve.replayed", SG, "RESERVING", I.ANSWER, "DONE", guards=("answers_reserve", "reserved_answer"),
        commands=("note_attempt",), report=O.REPLAYED,
        doc="reserve.replay of a publication that already ended: nothing to stage."),
    row("reserve.refused", SG, "RESERVING", I.REFUSAL, "DONE", guards=("answers_reserve",), report=O.REJECTED,
        doc="E.g. CAPACITY_ERROR, NOT_LEASE_HOLDER: nothing was taken."),
    row("reserve.lost", SG, "RESERVING", I.LOST, SAME, guards=("answers_reserve",), commands=("submit_reserve",),
        doc="The reserve may have landed: the same key again."),
    row("reserve.deadline", SG, "RESERVING", I.DEADLINE, "DONE", report=O.UNKNOWN,
        doc="The reserve may have taken a slot: unknown. The caller keeps the key and sends the same reserve for "
            "the same content next time, which the journal answers."),
    row("reserve.cancel", SG, "RESERVING", I.CANCEL, "DONE", report=O.UNKNOWN),
    row("stage.failed", SG, "BEGINNING TRANSFERRING ENDING", I.SETTLED, "DONE",
        guards=("stages_settled", "some_stage_failed"), report=O.STAGE_FAILED,
        doc="Every engine has settled and one failed: certainly not committed (the caller aborts). Nothing is "
            "cut short on the others: no engine's work races the cleanup that follows. Each failed engine's "
            "sub-machine says why (its `failure`)."),
    row("begin.all_prepared", SG, "BEGINNING", I.SETTLED, "TRANSFERRING", guards=("stages_settled",),
        commands=("send_next_bucket",), doc="PREPARED recorded from every engine: bucket 0 to all of them."),
    row("transfer.next_bucket", SG, "TRANSFERRING", I.SETTLED, SAME, guards=("stages_settled", "more_buckets"),
        commands=("send_next_bucket",),
        doc="RFC §3.2's barrier: bucket i landed on every engine before bucket i+1 goes to any."),
    row("transfer.all_landed", SG, "TRANSFERRING", I.SETTLED, "ENDING", guards=("stages_settled",),
        commands=("start_ends",), doc="The last bucket landed everywhere: `end` on every engine."),
    row("ending.all_ready", SG, "ENDING", I.SETTLED, "DONE", guards=("stages_settled",), report=O.STAGED,
        doc="READY recorded from every engine: the attempt may be committed."),
    late("stage.waiting", SG, "BEGINNING TRANSFERRING ENDING", I.SETTLED, doc="Other engines are still busy."),
    late("stage.late_reserve_timer", SG, "BEGINNING TRANSFERRING ENDING", I.DEADLINE,
         doc="The reserve's timer fired while its answer was already in the inbox."),
    row("stage.cancel", SG, "BEGINNING TRANSFERRING ENDING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: calls in flight are cancelled (their late answers land nowhere); the attempt "
            "stays LOADING in the registry, and `recover` settles it."),
    late("stage.late_reply", SG, "DONE", I.ANSWER, doc="An engine's answer after the staging ended."),
    late("stage.late_refusal", SG, "DONE", I.REFUSAL),
    late("stage.late_lost", SG, "DONE", I.LOST),
    late("stage.late_timer", SG, "DONE", I.DEADLINE),
    late("stage.late_cancel", SG, "DONE", I.CANCEL),
    # ================================================================ stage x engine
    row("begin.begun", SN, "BEGINNING", I.ANSWER, "PREPARING", guards=("answers_begin",),
        commands=("disarm_stage", "submit_prepared", "arm_prepared"),
        doc="Staging opened on the engine: record PREPARED (one key per attempt, engine and incarnation)."),
    row("begin.refused", SN, "BEGINNING", I.REFUSAL, "FAILED", guards=("answers_begin",),
        commands=("disarm_stage", "note_refusal")),
    row("begin.lost", SN, "BEGINNING", I.LOST, "FAILED", guards=("answers_begin",),
        commands=("disarm_stage", "note_refusal"),
        doc="Unreachable: the attempt fails (the abort's answer names this engine's cleanup if it is placed)."),
    row("begin.deadline", SN, "BEGINNING", I.DEADLINE, "FAILED", guards=("stage_timer",),
        commands=("note_refusal",), doc="The begin in flight counts for nothing: its late answer lands late."),
    row("prepared.recorded", SN, "PREPARING", I.ANSWER, "WAITING", guards=("answers_prepared",),
        commands=("disarm_stage",)),
    row("prepared.refused", SN, "PREPARING", I.REFUSAL, "FAILED", guards=("answers_prepared",),
        commands=("disarm_stage", "note_refusal"), doc="E.g. a stale incarnation: the registry keeps what it has."),
    row("prepared.lost", SN, "PREPARING", I.LOST, SAME, guards=("answers_prepared",), commands=("submit_prepared",),
        doc="The same key again: answered from the journal if it landed."),
    row("prepared.deadline", SN, "PREPARING", I.DEADLINE, "FAILED", guards=("stage_timer",),
        commands=("note_refusal",)),
    row("bucket.landed", SN, "SENDING", I.ANSWER, "WAITING", guards=("answers_bucket",), commands=("disarm_stage",),
        doc="The engine stashed the bucket (and hashes it while the next one comes)."),
    row("bucket.refused", SN, "SENDING", I.REFUSAL, "FAILED", guards=("answers_bucket",),
        commands=("disarm_stage", "note_refusal", "drop_link"),
        doc="The engine posted no receive, but the send went out beside the request and waits in the group for "
            "one: the group is out of step (its next collective would pair with this one) and never used again."),
    row("bucket.lost", SN, "SENDING", I.LOST, "FAILED", guards=("answers_bucket",),
        commands=("disarm_stage", "note_refusal", "drop_link"),
        doc="The collective may be half done: the link's group is poisoned and never used again."),
    row("bucket.deadline", SN, "SENDING", I.DEADLINE, "FAILED", guards=("stage_timer",),
        commands=("note_refusal", "drop_link"),
        doc="A fired deadline does not end a gloo/NCCL send that cannot be cancelled: the group is poisoned and "
            "never used again (the next call on this engine joins a new one)."),
    row("end.answered", SN, "ENDING", I.ANSWER, "CHECKING", guards=("answers_end",),
        commands=("disarm_stage", "check_probe"),
        doc="READY_LOCAL: checked before READY is recorded: what the engine serves (the served digest and config it "
            "read back from its own LoRA pool, against the snapshot's), then its probe scores (the caller's check)."),
    row("end.refused", SN, "ENDING", I.REFUSAL, "FAILED", guards=("answers_end",),
        commands=("disarm_stage", "note_refusal"), doc="E.g. MANIFEST_MISMATCH: the engine cleaned the stash."),
    row("end.lost", SN, "ENDING", I.LOST, "FAILED", guards=("answers_end",),
        commands=("disarm_stage", "note_refusal")),
    row("end.deadline", SN, "ENDING", I.DEADLINE, "FAILED", guards=("stage_timer",), commands=("note_refusal",)),
    row("probe.matches", SN, "CHECKING", I.ANSWER, "RECORDING", guards=("answers_probe", "probe_matches"),
        commands=("submit_ready", "arm_ready"),
        doc="Record READY (one key per attempt, engine and the incarnation that answered)."),
    row("probe.mismatch", SN, "CHECKING", I.ANSWER, "FAILED", guards=("answers_probe",),
        commands=("note_refusal",),
        doc="Never recorded READY: the engine does not serve the snapshot (the check's typed refusal, recorded as the "
            "engine's failure: SERVED_DIGEST_MISMATCH, SERVED_CONFIG_MISMATCH), or the loaded candidate's probe "
            "scores disagree (engine with engine, or with a reference forward: PROBE_MISMATCH)."),
    row("probe.lost", SN, "CHECKING", I.LOST, "FAILED", guards=("answers_probe",), commands=("note_refusal",),
        doc="The check itself failed (e.g. a reference forward raised): not known to match, so never READY."),
    row("ready.recorded", SN, "RECORDING", I.ANSWER, "READY", guards=("answers_ready",), commands=("disarm_stage",)),
    row("ready.refused", SN, "RECORDING", I.REFUSAL, "FAILED", guards=("answers_ready",),
        commands=("disarm_stage", "note_refusal")),
    row("ready.lost", SN, "RECORDING", I.LOST, SAME, guards=("answers_ready",), commands=("submit_ready",)),
    row("ready.deadline", SN, "RECORDING", I.DEADLINE, "FAILED", guards=("stage_timer",), commands=("note_refusal",),
        doc="Not known to be recorded: the attempt fails (an abort of an attempt READY here is still an abort)."),
    late("stage_engine.late_reply", SN, "*", I.ANSWER, doc="A reply to a call this phase does not wait for."),
    late("stage_engine.late_refusal", SN, "*", I.REFUSAL),
    late("stage_engine.late_lost", SN, "*", I.LOST),
    late("stage_engine.late_timer", SN, "*", I.DEADLINE),
    # ================================================================ settle: commit
    row("settle.commit", SE, "IDLE", I.START, "VIEWING", guards=("wants_commit",),
        commands=("read_revision", "arm_commit"),
        doc="Read the default's revision the commit will expect (one registry read, under the commit's deadline)."),
    row("revision.read", SE, "VIEWING", I.ANSWER, "COMMITTING", guards=("answers_revision",),
        commands=("note_revision", "submit_commit"),
        doc="Commit under a key derived from the attempt and the revision it expects."),
    row("revision.lost", SE, "VIEWING", I.LOST, SAME, guards=("answers_revision",), commands=("read_revision",),
        doc="Nothing was sent: read again (after the executor's pause) until the commit's deadline."),
    row("revision.refused", SE, "VIEWING", I.REFUSAL, "ABORTING", guards=("answers_revision",),
        commands=("disarm", "submit_abort", "arm_abort"),
        doc="A read is answered or lost; a refusal of it is a port outside its contract. No commit was ever sent: "
            "as at the deadline, abort (waiting for the deadline would leave its timer bounding no call)."),
    row("revision.deadline", SE, "VIEWING", I.DEADLINE, "ABORTING", commands=("submit_abort", "arm_abort"),
        doc="No commit was ever sent: the attempt is certainly not committed; abort it and clean what the answer "
            "names."),
    row("revision.cancel", SE, "VIEWING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="No commit was sent: the attempt stays LOADING in the registry, as a cancelled staging leaves it "
            "(`recover` settles it)."),
    row("settle.abort", SE, "IDLE", I.START, "ABORTING", commands=("submit_abort", "arm_abort"),
        doc="Staging failed before any commit was sent: the attempt is certainly not committed."),
    row("commit.committed", SE, "COMMITTING COMMIT_UNRESOLVED", I.ANSWER, "DONE", guards=("answers_commit",),
        report=O.COMMITTED),
    row("commit.refused", SE, "COMMITTING COMMIT_UNRESOLVED", I.REFUSAL, "ABORTING", guards=("answers_commit",),
        commands=("disarm", "submit_abort", "arm_abort"),
        doc="A certain refusal (not ready everywhere, revision moved): the commit did not land; abort."),
    row("commit.lost", SE, "COMMITTING COMMIT_UNRESOLVED", I.LOST, SAME, guards=("answers_commit",),
        commands=("submit_commit",),
        doc="The commit may have landed: the same key again, answered from the journal if it did."),
    row("commit.deadline", SE, "COMMITTING", I.DEADLINE, "COMMIT_UNRESOLVED",
        report=O.UNKNOWN,
        doc="Never an abort: the outcome is unknown, reported so; the call in flight resolves it "
            "(RFC §3.4: 结果没确认前不清理 B，也不开始下一次 publication)."),
    row("commit.cancel", SE, "COMMITTING", I.CANCEL, "COMMIT_UNRESOLVED", report=O.UNKNOWN,
        doc="The caller's cancellation ends its wait, never the commit."),
    late("commit.cancel_unresolved", SE, "COMMIT_UNRESOLVED", I.CANCEL),
    late("commit.late_timer", SE, "COMMIT_UNRESOLVED", I.DEADLINE,
         doc="A deadline past the unknown outcome changes nothing: the retry goes on until answered."),
    # ================================================================ settle: abort and cleanup
    row("abort.cleanup", SE, "ABORTING", I.ANSWER, "CLEANING", guards=("answers_abort", "names_cleanups"),
        commands=("disarm", "start_cleanups"),
        doc="Clean exactly the engines the abort's answer names, with the capability it signed."),
    row("abort.already_clean", SE, "ABORTING", I.ANSWER, "DONE", guards=("answers_abort", "abort_says_clean"),
        report=O.FAILED_CLEAN,
        doc="A replayed abort of an attempt already clean (abort.replay_clean): nothing is left."),
    row("abort.refused", SE, "ABORTING", I.REFUSAL, "DONE", guards=("answers_abort",),
        report=O.UNKNOWN,
        doc="E.g. abort.after_commit: the commit landed and its reply was lost. Nothing is cleaned."),
    row("abort.lost", SE, "ABORTING", I.LOST, SAME, guards=("answers_abort",), commands=("submit_abort",),
        doc="The abort may have landed: the same key again."),
    row("abort.deadline", SE, "ABORTING", I.DEADLINE, "DONE", guards=("abort_timer",), report=O.UNKNOWN,
        doc="No answer in time: nothing is cleaned on the strength of an abort that may not have landed."),
    row("abort.cancel", SE, "ABORTING CLEANING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="What was not confirmed stays CLEANING in the registry (capacity kept); `recover` finishes it."),
    row("cleaning.all_clean", SE, "CLEANING", I.SETTLED, "DONE", guards=("cleanups_settled", "capacity_freed"),
        report=O.FAILED_CLEAN, doc="Every engine's cleanup recorded and the registry freed the slot."),
    row("cleaning.unconfirmed", SE, "CLEANING", I.SETTLED, "DONE", guards=("cleanups_settled",),
        report=O.UNKNOWN, doc="Some engine did not confirm its cleanup: the slot stays taken."),
    late("cleaning.waiting", SE, "CLEANING", I.SETTLED, doc="Other engines are still cleaning."),
    late("settle.late_reply", SE, "ABORTING CLEANING DONE", I.ANSWER,
         doc="A reply to a call this phase no longer waits for (a commit answered after the abort, a "
             "duplicate)."),
    late("settle.late_refusal", SE, "ABORTING CLEANING DONE", I.REFUSAL),
    late("settle.late_lost", SE, "ABORTING CLEANING DONE", I.LOST),
    late("settle.late_timer", SE, "COMMITTING ABORTING CLEANING DONE", I.DEADLINE,
         doc="A timer that fired after its call was answered (it was already in the inbox when disarmed)."),
    late("settle.late_cancel", SE, "DONE", I.CANCEL),
    # ================================================================ cleanup x engine
    row("clean.done", CE, "CLEANING", I.ANSWER, "RECORDING", guards=("answers_engine_cleanup",),
        commands=("disarm_engine", "submit_cleaned", "arm_report"),
        doc="Cleaned on the engine: record it (one key per attempt and engine)."),
    row("clean.in_use", CE, "CLEANING", I.REFUSAL, "WAITING_IDLE", guards=("answers_engine_cleanup", "in_use"),
        commands=("arm_backoff",),
        doc="A loaded candidate a request still holds (its own probe): nothing is unloaded under a request; "
            "ask again after a pause, within the cleanup deadline."),
    row("clean.refused", CE, "CLEANING", I.REFUSAL, "RECORDING_UNKNOWN", guards=("answers_engine_cleanup",),
        commands=("disarm_engine", "submit_unknown", "arm_report"),
        doc="Refused for another reason: the engine's state is not what the registry thinks; record UNKNOWN."),
    row("clean.lost", CE, "CLEANING", I.LOST, "RECORDING_UNKNOWN", guards=("answers_engine_cleanup",),
        commands=("disarm_engine", "submit_unknown", "arm_report"),
        doc="Unreachable: the cleanup may not have run; the placement stays CLEANING (capacity kept)."),
    row("clean.retry", CE, "WAITING_IDLE", I.DEADLINE, "CLEANING", guards=("backoff_timer",),
        commands=("send_cleanup",)),
    row("clean.deadline", CE, "CLEANING WAITING_IDLE", I.DEADLINE, "RECORDING_UNKNOWN", guards=("engine_timer",),
        commands=("disarm_backoff", "submit_unknown", "arm_report"),
        doc="The cleanup deadline: a call still in flight counts for nothing (its late answer lands on a late "
            "row); the placement is recorded UNKNOWN and stays CLEANING in the registry (capacity kept)."),
    row("cleaned.recorded", CE, "RECORDING", I.ANSWER, "CLEANED", guards=("answers_cleaned",),
        commands=("disarm_report", "note_capacity")),
    row("cleaned.refused", CE, "RECORDING", I.REFUSAL, "UNCONFIRMED", guards=("answers_cleaned",),
        commands=("disarm_report",), doc="A stale receipt (another attempt is live): the registry keeps what it has."),
    row("cleaned.lost", CE, "RECORDING", I.LOST, SAME, guards=("answers_cleaned",), commands=("submit_cleaned",),
        doc="The same key again: answered from the journal if it landed."),
    row("cleaned.deadline", CE, "RECORDING", I.DEADLINE, "UNCONFIRMED", guards=("report_timer",),
        doc="Not known to be recorded: unconfirmed (the registry may already be clean; `recover` finds out)."),
    row("unknown.recorded", CE, "RECORDING_UNKNOWN", I.ANSWER, "UNCONFIRMED", guards=("answers_unknown",),
        commands=("disarm_report",)),
    row("unknown.refused", CE, "RECORDING_UNKNOWN", I.REFUSAL, "UNCONFIRMED", guards=("answers_unknown",),
        commands=("disarm_report",)),
    row("unknown.lost", CE, "RECORDING_UNKNOWN", I.LOST, SAME, guards=("answers_unknown",),
        commands=("submit_unknown",)),
    row("unknown.deadline", CE, "RECORDING_UNKNOWN", I.DEADLINE, "UNCONFIRMED", guards=("report_timer",)),
    late("clean.late_reply", CE, "*", I.ANSWER, doc="A reply to a call this phase does not wait for."),
    late("clean.late_refusal", CE, "*", I.REFUSAL),
    late("clean.late_lost", CE, "*", I.LOST),
    late("clean.late_timer", CE, "*", I.DEADLINE),
    # ================================================================ reclaim
    row("reclaim.start", RC, "IDLE", I.START, "CLAIMING", commands=("submit_claim", "arm_claim"),
        doc="One key per version: a retried reclaim is the same claim, answered from the journal."),
    row("claim.engines", RC, "CLAIMING", I.ANSWER, "RECLAIMING", guards=("answers_claim", "names_reclaims"),
        commands=("disarm", "start_reclaims"),
        doc="Reclaim on exactly the engines the claim's answer names, with the capability it signed."),
    row("claim.already_done", RC, "CLAIMING", I.ANSWER, "DONE", guards=("answers_claim", "claim_says_reclaimed"),
        report=O.RECLAIMED, doc="claim.replay_done: every engine confirmed before."),
    row("claim.refused", RC, "CLAIMING", I.REFUSAL, "DONE", guards=("answers_claim",),
        report=O.REJECTED, doc="E.g. claim.in_use: nothing was unloaded."),
    row("claim.lost", RC, "CLAIMING", I.LOST, SAME, guards=("answers_claim",), commands=("submit_claim",)),
    row("claim.deadline", RC, "CLAIMING", I.DEADLINE, "DONE", report=O.UNKNOWN,
        doc="The claim may have landed: nothing is sent to any engine on the strength of it."),
    row("claim.cancel", RC, "CLAIMING", I.CANCEL, "DONE", report=O.UNKNOWN),
    row("reclaiming.all_confirmed", RC, "RECLAIMING", I.SETTLED, "DONE",
        guards=("reclaims_settled", "registry_says_reclaimed"), report=O.RECLAIMED,
        doc="The last confirm's answer says RECLAIMED: every engine unloaded, the slot is free."),
    row("reclaiming.unconfirmed", RC, "RECLAIMING", I.SETTLED, "DONE", guards=("reclaims_settled",),
        report=O.PENDING, doc="Some engine did not confirm: the slot stays taken; reclaim again."),
    late("reclaiming.waiting", RC, "RECLAIMING", I.SETTLED),
    row("reclaiming.cancel_reclaimed", RC, "RECLAIMING", I.CANCEL, "DONE", guards=("registry_says_reclaimed",),
        report=O.RECLAIMED, doc="A confirm's answer said RECLAIMED already: every engine confirmed in the registry."),
    row("reclaiming.cancel", RC, "RECLAIMING", I.CANCEL, "DONE", report=O.PENDING),
    late("reclaim.late_reply", RC, "RECLAIMING DONE", I.ANSWER),
    late("reclaim.late_refusal", RC, "RECLAIMING DONE", I.REFUSAL),
    late("reclaim.late_lost", RC, "RECLAIMING DONE", I.LOST),
    late("reclaim.late_timer", RC, "RECLAIMING DONE", I.DEADLINE),
    late("reclaim.late_cancel", RC, "DONE", I.CANCEL),
    # ================================================================ reclaim x engine
    row("unload.done", RE, "UNLOADING", I.ANSWER, "CONFIRMING", guards=("answers_engine_reclaim", "unloaded"),
        commands=("submit_confirm",), doc="UNLOADED on the engine: confirm under this reclaim id."),
    row("unload.draining", RE, "UNLOADING", I.ANSWER, SAME, guards=("answers_engine_reclaim",),
        commands=("send_reclaim",),
        doc="Unregistered, still draining SGLang's refcount: ask again (idempotent per reclaim id)."),
    row("unload.refused", RE, "UNLOADING", I.REFUSAL, "UNCONFIRMED", guards=("answers_engine_reclaim",),
        commands=("disarm_engine",), doc="E.g. a forged or stale reclaim id: nothing was unloaded."),
    row("unload.lost", RE, "UNLOADING", I.LOST, SAME, guards=("answers_engine_reclaim",), commands=("send_reclaim",),
        doc="Unreachable (restarting?): ask again under the same reclaim id until the deadline."),
    row("unload.deadline", RE, "UNLOADING CONFIRMING", I.DEADLINE, "UNCONFIRMED", guards=("engine_timer",),
        doc="The engine stays unconfirmed, the slot stays taken; the next reclaim asks again."),
    row("confirm.done", RE, "CONFIRMING", I.ANSWER, "CONFIRMED", guards=("answers_confirm",),
        commands=("disarm_engine", "note_reclaimed")),
    row("confirm.refused", RE, "CONFIRMING", I.REFUSAL, "UNCONFIRMED", guards=("answers_confirm",),
        commands=("disarm_engine",)),
    row("confirm.lost", RE, "CONFIRMING", I.LOST, SAME, guards=("answers_confirm",), commands=("submit_confirm",),
        doc="The same confirm key again: answered from the journal if it landed."),
    late("unload.late_reply", RE, "*", I.ANSWER),
    late("unload.late_refusal", RE, "*", I.REFUSAL),
    late("unload.late_lost", RE, "*", I.LOST),
    late("unload.late_timer", RE, "*", I.DEADLINE),
    # ================================================================ session
    # The bind: one call per session, under one key derived from the session key; every Bind waits for it.
    row("bind.start", SS, "OPEN", I.BIND, "BINDING", commands=("submit_bind", "arm_bind"),
        doc="The first generation's bind (RFC §4.1): the registry binds the session to its default, once."),
    late("bind.waiting", SS, "BINDING", I.BIND, doc="The one bind in flight answers this waiter too."),
    row("bind.again", SS, "BIND_UNKNOWN", I.BIND, "BINDING", commands=("arm_bind",),
        doc="A new waiter for the bind still being retried: its own deadline."),
    row("bind.known", SS, "BOUND", I.BIND, SAME, report=O.BOUND, to="bind",
        doc="Every later call returns the same binding, with no registry call."),
    row("bind.closing", SS, CLOSING_PHASES, I.BIND, SAME, report=O.REJECTED, to="bind", reason=R.SESSION_CLOSED),
    row("bind.bound", SS, "BINDING BIND_UNKNOWN", I.ANSWER, "BOUND", guards=("answers_bind", "bound_answer"),
        commands=("disarm_bind", "note_binding"), report=O.BOUND, to="bind"),
    row("bind.refused", SS, "BINDING BIND_UNKNOWN", I.REFUSAL, "OPEN", guards=("answers_bind",),
        commands=("disarm_bind",), report=O.REJECTED, to="bind",
        doc="NO_PUBLISHED_VERSION (nothing to bind yet) or SESSION_CLOSED: nothing was bound; a later Bind asks "
            "again under the same key."),
    row("bind.lost", SS, "BINDING BIND_UNKNOWN", I.LOST, SAME, guards=("answers_bind",), commands=("submit_bind",),
        doc="The bind may have landed: the same key again (answered from the journal if it did), until answered."),
    row("bind.deadline", SS, "BINDING", I.DEADLINE, "BIND_UNKNOWN", guards=("bind_timer",), report=O.UNKNOWN,
        to="bind", doc="The binding is unknown: nothing is dispatched; the retry goes on and settles it."),
    # Generations: each request id is a sub-machine (GENERATION); the session decides whether one may start.
    row("generate.start", SS, "BOUND", I.GENERATE, SAME, guards=("no_unknown",), commands=("open_request",),
        doc="Ask the registry's dispatch view where the bound version may go now."),
    row("generate.unresolved", SS, "BOUND", I.GENERATE, SAME, report=O.REJECTED, to="request",
        reason=R.UNRESOLVED_OUTCOME, doc="An earlier generation may have been accepted: never a new attempt first."),
    row("generate.unbound", SS, "OPEN BINDING BIND_UNKNOWN", I.GENERATE, SAME, report=O.REJECTED, to="request",
        reason=R.NOT_BOUND),
    row("generate.closing", SS, CLOSING_PHASES, I.GENERATE, SAME, report=O.REJECTED, to="request",
        reason=R.SESSION_CLOSED, doc="Nothing is dispatched once the session began closing."),
    row("resolve.nothing", SS, OPEN_PHASES + " " + CLOSING_PHASES, I.RESOLVE, SAME, report=O.RESOLVED, to="request",
        doc="No generation under that id: nothing is unknown."),
    # The close (Relax's _finish_session_once): begin_close, abort what is live, local cleanup, close once.
    row("finish.close_only", SS, "OPEN", I.FINISH, "RELEASING", guards=("close_only",),
        commands=("submit_close", "arm_close"),
        doc="A session this process does not hold (never opened here, or closed and forgotten): the registry "
            "closes it or answers its tombstone; nothing is released twice."),
    row("finish.binding", SS, "BINDING", I.FINISH, "CLOSING", commands=("disarm_bind", "submit_begin_close",
                                                                          "arm_close"),
        report=O.REJECTED, to="bind", reason=R.SESSION_CLOSED,
        doc="The bind's waiters are told the session is closing. The bind in flight lands before begin_close "
            "(the close releases its ref) or is refused by the registry; either way its answer lands late."),
    row("finish.start", SS, "OPEN BIND_UNKNOWN BOUND", I.FINISH, "CLOSING", commands=("submit_begin_close",
                                                                                     "arm_close"),
        doc="From here on nothing is dispatched; the registry refuses late opens and binds."),
    row("finish.again", SS, "CLOSING RELEASING", I.FINISH, SAME, commands=("arm_close",),
        doc="Another finish waits for the same close (its own deadline); nothing is sent twice."),
    late("finish.waiting", SS, "ABORTING CLEANING_UP", I.FINISH),
    row("finish.retry_cleanup", SS, "CLEANUP_FAILED", I.FINISH, "CLEANING_UP", commands=("run_cleanup",)),
    row("finish.closed", SS, "CLOSED", I.FINISH, SAME, report=O.CLOSED, to="finish",
        doc="The close's answer again: released once, reported to every finish."),
    row("closing.drain", SS, "CLOSING", I.ANSWER, "ABORTING", guards=("answers_begin_close", "requests_live"),
        commands=("disarm_close", "abort_requests"),
        doc="Abort every generation sent or unknown (SGLang's own refcount decides when the adapter is free)."),
    row("closing.cleanup", SS, "CLOSING", I.ANSWER, "CLEANING_UP", guards=("answers_begin_close", "has_cleanup"),
        commands=("disarm_close", "run_cleanup")),
    row("closing.release", SS, "CLOSING", I.ANSWER, "RELEASING", guards=("answers_begin_close",),
        commands=("submit_close", "arm_close")),
    row("closing.refused", SS, "CLOSING", I.REFUSAL, "CLOSED", guards=("answers_begin_close",), report=O.REJECTED,
        to="finish", doc="Another epoch's session: the registry will not close it here."),
    row("closing.lost", SS, "CLOSING", I.LOST, SAME, guards=("answers_begin_close",),
        commands=("submit_begin_close",), doc="The same key again, until answered."),
    row("closing.deadline", SS, "CLOSING", I.DEADLINE, SAME, guards=("close_timer",), report=O.UNKNOWN,
        to="finish", doc="Not known to have landed: the finish is told so; the retry goes on and the close follows."),
    row("drain.cleanup", SS, "ABORTING", I.SETTLED, "CLEANING_UP", guards=("requests_settled", "has_cleanup"),
        commands=("run_cleanup",)),
    row("drain.release", SS, "ABORTING", I.SETTLED, "RELEASING", guards=("requests_settled",),
        commands=("submit_close", "arm_close"), doc="Every generation ended: release the session's ref."),
    late("drain.waiting", SS, "ABORTING", I.SETTLED, doc="Other generations are still being aborted."),
    late("session.settled", SS, "BOUND CLOSING", I.SETTLED, doc="A generation ended while the session runs."),
    row("cleanup.done", SS, "CLEANING_UP", I.ANSWER, "RELEASING", guards=("answers_cleanup",),
        commands=("submit_close", "arm_close")),
    row("cleanup.failed", SS, "CLEANING_UP", I.LOST, "CLEANUP_FAILED", guards=("answers_cleanup",),
        report=O.REJECTED, to="finish", reason=R.CLEANUP_FAILED,
        doc="The caller's local cleanup raised: nothing is released; the next finish runs it again."),
    row("release.closed", SS, "RELEASING", I.ANSWER, "CLOSED", guards=("answers_close",), commands=("disarm_close",),
        report=O.CLOSED, to="finish"),
    row("release.refused", SS, "RELEASING", I.REFUSAL, "CLOSED", guards=("answers_close",), report=O.REJECTED,
        to="finish"),
    row("release.lost", SS, "RELEASING", I.LOST, SAME, guards=("answers_close",), commands=("submit_close",),
        doc="The close may have landed: the same key again, so the ref is released exactly once."),
    row("release.deadline", SS, "RELEASING", I.DEADLINE, SAME, guards=("close_timer",), report=O.UNKNOWN,
        to="finish"),
    late("session.late_reply", SS, "*", I.ANSWER,
         doc="A reply no phase waits for (a bind answered after the finish began: released by the close, or "
             "refused)."),
    late("session.late_refusal", SS, "*", I.REFUSAL),
    late("session.late_lost", SS, "*", I.LOST),
    late("session.late_timer", SS, "*", I.DEADLINE),
    late("session.late_cancel", SS, "*", I.CANCEL,
         doc="A caller gone before its request opened a generation (refused, or not yet stepped): nothing to drop."),
    # ================================================================ generation (one request id)
    row("view.closing", GN, "VIEWING", I.ANSWER, "FAILED", guards=("answers_view", "session_closing"),
        report=O.REJECTED, reason=R.SESSION_CLOSED, doc="The session began closing meanwhile: nothing is sent."),
    row("view.servable", GN, "VIEWING", I.ANSWER, "SENDING", guards=("answers_view", "servable"),
        commands=("note_engines", "send_generate"),
        doc="Only to engines where the registry has the version READY in their current incarnation."),
    row("view.unservable", GN, "VIEWING", I.ANSWER, "FAILED", guards=("answers_view",), report=O.REJECTED,
        reason=R.NOT_SERVABLE, doc="RECLAIMING, RECLAIMED, or READY nowhere now: refused before it leaves."),
    row("view.lost", GN, "VIEWING", I.LOST, "FAILED", guards=("answers_view",), report=O.REJECTED,
        reason=R.VIEW_UNAVAILABLE, doc="Nothing was sent: a certain failure."),
    row("generate.done", GN, "SENDING", I.ANSWER, "DONE", guards=("answers_generate", "session_active"),
        report=O.GENERATED),
    row("generate.dropped", GN, "SENDING", I.ANSWER, "DONE", guards=("answers_generate",), report=O.DROPPED,
        doc="The session began closing: a late response never reaches its caller, nothing reopens."),
    row("generate.redispatch", GN, "SENDING", I.REFUSAL,
        SAME, guards=("answers_generate", "version_unavailable", "engines_left", "session_active"),
        commands=("note_refused", "send_generate"),
        doc="An engine restarted before the registry adopted it refused the version: it certainly did not run "
            "there; the same binding goes to another engine of the view, never another version."),
    row("generate.refused", GN, "SENDING", I.REFUSAL, "FAILED", guards=("answers_generate",), report=O.REJECTED),
    row("generate.lost", GN, "SENDING", I.LOST, "UNKNOWN", guards=("answers_generate",), report=O.UNKNOWN,
        doc="Accepted or not, nobody can tell: never resent; the session refuses new generations until resolved."),
    row("generate.hangup", GN, "SENDING", I.CANCEL, "UNKNOWN", commands=("hang_up",), report=O.UNKNOWN,
        doc="The caller went away: the call is dropped (SGLang sees its client leave) and its outcome is unknown."),
    row("view.cancel", GN, "VIEWING", I.CANCEL, "FAILED", doc="The caller went away before anything was sent."),
    late("generation.cancel", GN, "UNKNOWN RESOLVING ABORTING DONE FAILED RESOLVED ABORTED", I.CANCEL,
         doc="Nothing of the caller's is in flight on an engine."),
    row("generate.rid_in_use", GN, ALL_GENERATION_PHASES, I.GENERATE, SAME, report=O.REJECTED, reason=R.RID_IN_USE),
    row("resolve.start", GN, "UNKNOWN", I.RESOLVE, "RESOLVING", commands=("send_abort",),
        doc="End it on the engine (an abort of a request that never arrived, or ended, is harmless)."),
    late("resolve.waiting", GN, "RESOLVING", I.RESOLVE),
    row("resolve.known", GN, "VIEWING SENDING ABORTING DONE FAILED RESOLVED ABORTED", I.RESOLVE, SAME,
        report=O.RESOLVED, doc="Nothing unknown under that id."),
    row("resolve.done", GN, "RESOLVING", I.ANSWER, "RESOLVED", guards=("answers_abort",), report=O.RESOLVED,
        doc="A known failure now: a new attempt may be made."),
    row("resolve.closing", GN, "RESOLVING", I.LOST, "ABORTED", guards=("answers_abort", "session_closing"),
        report=O.DROPPED, doc="The close waits for it: given up like the close's own aborts (best effort)."),
    row("resolve.lost", GN, "RESOLVING", I.LOST, "UNKNOWN", guards=("answers_abort",), report=O.UNKNOWN),
    row("close_abort.answered", GN, "ABORTING", I.ANSWER, "ABORTED", guards=("answers_abort",), report=O.DROPPED,
        doc="The close's abort: whatever the generation answers after it is not delivered."),
    row("close_abort.lost", GN, "ABORTING", I.LOST, "ABORTED", guards=("answers_abort",), report=O.DROPPED,
        doc="Best effort: the session's ref is released by the close, and SGLang's own refcount keeps the "
            "adapter until the request ends (a reclaim waits for it)."),
    late("generation.late_reply", GN, "*", I.ANSWER, doc="A reply to a call this phase does not wait for."),
    late("generation.late_refusal", GN, "*", I.REFUSAL),
    late("generation.late_lost", GN, "*", I.LOST),
    # ================================================================ supervise (one restarted engine)
    # What the engine owes is the registry's answer to its new incarnation (restart.new's effects); the supervisor
    # decides only what to do with each answer. It stages no attempt its own process's Publisher is staging (the
    # caller names those in `own`): that publication's own begin reaches the new incarnation, or fails and is
    # aborted. Cleanups and reclaims the answer names are left to `Publisher.recover` and `Reclaimer.reclaim`, whose
    # drivers' rows finish them.
    row("supervise.start", SV, "IDLE", I.START, "ASKING", commands=("read_incarnation", "arm_incarnation"),
        doc="Ask the engine which incarnation it runs now (a restarted one has a new one and holds nothing)."),
    row("incarnation.read", SV, "ASKING", I.ANSWER, "ADOPTING", guards=("answers_incarnation",),
        commands=("disarm_incarnation", "note_incarnation", "submit_restarted", "arm_restarted"),
        doc="Report it under one key per engine and incarnation: reconciling again is answered from the journal, "
            "with the same attempts."),
    row("incarnation.refused", SV, "ASKING", I.REFUSAL, "DONE", guards=("answers_incarnation",),
        commands=("disarm_incarnation",), report=O.REJECTED, doc="Nothing was reported: reconcile again."),
    row("incarnation.lost", SV, "ASKING", I.LOST, "DONE", guards=("answers_incarnation",),
        commands=("disarm_incarnation",), report=O.REJECTED,
        doc="The engine did not answer (still starting?): nothing was reported; reconcile again once it is up."),
    row("incarnation.deadline", SV, "ASKING", I.DEADLINE, "DONE", guards=("incarnation_timer",), report=O.REJECTED,
        doc="A read changes nothing: its late answer lands late, and nothing was reported."),
    row("adopt.rehydrate", SV, "ADOPTING", I.ANSWER, "REHYDRATING", guards=("answers_restarted", "names_rehydrates"),
        commands=("disarm_restarted", "open_rehydrates"),
        doc="One rehydrate per version the answer stages on this engine, except the attempts of `own`; every other "
            "effect is left to the driver that owns it."),
    row("adopt.nothing", SV, "ADOPTING", I.ANSWER, "DONE", guards=("answers_restarted",),
        commands=("disarm_restarted", "open_rehydrates"), report=O.RECONCILED,
        doc="Nothing to rehydrate here (what the answer names is left to its own driver)."),
    row("adopt.refused", SV, "ADOPTING", I.REFUSAL, "DONE", guards=("answers_restarted",),
        commands=("disarm_restarted",), report=O.REJECTED,
        doc="restart.stale: the registry holds a newer incarnation (the engine restarted again): reconcile again."),
    row("adopt.lost", SV, "ADOPTING", I.LOST, SAME, guards=("answers_restarted",), commands=("submit_restarted",),
        doc="It may have landed: the same key again (answered from the journal if it did)."),
    row("adopt.deadline", SV, "ADOPTING", I.DEADLINE, "DONE", guards=("restarted_timer",), report=O.UNKNOWN,
        doc="The adoption may have landed (then routing already keeps requests off the engine): nothing is staged "
            "on the strength of it; reconciling again sends the same key."),
    row("rehydrating.done", SV, "REHYDRATING", I.SETTLED, "DONE", guards=("rehydrates_settled",),
        report=O.RECONCILED,
        doc="Every version owed is READY there, or failed and says why (its placement stays short of READY, so no "
            "request goes there for it; reconciling again stages it again)."),
    late("rehydrating.waiting", SV, "REHYDRATING", I.SETTLED, doc="Other versions are still being staged."),
    row("supervise.cancel", SV, "ASKING ADOPTING REHYDRATING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: calls in flight are cancelled; what was not staged stays short of READY."),
    late("supervise.late_reply", SV, "ADOPTING REHYDRATING DONE", I.ANSWER,
         doc="The read's or the report's answer after their deadline, or after a cancel."),
    late("supervise.late_refusal", SV, "ADOPTING REHYDRATING DONE", I.REFUSAL),
    late("supervise.late_lost", SV, "ADOPTING REHYDRATING DONE", I.LOST),
    late("supervise.late_timer", SV, "ADOPTING REHYDRATING DONE", I.DEADLINE,
         doc="A timer that fired while its call's answer was already in the inbox."),
    late("supervise.late_cancel", SV, "DONE", I.CANCEL),
    # ================================================================ rehydrate (one version the engine owes)
    row("placement.ready", RH, "VIEWING", I.ANSWER, "READY", guards=("answers_placement", "placement_ready"),
        doc="READY there already (a reconcile asked again and its answer was replayed): nothing is staged twice."),
    row("placement.stage", RH, "VIEWING", I.ANSWER, "STAGING", guards=("answers_placement",),
        commands=("send_rehydrate",),
        doc="Stage it under the attempt the registry issued, from the snapshot store by the digest it names (the "
            "stage driver: begin, each bucket, end, the probe, READY recorded)."),
    row("placement.lost", RH, "VIEWING", I.LOST, "FAILED", guards=("answers_placement",), commands=("note_failure",),
        doc="The registry could not be read: nothing was staged."),
    row("placement.refused", RH, "VIEWING", I.REFUSAL, "FAILED", guards=("answers_placement",),
        commands=("note_failure",),
        doc="A read is answered or lost; a refusal of it is a port outside its contract: nothing was staged."),
    row("rehydrate.ready", RH, "STAGING", I.ANSWER, "READY", guards=("answers_rehydrate",),
        doc="READY recorded for this incarnation: requests for the version may go to the engine again."),
    row("rehydrate.refused", RH, "STAGING", I.REFUSAL, "FAILED", guards=("answers_rehydrate",),
        commands=("note_failure",),
        doc="The snapshot missing or corrupt, the engine refusing, the probe differing: not READY there."),
    row("rehydrate.lost", RH, "STAGING", I.LOST, "FAILED", guards=("answers_rehydrate",), commands=("note_failure",),
        doc="Not known to be READY: the registry's placement says what landed; reconciling again finishes it."),
    # ================================================================ recover (what a crashed publisher left)
    # The registry holds at most one attempt pending (it refuses a reserve while one is: reserve.while_pending), so a
    # recovery settles at most one. A LOADING attempt may be READY everywhere: its commit decides (the registry
    # refuses one that is not, and the settle driver aborts it). It is committed only if the snapshot store holds
    # its bytes: a publisher that died before writing them left a version nobody could rehydrate after a restart.
    # An ABORTED one is aborted again under its abort key, whose answer names the cleanups still owed.
    row("recover.start", RV, "IDLE", I.START, "VIEWING", commands=("view_pending",),
        doc="Read the registry's versions: the rows pick the pending one (LOADING or ABORTED)."),
    row("pending.none", RV, "VIEWING", I.ANSWER, "DONE", guards=("answers_pending", "nothing_pending"),
        report=O.RECOVERED, doc="Nothing was left: no lease is taken."),
    row("pending.found", RV, "VIEWING", I.ANSWER, "LEASING", guards=("answers_pending",),
        commands=("note_pending", "acquire_lease"),
        doc="Only the lease's holder finishes what a crashed publisher left: another publisher's attempt in "
            "flight looks the same from here, and settling it would end a publication that is going well."),
    row("pending.refused", RV, "VIEWING", I.REFUSAL, "DONE", guards=("answers_pending",), report=O.REJECTED),
    row("pending.lost", RV, "VIEWING", I.LOST, "DONE", guards=("answers_pending",), report=O.REJECTED,
        doc="The registry could not be read: nothing was done."),
    row("lease.granted_commit", RV, "LEASING", I.ANSWER, "SETTLING", guards=("answers_lease", "committable"),
        commands=("note_fence", "settle_commit"),
        doc="LOADING, and its bytes are in the store: commit it under the lease's fence."),
    row("lease.granted_abort", RV, "LEASING", I.ANSWER, "SETTLING", guards=("answers_lease",),
        commands=("note_fence", "settle_abort"),
        doc="ABORTED, or LOADING without its bytes in the store: abort it and clean what the answer names."),
    row("lease.refused", RV, "LEASING", I.REFUSAL, "DONE", guards=("answers_lease",), report=O.REJECTED,
        doc="LEASE_HELD: another publisher works; the attempt is left as it is."),
    row("lease.lost", RV, "LEASING", I.LOST, "DONE", guards=("answers_lease",), report=O.UNKNOWN,
        doc="The lease may be ours (it expires unrenewed): nothing was settled."),
    row("settled.unknown", RV, "SETTLING", I.ANSWER, "DONE", guards=("answers_settle", "settle_unknown"),
        commands=("note_settled",), report=O.UNKNOWN,
        doc="A commit or an abort whose outcome is unknown (a commit's settle driver goes on resolving it): "
            "nothing further before it is known (RFC §3.4); `recover` again retries the same key."),
    row("settled.known", RV, "SETTLING", I.ANSWER, "DONE", guards=("answers_settle",), commands=("note_settled",),
        report=O.RECOVERED, doc="COMMITTED or FAILED_CLEAN: the slot is settled."),
    row("settle.refused", RV, "SETTLING", I.REFUSAL, "DONE", guards=("answers_settle",), report=O.UNKNOWN,
        doc="A settle driver answers with its outcome; anything else leaves the attempt as the registry has it."),
    row("settle.lost", RV, "SETTLING", I.LOST, "DONE", guards=("answers_settle",), report=O.UNKNOWN,
        doc="The settle driver failed outside its rows: the attempt's outcome is not known."),
    row("recover.cancel", RV, "VIEWING LEASING SETTLING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: a settle driver in flight goes on (a commit is never left unresolved)."),
    late("recover.late_reply", RV, "DONE", I.ANSWER, doc="A call's answer after the caller gave up."),
    late("recover.late_refusal", RV, "DONE", I.REFUSAL),
    late("recover.late_lost", RV, "DONE", I.LOST),
    late("recover.late_cancel", RV, "DONE", I.CANCEL),
    # ================================================================ lease (one publisher at a time, RFC §3)
    # A keeper acquires the lease (or, told to, takes over the fence live when it reads it) and renews it a third of
    # its ttl apart while its caller publishes. It decides nothing about the publication: a lease lost meanwhile
    # (expired or taken over) makes the registry itself refuse the publication's next Reserve or Commit under the old
    # fence (reserve.no_lease, commit.no_lease). A renewal waits for its answer with no timer of its own: the lease's
    # ttl bounds it (one answered too late is refused, lease.renew_lost), and the port's transport answers Lost.
    row("keeper.start", LS, "IDLE", I.START, "VIEWING", commands=("read_live_fence", "arm_acquire"),
        doc="First read the lease's fence now (one registry read, under the acquire's own deadline): the acquire's "
            "key names it (acquire_key), so a retry is the same call and a new acquisition a new one. An operator's "
            "take-over ends that fence, and no later one: a lease that moves on meanwhile is not "
            "(lease.take_over_moved)."),
    row("live.read", LS, "VIEWING", I.ANSWER, "ACQUIRING", guards=("answers_live_fence",),
        commands=("note_live", "submit_acquire"),
        doc="Acquire (the holder asking again is answered lease.acquire_replay), or take over the fence read "
            "(lease.take_over; none live: an ordinary acquire), under the key the read derives."),
    row("live.lost", LS, "VIEWING", I.LOST, SAME, guards=("answers_live_fence",), commands=("read_live_fence",),
        doc="Nothing was sent: read again (after the executor's pause) until the acquire's deadline."),
    row("live.refused", LS, "VIEWING", I.REFUSAL, "DONE", guards=("answers_live_fence",), commands=("disarm_acquire",),
        report=O.REJECTED,
        doc="A read is answered or lost; a refusal of it is a port outside its contract. Nothing was sent: "
            "the lease is as it was (waiting for the deadline would leave its timer bounding no call)."),
    row("live.deadline", LS, "VIEWING", I.DEADLINE, "DONE", guards=("acquire_timer",), report=O.UNKNOWN,
        doc="Nothing was sent: the lease is as it was. The caller is told its deadline passed, as at "
            "acquire.deadline."),
    row("live.cancel", LS, "VIEWING", I.CANCEL, "DONE", report=O.UNKNOWN, doc="The caller gave up: nothing was sent."),
    row("acquire.granted", LS, "ACQUIRING", I.ANSWER, "HOLDING", guards=("answers_acquire",),
        commands=("disarm_acquire", "note_lease", "arm_renew"), report=O.LEASED,
        doc="The fence the publication's Reserve and Commit carry; the first renewal a third of the ttl from now."),
    row("acquire.refused", LS, "ACQUIRING", I.REFUSAL, "DONE", guards=("answers_acquire",), report=O.REJECTED,
        doc="LEASE_HELD: another publisher holds it (or took it over since the fence named): nothing is reserved."),
    row("acquire.lost", LS, "ACQUIRING", I.LOST, SAME, guards=("answers_acquire",), commands=("submit_acquire",),
        doc="The same key again: answered from the journal if the first landed."),
    row("acquire.deadline", LS, "ACQUIRING", I.DEADLINE, "DONE", guards=("acquire_timer",), report=O.UNKNOWN,
        doc="The lease may be ours (it expires unrenewed): nothing is reserved under a fence we do not know."),
    row("acquire.cancel", LS, "ACQUIRING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: as a missed deadline."),
    row("hold.renew", LS, "HOLDING", I.DEADLINE, "RENEWING", guards=("renew_timer",), commands=("submit_renew",),
        doc="The registry's timer for this fence starts again (lease.renew); nothing else changes."),
    row("renew.renewed", LS, "RENEWING", I.ANSWER, "HOLDING", guards=("answers_renew",), commands=("arm_renew",)),
    row("renew.refused", LS, "RENEWING", I.REFUSAL, "DONE", guards=("answers_renew",), commands=("note_lost",),
        report=O.REJECTED,
        doc="lease.renew_lost: the lease expired or was taken over. The keeper stops; what stops the publication "
            "is the registry refusing its next call under this fence."),
    row("renew.lost", LS, "RENEWING", I.LOST, "HOLDING", guards=("answers_renew",), commands=("arm_renew",),
        doc="The registry could not be reached: asked again a period from now (a renewal is idempotent)."),
    row("keeper.stop", LS, "HOLDING RENEWING", I.CANCEL, "DONE", report=O.STOPPED,
        doc="The publication ended: no more renewals. The lease is not released (the next publication of this "
            "holder reuses it); it expires a ttl after the last renewal."),
    late("keeper.late_timer", LS, "HOLDING RENEWING DONE", I.DEADLINE,
         doc="The acquire's timer, fired while its answer was already in the inbox."),
    late("keeper.late_reply", LS, "HOLDING DONE", I.ANSWER, doc="An answer after the caller stopped the keeper."),
    late("keeper.late_refusal", LS, "HOLDING DONE", I.REFUSAL),
    late("keeper.late_lost", LS, "HOLDING DONE", I.LOST),
    late("keeper.late_cancel", LS, "DONE", I.CANCEL),
    # ================================================================ publish (one publication, end to end)
    # The choice between commit and abort, once the staging has ended: the stage driver's outcome and the snapshot
    # store's write decide it here, and the settle driver carries it out. The stage and settle drivers run as one
    # call each (their own rows are checked on their own; model_checks/drivers.py runs them as one step here).
    row("publish.start", PB, "IDLE", I.START, "STAGING", commands=("run_stage",),
        doc="The stage driver: the reserve, then every engine's staging (the snapshot store's write starts as soon "
            "as the attempt is known, beside the staging)."),
    row("publish.staged", PB, "STAGING", I.ANSWER, "STORING", guards=("answers_stage", "stage_staged"),
        commands=("note_stage", "wait_stored"),
        doc="READY recorded from every engine. A version the registry may serve is always in the store, so the "
            "commit waits for the write."),
    row("publish.stage_failed", PB, "STAGING", I.ANSWER, "SETTLING", guards=("answers_stage", "stage_failed"),
        commands=("note_stage", "settle_abort"),
        doc="Some engine's staging failed, or the reserve named another lora_name: certainly not committed. "
            "Abort, and clean exactly what the abort's answer names."),
    row("publish.replayed", PB, "STAGING", I.ANSWER, "DONE", guards=("answers_stage", "stage_replayed"),
        commands=("note_stage",), report=O.REPLAYED, doc="The same version and content was published before."),
    row("publish.rejected", PB, "STAGING", I.ANSWER, "DONE", guards=("answers_stage", "stage_rejected"),
        commands=("note_stage",), report=O.REJECTED,
        doc="Refused at reserve (capacity, a pending attempt, a conflict, a dead lease fence): nothing was taken."),
    row("publish.stage_unknown", PB, "STAGING", I.ANSWER, "DONE", guards=("answers_stage",), commands=("note_stage",),
        report=O.UNKNOWN,
        doc="The reserve's answer is unknown: it may have taken the slot. Nothing is aborted (there may be nothing "
            "to abort); publishing the same content again retries the same reserve, which the journal answers."),
    row("publish.stage_refused", PB, "STAGING", I.REFUSAL, "DONE", guards=("answers_stage",), report=O.UNKNOWN,
        doc="A stage driver answers with its outcome; anything else leaves the attempt as the registry has it."),
    row("publish.stage_lost", PB, "STAGING", I.LOST, "DONE", guards=("answers_stage",), report=O.UNKNOWN,
        doc="The stage driver failed outside its rows: nothing is known of the attempt (`recover` settles it)."),
    row("publish.stored", PB, "STORING", I.ANSWER, "SETTLING", guards=("answers_store",), commands=("settle_commit",),
        doc="Commit under the lease's fence (resolved until known, the settle driver's rows)."),
    row("publish.store_failed", PB, "STORING", I.REFUSAL, "SETTLING", guards=("answers_store",),
        commands=("settle_abort",),
        doc="The store could not take the bytes: a version nobody could rehydrate after a restart is never "
            "committed. Abort it (it is certainly not committed yet)."),
    row("publish.store_lost", PB, "STORING", I.LOST, "SETTLING", guards=("answers_store",), commands=("settle_abort",),
        doc="The write did not finish within its deadline: the same; the content-addressed store keeps nothing "
            "the registry names."),
    row("publish.committed", PB, "SETTLING", I.ANSWER, "DONE", guards=("answers_settle", "settle_committed"),
        commands=("note_settled",), report=O.COMMITTED),
    row("publish.cleaned", PB, "SETTLING", I.ANSWER, "DONE", guards=("answers_settle", "settle_clean"),
        commands=("note_settled",), report=O.FAILED_CLEAN),
    row("publish.settle_unknown", PB, "SETTLING", I.ANSWER, "DONE", guards=("answers_settle",),
        commands=("note_settled",), report=O.UNKNOWN,
        doc="A commit or an abort whose outcome is unknown (a commit's settle driver goes on resolving it), or a "
            "cleanup some engine did not confirm: the slot stays taken, nothing further before it is known."),
    row("publish.settle_refused", PB, "SETTLING", I.REFUSAL, "DONE", guards=("answers_settle",), report=O.UNKNOWN,
        doc="A settle driver answers with its outcome; anything else leaves the attempt as the registry has it."),
    row("publish.settle_lost", PB, "SETTLING", I.LOST, "DONE", guards=("answers_settle",), report=O.UNKNOWN,
        doc="The settle driver failed outside its rows: the attempt's outcome is not known."),
    row("publish.cancel", PB, "STAGING STORING SETTLING", I.CANCEL, "DONE", report=O.UNKNOWN,
        doc="The caller gave up: a staging in flight is cancelled (rows reserve.cancel, stage.cancel: `recover` "
            "settles the attempt); a commit goes on until it is answered."),
    late("publish.late_reply", PB, "DONE", I.ANSWER, doc="A call's answer after the caller gave up."),
    late("publish.late_refusal", PB, "DONE", I.REFUSAL),
    late("publish.late_lost", PB, "DONE", I.LOST),
    late("publish.late_cancel", PB, "DONE", I.CANCEL),
)
# fmt: on

DRIVER_ROWS_BY_ID: dict[str, DriverRow] = {r.id: r for r in DRIVER_ROWS}


def driver_rows_for(machine: Driver, rows: tuple[DriverRow, ...] = DRIVER_ROWS) -> tuple[DriverRow, ...]:
    return tuple(r for r in rows if r.machine is machine)


# The pairs no row covers, and why none can happen with an executor that follows driver_loop.py: reaching
# one is the ProtocolError (the model checker counts it as a violation).
NOT_POSSIBLE = {
    "stage replies": "the stage coordinator's one call is the reserve, answered once: past RESERVING, every reply "
    "is an engine's and reaches that engine's sub-machine; only a finished coordinator receives them (late rows)",
    "IDLE": "the executor's first input is Start; nothing else is in flight before it",
    "Start": "Start is sent once, before any other input",
    "Settled": "only a sub-machine that just finished produces it, and only while its coordinator waits for it "
    "(a session's generations exist from BOUND on, and the close waits for every one of them before CLEANING_UP)",
    "session Start": "a session has no Start: it waits for its caller's Bind, Generate, Resolve or Finish",
    "rehydrate ended": "a rehydrate has one call in flight at a time, answered once, and no timer or cancel of its "
    "own: nothing reaches it once it is READY or FAILED",
}


def uncovered_driver_pairs(rows: tuple[DriverRow, ...] = DRIVER_ROWS) -> tuple[tuple[Driver, str, Input], ...]:
    """(machine, phase, input) pairs no row covers: reaching one raises the ProtocolError."""
    covered = {(r.machine, s, r.input) for r in rows for s in r.expanded_sources()}
    return tuple((m, p, i) for m in Driver for p in PHASES[m] for i in INPUTS[m] if (m, p, i) not in covered)
