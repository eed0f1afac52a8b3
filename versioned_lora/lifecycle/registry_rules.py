"""The registry's named guards, updates, writers, effects and results, referenced by name from the
table (`versioned_lora.spec.table`). Each is a small pure function.

Signatures: a guard is `(state, event) -> bool`; an update writes fields of a `RegistryDraft`
(`(draft, event) -> None`); a writer puts the row's target state on the located entity; an effect
builder and a result builder read `(before, after, event)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
from immutables import Map

from versioned_lora.lifecycle.effects import (
    ArmLeaseTimer,
    CapacityFreed,
    CleanupOnEngine,
    ReclaimEligible,
    ReclaimOnEngine,
    RegistryEffect,
    StageOnEngine,
)
from versioned_lora.lifecycle.results import (
    Aborted,
    Bound,
    Closed,
    Committed,
    LeaseGranted,
    LeaseStatus,
    ReclaimClaimed,
    ReclaimConfirmed,
    Recorded,
    RegistryResult,
    Reserved,
    Restarted,
    SessionStatus,
)
from versioned_lora.spec.events import (
    Abort,
    AcquireLease,
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    EngineRestarted,
    ExpireLease,
    OpenSession,
    RecordCleaned,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    ReleaseLease,
    RenewLease,
    Reserve,
    TakeOverLease,
)
from versioned_lora.spec.identities import SessionKey, VersionKey, attempt_token, lora_name, reclaim_id
from versioned_lora.spec.model import (
    CommitReceipt,
    Placement,
    PublisherLease,
    RegistryConfig,
    RegistryState,
    SessionRecord,
    Version,
    holds_lease,
    lease_required,
    occupied_slots,
    pending_versions,
    session_refs,
    session_state,
)
from versioned_lora.spec.states import (
    EngineState,
    LeaseState,
    Machine,
    PlacementState,
    ReclaimState,
    SessionState,
    VersionState,
)

_new_value = object.__new__

# The two answers of every bind and close, built the way `freeze` builds states (a test checks they equal
# the attrs-constructed values): attrs' frozen __init__ costs more than the rest of the answer.
_set_bound_session, _set_bound_version, _set_bound_lora_name = (
    Bound.__dict__[f.name].__set__ for f in attrs.fields(Bound)
)
_set_closed_session, _set_closed_released = (Closed.__dict__[f.name].__set__ for f in attrs.fields(Closed))


def new_bound(session: SessionKey, version: VersionKey, lora_name: str) -> Bound:
    bound = _new_value(Bound)
    _set_bound_session(bound, session)
    _set_bound_version(bound, version)
    _set_bound_lora_name(bound, lora_name)
    return bound


def new_closed(session: SessionKey, released: bool) -> Closed:
    closed = _new_value(Closed)
    _set_closed_session(closed, session)
    _set_closed_released(closed, released)
    return closed


class RegistryDraft:
    """A mutable scratch copy of `RegistryState` for the duration of one step: the row's updates and
    writer assign new persistent maps to its attributes, and `freeze` turns it into the next state.

    Both classes keep their fields in an instance `__dict__` (RegistryState is not slotted for this):
    a draft is one dict copy, and `freeze` retypes the draft in place instead of building a second
    object. Equivalent to `RegistryState(...)` (a test checks it), at about half the cost of copying
    ten fields in and ten out, which was the largest single cost of a bind or a close. (mypy checks that
    updates write only declared fields; `checking.registry_step_violations` checks it at run time.)"""

    config: RegistryConfig
    versions: Map[VersionKey, Version]
    placements: Map[tuple[VersionKey, str], Placement]
    session_refs: Map[VersionKey, int]
    sessions: Map[SessionKey, SessionRecord]
    low_water: Map[int, int]
    default: VersionKey | None
    default_revision: int
    incarnations: Map[str, int]
    attempts_issued: int
    id_salt: str
    lease: PublisherLease

    def freeze(self) -> RegistryState:
        self.__class__ = RegistryState  # type: ignore[assignment]  # the draft is used once, then is the state
        return self  # type: ignore[return-value]

    def mint_attempt_token(self) -> str:
        self.attempts_issued += 1
        return attempt_token(self.config.epoch, self.attempts_issued)


def draft_of(s: RegistryState) -> RegistryDraft:
    """The draft a step starts from (a function, not `__init__`: a class call costs a third more)."""
    draft = _new_value(RegistryDraft)
    draft.__dict__.update(s.__dict__)
    return draft


VersionEvent = Reserve | Commit | Abort | ClaimReclaim
LeaseEvent = AcquireLease | RenewLease | ReleaseLease | ExpireLease | TakeOverLease
PlacementEvent = RecordPrepared | RecordReady | RecordUnknown | RecordCleaned
SessionEvent = OpenSession | BindFirst | BeginClose | CloseAndRelease

# ================================================================ locators: which state selects the row


def locate_version(s: RegistryState, e: VersionEvent) -> str:
    if e.version.epoch != s.config.epoch:
        return VersionState.OTHER_EPOCH
    version = s.versions.get(e.version)
    return VersionState.UNSEEN if version is None else version.state


def locate_placement(s: RegistryState, e: PlacementEvent) -> str:
    if e.engine not in s.incarnations:
        return PlacementState.FOREIGN
    if e.version.epoch != s.config.epoch:
        return PlacementState.OTHER_EPOCH
    placement = s.placements.get((e.version, e.engine))
    return PlacementState.UNSEEN if placement is None else placement.state


def locate_session(s: RegistryState, e: SessionEvent) -> str:
    return session_state(s, e.session)


def locate_reclaim(s: RegistryState, e: ConfirmReclaim) -> str:
    if e.engine not in s.incarnations:
        return ReclaimState.FOREIGN
    if e.version.epoch != s.config.epoch:
        return ReclaimState.OTHER_EPOCH
    version = s.versions.get(e.version)
    if version is None:
        return ReclaimState.UNSEEN
    if version.state not in (VersionState.RECLAIMING, VersionState.RECLAIMED):
        return ReclaimState.NOT_CLAIMED
    return ReclaimState.CONFIRMED if e.engine in version.reclaim_confirmed else ReclaimState.PENDING


def locate_engine(s: RegistryState, e: EngineRestarted) -> str:
    return EngineState.UP if e.engine in s.incarnations else EngineState.FOREIGN


def locate_lease(s: RegistryState, e: LeaseEvent) -> str:
    return LeaseState.FREE if s.lease.holder is None else LeaseState.HELD


LOCATORS: dict[type, Callable[[RegistryState, Any], str]] = {
    Reserve: locate_version,
    Commit: locate_version,
    Abort: locate_version,
    ClaimReclaim: locate_version,
    RecordPrepared: locate_placement,
    RecordReady: locate_placement,
    RecordUnknown: locate_placement,
    RecordCleaned: locate_placement,
    OpenSession: locate_session,
    BindFirst: locate_session,
    BeginClose: locate_session,
    CloseAndRelease: locate_session,
    ConfirmReclaim: locate_reclaim,
    EngineRestarted: locate_engine,
    AcquireLease: locate_lease,
    RenewLease: locate_lease,
    ReleaseLease: locate_lease,
    ExpireLease: locate_lease,
    TakeOverLease: locate_lease,
}

# ================================================================ guards


def digest_differs(s: RegistryState, e: Reserve | RecordPrepared | RecordReady) -> bool:
    return s.versions[e.version].digest != e.digest


def publication_pending(s: RegistryState, e: Reserve) -> bool:
    return bool(pending_versions(s))


def capacity_full(s: RegistryState, e: Reserve) -> bool:
    return occupied_slots(s) >= s.config.capacity


def attempt_token_matches(s: RegistryState, e: Commit) -> bool:
    return s.versions[e.version].attempt_token == e.attempt_token


def attempt_token_mismatch(s: RegistryState, e: Commit | Abort) -> bool:
    return s.versions[e.version].attempt_token != e.attempt_token


def revision_mismatch(s: RegistryState, e: Commit) -> bool:
    return e.expected_default_revision != s.default_revision


def not_ready_everywhere(s: RegistryState, e: Commit) -> bool:
    for engine in s.config.engines:
        placement = s.placements[(e.version, engine)]
        if placement.state is not PlacementState.READY or placement.incarnation != s.incarnations[engine]:
            return True
    return False


def no_default(s: RegistryState, e: Commit | BindFirst) -> bool:
    return s.default is None


def session_refs_positive(s: RegistryState, e: ClaimReclaim) -> bool:
    return session_refs(s, e.version) > 0


def placement_token_mismatch(s: RegistryState, e: PlacementEvent) -> bool:
    return s.placements[(e.version, e.engine)].attempt_token != e.attempt_token


def incarnation_stale(s: RegistryState, e: RecordPrepared | RecordReady) -> bool:
    return e.incarnation != s.incarnations[e.engine]


def version_reclaiming(s: RegistryState, e: RecordPrepared | RecordReady) -> bool:
    return s.versions[e.version].state in (VersionState.RECLAIMING, VersionState.RECLAIMED)


def others_cleaned(s: RegistryState, e: RecordCleaned) -> bool:
    return all(
        s.placements[(e.version, engine)].state is PlacementState.CLEANED
        for engine in s.config.engines
        if engine != e.engine
    )


def session_bound(s: RegistryState, e: CloseAndRelease) -> bool:
    return s.sessions[e.session].version is not None


def reclaim_id_mismatch(s: RegistryState, e: ConfirmReclaim) -> bool:
    return s.versions[e.version].reclaim_id != e.reclaim_id


def others_confirmed(s: RegistryState, e: ConfirmReclaim) -> bool:
    return s.versions[e.version].reclaim_confirmed | {e.engine} >= frozenset(s.config.engines)


def lease_not_held(s: RegistryState, e: Reserve | Commit) -> bool:
    return lease_required(s) and not holds_lease(s, e.fence)


def same_holder(s: RegistryState, e: AcquireLease) -> bool:
    return s.lease.holder == e.holder


def lease_matches(s: RegistryState, e: RenewLease | ReleaseLease) -> bool:
    return s.lease.holder == e.holder and s.lease.fence == e.fence


def fence_is_live(s: RegistryState, e: ExpireLease | TakeOverLease) -> bool:
    return s.lease.fence == e.fence


def incarnation_not_newer(s: RegistryState, e: EngineRestarted) -> bool:
    return e.incarnation <= s.incarnations[e.engine]


GUARDS: dict[str, Callable[[RegistryState, Any], bool]] = {
    f.__name__: f
    for f in (
        digest_differs,
        publication_pending,
        capacity_full,
        attempt_token_matches,
        attempt_token_mismatch,
        revision_mismatch,
        not_ready_everywhere,
        no_default,
        session_refs_positive,
        placement_token_mismatch,
        incarnation_stale,
        version_reclaiming,
        others_cleaned,
        session_bound,
        reclaim_id_mismatch,
        others_confirmed,
        incarnation_not_newer,
        lease_not_held,
        same_holder,
        lease_matches,
        fence_is_live,
    )
}

# ================================================================ updates


def _set_version(d: RegistryDraft, version: Version) -> None:
    d.versions = d.versions.set(version.key, version)


def create_version(d: RegistryDraft, e: Reserve) -> None:
    token = d.mint_attempt_token()
    _set_version(d, Version(e.version, e.digest, lora_name(e.version, e.digest), VersionState.LOADING, token))


def renew_attempt(d: RegistryDraft, e: Reserve) -> None:
    _set_version(d, attrs.evolve(d.versions[e.version], attempt_token=d.mint_attempt_token()))


def place_attempt_on_all_engines(d: RegistryDraft, e: Reserve) -> None:
    token = d.versions[e.version].attempt_token
    placements = d.placements
    for engine in d.config.engines:
        placements = placements.set(
            (e.version, engine), Placement(PlacementState.BEGUN, token, d.incarnations[engine])
        )
    d.placements = placements


def retire_old_default(d: RegistryDraft, e: Commit) -> None:
    assert d.default is not None  # the swap row is reached only once a default exists
    _set_version(d, attrs.evolve(d.versions[d.default], state=VersionState.RETIRED))


def point_default_here(d: RegistryDraft, e: Commit) -> None:
    revision = d.default_revision + 1
    receipt = CommitReceipt(e.version, e.attempt_token, revision, d.default)
    _set_version(d, attrs.evolve(d.versions[e.version], commit=receipt))
    d.default = e.version
    d.default_revision = revision


def clean_attempt_on_all_engines(d: RegistryDraft, e: Abort) -> None:
    placements = d.placements
    for engine in d.config.engines:
        key = (e.version, engine)
        placements = placements.set(key, attrs.evolve(placements[key], state=PlacementState.CLEANING))
    d.placements = placements


def mark_failed_clean(d: RegistryDraft, e: RecordCleaned) -> None:
    _set_version(d, attrs.evolve(d.versions[e.version], state=VersionState.FAILED_CLEAN))


def issue_reclaim_id(d: RegistryDraft, e: ClaimReclaim) -> None:
    _set_version(d, attrs.evolve(d.versions[e.version], reclaim_id=reclaim_id(e.version, d.id_salt)))


def mark_reclaimed(d: RegistryDraft, e: ConfirmReclaim) -> None:
    _set_version(d, attrs.evolve(d.versions[e.version], state=VersionState.RECLAIMED))


def take_session_ref(d: RegistryDraft, e: BindFirst) -> None:
    version = d.default
    assert version is not None  # bind.no_default answers before this row
    d.session_refs = d.session_refs.set(version, d.session_refs.get(version, 0) + 1)


def release_session_ref(d: RegistryDraft, e: CloseAndRelease) -> None:
    version = d.sessions[e.session].version
    assert version is not None  # only rows for bound sessions release
    left = d.session_refs[version] - 1
    # Zero entries are dropped so the map only holds versions that live sessions use.
    d.session_refs = d.session_refs.set(version, left) if left else d.session_refs.delete(version)


def adopt_incarnation(d: RegistryDraft, e: EngineRestarted) -> None:
    d.incarnations = d.incarnations.set(e.engine, e.incarnation)


def replace_placements_on_engine(d: RegistryDraft, e: EngineRestarted) -> None:
    """The new incarnation holds nothing. The pending attempt is staged again under its own token;
    versions sessions may still use get a rehydrate attempt (a fresh token); versions nobody can use
    become ABSENT (their reclaim answers UNLOADED(absent)); cleanups and history stay as they are."""
    placements = d.placements
    for key in sorted(d.versions):  # sorted: token minting must not depend on hash order
        version = d.versions[key]
        if version.state is VersionState.LOADING:
            placement = Placement(PlacementState.BEGUN, version.attempt_token, e.incarnation)
        elif version.state is VersionState.PUBLISHED or (
            version.state is VersionState.RETIRED and d.session_refs.get(key, 0) > 0
        ):
            placement = Placement(PlacementState.BEGUN, d.mint_attempt_token(), e.incarnation)
        elif version.state in (VersionState.RETIRED, VersionState.RECLAIMING):
            placement = Placement(PlacementState.ABSENT, None, e.incarnation)
        else:
            continue
        placements = placements.set((key, e.engine), placement)
    d.placements = placements


def grant_lease(d: RegistryDraft, e: AcquireLease | TakeOverLease) -> None:
    d.lease = PublisherLease(e.holder, d.lease.fence + 1, e.ttl_s)


UPDATES: dict[str, Callable[[RegistryDraft, Any], None]] = {
    f.__name__: f
    for f in (
        create_version,
        renew_attempt,
        place_attempt_on_all_engines,
        retire_old_default,
        point_default_here,
        clean_attempt_on_all_engines,
        mark_failed_clean,
        issue_reclaim_id,
        mark_reclaimed,
        take_session_ref,
        release_session_ref,
        adopt_incarnation,
        replace_placements_on_engine,
        grant_lease,
    )
}

# ================================================================ writers: put the row's target on the located entity

# Session records are interned: there are only (states x versions) distinct ones, and a bind or a
# close is the hot path, so reusing them saves an allocation per step. They are immutable values.
_SESSION_RECORDS: dict[tuple[SessionState, VersionKey | None], SessionRecord] = {}
_TOMBSTONE = SessionRecord(SessionState.CLOSED, None)


def _session_record(state: SessionState, version: VersionKey | None) -> SessionRecord:
    record = _SESSION_RECORDS.get((state, version))
    if record is None:
        record = _SESSION_RECORDS[(state, version)] = SessionRecord(state, version)
    return record


def write_version(d: RegistryDraft, e: VersionEvent, target: VersionState) -> None:
    _set_version(d, attrs.evolve(d.versions[e.version], state=target))


def write_placement(d: RegistryDraft, e: PlacementEvent, target: PlacementState) -> None:
    key = (e.version, e.engine)
    d.placements = d.placements.set(key, attrs.evolve(d.placements[key], state=target))


_BOUND, _CLOSED = SessionState.BOUND, SessionState.CLOSED  # module constants: enum attribute access is slow


def write_session(d: RegistryDraft, e: SessionEvent, target: SessionState) -> None:
    key = e.session
    if target is _CLOSED:
        _close_session(d, key)
        return
    if target is _BOUND:  # entered only from UNSEEN/OPEN: binding reads the default exactly then
        version = d.default
    else:
        current = d.sessions.get(key)
        version = None if current is None else current.version
    d.sessions = d.sessions.set(key, _session_record(target, version))


def _close_session(d: RegistryDraft, key: SessionKey) -> None:
    """Tombstone the key, then compact: move the shard's mark over every contiguous closed seq."""
    epoch, shard, seq = key
    mark = d.low_water.get(shard, 0)
    if seq != mark:
        d.sessions = d.sessions.set(key, _TOMBSTONE)
        return
    try:
        sessions = d.sessions.delete(key)
    except KeyError:  # closed before it was ever opened
        sessions = d.sessions
    mark += 1
    # Plain tuples: they equal and hash like the SessionKey, at a fifth of a NamedTuple's construction.
    successor = sessions.get(cast(SessionKey, (epoch, shard, mark)))
    while successor is not None and successor.state is _CLOSED:
        sessions = sessions.delete(cast(SessionKey, (epoch, shard, mark)))
        mark += 1
        successor = sessions.get(cast(SessionKey, (epoch, shard, mark)))
    d.sessions = sessions
    d.low_water = d.low_water.set(shard, mark)


