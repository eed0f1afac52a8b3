"""The state the table talks about: immutable values on persistent maps.

`RegistryState` is the whole registry (versions, per-engine placements, sessions, default pointer).
`EngineAdapterState` is one engine's managed adapters, the engine side. Both are attrs frozen,
hashable values; the maps are `immutables.Map` (a HAMT), so a step copies O(log n) nodes rather
than 10^5 sessions.

Closed sessions are kept as tombstones only above their shard's low-water mark: every seq below the
mark is closed. Contract with the caller: every allocated seq is eventually closed (closing an
unseen key is allowed precisely so that sessions which never reached the registry still close), so
the mark keeps moving and memory stays O(open sessions + tombstones above the oldest open seq).
"""

from __future__ import annotations

import attrs
from immutables import Map

from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.states import AdapterState, PlacementState, SessionState, VersionState

# Versions in these states hold one managed slot (DESIGN.md §3); FAILED_CLEAN and RECLAIMED free it.
OCCUPYING_STATES = frozenset(
    {VersionState.LOADING, VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.ABORTED}
)
# A publication attempt is pending until it is committed or completely cleaned.
PENDING_STATES = frozenset({VersionState.LOADING, VersionState.ABORTED})
# Requests may be dispatched for these versions; never once RECLAIMING.
DISPATCHABLE_STATES = frozenset({VersionState.PUBLISHED, VersionState.RETIRED})
# Sessions in these states hold one session ref on their bound version.
REF_HOLDING_SESSION_STATES = frozenset({SessionState.BOUND, SessionState.FINALIZING})
# Engine-side adapters in these states hold (or, staging and loading, will hold) one of the engine's pinned LoRA
# slots; UNLOADED, CLEANED and ABSENT hold none. A load or an unload whose outcome is not known, and an unload that
# failed, keep the slot: SGLang may hold (or still holds) the weights.
SLOT_HOLDING_ADAPTER_STATES = frozenset(
    {AdapterState.STAGING, AdapterState.LOADING, AdapterState.CANCELLING, AdapterState.READY, AdapterState.CLEANING,
     AdapterState.UNREGISTERED, AdapterState.DRAINING, AdapterState.UNLOADING, AdapterState.UNLOAD_FAILED}
)


# Metadata of a field added to a journaled type after journals were written: the journal's encoding leaves it out
# while it holds its default (adapters/journal.py), so what older code wrote reads, and digests, the same.
ENCODED_WHEN_SET = "encoded_when_set"


@attrs.frozen
class RegistryConfig:
    epoch: int
    engines: tuple[str, ...]
    capacity: int
    # Every Reserve and Commit must carry the live publisher lease's fence. Off only in registries whose
    # journal was begun before leases existed (they replay as they ran) and in pure tests that leave it off;
    # once any lease has been granted, fences are required whatever this says (`lease_required`).
    publisher_lease: bool = attrs.field(default=False, metadata={ENCODED_WHEN_SET: True})


@attrs.frozen
class CommitReceipt:
    version: VersionKey
    attempt_token: str
    default_revision: int  # the revision this commit produced
    previous_default: VersionKey | None


@attrs.frozen
class Version:
    key: VersionKey
    digest: str
    lora_name: str
    state: VersionState
    attempt_token: str  # the publication attempt; rehydrate attempts live on placements
    commit: CommitReceipt | None = None
    reclaim_id: str | None = None
    reclaim_confirmed: frozenset[str] = frozenset()


@attrs.frozen
class Placement:
    """One version on one engine: the attempt that stages it there and the engine incarnation it was
    staged for. A READY from another incarnation never counts."""

    state: PlacementState
    attempt_token: str | None
    incarnation: int


@attrs.frozen
class SessionRecord:
    state: SessionState
    version: VersionKey | None  # the binding; fixed once set, dropped from the tombstone


@attrs.frozen
class PublisherLease:
    """The publisher lease (events.AcquireLease and the rows after it). `fence` is the last fence granted (0:
    never granted); `holder` is None while the lease is FREE. `ttl_s` is the grant's time to live, which the
    registry's timer uses: the state holds no clock."""

    holder: str | None = None
    fence: int = 0
    ttl_s: float = 0.0


NO_LEASE = PublisherLease()


@attrs.frozen(slots=False)  # not slotted: lifecycle's RegistryDraft becomes the next state by retyping
class RegistryState:
    config: RegistryConfig
    versions: Map[VersionKey, Version]
    placements: Map[tuple[VersionKey, str], Placement]
    session_refs: Map[VersionKey, int]
    sessions: Map[SessionKey, SessionRecord]
    low_water: Map[int, int]  # shard -> every seq below this is closed
    default: VersionKey | None
    default_revision: int
    incarnations: Map[str, int]  # engine -> its current incarnation as the registry knows it
    attempts_issued: int  # attempt-token counter
    # Mixed into reclaim ids (identities.reclaim_id) so that none can be computed from a name: minted once per
    # journal by the registry's process and kept there, so a recovered registry issues the same ids. The model
    # checker and the pure tests leave it empty. Added after journals were first written: encoded only when set
    # (`ENCODED_WHEN_SET`), so a state without a salt encodes, and digests, as it did before the field existed.
    id_salt: str = attrs.field(default="", metadata={ENCODED_WHEN_SET: True})
    # The publisher lease. Added after id_salt, encoded only when set, like it.
    lease: PublisherLease = attrs.field(default=NO_LEASE, metadata={ENCODED_WHEN_SET: True})


@attrs.frozen
class ManagedAdapter:
    state: AdapterState
    attempt_token: str | None = None
    digest: str | None = None
    bucket_count: int = 0
    buckets_received: int = 0
    native_refs: int = 0  # mirrors SGLang's request refcount for this name
    reclaim_id: str | None = None
    absent: bool = False  # UNLOADED because this incarnation never held it
    cleaned_attempts: frozenset[str] = frozenset()  # a late begin/bucket/end for these never recreates


@attrs.frozen
class EngineAdapterState:
    engine: str
    incarnation: int
    adapters: Map[str, ManagedAdapter]


# ---- small read helpers shared by the table's guards and the invariants ----


def session_refs(state: RegistryState, version: VersionKey) -> int:
    return state.session_refs.get(version, 0)


def occupied_slots(state: RegistryState) -> int:
    return sum(1 for v in state.versions.values() if v.state in OCCUPYING_STATES)


def lease_required(state: RegistryState) -> bool:
    """Whether Reserve and Commit must carry the live lease's fence: by configuration, or because a lease has
    been granted in this registry (a registry cannot go back to unfenced publication)."""
    return state.config.publisher_lease or state.lease.fence > 0


def holds_lease(state: RegistryState, fence: int) -> bool:
    return state.lease.holder is not None and fence == state.lease.fence


def pending_versions(state: RegistryState) -> tuple[Version, ...]:
    return tuple(v for v in state.versions.values() if v.state in PENDING_STATES)


_UNSEEN, _COMPACTED, _OTHER_EPOCH = SessionState.UNSEEN, SessionState.COMPACTED, SessionState.OTHER_EPOCH


def session_state(state: RegistryState, key: SessionKey) -> SessionState:
    """The session machine's state for `key`, including the pseudo-states. (On every bind and close,
    hence the module constants: enum attribute access costs a dict lookup through the metaclass.)"""
    if key.epoch != state.config.epoch:
        return _OTHER_EPOCH
    if key.seq < state.low_water.get(key.shard, 0):
        return _COMPACTED
    record = state.sessions.get(key)
    return _UNSEEN if record is None else record.state
