"""The driver machines of `spec/drivers.py`, sans-I/O: `step(state, input) -> DriverStep`.

The table decides; this module holds the named guards and command builders its rows refer to, and the
one `step` that picks a row. States, inputs and commands are frozen values (hashable, so the model
checker interns them); every idempotency key is derived from the state (`keys_of`), never from a clock
or a uuid. Nothing here does I/O or knows about asyncio, Ray or HTTP: `runtime/driver_loop.py` executes
the commands and feeds their outcomes back as inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
from immutables import Map

from versioned_lora.lifecycle.effects import CapacityFreed, CleanupOnEngine, ReclaimOnEngine, StageOnEngine
from versioned_lora.lifecycle.errors import ProtocolError
from versioned_lora.lifecycle.results import (
    Aborted,
    Bound,
    LeaseGranted,
    ReclaimClaimed,
    ReclaimConfirmed,
    Rejected,
    Reserved,
)
from versioned_lora.spec.drivers import DRIVER_ROWS, SETTLES, TERMINAL, Driver, DriverOutcome, DriverRow, Input
from versioned_lora.spec.events import (
    NO_FENCE,
    Abort,
    AcquireLease,
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    EngineRestarted,
    RecordCleaned,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    RegistryEvent,
    RenewLease,
    Reserve,
    TakeOverLease,
)
from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import SAME, PlacementState, VersionState

# ---------------------------------------------------------------- calls, timers, inputs, commands


@attrs.frozen(order=True)
class Call:
    """Which of a driver's calls a reply belongs to: an operation, and the engine for per-engine calls."""

    op: str
    engine: str = ""


@attrs.frozen(order=True)
class Timer:
    """A timer names the one call it bounds: a Deadline of an earlier call (already in the inbox when that call
    was answered) never passes for the deadline of the next one, so it lands on a late row."""

    name: str  # "reserve" | "commit" | "abort" | "claim" | "engine" | "report" | "backoff"; staging: the call's op
    engine: str = ""
    index: int = -1  # staging's bucket calls: the bucket


@attrs.frozen
class Reply:
    """A registry answer as the driver sees it (the runtime's RegistryAnswer, minus transport fields)."""

    result: Any
    effects: tuple[Any, ...] = ()
    capabilities: tuple[str | None, ...] = ()


@attrs.frozen
class Start:
    pass


@attrs.frozen
class Answer:
    call: Call
    value: Any = None  # a Reply for registry calls; the engine call's return value otherwise


@attrs.frozen
class Refusal:
    call: Call
    reason: str
    origin: str = ""  # who refused, where the call may go to several parties (a generation: the engine)


@attrs.frozen
class Lost:
    call: Call


@attrs.frozen
class Deadline:
    timer: Timer


@attrs.frozen
class Cancel:
    """The caller stopped waiting: for its whole work, or (a session's) for the generation `rid`."""

    rid: str = ""


@attrs.frozen
class Settled:
    engine: str


@attrs.frozen
class Bind:
    """A session's caller needs its binding (every generation asks first)."""


@attrs.frozen
class Generate:
    rid: str


@attrs.frozen
class Resolve:
    """End the generation `rid` whose outcome is unknown, so a new attempt may be made."""

    rid: str


@attrs.frozen
class Finish:
    pass


DriverInput: TypeAlias = (Start | Answer | Refusal | Lost | Deadline | Cancel | Settled | Bind | Generate | Resolve
                          | Finish)


@attrs.frozen
class Submit:
    """One registry call under `key` (the same key on every retry of the same call)."""

    call: Call
    event: RegistryEvent
    key: str


@attrs.frozen
class CleanupEngine:
    call: Call
    engine: str
    lora_name: str
    attempt_token: str
    capability: str | None


@attrs.frozen
class ReclaimEngine:
    """Unregister, wait for the refcount to drain (up to the executor's poll interval), unload once."""

    call: Call
    engine: str
    lora_name: str
    reclaim_id: str
    capability: str | None


@attrs.frozen
class StageEngine:
    """One staging call on one engine: `begin`, bucket `index`, or `end` (the executor runs the port's call;
    `end` answers with the engine's receipt: READY_LOCAL, its incarnation and digest, and the probe)."""

    call: Call  # op: "begin" | "bucket" | "end"
    engine: str
    index: int = -1  # the bucket, for "bucket"


@attrs.frozen
class CheckProbe:
    """Check an engine's `end` receipt: what it serves (the served digest and config it read back from its own LoRA
    pool) against the snapshot's, then its probe against the reference. Answered True (both hold), False (the probe
    differs), or a `CheckRefused` naming the check that failed (SERVED_DIGEST_MISMATCH, SERVED_CONFIG_MISMATCH)."""

    call: Call  # op: "probe"
    engine: str
    receipt: Any


@attrs.frozen
class CheckRefused:
    """A `CheckProbe` answer that refuses the receipt for a typed reason: `code` is the refusal's code (the one the
    publication's outcome carries), `detail` names both sides."""

    code: str
    detail: str = ""


@attrs.frozen
class DropLink:
    """The engine's transfer group may hold a half-done collective: never use it again (the next call joins a
    new one). No reply: the executor does it at once."""

    engine: str


@attrs.frozen
class ViewDispatch:
    """Read the registry's dispatch view of `version`: answered with the engines it may go to now (maybe none)."""

    call: Call  # op: "view", engine: the request id
    version: VersionKey


@attrs.frozen
class SendGeneration:
    """One generation attempt to one of `engines`, carrying the bound `lora_name`: answered with the response,
    refused (an engine's typed refusal, `origin` the engine), or lost (its outcome unknown)."""

    call: Call  # op: "generate", engine: the request id
    rid: str  # the attempt's request id on the engine (a re-dispatch after a refusal gets its own)
    lora_name: str
    engines: frozenset[str]


@attrs.frozen
class AbortGeneration:
    """Ask the engine to end `rid` (harmless for a request that never arrived or ended)."""

    call: Call  # op: "abort", engine: the request id
    rid: str


@attrs.frozen
class HangUp:
    """Stop waiting for `call` at once: the executor drops it (an HTTP generation's engine sees its client go)."""

    call: Call


@attrs.frozen
class LocalCleanup:
    """The session's caller's own cleanup before the close (Relax's local record): answered, or lost if it raised."""

    call: Call  # op: "local_cleanup"


@attrs.frozen
class ReadIncarnation:
    """Ask the engine which incarnation it runs now: answered with the number."""

    call: Call  # op: "incarnation"
    engine: str


@attrs.frozen
class ReadRevision:
    """Read the registry's default revision (its publication view's): answered with the number."""

    call: Call  # op: "revision"


@attrs.frozen
class ReadLiveFence:
    """Read the fence of the publisher lease now (its publication view's: the live one, else the last one granted):
    answered with the number (NO_FENCE: none was ever granted)."""

    call: Call  # op: "live_fence"


@attrs.frozen
class ReadAttempt:
    """Read `version`'s last attempt in the registry (its publication view's): answered with its attempt token ("":
    the registry holds no such version)."""

    call: Call  # op: "attempt"
    version: VersionKey


@attrs.frozen
class ViewPlacement:
    """Read the registry's placement of `version` on `engine`: answered with its PlacementState."""

    call: Call  # op: "placement", engine: the attempt token (the rehydrate's key)
    version: VersionKey
    engine: str


@attrs.frozen
class Rehydrate:
    """Stage `order` (an attempt the registry issued for a restarted engine) from the snapshot store by its digest:
    the executor runs the stage driver (its own rows and deadlines) and answers True once READY was recorded, a
    Refusal (why) if it failed, Lost if the registry could not be reached."""

    call: Call  # op: "rehydrate", engine: the attempt token
    order: StageOnEngine


@attrs.frozen
class PendingAttempt:
    """A version's attempt as the registry holds it, and whether the snapshot store holds its bytes."""

    version: VersionKey
    state: VersionState
    attempt_token: str
    lora_name: str
    stored: bool


@attrs.frozen
class ViewPending:
    """Read every version's attempt from the registry: answered with a tuple of `PendingAttempt`, in version order
    (the rows pick the pending ones)."""

    call: Call  # op: "pending"