def write_reclaim(d: RegistryDraft, e: ConfirmReclaim, target: ReclaimState) -> None:
    version = d.versions[e.version]
    _set_version(d, attrs.evolve(version, reclaim_confirmed=version.reclaim_confirmed | {e.engine}))


def write_lease(d: RegistryDraft, e: LeaseEvent, target: LeaseState) -> None:
    """The lease's state is whether it has a holder: FREE drops the holder (the last fence stays, so the next
    grant's is above it); HELD was written by the row's grant."""
    if target is LeaseState.FREE:
        d.lease = attrs.evolve(d.lease, holder=None)


WRITERS: dict[Machine, Callable[[RegistryDraft, Any, Any], None]] = {
    Machine.VERSION: write_version,
    Machine.ATTEMPT: write_placement,
    Machine.SESSION: write_session,
    Machine.RECLAIM: write_reclaim,
    Machine.LEASE: write_lease,
}

# ================================================================ effects


def _stage(s: RegistryState, version: Version, engine: str, token: str) -> StageOnEngine:
    return StageOnEngine(engine, version.key, version.lora_name, token, s.incarnations[engine], version.digest)


def _cleanup(version: Version, engine: str) -> CleanupOnEngine:
    return CleanupOnEngine(engine, version.key, version.lora_name, version.attempt_token)


