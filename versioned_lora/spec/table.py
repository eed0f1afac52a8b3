"""THE transition table: every state change of the registry and of the engine side is one row here.

Reading a row: when an event of type `event` reaches an entity of `machine` whose state is one of
`sources`, the rows for that (machine, state, event) are tried top to bottom; the first whose named
`guards` all hold fires. It moves the entity to `target` (SAME = unchanged), runs the named
`updates` (which write the other fields listed in `writes`), returns `result` (a `Reason` name means
a refusal) and emits the named `effects` for the runtime to execute. `also` documents the other
machines the row moves (the default pointer, the previous default...).

Rows with no `writes` change nothing: they are the explicit answers to late, duplicated and stale
messages. Only such rows may use the wildcard source. A (state, event) pair that no row covers is a
bug in the caller and raises the one `ProtocolError` (h11 style); `uncovered_pairs` lists them.

Guards, updates, effects and results are small pure functions in `versioned_lora.lifecycle`,
referenced here by name only.
"""

from __future__ import annotations

import attrs

from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import SAME, STATES, WILDCARD, Machine, wildcard_states

V, A, S, R, D, E, L, AD, P = (
    Machine.VERSION,
    Machine.ATTEMPT,
    Machine.SESSION,
    Machine.RECLAIM,
    Machine.DEFAULT,
    Machine.ENGINE,
    Machine.LEASE,
    Machine.ADAPTER,
    Machine.PROCESS,
)


@attrs.frozen
class Move:
    """A secondary transition of another machine caused by a row (for diagrams and coverage)."""

    machine: Machine
    source: str
    target: str


@attrs.frozen
class Row:
    id: str
    machine: Machine
    sources: tuple[str, ...]
    event: str
    target: str
    result: str
    guards: tuple[str, ...] = ()
    updates: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    also: tuple[Move, ...] = ()
    doc: str = ""

    @property
    def changes_state(self) -> bool:
        return bool(self.writes)

    @property
    def is_refusal(self) -> bool:
        return self.result in Reason.__members__

    def expanded_sources(self) -> tuple[str, ...]:
        return wildcard_states(self.machine) if self.sources == (WILDCARD,) else self.sources


def _sources(sources: str) -> tuple[str, ...]:
    return tuple(sources.split())


def move(
    id: str,
    machine: Machine,
    sources: str,
    event: str,
    target: str,
    result: str,
    *,
    guards: tuple[str, ...] = (),
    updates: tuple[str, ...] = (),
    effects: tuple[str, ...] = (),
    writes: tuple[str, ...],
    also: tuple[Move, ...] = (),
    doc: str = "",
) -> Row:
    """A row that changes state."""
    return Row(id, machine, _sources(sources), event, target, result, guards, updates, effects, writes, also, doc)


def keep(
    id: str,
    machine: Machine,
    sources: str,
    event: str,
    result: str,
    *,
    guards: tuple[str, ...] = (),
    effects: tuple[str, ...] = (),
    doc: str = "",
) -> Row:
    """A row that changes nothing: a refusal (`result` is a Reason) or an idempotent re-answer."""
    return Row(id, machine, _sources(sources), event, SAME, result, guards, (), effects, (), (), doc)


# Field paths a row may write; the frame test checks every changed field is declared by the fired row.
VERSION_NEW = ("version.state", "version.digest", "version.lora_name", "version.attempt_token")
ATTEMPT_ALL = ("placement.state", "placement.attempt_token", "placement.incarnation")
SESSION_CLOSE = ("session.state", "session.version", "shard.low_water")
TO_CLEANING = tuple(Move(A, s, "CLEANING") for s in ("BEGUN", "PREPARED", "READY", "UNKNOWN"))
COMPACTION = (Move(S, "CLOSED", "COMPACTED"),)  # a close at the mark moves it over contiguous tombstones
DEFAULT_MOVE = ("version.state", "version.commit", "default.version", "default.revision")