@attrs.frozen
class TakeLease:
    """Acquire the publisher lease (the holder asking again renews it): answered with `LeaseGranted`, or refused."""

    call: Call  # op: "lease"


@attrs.frozen
class SettleAttempt:
    """Run the settle driver for `attempt`: commit it under `fence` (resolved until known, its own rows), or abort it
    and clean what the answer names. Answered with the settle driver's outcome (a `DriverOutcome`)."""

    call: Call  # op: "settle"
    attempt: PendingAttempt
    commit: bool
    fence: int


@attrs.frozen
class StageResult:
    """A stage driver's outcome as its publication sees it: the report, the attempt the registry issued ("" if
    the reserve's answer never came), and the key its reserve went under ("" if none was sent)."""

    outcome: DriverOutcome
    attempt_token: str
    reserve_key: str = ""


@attrs.frozen
class RunStage:
    """Run the publication's stage driver (its reserve and every engine's staging, its own rows) for the publication's
    content, reserving under `reserve_key` ("": the stage driver derives it): answered with a `StageResult`."""

    call: Call  # op: "stage"
    version: VersionKey
    digest: str
    lora_name: str
    fence: int
    reserve_key: str


@attrs.frozen
class WaitStored:
    """Wait until the snapshot store holds the candidate's bytes (written beside the staging): answered once it
    does (at once without a store), refused if the write failed, Lost past its deadline."""

    call: Call  # op: "store"


@attrs.frozen
class Arm:
    timer: Timer
    deadline: str  # the `runtime.deadlines.Deadlines` field that gives its seconds


@attrs.frozen
class Disarm:
    timer: Timer


@attrs.frozen
class Report:
    """Tell the caller how the work ended (the driver may go on: a commit reported UNKNOWN is resolved)."""

    outcome: DriverOutcome
    reason: str | None = None
    subject: str = ""  # a session's: "bind", "finish" or a request id (whose caller it answers); else ""


# The calls: one I/O each (some run a driver of their own).
Call_: TypeAlias = (Submit | StageEngine | CheckProbe | CleanupEngine | ReclaimEngine | ViewDispatch | SendGeneration
                    | AbortGeneration | LocalCleanup | ReadIncarnation | ReadRevision | ReadLiveFence | ViewPlacement
                    | Rehydrate | ViewPending | TakeLease | SettleAttempt | RunStage | WaitStored | ReadAttempt)
Command: TypeAlias = Call_ | DropLink | HangUp | Arm | Disarm | Report

# ---------------------------------------------------------------- driver states

UNREAD = -1  # a settle driver's expected revision before its read (an abort never reads it)


@attrs.frozen
class StageFailure:
    """Why one engine's staging failed: the input kind that failed it (a refusal, a lost call, a deadline, or
    the probe check's answer), the call, and a refusal's reason."""

    kind: Input
    op: str
    reason: str | None = None


@attrs.frozen
class StageEngineState:
    phase: str
    order: StageOnEngine
    receipt: Any = None  # the engine's `end` answer, once it came
    failure: StageFailure | None = None


@attrs.frozen
class StageState:
    """One attempt: its reserve (a publication), then its staging on the engines the reserve's answer names, or
    on one restarted engine (a rehydrate, whose attempt the registry issued already)."""

    phase: str
    version: VersionKey
    attempt_token: str  # "" until the reserve's answer names it
    bucket_count: int
    engines: Map[str, StageEngineState] = attrs.field(factory=Map)
    bucket: int = -1  # the bucket sent last to every engine (-1: none yet)
    reason: str | None = None
    # A publication's reserve: the content, the name the candidate carries, its key ("" until derived from the
    # version's last attempt, row attempt.read; the caller's after a reserve left unknown) and the lease's fence.
    digest: str = ""
    lora_name: str = ""
    reserve_key: str = ""
    fence: int = NO_FENCE


@attrs.frozen
class CleanupEngineState:
    phase: str
    order: CleanupOnEngine
    capability: str | None
    freed: bool = False  # the registry's answer to this engine's cleaned receipt freed the slot


@attrs.frozen
class SettleState:
    """A staged attempt's end game. `commit`: READY was recorded everywhere, so commit; else abort."""

    phase: str
    version: VersionKey
    attempt_token: str
    commit: bool
    engines: Map[str, CleanupEngineState] = attrs.field(factory=Map)
    reason: str | None = None  # the refusal that decided the outcome, for the caller
    fence: int = NO_FENCE  # the publisher lease's fence the commit carries (events.Commit)
    expected_revision: int = UNREAD  # the default's revision the commit expects, once read (row revision.read)


@attrs.frozen
class ReclaimEngineState:
    phase: str
    order: ReclaimOnEngine
    capability: str | None
    reclaimed: bool = False  # this engine's confirm was answered RECLAIMED (the last one)


@attrs.frozen
class ReclaimState:
    phase: str
    version: VersionKey
    engines: Map[str, ReclaimEngineState] = attrs.field(factory=Map)
    reclaim_id: str | None = None
    reason: str | None = None


@attrs.frozen
class GenerationState:
    phase: str
    rid: str
    engines: frozenset[str] = frozenset()  # where the view said it may go
    refused: frozenset[str] = frozenset()  # engines that refused the version (restarted, not yet adopted)

    @property
    def attempt_rid(self) -> str:
        """The request id on the engine: the caller's, then one per re-dispatch (an engine keeps ids unique)."""
        return f"{self.rid}~{len(self.refused)}" if self.refused else self.rid


@attrs.frozen
class SessionState:
    """One session (RFC §4): its one bind, its generations (one sub-machine per request id), its close."""

    phase: str
    session: SessionKey
    requests: Map[str, GenerationState] = attrs.field(factory=Map)
    version: VersionKey | None = None  # the binding, once known
    lora_name: str = ""
    cleanup: bool = False  # the caller has a local cleanup to run before the close
    close_only: bool = False  # a session this process does not hold: the finish only sends the close


@attrs.frozen
class RehydrateState:
    phase: str
    order: StageOnEngine
    failure: str | None = None  # why it failed: the refusal's reason, or the input kind (Lost)


@attrs.frozen
class SuperviseState:
    """One restarted engine: its incarnation reported, then one rehydrate per version the registry's answer stages
    there (keyed by attempt token), except the attempts `own` (those its process's Publisher is staging itself)."""

    phase: str
    engine: str
    own: frozenset[str] = frozenset()
    incarnation: int = -1  # the engine's, once read
    rehydrates: Map[str, RehydrateState] = attrs.field(factory=Map)
    left: tuple[Any, ...] = ()  # the answer's effects for other drivers: own stagings, cleanups, reclaims
    reason: str | None = None


@attrs.frozen
class RecoverState:
    """What a crashed publisher left: the attempt pending (the registry holds at most one), settled under the
    lease's `fence`; `outcome` is its settle driver's."""

    phase: str
    attempt: PendingAttempt | None = None
    fence: int = NO_FENCE
    outcome: DriverOutcome | None = None
    reason: str | None = None


@attrs.frozen
class LeaseState:
    """A lease keeper: it reads the lease's fence into `live` first (the acquire's key names it); `take_over`: an
    operator's take-over of that fence (NO_FENCE: none was granted, an ordinary acquire); `fence` the one granted;
    `lost`: a renewal was refused."""

    phase: str
    holder: str
    ttl_s: float
    take_over: bool = False
    live: int = NO_FENCE
    fence: int = NO_FENCE
    lost: bool = False
    reason: str | None = None


@attrs.frozen
class PublishState:
    """One publication: `stage` is its stage driver's outcome once answered, `outcome` its settle driver's; the settle
    commits under the lease's `fence`. `reserve_key`: the key of a reserve left unknown before for this content (its
    stage driver sends it again), else "" (the stage driver derives it); once staged, the key its reserve went
    under."""

    phase: str
    version: VersionKey
    lora_name: str
    fence: int = NO_FENCE
    digest: str = ""
    reserve_key: str = ""
    attempt_token: str = ""
    stage: DriverOutcome | None = None
    outcome: DriverOutcome | None = None
    reason: str | None = None

    @property
    def attempt(self) -> PendingAttempt:
        """The attempt its settle driver commits or aborts (its bytes stored: the commit waits for them)."""
        return PendingAttempt(self.version, VersionState.LOADING, self.attempt_token, self.lora_name, True)