def _reclaim(version: Version, engine: str) -> ReclaimOnEngine:
    assert version.reclaim_id is not None
    return ReclaimOnEngine(engine, version.key, version.lora_name, version.reclaim_id)


def stage_on_all_engines(b: RegistryState, a: RegistryState, e: Reserve) -> tuple[RegistryEffect, ...]:
    version = a.versions[e.version]
    return tuple(_stage(a, version, engine, version.attempt_token) for engine in a.config.engines)


def cleanup_on_all_engines(b: RegistryState, a: RegistryState, e: Abort) -> tuple[RegistryEffect, ...]:
    version = a.versions[e.version]
    return tuple(_cleanup(version, engine) for engine in a.config.engines)


def cleanup_where_still_cleaning(b: RegistryState, a: RegistryState, e: Abort) -> tuple[RegistryEffect, ...]:
    version = a.versions[e.version]
    return tuple(
        _cleanup(version, engine)
        for engine in a.config.engines
        if a.placements[(e.version, engine)].state is PlacementState.CLEANING
    )


def reclaim_on_all_engines(b: RegistryState, a: RegistryState, e: ClaimReclaim) -> tuple[RegistryEffect, ...]:
    version = a.versions[e.version]
    return tuple(_reclaim(version, engine) for engine in a.config.engines)