# fmt: off
ROWS: tuple[Row, ...] = (
    # ================================================================ version: reserve
    keep("reserve.conflict", V, "*", "Reserve", Reason.VERSION_CONFLICT, guards=("digest_differs",),
         doc="Same key, other content: a conflict forever within the epoch, whatever the version's state."),
    keep("reserve.other_epoch", V, "OTHER_EPOCH", "Reserve", Reason.UNKNOWN_VERSION,
         doc="This registry serves one deployment epoch."),
    keep("reserve.no_lease", V, "UNSEEN FAILED_CLEAN", "Reserve", Reason.NOT_LEASE_HOLDER,
         guards=("lease_not_held",),
         doc="Only the holder of the live publisher lease starts a publication: refused before any slot is taken."),
    keep("reserve.while_pending", V, "UNSEEN FAILED_CLEAN", "Reserve", Reason.PUBLICATION_IN_PROGRESS,
         guards=("publication_pending",),
         doc="One pending attempt at a time, including one whose cleanup is not yet confirmed."),
    keep("reserve.over_capacity", V, "UNSEEN FAILED_CLEAN", "Reserve", Reason.CAPACITY_ERROR,
         guards=("capacity_full",), doc="Refused in the registry, before any begin or transfer."),
    move("reserve.new", V, "UNSEEN", "Reserve", "LOADING", "reserved",
         updates=("create_version", "place_attempt_on_all_engines"), effects=("stage_on_all_engines",),
         writes=(*VERSION_NEW, *ATTEMPT_ALL, "counter.attempts"), also=(Move(A, "UNSEEN", "BEGUN"),),
         doc="Takes a slot and mints the attempt token; every engine is asked to stage it."),
    move("reserve.retry_after_failed_clean", V, "FAILED_CLEAN", "Reserve", "LOADING", "reserved",
         updates=("renew_attempt", "place_attempt_on_all_engines"), effects=("stage_on_all_engines",),
         writes=("version.state", "version.attempt_token", *ATTEMPT_ALL, "counter.attempts"),
         also=(Move(A, "CLEANED", "BEGUN"),),
         doc="Same key and content after a cleaned failure: a fresh attempt with a new token."),
    keep("reserve.replay", V, "LOADING PUBLISHED RETIRED RECLAIMING RECLAIMED ABORTED", "Reserve", "reserved",
         doc="Same key and content: the existing attempt and state; nothing is loaded or taken twice."),
    # ================================================================ version: commit
    keep("commit.unknown", V, "UNSEEN OTHER_EPOCH", "Commit", Reason.UNKNOWN_VERSION),
    keep("commit.replay", V, "PUBLISHED RETIRED RECLAIMING RECLAIMED", "Commit", "committed",
         guards=("attempt_token_matches",),
         doc="A replayed commit returns the original receipt; a retired version never becomes default again."),
    keep("commit.stale_after_commit", V, "PUBLISHED RETIRED RECLAIMING RECLAIMED", "Commit", Reason.STALE_ATTEMPT),
    keep("commit.stale_attempt", V, "LOADING", "Commit", Reason.STALE_ATTEMPT, guards=("attempt_token_mismatch",)),
    keep("commit.no_lease", V, "LOADING", "Commit", Reason.NOT_LEASE_HOLDER, guards=("lease_not_held",),
         doc="A publisher whose lease expired or was taken over cannot move the default; the lease's holder "
             "recovers the attempt."),
    keep("commit.revision_moved", V, "LOADING", "Commit", Reason.REVISION_MISMATCH, guards=("revision_mismatch",)),
    keep("commit.not_ready", V, "LOADING", "Commit", Reason.NOT_READY, guards=("not_ready_everywhere",),
         doc="Needs READY from every target engine, for this attempt, in its current incarnation."),
    move("commit.bootstrap", V, "LOADING", "Commit", "PUBLISHED", "committed", guards=("no_default",),
         updates=("point_default_here",), writes=DEFAULT_MOVE,
         also=(Move(D, "NONE", "SET"),), doc="The first version: binding works from now on."),
    move("commit.swap", V, "LOADING", "Commit", "PUBLISHED", "committed",
         updates=("retire_old_default", "point_default_here"), effects=("old_default_reclaimable",),
         writes=DEFAULT_MOVE, also=(Move(D, "SET", "SET"), Move(V, "PUBLISHED", "RETIRED")),
         doc="Old default PUBLISHED -> RETIRED, new LOADING -> PUBLISHED, default_revision += 1."),
    keep("commit.aborted", V, "ABORTED FAILED_CLEAN", "Commit", Reason.STALE_ATTEMPT),
    # ================================================================ version: abort
    keep("abort.unknown", V, "UNSEEN OTHER_EPOCH", "Abort", Reason.UNKNOWN_VERSION),
    keep("abort.stale_attempt", V, "LOADING ABORTED FAILED_CLEAN", "Abort", Reason.STALE_ATTEMPT,
         guards=("attempt_token_mismatch",)),
    move("abort.loading", V, "LOADING", "Abort", "ABORTED", "aborted",
         updates=("clean_attempt_on_all_engines",), effects=("cleanup_on_all_engines",),
         writes=("version.state", "placement.state"), also=TO_CLEANING,
         doc="Capacity stays taken until every engine confirmed its cleanup."),
    keep("abort.replay", V, "ABORTED", "Abort", "aborted", effects=("cleanup_where_still_cleaning",),
         doc="A recovering publisher re-issues the (idempotent) cleanups that are not yet confirmed."),
    keep("abort.replay_clean", V, "FAILED_CLEAN", "Abort", "aborted"),
    keep("abort.after_commit", V, "PUBLISHED RETIRED RECLAIMING RECLAIMED", "Abort", Reason.STALE_ATTEMPT,
         doc="The commit landed (its reply may have been lost): a committed version is never cleaned."),
    # ================================================================ version: claim reclaim
    keep("claim.unknown", V, "UNSEEN OTHER_EPOCH", "ClaimReclaim", Reason.UNKNOWN_VERSION),
    keep("claim.in_use", V, "RETIRED", "ClaimReclaim", Reason.NOT_RECLAIMABLE, guards=("session_refs_positive",),
         doc="A bound session may still dispatch on it."),
    move("claim.retired", V, "RETIRED", "ClaimReclaim", "RECLAIMING", "reclaim_claimed",
         updates=("issue_reclaim_id",), effects=("reclaim_on_all_engines",),
         writes=("version.state", "version.reclaim_id"), also=(Move(R, "NOT_CLAIMED", "PENDING"),),
         doc="From now on nothing is dispatched for it; every engine unregisters, drains and unloads it."),
    keep("claim.replay", V, "RECLAIMING", "ClaimReclaim", "reclaim_claimed", effects=("reclaim_where_unconfirmed",),
         doc="Same stable reclaim id; unconfirmed engines are asked again (idempotent per reclaim id)."),
    keep("claim.replay_done", V, "RECLAIMED", "ClaimReclaim", "reclaim_claimed"),
    keep("claim.not_retired", V, "LOADING PUBLISHED ABORTED FAILED_CLEAN", "ClaimReclaim", Reason.NOT_RECLAIMABLE),
    # ================================================================ attempt x engine: prepared
    keep("prepared.unknown", A, "UNSEEN OTHER_EPOCH", "RecordPrepared", Reason.UNKNOWN_VERSION),
    keep("prepared.stale_attempt", A, "*", "RecordPrepared", Reason.STALE_ATTEMPT,
         guards=("placement_token_mismatch",)),
    keep("prepared.stale_incarnation", A, "*", "RecordPrepared", Reason.STALE_INCARNATION,
         guards=("incarnation_stale",)),
    keep("prepared.digest_mismatch", A, "*", "RecordPrepared", Reason.VERSION_CONFLICT, guards=("digest_differs",)),
    keep("prepared.reclaiming", A, "*", "RecordPrepared", Reason.STALE_ATTEMPT, guards=("version_reclaiming",),
         doc="A rehydrate that finishes after the version was claimed for reclaim counts for nothing."),
    move("prepared.begun", A, "BEGUN UNKNOWN", "RecordPrepared", "PREPARED", "recorded", writes=("placement.state",)),
    keep("prepared.replay", A, "PREPARED READY", "RecordPrepared", "recorded"),
    keep("prepared.late", A, "CLEANING CLEANED ABSENT", "RecordPrepared", Reason.STALE_ATTEMPT),
    # ================================================================ attempt x engine: ready
    keep("ready.unknown", A, "UNSEEN OTHER_EPOCH", "RecordReady", Reason.UNKNOWN_VERSION),
    keep("ready.stale_attempt", A, "*", "RecordReady", Reason.STALE_ATTEMPT, guards=("placement_token_mismatch",)),
    keep("ready.stale_incarnation", A, "*", "RecordReady", Reason.STALE_INCARNATION, guards=("incarnation_stale",),
         doc="A READY from an older incarnation does not count."),
    keep("ready.digest_mismatch", A, "*", "RecordReady", Reason.VERSION_CONFLICT, guards=("digest_differs",),
         doc="A READY whose digest differs from the reserved one is rejected."),
    keep("ready.reclaiming", A, "*", "RecordReady", Reason.STALE_ATTEMPT, guards=("version_reclaiming",)),
    move("ready.local", A, "BEGUN PREPARED UNKNOWN", "RecordReady", "READY", "recorded", writes=("placement.state",)),
    keep("ready.replay", A, "READY", "RecordReady", "recorded"),
    keep("ready.late", A, "CLEANING CLEANED ABSENT", "RecordReady", Reason.STALE_ATTEMPT,
         doc="A READY after cleanup started never revives the attempt."),
    # ================================================================ attempt x engine: unknown outcome
    keep("unknown.unknown_version", A, "UNSEEN OTHER_EPOCH", "RecordUnknown", Reason.UNKNOWN_VERSION),
    keep("unknown.stale_attempt", A, "*", "RecordUnknown", Reason.STALE_ATTEMPT, guards=("placement_token_mismatch",)),
    move("unknown.pending", A, "BEGUN PREPARED", "RecordUnknown", "UNKNOWN", "recorded", writes=("placement.state",),
         doc="Keeps the resource and the capacity; blocks commit until the engine's state is known."),
    keep("unknown.settled", A, "UNKNOWN READY CLEANING CLEANED ABSENT", "RecordUnknown", "recorded",
         doc="Nothing to forget: READY stays READY, a cleanup not confirmed stays CLEANING (capacity kept)."),
    # ================================================================ attempt x engine: cleaned
    keep("cleaned.unknown_version", A, "UNSEEN OTHER_EPOCH", "RecordCleaned", Reason.UNKNOWN_VERSION),
    keep("cleaned.stale_attempt", A, "*", "RecordCleaned", Reason.STALE_ATTEMPT, guards=("placement_token_mismatch",)),
    move("cleaned.last", A, "CLEANING", "RecordCleaned", "CLEANED", "recorded", guards=("others_cleaned",),
         updates=("mark_failed_clean",), effects=("capacity_freed",), writes=("placement.state", "version.state"),
         also=(Move(V, "ABORTED", "FAILED_CLEAN"),), doc="The slot is freed only when every engine is clean."),
    move("cleaned.one", A, "CLEANING", "RecordCleaned", "CLEANED", "recorded", writes=("placement.state",)),
    keep("cleaned.replay", A, "CLEANED", "RecordCleaned", "recorded"),
    keep("cleaned.live_attempt", A, "BEGUN PREPARED READY UNKNOWN ABSENT", "RecordCleaned", Reason.STALE_ATTEMPT,
         doc="A cleaned receipt never removes an attempt that was not aborted."),
    # ================================================================ session
    keep("open.other_epoch", S, "OTHER_EPOCH", "OpenSession", Reason.SESSION_CLOSED),
    move("open.unseen", S, "UNSEEN", "OpenSession", "OPEN", "session_status", writes=("session.state",)),
    keep("open.replay", S, "OPEN BOUND", "OpenSession", "session_status"),
    keep("open.late", S, "FINALIZING CLOSED COMPACTED", "OpenSession", Reason.SESSION_CLOSED,
         doc="A late open never reopens a closing or closed session."),
    keep("bind.no_default", S, "UNSEEN OPEN", "BindFirst", Reason.NO_PUBLISHED_VERSION, guards=("no_default",),
         doc="Before the bootstrap commit there is nothing to bind."),
    move("bind.first", S, "UNSEEN OPEN", "BindFirst", "BOUND", "bound_to_default", updates=("take_session_ref",),
         writes=("session.state", "session.version", "version.session_refs"),
         doc="Reads the current default once and takes one session ref; opens an unseen key."),
    keep("bind.replay", S, "BOUND", "BindFirst", "bound", doc="Every later call returns the same version."),
    keep("bind.closed", S, "FINALIZING CLOSED COMPACTED OTHER_EPOCH", "BindFirst", Reason.SESSION_CLOSED,
         doc="A late bind after begin_close or close never binds."),
    move("begin_close.live", S, "UNSEEN OPEN BOUND", "BeginClose", "FINALIZING", "session_status",
         writes=("session.state",), doc="Refuses late open/bind from now on; the binding (if any) is kept."),
    keep("begin_close.replay", S, "FINALIZING CLOSED COMPACTED", "BeginClose", "session_status"),
    keep("begin_close.other_epoch", S, "OTHER_EPOCH", "BeginClose", Reason.SESSION_CLOSED),
    move("close.bound", S, "BOUND", "CloseAndRelease", "CLOSED", "closed", updates=("release_session_ref",),
         effects=("reclaimable_after_release",), writes=(*SESSION_CLOSE, "version.session_refs"), also=COMPACTION,
         doc="Releases the one session ref exactly once; the record stays as a tombstone."),
    move("close.finalizing_bound", S, "FINALIZING", "CloseAndRelease", "CLOSED", "closed", guards=("session_bound",),
         updates=("release_session_ref",), effects=("reclaimable_after_release",),
         writes=(*SESSION_CLOSE, "version.session_refs"), also=COMPACTION),
    move("close.unbound", S, "UNSEEN OPEN FINALIZING", "CloseAndRelease", "CLOSED", "closed",
         writes=SESSION_CLOSE, also=COMPACTION,
         doc="Close may arrive before open: an unseen key gets a tombstone so it can never open."),
    keep("close.replay", S, "CLOSED COMPACTED", "CloseAndRelease", "closed",
         doc="A duplicate close releases nothing."),
    keep("close.other_epoch", S, "OTHER_EPOCH", "CloseAndRelease", Reason.SESSION_CLOSED),
    # ================================================================ reclaim x engine
    keep("confirm.unknown", R, "UNSEEN OTHER_EPOCH", "ConfirmReclaim", Reason.UNKNOWN_VERSION),
    keep("confirm.not_claimed", R, "NOT_CLAIMED", "ConfirmReclaim", Reason.NOT_RECLAIMABLE),
    keep("confirm.forged", R, "PENDING CONFIRMED", "ConfirmReclaim", Reason.NOT_RECLAIMABLE,
         guards=("reclaim_id_mismatch",), doc="A receipt for another reclaim id changes nothing."),
    move("confirm.last", R, "PENDING", "ConfirmReclaim", "CONFIRMED", "reclaim_confirmed",
         guards=("others_confirmed",), updates=("mark_reclaimed",), effects=("capacity_freed",),
         writes=("version.reclaim_confirmed", "version.state"), also=(Move(V, "RECLAIMING", "RECLAIMED"),),
         doc="RECLAIMED, and its slot free, only after every engine confirmed this reclaim id."),
    move("confirm.one", R, "PENDING", "ConfirmReclaim", "CONFIRMED", "reclaim_confirmed",
         writes=("version.reclaim_confirmed",)),
    keep("confirm.replay", R, "CONFIRMED", "ConfirmReclaim", "reclaim_confirmed",
         doc="Duplicate and late receipts are harmless."),
    # ================================================================ engine (the registry's view)
    keep("restart.stale", E, "UP", "EngineRestarted", Reason.STALE_INCARNATION, guards=("incarnation_not_newer",)),
    move("restart.new", E, "UP", "EngineRestarted", SAME, "restarted",
         updates=("adopt_incarnation", "replace_placements_on_engine"), effects=("recover_engine",),
         writes=("engine.incarnation", *ATTEMPT_ALL, "counter.attempts"),
         also=(Move(A, "READY", "BEGUN"), Move(A, "PREPARED", "BEGUN"), Move(A, "UNKNOWN", "BEGUN"),
               Move(A, "BEGUN", "BEGUN"), Move(A, "READY", "ABSENT"),
               # a rehydrate of a version nobody can use any more, caught by the next restart mid-staging
               Move(A, "BEGUN", "ABSENT"), Move(A, "PREPARED", "ABSENT"), Move(A, "UNKNOWN", "ABSENT")),
         doc="Invalidates that engine's READY; the pending attempt is staged again and every version it must "
             "hold gets a rehydrate attempt (default unchanged); versions it need not hold become ABSENT."),
    # ================================================================ the publisher lease
    move("lease.acquire", L, "FREE", "AcquireLease", "HELD", "lease_granted", updates=("grant_lease",),
         effects=("arm_lease_timer",), writes=("lease.holder", "lease.fence", "lease.ttl_s"),
         doc="A new fence, one above the last: everything fenced by an earlier grant is refused from now on."),
    keep("lease.acquire_replay", L, "HELD", "AcquireLease", "lease_granted", guards=("same_holder",),
         effects=("arm_lease_timer",),
         doc="The holder asking again (a lost reply, a restarted loop): the same fence, its timer armed afresh."),
    keep("lease.held", L, "HELD", "AcquireLease", Reason.LEASE_HELD,
         doc="One publisher at a time: a second one is refused before it reserves anything."),
    keep("lease.renew", L, "HELD", "RenewLease", "lease_granted", guards=("lease_matches",),
         effects=("arm_lease_timer",), doc="The holder's timer starts again; nothing in the state changes."),
    keep("lease.renew_lost", L, "FREE HELD", "RenewLease", Reason.NOT_LEASE_HOLDER,
         doc="The lease expired or moved on: the old holder learns it lost it (and must not publish)."),
    move("lease.release", L, "HELD", "ReleaseLease", "FREE", "lease_status", guards=("lease_matches",),
         writes=("lease.holder",), doc="The holder is done: another may acquire at once."),
    keep("lease.release_replay", L, "FREE HELD", "ReleaseLease", "lease_status",
         doc="A release of a fence no longer live (repeated, or after expiry): nothing to give up."),
    move("lease.expire", L, "HELD", "ExpireLease", "FREE", "lease_status", guards=("fence_is_live",),
         writes=("lease.holder",),
         doc="The registry's timer: the holder stopped renewing. A pending attempt it left stays as it is "
             "(capacity kept) for the next holder's recovery."),
    keep("lease.expire_late", L, "FREE HELD", "ExpireLease", "lease_status",
         doc="A timer of an earlier grant, or one that fired after a renewal re-armed it: changes nothing."),
    move("lease.take_over", L, "HELD", "TakeOverLease", SAME, "lease_granted", guards=("fence_is_live",),
         updates=("grant_lease",), effects=("arm_lease_timer",), writes=("lease.holder", "lease.fence", "lease.ttl_s"),
         doc="An operator ends a crashed publisher's lease at once rather than waiting for its timer."),
    move("lease.take_over_free", L, "FREE", "TakeOverLease", "HELD", "lease_granted", updates=("grant_lease",),
         effects=("arm_lease_timer",), writes=("lease.holder", "lease.fence", "lease.ttl_s"),
         doc="Nothing to end (it expired or was released meanwhile): an ordinary grant."),
    keep("lease.take_over_moved", L, "HELD", "TakeOverLease", Reason.LEASE_HELD,
         doc="The named fence is not the live one: someone else took the lease since; nothing is ended."),
    # ================================================================ managed adapter x engine (engine side)
    keep("begin.stale_incarnation", AD, "*", "BeginStaging", Reason.STALE_INCARNATION,
         guards=("engine_incarnation_stale",)),
    move("begin.absent", AD, "ABSENT", "BeginStaging", "STAGING", "adapter_status", updates=("open_stash",),
         effects=("allocate_stash",),
         writes=("adapter.state", "adapter.attempt_token", "adapter.digest", "adapter.bucket_count"),
         doc="PREPARED: identity, attempt, incarnation and bucket plan are fixed; a stash is allocated."),
    keep("begin.after_cleanup", AD, "CLEANED", "BeginStaging", Reason.STALE_ATTEMPT, guards=("attempt_was_cleaned",),
         doc="Cleanup came first: a late begin never recreates anything."),
    move("begin.new_after_cleanup", AD, "CLEANED", "BeginStaging", "STAGING", "adapter_status",
         updates=("open_stash",), effects=("allocate_stash",),
         writes=("adapter.state", "adapter.attempt_token", "adapter.digest", "adapter.bucket_count",
                 "adapter.buckets_received")),
    keep("begin.replay", AD, "STAGING LOADING READY", "BeginStaging", "adapter_status", guards=("same_attempt",)),
    keep("begin.other_attempt", AD, "STAGING LOADING READY", "BeginStaging", Reason.STALE_ATTEMPT),
    keep("begin.reclaimed", AD, "UNREGISTERED DRAINING UNLOADING UNLOADED", "BeginStaging", Reason.STALE_ATTEMPT,
         doc="A reclaimed name is never loaded again."),
    keep("begin.while_cleaning", AD, "CANCELLING CLEANING UNLOAD_FAILED", "BeginStaging", Reason.STALE_ATTEMPT,
         doc="The name's last attempt is being undone (or its unload failed): nothing is staged under it meanwhile."),
    keep("bucket.stale_incarnation", AD, "*", "ReceiveBucket", Reason.STALE_INCARNATION,
         guards=("engine_incarnation_stale",)),
    keep("bucket.other_attempt", AD, "*", "ReceiveBucket", Reason.STALE_ATTEMPT, guards=("adapter_attempt_mismatch",)),
    move("bucket.next", AD, "STAGING", "ReceiveBucket", SAME, "adapter_status", guards=("bucket_is_next",),
         updates=("count_bucket",), effects=("stash_bucket",), writes=("adapter.buckets_received",)),
    keep("bucket.duplicate", AD, "STAGING LOADING READY", "ReceiveBucket", "adapter_status",
         guards=("bucket_received",), doc="A duplicate receive runs no second collective."),
    keep("bucket.out_of_order", AD, "STAGING", "ReceiveBucket", Reason.BAD_BUCKET),
    keep("bucket.late", AD, "ABSENT LOADING CANCELLING READY CLEANING CLEANED UNREGISTERED DRAINING UNLOADING "
         "UNLOAD_FAILED UNLOADED", "ReceiveBucket", Reason.STALE_ATTEMPT),
    keep("end.stale_incarnation", AD, "*", "EndStaging", Reason.STALE_INCARNATION,
         guards=("engine_incarnation_stale",)),
    keep("end.other_attempt", AD, "*", "EndStaging", Reason.STALE_ATTEMPT, guards=("adapter_attempt_mismatch",)),
    keep("end.incomplete", AD, "STAGING", "EndStaging", Reason.INCOMPLETE_TRANSFER, guards=("buckets_missing",)),
    move("end.bad_manifest", AD, "STAGING", "EndStaging", "CLEANED", Reason.MANIFEST_MISMATCH,
         guards=("manifest_rejected",), updates=("remember_cleaned_attempt",), effects=("free_stash",),
         writes=("adapter.state", "adapter.cleaned_attempts"), doc="Nothing is loaded; the stash is freed."),
    move("end.verified", AD, "STAGING", "EndStaging", "LOADING", "adapter_status", effects=("load_pinned",),
         writes=("adapter.state",),
         doc="A fresh load, pinned, from the stash (which it reads: freed once it is over); its outcome decides "
             "(loaded.ready, load_failed.cleaned)."),
    keep("end.loading", AD, "LOADING", "EndStaging", Reason.IN_USE,
         doc="A second end while the first one's load runs: ask again once it is over."),
    keep("end.replay", AD, "READY", "EndStaging", "ready_local"),
    keep("end.late", AD, "ABSENT CANCELLING CLEANING CLEANED UNREGISTERED DRAINING UNLOADING UNLOAD_FAILED UNLOADED",
         "EndStaging", Reason.STALE_ATTEMPT, doc="A late end after cleanup loads nothing."),
    # ---- the outcome of the load an end commanded (issue 41)
    keep("loaded.other_attempt", AD, "*", "LoadDone", Reason.STALE_ATTEMPT, guards=("adapter_attempt_mismatch",)),
    move("loaded.ready", AD, "LOADING", "LoadDone", "READY", "ready_local", effects=("free_stash",),
         writes=("adapter.state",),
         doc="Loaded pinned (then probed): READY_LOCAL(version, digest, attempt, incarnation); the stash is freed."),
    move("loaded.after_cleanup", AD, "CANCELLING", "LoadDone", "CLEANING", Reason.STALE_ATTEMPT,
         effects=("free_stash", "unregister", "physical_unload"), writes=("adapter.state",),
         doc="A cleanup came while it loaded: unloaded at once, never left pinned; the end is told cleanup came "
             "first."),
    keep("loaded.unawaited", AD, "ABSENT STAGING READY CLEANING CLEANED UNREGISTERED DRAINING UNLOADING UNLOAD_FAILED "
         "UNLOADED", "LoadDone", Reason.STALE_ATTEMPT, doc="No load of this attempt runs here: changes nothing."),
    keep("load_failed.other_attempt", AD, "*", "LoadFailed", Reason.STALE_ATTEMPT,
         guards=("adapter_attempt_mismatch",)),
    move("load_failed.cleaned", AD, "LOADING", "LoadFailed", "CLEANED", Reason.LOAD_FAILED,
         updates=("remember_cleaned_attempt",), effects=("free_stash",),
         writes=("adapter.state", "adapter.cleaned_attempts"),
         doc="Nothing was loaded: the stash is freed and the attempt is over here (its cleanup answers CLEANED); the "
             "end is refused, typed."),
    move("load_failed.after_cleanup", AD, "CANCELLING", "LoadFailed", "CLEANED", Reason.STALE_ATTEMPT,
         effects=("free_stash",), writes=("adapter.state",), doc="Nothing to undo but the stash."),
    keep("load_failed.unawaited", AD, "ABSENT STAGING READY CLEANING CLEANED UNREGISTERED DRAINING UNLOADING "
         "UNLOAD_FAILED UNLOADED", "LoadFailed", Reason.STALE_ATTEMPT,
         doc="No load of this attempt runs here: changes nothing."),
    move("cleanup.before_begin", AD, "ABSENT", "CleanupAttempt", "CLEANED", "adapter_status",
         updates=("remember_cleaned_attempt",), writes=("adapter.state", "adapter.cleaned_attempts"),
         doc="Cleanup may overtake begin: remember the attempt so its late begin never creates anything."),
    keep("cleanup.replay", AD, "CLEANED", "CleanupAttempt", "adapter_status", guards=("attempt_was_cleaned",)),
    move("cleanup.unstarted", AD, "CLEANED", "CleanupAttempt", SAME, "adapter_status",
         updates=("remember_cleaned_attempt",), writes=("adapter.cleaned_attempts",)),
    keep("cleanup.other_attempt", AD, "STAGING LOADING READY CANCELLING CLEANING UNLOAD_FAILED", "CleanupAttempt",
         Reason.STALE_ATTEMPT, guards=("adapter_attempt_mismatch",),
         doc="Never touches another attempt (e.g. a published version)."),
    move("cleanup.staging", AD, "STAGING", "CleanupAttempt", "CLEANED", "adapter_status",
         updates=("remember_cleaned_attempt",), effects=("free_stash",),
         writes=("adapter.state", "adapter.cleaned_attempts")),
    keep("cleanup.ready_in_use", AD, "READY", "CleanupAttempt", Reason.IN_USE, guards=("native_refs_positive",)),
    move("cleanup.loading", AD, "LOADING", "CleanupAttempt", "CANCELLING", Reason.IN_USE,
         updates=("remember_cleaned_attempt",), writes=("adapter.state", "adapter.cleaned_attempts"),
         doc="The end's load still runs (the publisher's end deadline passed): whatever it gives is undone when it "
             "is over (loaded.after_cleanup); the cleanup asks again."),
    keep("cleanup.settling", AD, "CANCELLING CLEANING", "CleanupAttempt", Reason.IN_USE,
         doc="Its load or its unload still runs: ask again once it is over."),
    move("cleanup.ready", AD, "READY", "CleanupAttempt", "CLEANING", "adapter_status",
         updates=("remember_cleaned_attempt",), effects=("unregister", "physical_unload"),
         writes=("adapter.state", "adapter.cleaned_attempts"),
         doc="A loaded candidate is unloaded once; its outcome decides (unloaded.cleaned, unload_failed.cleanup)."),
    move("cleanup.retry_unload", AD, "UNLOAD_FAILED", "CleanupAttempt", "CLEANING", "adapter_status",
         guards=("attempt_was_cleaned",), effects=("physical_unload",), writes=("adapter.state",),
         doc="The cleanup's unload failed: the cleanup sent again asks SGLang's unload again."),
    keep("cleanup.reclaimed", AD, "UNREGISTERED DRAINING UNLOADING UNLOAD_FAILED UNLOADED", "CleanupAttempt",
         Reason.STALE_ATTEMPT),
    move("acquire.ready", AD, "READY", "AcquireRequest", SAME, "adapter_status", updates=("take_native_ref",),
         writes=("adapter.native_refs",)),
    keep("acquire.unavailable", AD, "ABSENT STAGING LOADING CANCELLING CLEANING CLEANED UNREGISTERED DRAINING "
         "UNLOADING UNLOAD_FAILED UNLOADED", "AcquireRequest",
         Reason.VERSION_UNAVAILABLE, doc="The exact version or an error: never a fallback, never an implicit reload."),
    move("release.last_while_draining", AD, "DRAINING", "ReleaseRequest", "UNREGISTERED", "adapter_status",
         guards=("last_native_ref",), updates=("drop_native_ref",), writes=("adapter.state", "adapter.native_refs")),
    move("release.one", AD, "DRAINING", "ReleaseRequest", SAME, "adapter_status", updates=("drop_native_ref",),
         writes=("adapter.native_refs",)),
    move("release.serving", AD, "READY", "ReleaseRequest", SAME, "adapter_status", guards=("native_refs_positive",),
         updates=("drop_native_ref",), writes=("adapter.native_refs",)),
    keep("release.duplicate", AD, "READY ABSENT STAGING LOADING CANCELLING CLEANING CLEANED UNREGISTERED UNLOADING "
         "UNLOAD_FAILED UNLOADED", "ReleaseRequest",
         "adapter_status", doc="A duplicate terminal releases nothing."),
    move("reclaim.in_use", AD, "READY", "ReclaimAdapter", "DRAINING", "adapter_status",
         guards=("native_refs_positive",), updates=("note_reclaim_id",), effects=("unregister", "await_unload"),
         writes=("adapter.state", "adapter.reclaim_id"), doc="Stays pinned and serving in-flight requests."),
    move("reclaim.idle", AD, "READY", "ReclaimAdapter", "UNREGISTERED", "adapter_status",
         updates=("note_reclaim_id",), effects=("unregister", "await_unload"),
         writes=("adapter.state", "adapter.reclaim_id")),
    keep("reclaim.forged", AD, "UNREGISTERED DRAINING UNLOADING UNLOAD_FAILED UNLOADED", "ReclaimAdapter",
         Reason.NOT_RECLAIMABLE, guards=("engine_reclaim_id_mismatch",)),
    move("reclaim.retry_unload", AD, "UNLOAD_FAILED", "ReclaimAdapter", "UNLOADING", "adapter_status",
         effects=("physical_unload",), writes=("adapter.state",),
         doc="The reclaim's unload failed: the same reclaim sent again asks SGLang's unload again (drained already: "
             "the name is unregistered)."),
    keep("reclaim.replay", AD, "UNREGISTERED DRAINING UNLOADING UNLOADED", "ReclaimAdapter", "adapter_status"),
    keep("reclaim.settling", AD, "LOADING CANCELLING CLEANING", "ReclaimAdapter", Reason.IN_USE,
         doc="A load or an unload of this name runs here: ask again once it is over."),
    move("reclaim.absent", AD, "ABSENT CLEANED", "ReclaimAdapter", "UNLOADED", "adapter_status",
         updates=("note_reclaim_id", "mark_absent"), writes=("adapter.state", "adapter.reclaim_id", "adapter.absent"),
         doc="This incarnation never held the name: UNLOADED(absent)."),
    move("reclaim.staging", AD, "STAGING", "ReclaimAdapter", "UNLOADED", "adapter_status",
         updates=("note_reclaim_id", "mark_absent"), effects=("free_stash",),
         writes=("adapter.state", "adapter.reclaim_id", "adapter.absent"),
         doc="A rehydrate still staging is dropped; nothing was ever loaded."),
    keep("unload.forged", AD, "UNREGISTERED DRAINING UNLOADING UNLOAD_FAILED UNLOADED", "FinishUnload",
         Reason.NOT_RECLAIMABLE,
         guards=("engine_reclaim_id_mismatch",)),
    move("unload.drained", AD, "UNREGISTERED", "FinishUnload", "UNLOADING", "adapter_status",
         effects=("physical_unload",), writes=("adapter.state",),
         doc="The one physical unload; its outcome decides (unloaded.reclaimed, unload_failed.reclaim)."),
    keep("unload.in_use", AD, "DRAINING", "FinishUnload", Reason.IN_USE,
         doc="Nothing is unloaded while the native refcount is above zero."),
    keep("unload.replay", AD, "UNLOADING UNLOAD_FAILED UNLOADED", "FinishUnload", "adapter_status",
         doc="A second unload changes nothing."),
    keep("unload.not_reclaiming", AD, "ABSENT STAGING LOADING CANCELLING READY CLEANING CLEANED", "FinishUnload",
         Reason.NOT_RECLAIMABLE),
    # ---- the outcome of a physical unload a row commanded (issue 41)
    move("unloaded.cleaned", AD, "CLEANING", "UnloadDone", "CLEANED", "adapter_status", writes=("adapter.state",),
         doc="SGLang unloaded the cleaned candidate: its slot is free."),
    move("unloaded.reclaimed", AD, "UNLOADING", "UnloadDone", "UNLOADED", "adapter_status", writes=("adapter.state",),
         doc="SGLang unloaded the reclaimed name: its slot is free; UNLOADED is the reclaim's receipt."),
    keep("unloaded.unawaited", AD, "ABSENT STAGING LOADING CANCELLING READY CLEANED UNREGISTERED "
         "DRAINING UNLOAD_FAILED UNLOADED", "UnloadDone", "adapter_status",
         doc="No unload of this name runs: changes nothing."),
    move("unload_failed.cleanup", AD, "CLEANING", "UnloadFailed", "UNLOAD_FAILED", Reason.UNLOAD_FAILED,
         writes=("adapter.state",),
         doc="SGLang still holds the weights: the slot stays held and the cleanup is refused, typed (the registry "
             "keeps the placement CLEANING); the cleanup sent again retries (cleanup.retry_unload)."),
    move("unload_failed.reclaim", AD, "UNLOADING", "UnloadFailed", "UNLOAD_FAILED", "adapter_status",
         writes=("adapter.state",),
         doc="SGLang still holds the weights: the slot stays held, no receipt; the reclaim sent again retries "
             "(reclaim.retry_unload)."),
    keep("unload_failed.unawaited", AD, "ABSENT STAGING LOADING CANCELLING READY CLEANED UNREGISTERED "
         "DRAINING UNLOAD_FAILED UNLOADED", "UnloadFailed", "adapter_status",
         doc="No unload of this name runs: changes nothing."),
    # ================================================================ engine process (engine side)
    keep("started.stale", P, "UP", "EngineStarted", Reason.STALE_INCARNATION,
         guards=("process_incarnation_not_newer",)),
    move("started.new", P, "UP", "EngineStarted", SAME, "process_status", updates=("forget_all_adapters",),
         writes=("process.incarnation", "adapter.state"), also=(Move(AD, WILDCARD, "ABSENT"),),
         doc="A new incarnation starts with every managed adapter ABSENT."),
)
# fmt: on