DriverState: TypeAlias = (StageState | SettleState | ReclaimState | SessionState | SuperviseState | RecoverState
                          | LeaseState | PublishState)
SubState: TypeAlias = StageEngineState | CleanupEngineState | ReclaimEngineState | GenerationState | RehydrateState


def stage(version: VersionKey, attempt_token: str, bucket_count: int, orders: tuple[StageOnEngine, ...]) -> StageState:
    """Staging of an attempt the registry issued already (a rehydrate): `begin` first."""
    if bucket_count < 1 or not orders:
        raise ValueError(f"staging needs at least one bucket and one engine ({bucket_count}, {len(orders)})")
    return StageState("IDLE", version, attempt_token, bucket_count, _waiting(orders))


def publication(version: VersionKey, digest: str, lora_name: str, bucket_count: int, reserve_key: str,
                fence: int = NO_FENCE) -> StageState:
    """A publication's attempt: reserve under `reserve_key`, then stage on the engines the answer names."""
    if bucket_count < 1:
        raise ValueError(f"staging needs at least one bucket ({bucket_count})")
    return StageState("IDLE", version, "", bucket_count, digest=digest, lora_name=lora_name, reserve_key=reserve_key,
                      fence=fence)


def _waiting(orders: Iterable[StageOnEngine]) -> Map[str, StageEngineState]:
    return Map({o.engine: StageEngineState("WAITING", o) for o in orders})  # each waits for its first call


def settle(version: VersionKey, attempt_token: str, *, commit: bool, fence: int = NO_FENCE) -> SettleState:
    """Commit the attempt (the driver reads the revision it expects first) or abort it."""
    return SettleState("IDLE", version, attempt_token, commit, fence=fence)


def reclaim(version: VersionKey) -> ReclaimState:
    return ReclaimState("IDLE", version)


def session(key: SessionKey, *, cleanup: bool = False, close_only: bool = False) -> SessionState:
    return SessionState("OPEN", key, cleanup=cleanup, close_only=close_only)


def supervise(engine: str, own: frozenset[str] = frozenset()) -> SuperviseState:
    return SuperviseState("IDLE", engine, own)


def recover() -> RecoverState:
    return RecoverState("IDLE")


def publish(version: VersionKey, lora_name: str, fence: int = NO_FENCE, digest: str = "",
            reserve_key: str = "") -> PublishState:
    """One publication of `version` (its candidate carries `lora_name` and `digest`) under the lease's `fence`;
    `reserve_key`: a reserve of this content left unknown before (`PublisherState.publication` passes it)."""
    return PublishState("IDLE", version, lora_name, fence, digest, reserve_key)


@attrs.frozen
class PublisherState:
    """What a publisher carries from one publication to the next: the keys of the reserves whose outcome was left
    unknown (rows reserve.deadline, publish.stage_unknown), by content. Publishing the same content again sends the
    same reserve, which the registry answers from its journal; every other key is derived from what a row read."""

    unknown_reserves: Map[tuple[VersionKey, str], str] = attrs.field(factory=Map)

    def publication(self, version: VersionKey, digest: str, lora_name: str, fence: int) -> PublishState:
        """The next publication of this content: under the key of its reserve left unknown, if there is one."""
        return publish(version, lora_name, fence, digest, self.unknown_reserves.get((version, digest), ""))

    def after(self, publication: PublishState) -> PublisherState:
        """The publisher once `publication` ended: its reserve's key is kept only if the reserve's outcome is unknown
        (a cancelled publication keeps none: `recover` settles what it left)."""
        content = (publication.version, publication.digest)
        if publication.stage is DriverOutcome.UNKNOWN and publication.reserve_key:
            return PublisherState(self.unknown_reserves.set(content, publication.reserve_key))
        return PublisherState(self.unknown_reserves.delete(content)) if content in self.unknown_reserves else self


def keep_lease(holder: str, ttl_s: float, take_over: bool = False) -> LeaseState:
    """The publisher lease for `holder`, acquired under a key derived from the fence the keeper reads first
    (`take_over`: that fence ended and taken), then renewed until the caller cancels the keeper."""
    return LeaseState("IDLE", holder, ttl_s, take_over)


def lease_lost(state: LeaseState) -> bool:
    """The keeper ended because the registry refused a renewal: its fence is dead (expired or taken over)."""
    return state.lost


# ---------------------------------------------------------------- keys (derived from the state only)


def commit_key(s: SettleState) -> str:
    """One key per attempt, expected revision and lease fence: a publisher retrying its own commit sends the
    same call; a publisher under another fence (one that took the lease over) sends a new one, which the
    registry answers with the original receipt if the first landed (commit.replay). Unfenced: no suffix."""
    fenced = f":{s.fence}" if s.fence != NO_FENCE else ""
    return f"commit:{s.attempt_token}:{s.expected_revision}{fenced}"


def reserve_key(s: StageState, last_attempt: str) -> str:
    """One key per content and per attempt of the version the registry held when read: a retry after a lost reply is
    the same call (the journal answers it), while a version aborted and cleaned since (a new last attempt) is reserved
    under a new key, never answered by the old attempt's journaled reservation."""
    return f"reserve:{s.version.epoch}:{s.version.version_id}:{s.digest}:{last_attempt or 'none'}"


def acquire_key(s: LeaseState) -> str:
    """One key per holder and fence read: a grant is journaled only when it moves the fence on, so this key is never
    read again once it was granted, and a retry after a lost reply is the same call. An acquire the holder's live
    lease answers (lease.acquire_replay) is a keep row, answered afresh."""
    return f"{'take_over' if s.take_over else 'lease'}:{s.holder}:{s.live}"


def abort_key(s: SettleState) -> str:
    return f"abort:{s.attempt_token}"


def claim_key(s: ReclaimState) -> str:
    return f"claim:{s.version.epoch}:{s.version.version_id}"


def session_key(s: SessionState, call: str) -> str:
    """bind / bclose / close, one key each per session key (a session key is never reused: the registry refuses a
    closed one); a close-only finish, for a session this process no longer holds, has its own."""
    k = s.session
    return f"{'close-again' if s.close_only else call}:{k.epoch}:{k.shard}:{k.seq}"


def renew_key(s: LeaseState) -> str:
    """One key per holder and fence. A renewal changes nothing in the registry's state (lease.renew is a keep row),
    so the registry answers it afresh each time: a call that changes nothing is never journaled (RegistryCore)."""
    return f"renew:{s.holder}:{s.fence}"


def restarted_key(engine: str, incarnation: int) -> str:
    """One key per engine and incarnation: reporting the same incarnation again is answered from the journal."""
    return f"incarnation:{engine}:{incarnation}"


# ---------------------------------------------------------------- guards: (state, sub, input) -> bool

Ctx = tuple[Any, Any, DriverInput]  # (coordinator state, sub-machine state or None, input)


def _call_op(inp: DriverInput) -> str:
    return inp.call.op if isinstance(inp, (Answer, Refusal, Lost)) else ""


def _result(inp: DriverInput) -> Any:
    return inp.value.result if isinstance(inp, Answer) and isinstance(inp.value, Reply) else None


def _effects(inp: DriverInput, kind: type) -> list[tuple[Any, str | None]]:
    if not (isinstance(inp, Answer) and isinstance(inp.value, Reply)):
        return []
    caps = inp.value.capabilities
    return [(e, caps[i] if i < len(caps) else None) for i, e in enumerate(inp.value.effects) if isinstance(e, kind)]


def _timer(inp: DriverInput, name: str) -> bool:
    return isinstance(inp, Deadline) and inp.timer.name == name


def _settled(s: Any) -> bool:
    return all(sub.phase in SETTLES[MACHINE_OF[type(sub)]] for sub in subs_of(s).values())