def reclaim_where_unconfirmed(b: RegistryState, a: RegistryState, e: ClaimReclaim) -> tuple[RegistryEffect, ...]:
    version = a.versions[e.version]
    return tuple(_reclaim(version, engine) for engine in a.config.engines if engine not in version.reclaim_confirmed)


def old_default_reclaimable(b: RegistryState, a: RegistryState, e: Commit) -> tuple[RegistryEffect, ...]:
    old = b.default
    assert old is not None  # only the swap row emits this
    return (ReclaimEligible(old),) if session_refs(a, old) == 0 else ()


def reclaimable_after_release(b: RegistryState, a: RegistryState, e: CloseAndRelease) -> tuple[RegistryEffect, ...]:
    version = b.sessions[e.session].version
    assert version is not None
    # `not in`: zero counts are never stored (release_session_ref deletes them).
    if version not in a.session_refs and a.versions[version].state is VersionState.RETIRED:
        return (ReclaimEligible(version),)
    return ()


def capacity_freed(
    b: RegistryState, a: RegistryState, e: RecordCleaned | ConfirmReclaim
) -> tuple[RegistryEffect, ...]:
    return (CapacityFreed(e.version),)


def recover_engine(b: RegistryState, a: RegistryState, e: EngineRestarted) -> tuple[RegistryEffect, ...]:
    """Everything the restarted engine must be brought to: stage the pending attempt, rehydrate what
    sessions still use, finish cleanups, answer reclaims (UNLOADED(absent) on the new incarnation)."""
    effects: list[RegistryEffect] = []
    for key in sorted(a.versions):
        version = a.versions[key]
        placement = a.placements[(key, e.engine)]
        if placement.state is PlacementState.BEGUN:
            assert placement.attempt_token is not None
            effects.append(_stage(a, version, e.engine, placement.attempt_token))
        elif placement.state is PlacementState.CLEANING:
            effects.append(_cleanup(version, e.engine))
        elif version.state is VersionState.RECLAIMING and e.engine not in version.reclaim_confirmed:
            effects.append(_reclaim(version, e.engine))
    return tuple(effects)