ROWS_BY_ID: dict[str, Row] = {row.id: row for row in ROWS}

FIELDS = frozenset(
    {
        "version.state", "version.digest", "version.lora_name", "version.attempt_token", "version.commit",
        "version.reclaim_id", "version.reclaim_confirmed", "version.session_refs",
        "placement.state", "placement.attempt_token", "placement.incarnation",
        "session.state", "session.version", "shard.low_water",
        "default.version", "default.revision", "engine.incarnation", "counter.attempts",
        "lease.holder", "lease.fence", "lease.ttl_s",
        "adapter.state", "adapter.attempt_token", "adapter.digest", "adapter.bucket_count",
        "adapter.buckets_received", "adapter.native_refs", "adapter.reclaim_id", "adapter.absent",
        "adapter.cleaned_attempts", "process.incarnation",
    }
)  # fmt: skip


def rows_for(machine: Machine) -> tuple[Row, ...]:
    return tuple(row for row in ROWS if row.machine is machine)


def covered_pairs(rows: tuple[Row, ...] = ROWS) -> frozenset[tuple[Machine, str, str]]:
    return frozenset((row.machine, source, row.event) for row in rows for source in row.expanded_sources())


def uncovered_pairs(events: dict[str, Machine], rows: tuple[Row, ...] = ROWS) -> tuple[tuple[Machine, str, str], ...]:
    """(machine, state, event) pairs no row covers: reaching one raises the ProtocolError."""
    covered = covered_pairs(rows)
    return tuple(
        (machine, state, event)
        for event, machine in events.items()
        for state in STATES[machine]
        if (machine, state, event) not in covered
    )