# A generation in these phases may have been accepted by an engine: no new generation starts before it is resolved.
UNRESOLVED = frozenset({"UNKNOWN", "RESOLVING"})

GUARDS: dict[str, Callable[[Any, Any, DriverInput], bool]] = {
    "answers_begin": lambda s, sub, i: _call_op(i) == "begin",
    "answers_prepared": lambda s, sub, i: _call_op(i) == "prepared",
    "answers_bucket": lambda s, sub, i: _call_op(i) == "bucket",
    # An `end` answer is one with the engine's receipt: one without (an executor bug) lands on the late row.
    "answers_end": lambda s, sub, i: _call_op(i) == "end" and (
        not isinstance(i, Answer) or (hasattr(i.value, "digest") and hasattr(i.value, "incarnation"))),
    "answers_probe": lambda s, sub, i: _call_op(i) == "probe",
    "answers_ready": lambda s, sub, i: _call_op(i) == "ready",
    "probe_matches": lambda s, sub, i: isinstance(i, Answer) and i.value is True,
    "stages_settled": lambda s, sub, i: _settled(s),
    "some_stage_failed": lambda s, sub, i: any(e.phase == "FAILED" for e in s.engines.values()),
    "more_buckets": lambda s, sub, i: s.bucket + 1 < s.bucket_count,
    "needs_reserve": lambda s, sub, i: not s.engines,
    "has_reserve_key": lambda s, sub, i: bool(s.reserve_key),
    "answers_attempt": lambda s, sub, i: _call_op(i) == "attempt" and _shaped(i, str),
    "answers_reserve": lambda s, sub, i: _call_op(i) == "reserve",
    "reserved_answer": lambda s, sub, i: isinstance(_result(i), Reserved),
    "reserved_loading": lambda s, sub, i: isinstance(_result(i), Reserved)
    and _result(i).state is VersionState.LOADING,
    "names_match": lambda s, sub, i: _result(i).lora_name == s.lora_name and bool(_stages(i)) and all(
        o.lora_name == s.lora_name for o in _stages(i)),
    "stage_timer": lambda s, sub, i: isinstance(i, Deadline) and i.timer == _stage_timer(sub, s),
    "wants_commit": lambda s, sub, i: bool(s.commit),
    "answers_commit": lambda s, sub, i: _call_op(i) == "commit",
    "answers_revision": lambda s, sub, i: _call_op(i) == "revision" and _shaped(i, int),
    "answers_abort": lambda s, sub, i: _call_op(i) == "abort",
    "answers_claim": lambda s, sub, i: _call_op(i) == "claim",
    "answers_engine_cleanup": lambda s, sub, i: _call_op(i) == "cleanup",
    "answers_cleaned": lambda s, sub, i: _call_op(i) == "cleaned",
    "answers_unknown": lambda s, sub, i: _call_op(i) == "unknown",
    "answers_engine_reclaim": lambda s, sub, i: _call_op(i) == "reclaim",
    "answers_confirm": lambda s, sub, i: _call_op(i) == "confirm",
    "names_cleanups": lambda s, sub, i: bool(_effects(i, CleanupOnEngine)),
    "names_reclaims": lambda s, sub, i: bool(_effects(i, ReclaimOnEngine)),
    "abort_says_clean": lambda s, sub, i: isinstance(_result(i), Aborted)
    and _result(i).state is VersionState.FAILED_CLEAN,
    "claim_says_reclaimed": lambda s, sub, i: isinstance(_result(i), ReclaimClaimed)
    and _result(i).state is VersionState.RECLAIMED,
    "engine_timer": lambda s, sub, i: _timer(i, "engine"),
    "abort_timer": lambda s, sub, i: _timer(i, "abort"),
    "backoff_timer": lambda s, sub, i: _timer(i, "backoff"),
    "report_timer": lambda s, sub, i: _timer(i, "report"),
    "in_use": lambda s, sub, i: isinstance(i, Refusal) and i.reason == Reason.IN_USE,
    "unloaded": lambda s, sub, i: isinstance(i, Answer) and i.value is True,
    "cleanups_settled": lambda s, sub, i: _settled(s),
    "reclaims_settled": lambda s, sub, i: _settled(s),
    "capacity_freed": lambda s, sub, i: any(e.freed for e in s.engines.values()),
    "registry_says_reclaimed": lambda s, sub, i: any(e.reclaimed for e in s.engines.values()),
    # ---- session
    "answers_bind": lambda s, sub, i: _call_op(i) == "bind",
    "bound_answer": lambda s, sub, i: isinstance(_result(i), Bound),
    "answers_begin_close": lambda s, sub, i: _call_op(i) == "begin_close",
    "answers_close": lambda s, sub, i: _call_op(i) == "close",
    "answers_cleanup": lambda s, sub, i: _call_op(i) == "local_cleanup",
    "bind_timer": lambda s, sub, i: _timer(i, "bind"),
    "close_timer": lambda s, sub, i: _timer(i, "close"),
    "no_unknown": lambda s, sub, i: not any(g.phase in UNRESOLVED for g in s.requests.values()),
    "requests_live": lambda s, sub, i: not _settled(s),
    "requests_settled": lambda s, sub, i: _settled(s),
    "has_cleanup": lambda s, sub, i: s.cleanup,
    "close_only": lambda s, sub, i: s.close_only,
    # ---- generation (s: the session, sub: the generation)
    "answers_view": lambda s, sub, i: _call_op(i) == "view",
    "answers_generate": lambda s, sub, i: _call_op(i) == "generate",
    "session_active": lambda s, sub, i: s.phase == "BOUND",
    "session_closing": lambda s, sub, i: s.phase != "BOUND",
    "servable": lambda s, sub, i: isinstance(i, Answer) and isinstance(i.value, frozenset) and bool(i.value),
    "version_unavailable": lambda s, sub, i: isinstance(i, Refusal) and i.reason == Reason.VERSION_UNAVAILABLE
    and bool(i.origin),
    "engines_left": lambda s, sub, i: isinstance(i, Refusal) and bool(sub.engines - sub.refused - {i.origin}),
    # ---- supervise (s: the supervisor, sub: a rehydrate)
    # (an answer of another shape than the call's is an executor's bug: no row takes it, the ProtocolError)
    "answers_incarnation": lambda s, sub, i: _call_op(i) == "incarnation" and _shaped(i, int),
    "answers_restarted": lambda s, sub, i: _call_op(i) == "restarted",
    "incarnation_timer": lambda s, sub, i: _timer(i, "incarnation"),
    "restarted_timer": lambda s, sub, i: _timer(i, "restarted"),
    "names_rehydrates": lambda s, sub, i: bool(_owed(s, i)),
    "rehydrates_settled": lambda s, sub, i: _settled(s),
    "answers_placement": lambda s, sub, i: _call_op(i) == "placement",
    "placement_ready": lambda s, sub, i: isinstance(i, Answer) and i.value is PlacementState.READY,
    "answers_rehydrate": lambda s, sub, i: _call_op(i) == "rehydrate",
    # ---- recover
    "answers_pending": lambda s, sub, i: _call_op(i) == "pending" and _shaped(i, tuple) and all(
        isinstance(a, PendingAttempt) for a in getattr(i, "value", ())),
    "nothing_pending": lambda s, sub, i: not _pending(i),
    "answers_lease": lambda s, sub, i: _call_op(i) == "lease" and _shaped(i, LeaseGranted),
    "answers_settle": lambda s, sub, i: _call_op(i) == "settle" and _shaped(i, DriverOutcome),
    "committable": lambda s, sub, i: committable(s.attempt),
    "settle_unknown": lambda s, sub, i: isinstance(i, Answer) and i.value is DriverOutcome.UNKNOWN,
    # ---- publish
    "answers_stage": lambda s, sub, i: _call_op(i) == "stage" and _shaped(i, StageResult),
    "stage_staged": lambda s, sub, i: _staged(i) is DriverOutcome.STAGED,
    "stage_failed": lambda s, sub, i: _staged(i) is DriverOutcome.STAGE_FAILED,
    "stage_replayed": lambda s, sub, i: _staged(i) is DriverOutcome.REPLAYED,
    "stage_rejected": lambda s, sub, i: _staged(i) is DriverOutcome.REJECTED,
    "answers_store": lambda s, sub, i: _call_op(i) == "store",
    "settle_committed": lambda s, sub, i: isinstance(i, Answer) and i.value is DriverOutcome.COMMITTED,
    "settle_clean": lambda s, sub, i: isinstance(i, Answer) and i.value is DriverOutcome.FAILED_CLEAN,
    # ---- lease
    # (an answer of another shape is an executor's bug: no row takes it, the ProtocolError)
    "answers_acquire": lambda s, sub, i: _call_op(i) == "acquire" and (
        isinstance(_result(i), (LeaseGranted, Rejected)) or not isinstance(i, Answer)),
    "answers_renew": lambda s, sub, i: _call_op(i) == "renew",
    "answers_live_fence": lambda s, sub, i: _call_op(i) == "live_fence" and _shaped(i, int),
    "acquire_timer": lambda s, sub, i: _timer(i, "acquire"),
    "renew_timer": lambda s, sub, i: _timer(i, "renew"),
}