def arm_lease_timer(b: RegistryState, a: RegistryState, e: LeaseEvent) -> tuple[RegistryEffect, ...]:
    return (ArmLeaseTimer(a.lease.fence, a.lease.ttl_s),)


EFFECTS: dict[str, Callable[[RegistryState, RegistryState, Any], tuple[RegistryEffect, ...]]] = {
    f.__name__: f
    for f in (
        stage_on_all_engines,
        cleanup_on_all_engines,
        cleanup_where_still_cleaning,
        reclaim_on_all_engines,
        reclaim_where_unconfirmed,
        old_default_reclaimable,
        reclaimable_after_release,
        capacity_freed,
        recover_engine,
        arm_lease_timer,
    )
}

# ================================================================ results


def reserved(b: RegistryState, a: RegistryState, e: Reserve, row: str) -> RegistryResult:
    version = a.versions[e.version]
    return Reserved(version.key, version.lora_name, version.attempt_token, version.state)


def recorded(b: RegistryState, a: RegistryState, e: PlacementEvent, row: str) -> RegistryResult:
    return Recorded(e.version, e.engine, a.placements[(e.version, e.engine)].state)


def committed(b: RegistryState, a: RegistryState, e: Commit, row: str) -> RegistryResult:
    receipt = a.versions[e.version].commit
    assert receipt is not None
    return Committed(receipt)


def aborted(b: RegistryState, a: RegistryState, e: Abort, row: str) -> RegistryResult:
    version = a.versions[e.version]
    return Aborted(version.key, version.attempt_token, version.state)


def reclaim_claimed(b: RegistryState, a: RegistryState, e: ClaimReclaim, row: str) -> RegistryResult:
    version = a.versions[e.version]
    assert version.reclaim_id is not None
    return ReclaimClaimed(version.key, version.reclaim_id, version.state)


def reclaim_confirmed(b: RegistryState, a: RegistryState, e: ConfirmReclaim, row: str) -> RegistryResult:
    return ReclaimConfirmed(e.version, e.engine, a.versions[e.version].state)


def session_status(b: RegistryState, a: RegistryState, e: SessionEvent, row: str) -> RegistryResult:
    record = a.sessions.get(e.session)
    return SessionStatus(e.session, session_state(a, e.session), None if record is None else record.version)


def bound(b: RegistryState, a: RegistryState, e: BindFirst, row: str) -> RegistryResult:
    version = a.sessions[e.session].version
    assert version is not None
    return new_bound(e.session, version, a.versions[version].lora_name)


def bound_to_default(b: RegistryState, a: RegistryState, e: BindFirst, row: str) -> RegistryResult:
    """The first bind's answer: the session was just bound to the default (saves a lookup per bind)."""
    assert a.default is not None
    return new_bound(e.session, a.default, a.versions[a.default].lora_name)