def _note_stage(s: PublishState, i: DriverInput) -> PublishState:
    assert isinstance(i, Answer) and isinstance(i.value, StageResult), i  # (its rows' guard: answers_stage)
    return attrs.evolve(s, stage=i.value.outcome, attempt_token=i.value.attempt_token,
                        reserve_key=i.value.reserve_key)


def _staged(i: DriverInput) -> DriverOutcome | None:
    return i.value.outcome if isinstance(i, Answer) and isinstance(i.value, StageResult) else None


def _pending(i: DriverInput) -> tuple[PendingAttempt, ...]:
    """The attempts a crashed publisher may have left: LOADING (staged, maybe READY, not committed) or ABORTED
    (cleanups still owed), in the order the view answered (version order; the registry holds at most one)."""
    attempts = i.value if isinstance(i, Answer) else ()
    return tuple(a for a in attempts if a.state in (VersionState.LOADING, VersionState.ABORTED))


def committable(a: PendingAttempt | None) -> bool:
    """A pending attempt that recovery commits (the registry refuses it unless READY everywhere): LOADING, with its
    bytes in the snapshot store (else nobody could rehydrate the version after a restart)."""
    return a is not None and a.state is VersionState.LOADING and a.stored


def _shaped(i: DriverInput, kind: type) -> bool:
    """Not an answer, or an answer whose value is of the call's kind."""
    return not isinstance(i, Answer) or isinstance(i.value, kind)


def _owed(s: SuperviseState, i: DriverInput) -> list[StageOnEngine]:
    """The versions the registry's answer stages on this engine, except the attempts its own Publisher stages."""
    return [o for o in _stages(i) if o.engine == s.engine and o.attempt_token not in s.own]

def _acquire_event(s: LeaseState) -> RegistryEvent:
    if s.take_over and s.live != NO_FENCE:
        return TakeOverLease(s.holder, s.live, s.ttl_s)
    return AcquireLease(s.holder, s.ttl_s)


# The `Arm` deadline name of a lease's renewal period (its executor answers a third of the lease's ttl).
RENEW_PERIOD = "lease_renew"

# ---------------------------------------------------------------- command builders
# (state, sub, input) -> (state', commands).
# A builder of a coordinator row gets and returns the coordinator; one of a sub-machine row, the sub-machine.

Built = tuple[Any, tuple[Command, ...]]


def _stage_timer(e: StageEngineState, s: StageState) -> Timer:
    """The timer of the call the sub-machine's phase waits for (a bucket's names the bucket)."""
    op = _stage_op(e)
    return Timer(op, e.order.engine, s.bucket if op == "bucket" else -1)


def _start_calls(s: StageState, op: str, deadline: str, phase: str, index: int = -1) -> Built:
    """The same call to every engine at once, each under its own deadline."""
    engines: dict[str, StageEngineState] = {}
    commands: list[Command] = []
    for name, e in sorted(s.engines.items()):
        engines[name] = attrs.evolve(e, phase=phase)
        commands += [StageEngine(Call(op, name), name, index), Arm(Timer(op, name, index), deadline)]
    return attrs.evolve(s, engines=Map(engines)), tuple(commands)


def _stages(i: DriverInput) -> list[StageOnEngine]:
    return [e for e, _ in _effects(i, StageOnEngine)]


def _send_next_bucket(s: StageState, sub: None, i: DriverInput) -> Built:
    s = attrs.evolve(s, bucket=s.bucket + 1)
    return _start_calls(s, "bucket", "bucket", "SENDING", s.bucket)


def _note_refusal(e: StageEngineState, s: Any, i: DriverInput) -> Built:
    if isinstance(i, Deadline):
        failure = StageFailure(Input.DEADLINE, _stage_op(e), None)
    elif isinstance(i, Answer) and i.call.op == "probe":
        # The probe differs (no code: the publisher's PROBE_MISMATCH), or the check named its own refusal.
        failure = StageFailure(Input.ANSWER, "probe", i.value.code if isinstance(i.value, CheckRefused) else None)
    else:
        failure = StageFailure(input_kind(i), _call_op(i), _reason(i))
    return attrs.evolve(e, failure=failure), ()


def _stage_op(e: StageEngineState) -> str:
    """The call a staging sub-machine's phase waits for."""
    return {"BEGINNING": "begin", "PREPARING": "prepared", "SENDING": "bucket", "ENDING": "end",
            "CHECKING": "probe", "RECORDING": "ready"}.get(e.phase, e.phase)


def _submit_prepared(e: StageEngineState, s: Any, i: DriverInput) -> Built:
    o = e.order
    return e, (Submit(Call("prepared", o.engine), RecordPrepared(o.version, o.attempt_token, o.engine, o.incarnation,
                                                                 o.digest),
                      f"prepared:{o.attempt_token}:{o.engine}:{o.incarnation}"),)


def _check_probe(e: StageEngineState, s: Any, i: DriverInput) -> Built:
    assert isinstance(i, Answer)
    e = attrs.evolve(e, receipt=i.value)
    return e, (CheckProbe(Call("probe", e.order.engine), e.order.engine, i.value),)


def _submit_ready(e: StageEngineState, s: Any, i: DriverInput) -> Built:
    """READY under the incarnation and digest the engine's own `end` answered (the registry refuses a READY
    from an incarnation or content it did not stage)."""
    o, receipt = e.order, e.receipt
    return e, (Submit(Call("ready", o.engine), RecordReady(o.version, o.attempt_token, o.engine,
                                                           int(receipt.incarnation), str(receipt.digest)),
                      f"ready:{o.attempt_token}:{o.engine}:{int(receipt.incarnation)}"),)


def _submit_commit(s: SettleState, sub: None, i: DriverInput) -> Built:
    return s, (Submit(Call("commit"), Commit(s.version, s.attempt_token, s.expected_revision, s.fence),
                      commit_key(s)),)


def _note_revision(s: SettleState, sub: None, i: DriverInput) -> Built:
    assert isinstance(i, Answer)  # (the guard answers_revision holds: an int)
    return attrs.evolve(s, expected_revision=int(i.value)), ()


def _submit_abort(s: SettleState, sub: None, i: DriverInput) -> Built:
    return s, (Submit(Call("abort"), Abort(s.version, s.attempt_token), abort_key(s)),)


def _start_cleanups(s: SettleState, sub: None, i: DriverInput) -> Built:
    engines = {c.engine: CleanupEngineState("CLEANING", c, cap) for c, cap in _effects(i, CleanupOnEngine)}
    commands: list[Command] = []
    for name, e in sorted(engines.items()):
        commands += [_cleanup_command(e), Arm(Timer("engine", name), "cleanup")]
    return attrs.evolve(s, engines=Map(engines)), tuple(commands)


def _cleanup_command(e: CleanupEngineState) -> CleanupEngine:
    o = e.order
    return CleanupEngine(Call("cleanup", o.engine), o.engine, o.lora_name, o.attempt_token, e.capability)