def closed(b: RegistryState, a: RegistryState, e: CloseAndRelease, row: str) -> RegistryResult:
    before = b.sessions.get(e.session)
    return new_closed(e.session, before is not None and before.version is not None)


def restarted(b: RegistryState, a: RegistryState, e: EngineRestarted, row: str) -> RegistryResult:
    return Restarted(e.engine, a.incarnations[e.engine])


def lease_granted(b: RegistryState, a: RegistryState, e: LeaseEvent, row: str) -> RegistryResult:
    lease = a.lease
    # A granting row leaves the lease HELD; were it not so, the answer names no holder, which the step properties
    # report (free_lease_is_granted, lease_timer_armed_on_grant) rather than an assert that no property names.
    return LeaseGranted(lease.holder or "", lease.fence, lease.ttl_s)


def lease_status(b: RegistryState, a: RegistryState, e: LeaseEvent, row: str) -> RegistryResult:
    lease = a.lease
    return LeaseStatus(LeaseState.FREE if lease.holder is None else LeaseState.HELD, lease.holder, lease.fence)


RESULTS: dict[str, Callable[[RegistryState, RegistryState, Any, str], RegistryResult]] = {
    f.__name__: f
    for f in (
        reserved,
        recorded,
        committed,
        aborted,
        reclaim_claimed,
        reclaim_confirmed,
        session_status,
        bound,
        bound_to_default,
        closed,
        restarted,
        lease_granted,
        lease_status,
    )
}