def _submit_claim(s: ReclaimState, sub: None, i: DriverInput) -> Built:
    return s, (Submit(Call("claim"), ClaimReclaim(s.version), claim_key(s)),)


def _start_reclaims(s: ReclaimState, sub: None, i: DriverInput) -> Built:
    result = _result(i)
    engines = {r.engine: ReclaimEngineState("UNLOADING", r, cap) for r, cap in _effects(i, ReclaimOnEngine)}
    commands: list[Command] = []
    for name, e in sorted(engines.items()):
        commands += [_reclaim_command(e), Arm(Timer("engine", name), "reclaim")]
    return attrs.evolve(s, engines=Map(engines), reclaim_id=result.reclaim_id), tuple(commands)


def _reclaim_command(e: ReclaimEngineState) -> ReclaimEngine:
    o = e.order
    return ReclaimEngine(Call("reclaim", o.engine), o.engine, o.lora_name, o.reclaim_id, e.capability)


def _own_timer(s: SettleState | ReclaimState) -> Timer:
    """The coordinator's own timer in its phase: the claim's, the abort's, or the commit's."""
    return Timer("claim" if isinstance(s, ReclaimState) else "abort" if s.phase == "ABORTING" else "commit")


def _sub_timer(sub: Any) -> Timer:
    return Timer("engine", sub.order.engine)


def _session_submit(s: SessionState, op: str, event: Any) -> Built:
    return s, (Submit(Call(op), event, session_key(s, {"begin_close": "bclose"}.get(op, op))),)


def _open_request(s: SessionState, sub: None, i: DriverInput) -> Built:
    assert isinstance(i, Generate) and s.version is not None
    g = GenerationState("VIEWING", i.rid)
    return attrs.evolve(s, requests=s.requests.set(i.rid, g)), (ViewDispatch(Call("view", i.rid), s.version),)


def _abort_requests(s: SessionState, sub: None, i: DriverInput) -> Built:
    """Every generation sent or unknown is aborted (one sent and being resolved has its abort in flight)."""
    requests, commands = dict(s.requests), []
    for rid, g in sorted(s.requests.items()):
        if g.phase in ("SENDING", "UNKNOWN"):
            requests[rid] = attrs.evolve(g, phase="ABORTING")
            commands.append(AbortGeneration(Call("abort", rid), g.attempt_rid))
    return attrs.evolve(s, requests=Map(requests)), tuple(commands)


def _send_generate(g: GenerationState, s: SessionState, i: DriverInput) -> Built:
    return g, (SendGeneration(Call("generate", g.rid), g.attempt_rid, s.lora_name, g.engines - g.refused),)


def _open_rehydrates(s: SuperviseState, sub: None, i: DriverInput) -> Built:
    owed = _owed(s, i)
    reply = i.value if isinstance(i, Answer) and isinstance(i.value, Reply) else Reply(None)
    rehydrates = {o.attempt_token: RehydrateState("VIEWING", o) for o in owed}
    commands = tuple(ViewPlacement(Call("placement", o.attempt_token), o.version, o.engine) for o in owed)
    left = tuple(e for e in reply.effects if e not in owed)
    return attrs.evolve(s, rehydrates=Map(rehydrates), left=left), commands


BUILDERS: dict[str, Callable[[Any, Any, DriverInput], Built]] = {
    "start_begins": lambda s, sub, i: _start_calls(s, "begin", "begin", "BEGINNING"),
    "submit_reserve": lambda s, sub, i: (s, (Submit(Call("reserve"), Reserve(s.version, s.digest, s.fence),
                                                    s.reserve_key),)),
    "arm_reserve": lambda s, sub, i: (s, (Arm(Timer("reserve"), "reserve"),)),
    "read_attempt": lambda s, sub, i: (s, (ReadAttempt(Call("attempt"), s.version),)),
    "note_reserve_key": lambda s, sub, i: (attrs.evolve(s, reserve_key=reserve_key(
        s, str(i.value) if isinstance(i, Answer) else "")), ()),
    "disarm_reserve": lambda s, sub, i: (s, (Disarm(Timer("reserve")),)),
    "open_stages": lambda s, sub, i: (attrs.evolve(s, attempt_token=_result(i).attempt_token,
                                                   engines=_waiting(_stages(i))), ()),
    "note_attempt": lambda s, sub, i: (attrs.evolve(s, attempt_token=_result(i).attempt_token), ()),
    "send_next_bucket": _send_next_bucket,
    "start_ends": lambda s, sub, i: _start_calls(s, "end", "end", "ENDING"),
    "submit_commit": _submit_commit,
    "submit_abort": _submit_abort,
    "arm_commit": lambda s, sub, i: (s, (Arm(Timer("commit"), "commit"),)),
    "read_revision": lambda s, sub, i: (s, (ReadRevision(Call("revision")),)),
    "note_revision": _note_revision,
    # The same timer (one registry call is in flight at a time), its own deadline: no-progress bounds staging
    # and the commit, not the abort that follows them.
    "arm_abort": lambda s, sub, i: (s, (Arm(Timer("abort"), "abort"),)),
    "disarm": lambda s, sub, i: (s, (Disarm(_own_timer(s)),)),
    "start_cleanups": _start_cleanups,
    "submit_claim": _submit_claim,
    "arm_claim": lambda s, sub, i: (s, (Arm(Timer("claim"), "commit"),)),
    "start_reclaims": _start_reclaims,
    # ---- sub-machines
    "submit_prepared": _submit_prepared,
    "check_probe": _check_probe,
    "submit_ready": _submit_ready,
    "note_refusal": _note_refusal,
    "drop_link": lambda e, sub, i: (e, (DropLink(e.order.engine),)),
    "disarm_stage": lambda e, s, i: (e, (Disarm(_stage_timer(e, s)),)),
    "arm_prepared": lambda e, s, i: (e, (Arm(Timer("prepared", e.order.engine), "report"),)),
    "arm_ready": lambda e, s, i: (e, (Arm(Timer("ready", e.order.engine), "report"),)),
    "send_cleanup": lambda e, sub, i: (e, (_cleanup_command(e),)),
    "arm_backoff": lambda e, sub, i: (e, (Arm(Timer("backoff", e.order.engine), "retry_pause"),)),
    "disarm_engine": lambda e, sub, i: (e, (Disarm(_sub_timer(e)),)),
    "disarm_backoff": lambda e, sub, i: (e, (Disarm(Timer("backoff", e.order.engine)),)),
    "arm_report": lambda e, sub, i: (e, (Arm(Timer("report", e.order.engine), "report"),)),
    "disarm_report": lambda e, sub, i: (e, (Disarm(Timer("report", e.order.engine)),)),
    "submit_cleaned": lambda e, sub, i: (e, (Submit(
        Call("cleaned", e.order.engine), RecordCleaned(e.order.version, e.order.attempt_token, e.order.engine),
        f"cleaned:{e.order.attempt_token}:{e.order.engine}"),)),
    # One UNKNOWN receipt per attempt and engine: a second unknown outcome is the same fact.
    "submit_unknown": lambda e, sub, i: (e, (Submit(
        Call("unknown", e.order.engine), RecordUnknown(e.order.version, e.order.attempt_token, e.order.engine),
        f"unknown:{e.order.attempt_token}:{e.order.engine}"),)),
    "note_capacity": lambda e, sub, i: (attrs.evolve(e, freed=bool(_effects(i, CapacityFreed))), ()),
    "send_reclaim": lambda e, sub, i: (e, (_reclaim_command(e),)),
    "submit_confirm": lambda e, sub, i: (e, (Submit(
        Call("confirm", e.order.engine), ConfirmReclaim(e.order.version, e.order.engine, e.order.reclaim_id),
        f"confirm:{e.order.reclaim_id}:{e.order.engine}"),)),
    "note_reclaimed": lambda e, sub, i: (attrs.evolve(
        e, reclaimed=isinstance(_result(i), ReclaimConfirmed) and _result(i).state is VersionState.RECLAIMED), ()),
    # ---- session
    "submit_bind": lambda s, sub, i: _session_submit(s, "bind", BindFirst(s.session)),
    "submit_begin_close": lambda s, sub, i: _session_submit(s, "begin_close", BeginClose(s.session)),
    "submit_close": lambda s, sub, i: _session_submit(s, "close", CloseAndRelease(s.session)),
    "arm_bind": lambda s, sub, i: (s, (Arm(Timer("bind"), "report"),)),
    "disarm_bind": lambda s, sub, i: (s, (Disarm(Timer("bind")),)),
    "arm_close": lambda s, sub, i: (s, (Arm(Timer("close"), "report"),)),
    "disarm_close": lambda s, sub, i: (s, (Disarm(Timer("close")),)),
    "note_binding": lambda s, sub, i: (attrs.evolve(s, version=_result(i).version, lora_name=_result(i).lora_name)
                                       if isinstance(_result(i), Bound) else s, ()),
    "open_request": _open_request,
    "abort_requests": _abort_requests,
    "run_cleanup": lambda s, sub, i: (s, (LocalCleanup(Call("local_cleanup")),)),
    # ---- generation
    "note_engines": lambda g, s, i: (attrs.evolve(g, engines=frozenset(i.value)) if isinstance(i, Answer) else g,
                                     ()),
    "note_refused": lambda g, s, i: (attrs.evolve(g, refused=g.refused | {i.origin})
                                     if isinstance(i, Refusal) else g, ()),
    "send_generate": _send_generate,
    "send_abort": lambda g, s, i: (g, (AbortGeneration(Call("abort", g.rid), g.attempt_rid),)),
    "hang_up": lambda g, s, i: (g, (HangUp(Call("generate", g.rid)),)),
    # ---- supervise
    "read_incarnation": lambda s, sub, i: (s, (ReadIncarnation(Call("incarnation"), s.engine),)),
    "arm_incarnation": lambda s, sub, i: (s, (Arm(Timer("incarnation"), "report"),)),
    "disarm_incarnation": lambda s, sub, i: (s, (Disarm(Timer("incarnation")),)),
    "note_incarnation": lambda s, sub, i: (attrs.evolve(s, incarnation=int(i.value)) if isinstance(i, Answer)
                                           else s, ()),
    "submit_restarted": lambda s, sub, i: (s, (Submit(Call("restarted"), EngineRestarted(s.engine, s.incarnation),
                                                      restarted_key(s.engine, s.incarnation)),)),
    "arm_restarted": lambda s, sub, i: (s, (Arm(Timer("restarted"), "report"),)),
    "disarm_restarted": lambda s, sub, i: (s, (Disarm(Timer("restarted")),)),
    "open_rehydrates": _open_rehydrates,
    # ---- rehydrate
    "send_rehydrate": lambda r, s, i: (r, (Rehydrate(Call("rehydrate", r.order.attempt_token), r.order),)),
    "note_failure": lambda r, s, i: (attrs.evolve(r, failure=_reason(i) or str(input_kind(i))), ()),
    # ---- recover
    "view_pending": lambda s, sub, i: (s, (ViewPending(Call("pending")),)),
    # (the first pending: the registry holds at most one)
    "note_pending": lambda s, sub, i: (attrs.evolve(s, attempt=_pending(i)[0]), ()),
    "acquire_lease": lambda s, sub, i: (s, (TakeLease(Call("lease")),)),
    "note_fence": lambda s, sub, i: (attrs.evolve(s, fence=int(i.value.fence)) if isinstance(i, Answer) else s, ()),
    "settle_commit": lambda s, sub, i: (s, (SettleAttempt(Call("settle"), s.attempt, True, s.fence),)),
    "settle_abort": lambda s, sub, i: (s, (SettleAttempt(Call("settle"), s.attempt, False, s.fence),)),
    "note_settled": lambda s, sub, i: (attrs.evolve(s, outcome=i.value) if isinstance(i, Answer) else s, ()),
    # ---- publish (settle_commit, settle_abort and note_settled above: a publication settles as a recovery does)
    "run_stage": lambda s, sub, i: (s, (RunStage(Call("stage"), s.version, s.digest, s.lora_name, s.fence,
                                                 s.reserve_key),)),
    "note_stage": lambda s, sub, i: (_note_stage(s, i), ()),
    "wait_stored": lambda s, sub, i: (s, (WaitStored(Call("store")),)),
    # ---- lease (a renewal's retry pause is its period: it is the timer "renew" again)
    "submit_acquire": lambda s, sub, i: (s, (Submit(Call("acquire"), _acquire_event(s), acquire_key(s)),)),
    # Its own deadline (Deadlines.acquire), not a publication's: a publisher idle for long acquires as a fresh one.
    "arm_acquire": lambda s, sub, i: (s, (Arm(Timer("acquire"), "acquire"),)),
    "read_live_fence": lambda s, sub, i: (s, (ReadLiveFence(Call("live_fence")),)),
    "note_live": lambda s, sub, i: (attrs.evolve(s, live=i.value) if isinstance(i, Answer) else s, ()),
    "disarm_acquire": lambda s, sub, i: (s, (Disarm(Timer("acquire")),)),
    "note_lease": lambda s, sub, i: (attrs.evolve(s, fence=_result(i).fence), ()),
    "arm_renew": lambda s, sub, i: (s, (Arm(Timer("renew"), RENEW_PERIOD),)),
    "submit_renew": lambda s, sub, i: (s, (Submit(Call("renew"), RenewLease(s.holder, s.fence), renew_key(s)),)),
    "note_lost": lambda s, sub, i: (attrs.evolve(s, lost=True), ()),
}

# ---------------------------------------------------------------- step

MACHINE_OF: dict[type, Driver] = {
    StageState: Driver.STAGE,
    StageEngineState: Driver.STAGE_ENGINE,
    SettleState: Driver.SETTLE,
    CleanupEngineState: Driver.CLEANUP_ENGINE,
    ReclaimState: Driver.RECLAIM,
    ReclaimEngineState: Driver.RECLAIM_ENGINE,
    SessionState: Driver.SESSION,
    GenerationState: Driver.GENERATION,
    SuperviseState: Driver.SUPERVISE,
    RehydrateState: Driver.REHYDRATE,
    RecoverState: Driver.RECOVER,
    LeaseState: Driver.LEASE,
    PublishState: Driver.PUBLISH,
}
INPUT_KIND: dict[type, Input] = {
    Start: Input.START, Answer: Input.ANSWER, Refusal: Input.REFUSAL, Lost: Input.LOST,
    Deadline: Input.DEADLINE, Cancel: Input.CANCEL, Settled: Input.SETTLED, Bind: Input.BIND,
    Generate: Input.GENERATE, Resolve: Input.RESOLVE, Finish: Input.FINISH,
}  # fmt: skip


def input_kind(inp: DriverInput) -> Input:
    """A registry answer whose result is `Rejected` is a refusal: certain, and nothing changed there."""
    if isinstance(inp, Answer) and isinstance(inp.value, Reply) and isinstance(inp.value.result, Rejected):
        return Input.REFUSAL
    return INPUT_KIND[type(inp)]


def _reason(inp: DriverInput) -> str | None:
    if isinstance(inp, Refusal):
        return inp.reason
    result = _result(inp)
    return str(result.reason) if isinstance(result, Rejected) else None


def _engine_of(inp: DriverInput) -> str:
    if isinstance(inp, (Answer, Refusal, Lost)):
        return inp.call.engine
    if isinstance(inp, Deadline):
        return inp.timer.engine
    if isinstance(inp, (Generate, Resolve, Cancel)):
        return inp.rid
    return ""


_SUBS = {SessionState: "requests", SuperviseState: "rehydrates", RecoverState: "", LeaseState: "", PublishState: ""}
_NO_SUBS: Map[str, Any] = Map()


def subs_of(state: Any) -> Any:
    """A coordinator's sub-machines by key: its engines', a session's generations by request id, or a supervisor's
    rehydrates by attempt token (a recovery, a lease keeper and a publication have none)."""
    field = _SUBS.get(type(state), "engines")
    return getattr(state, field) if field else _NO_SUBS


def _with_subs(state: Any, subs: Any) -> Any:
    return attrs.evolve(state, **{_SUBS.get(type(state), "engines"): subs})


@attrs.frozen
class DriverStep:
    state: Any
    commands: tuple[Command, ...]
    fired: tuple[str, ...]  # the ids of the rows that fired (a sub-machine's, then its coordinator's)


class Drivers:
    """The driver table compiled for lookup: the spec's rows, or a mutant's (scripts/mutate_drivers.py)."""

    def __init__(
        self,
        rows: tuple[DriverRow, ...] = DRIVER_ROWS,
        guards: Mapping[str, Callable[[Any, Any, DriverInput], bool]] | None = None,
        builders: Mapping[str, Callable[[Any, Any, DriverInput], Built]] | None = None,
    ) -> None:
        self.rows = rows
        self.guards = GUARDS if guards is None else guards
        self.builders = BUILDERS if builders is None else builders
        self._by_pair: dict[tuple[Driver, str, Input], list[DriverRow]] = {}
        for r in rows:
            for phase in r.expanded_sources():
                self._by_pair.setdefault((r.machine, phase, r.input), []).append(r)
        unknown = {g for r in rows for g in r.guards} - self.guards.keys()
        unknown |= {c for r in rows for c in r.commands} - self.builders.keys()
        if unknown:
            raise ValueError(f"driver rows name unknown guards or commands: {sorted(unknown)}")

    def rows_for(self, machine: Driver, phase: str, kind: Input) -> Sequence[DriverRow]:
        """The rows for `kind` in `phase` of `machine`, in table order: the candidates `select` tries."""
        return self._by_pair.get((machine, phase, kind), ())

    def select(self, state: Any, sub: Any, inp: DriverInput) -> DriverRow:
        target = sub if sub is not None else state
        machine, kind = MACHINE_OF[type(target)], input_kind(inp)
        for r in self.rows_for(machine, target.phase, kind):
            if all(self.guards[g](state, sub, inp) for g in r.guards):
                return r
        raise ProtocolError(f"no driver row for {machine}/{target.phase} on {kind}", machine=str(machine),
                            state=target.phase)

    def _fire(self, state: Any, sub: Any, inp: DriverInput) -> tuple[Any, tuple[Command, ...], str]:
        r = self.select(state, sub, inp)
        target = sub if sub is not None else state
        commands: list[Command] = []
        for name in r.commands:
            target, built = self.builders[name](target, sub if sub is None else state, inp)
            commands += built
        if r.target != SAME:
            target = attrs.evolve(target, phase=r.target)
        if sub is not None or isinstance(target, SessionState):
            # A session's or a generation's report answers one caller's request (a generation's: its request id's
            # caller): the row's reason or this input's, never an earlier one.
            if r.report is not None:
                subject = sub.rid if sub is not None else _engine_of(inp) if r.to == "request" else r.to
                commands.append(Report(r.report, r.reason or _reason(inp), subject))
        else:  # one piece of work, one caller: the refusal that decided its outcome stays its reason
            reason = _reason(inp)
            if reason is not None and r.target != SAME:
                target = attrs.evolve(target, reason=reason)
            if r.report is not None:
                commands.append(Report(r.report, target.reason))
        return target, tuple(commands), r.id

    def step(self, state: DriverState, inp: DriverInput) -> DriverStep:
        """One input: the sub-machine of the engine it names (if the work is still running and has one),
        then, if that sub-machine just finished, its coordinator with `Settled`; else the coordinator."""
        engine = _engine_of(inp)
        running = state.phase not in TERMINAL[MACHINE_OF[type(state)]]
        sub = subs_of(state).get(engine) if engine and running else None
        if sub is None:
            new, commands, fired = self._fire(state, None, inp)
            return DriverStep(new, commands, (fired,))
        new_sub, commands, fired = self._fire(state, sub, inp)
        state = _with_subs(state, subs_of(state).set(engine, new_sub))
        settles = SETTLES[MACHINE_OF[type(sub)]]
        if new_sub.phase in settles and new_sub.phase != sub.phase:
            state, more, coordinator = self._fire(state, None, Settled(engine))
            return DriverStep(state, commands + more, (fired, coordinator))
        return DriverStep(state, commands, (fired,))


DRIVERS = Drivers()


def is_done(state: DriverState) -> bool:
    return state.phase in TERMINAL[MACHINE_OF[type(state)]]


def failed_engines(state: StageState) -> tuple[str, ...]:
    """The engines whose staging failed (their sub-machine's `failure` says why), by name."""
    return tuple(sorted(name for name, e in state.engines.items() if e.phase == "FAILED"))


# The stage coordinator's timed phases (`PublishOutcome.phases`): reserve, begin, bucket_<i>, end. A phase has
# completed when the coordinator enters one of these from it; the phase a failed call belongs to, by its op.
_STAGE_PROGRESS = frozenset({"BEGINNING", "TRANSFERRING", "ENDING", "DONE"})
_STAGE_PHASE_OF_CALL = {"begin": "BEGINNING", "prepared": "BEGINNING", "bucket": "TRANSFERRING", "end": "ENDING",
                        "probe": "ENDING", "ready": "ENDING"}


def stage_phase(state: StageState, op: str | None = None) -> str:
    """The timed phase the coordinator is in (or, given a call's op, the one that call belongs to)."""
    phase = state.phase if op is None else _STAGE_PHASE_OF_CALL[op]
    return {"VIEWING": "reserve", "RESERVING": "reserve", "BEGINNING": "begin", "ENDING": "end"}.get(
        phase, f"bucket_{state.bucket}")


def stage_phase_moved(before: StageState, after: StageState) -> bool:
    """The step left the timed phase `before` was in (a new coordinator phase, or the next bucket)."""
    return after.phase != before.phase or after.bucket != before.bucket


def stage_phase_completed(before: StageState, after: StageState) -> str | None:
    """The timed phase the step completed (every engine through it, none failed), else None."""
    done = before.phase != "IDLE" and after.phase in _STAGE_PROGRESS and not failed_engines(after)
    return stage_phase(before) if done and stage_phase_moved(before, after) else None


def staging_started(before: StageState, after: StageState) -> bool:
    """The step sent the first `begin`s: the attempt is known and its engines are being staged."""
    return after.phase == "BEGINNING" and before.phase != "BEGINNING"


def unresolved_requests(state: SessionState) -> tuple[str, ...]:
    """The request ids whose generation may have been accepted by an engine (not resolved yet)."""
    return tuple(sorted(rid for rid, g in state.requests.items() if g.phase in UNRESOLVED))


def requests_in_flight(state: SessionState) -> tuple[str, ...]:
    """The request ids being dispatched or sent now (their caller waits for the response)."""
    return tuple(sorted(rid for rid, g in state.requests.items() if g.phase in ("VIEWING", "SENDING")))


def aborted_requests(state: SessionState) -> tuple[str, ...]:
    """The request ids the session's close aborted."""
    return tuple(sorted(rid for rid, g in state.requests.items() if g.phase == "ABORTED"))


def in_flight_rid(state: SessionState, rid: str) -> str | None:
    """The engine's request id of `rid`'s generation while it is sent (a temporary abort's target), else None."""
    g = state.requests.get(rid)
    return g.attempt_rid if g is not None and g.phase == "SENDING" else None


def confirmed_engines(state: ReclaimState) -> tuple[str, ...]:
    """The engines whose unload this reclaim confirmed to the registry."""
    return tuple(sorted(name for name, e in state.engines.items() if e.phase == "CONFIRMED"))


def rehydrated_versions(state: SuperviseState) -> tuple[VersionKey, ...]:
    """The versions READY on the supervised engine (staged now, or READY there already)."""
    return tuple(sorted((r.order.version for r in state.rehydrates.values() if r.phase == "READY"), key=str))


def failed_rehydrates(state: SuperviseState) -> tuple[tuple[VersionKey, str], ...]:
    """(version, why) for each version owed that is not READY there (no request goes there for it)."""
    return tuple(sorted(((r.order.version, r.failure or "") for r in state.rehydrates.values()
                         if r.phase == "FAILED"), key=str))
