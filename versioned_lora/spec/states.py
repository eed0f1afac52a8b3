"""The machines and their states.

States are `StrEnum`s whose value is their name, so the table can name them as plain strings and a
state compares and hashes exactly like that string (the compiled lookup relies on this).

Pseudo-states are what a locator reports when there is no stored record to look at (an unseen key,
a key from another epoch, an engine outside the configured set). They are real sources in the table
(a bind on an UNSEEN session opens it) but a wildcard source never covers them.
"""

from __future__ import annotations

from enum import StrEnum


class Machine(StrEnum):
    VERSION = "version"  # one logical LoRA version
    ATTEMPT = "attempt"  # attempt x engine: the registry's view of one version being staged on one engine
    SESSION = "session"  # one agentic session
    RECLAIM = "reclaim"  # reclaim x engine: one engine's unload receipt for a reclaiming version
    DEFAULT = "default"  # the default pointer (moved only by commit)
    ENGINE = "engine"  # the registry's view of an engine process (its current incarnation)
    LEASE = "lease"  # the publisher lease: which one publisher may reserve and commit (its fencing epoch)
    ADAPTER = "adapter"  # managed adapter x engine, the engine side (driven inside the SGLang patch)
    PROCESS = "process"  # the engine process itself, the engine side


REGISTRY_MACHINES = frozenset(
    {Machine.VERSION, Machine.ATTEMPT, Machine.SESSION, Machine.RECLAIM, Machine.DEFAULT, Machine.ENGINE,
     Machine.LEASE}
)
ENGINE_SIDE_MACHINES = frozenset({Machine.ADAPTER, Machine.PROCESS})


class VersionState(StrEnum):
    UNSEEN = "UNSEEN"
    OTHER_EPOCH = "OTHER_EPOCH"
    LOADING = "LOADING"
    PUBLISHED = "PUBLISHED"
    RETIRED = "RETIRED"
    RECLAIMING = "RECLAIMING"
    RECLAIMED = "RECLAIMED"
    ABORTED = "ABORTED"
    FAILED_CLEAN = "FAILED_CLEAN"


class PlacementState(StrEnum):
    UNSEEN = "UNSEEN"
    OTHER_EPOCH = "OTHER_EPOCH"
    FOREIGN = "FOREIGN"
    BEGUN = "BEGUN"
    PREPARED = "PREPARED"
    READY = "READY"
    UNKNOWN = "UNKNOWN"  # an outcome could not be confirmed: keeps the resource and the capacity
    CLEANING = "CLEANING"
    CLEANED = "CLEANED"
    ABSENT = "ABSENT"  # the engine restarted and need not hold this version


class SessionState(StrEnum):
    UNSEEN = "UNSEEN"
    OTHER_EPOCH = "OTHER_EPOCH"
    COMPACTED = "COMPACTED"  # closed, below its shard's low-water mark
    OPEN = "OPEN"
    BOUND = "BOUND"
    FINALIZING = "FINALIZING"
    CLOSED = "CLOSED"  # a tombstone above the low-water mark


class ReclaimState(StrEnum):
    UNSEEN = "UNSEEN"
    OTHER_EPOCH = "OTHER_EPOCH"
    FOREIGN = "FOREIGN"
    NOT_CLAIMED = "NOT_CLAIMED"  # the version is not RECLAIMING or RECLAIMED
    PENDING = "PENDING"
    CONFIRMED = "CONFIRMED"


class DefaultState(StrEnum):
    NONE = "NONE"  # before the bootstrap commit: binding answers NO_PUBLISHED_VERSION
    SET = "SET"


class EngineState(StrEnum):
    FOREIGN = "FOREIGN"
    UP = "UP"


class LeaseState(StrEnum):
    FREE = "FREE"  # nobody may publish until a publisher acquires it (never held yet, released or expired)
    HELD = "HELD"  # one holder, under the lease's current fence


class AdapterState(StrEnum):
    ABSENT = "ABSENT"
    STAGING = "STAGING"
    LOADING = "LOADING"  # verified; SGLang's load of the stash runs, its outcome not known yet
    CANCELLING = "CANCELLING"  # a cleanup came while the load ran: whatever the load gives is undone
    READY = "READY"  # loaded and pinned
    CLEANING = "CLEANING"  # a cleaned candidate's physical unload runs, its outcome not known yet
    UNREGISTERED = "UNREGISTERED"  # new requests fail; native refcount is 0, physical unload pending
    DRAINING = "DRAINING"  # unregistered, native refcount > 0
    UNLOADING = "UNLOADING"  # a reclaim's physical unload runs, its outcome not known yet
    UNLOAD_FAILED = "UNLOAD_FAILED"  # SGLang's unload failed: still loaded and pinned; a resent call retries it
    UNLOADED = "UNLOADED"
    CLEANED = "CLEANED"


class ProcessState(StrEnum):
    UP = "UP"


STATES: dict[Machine, tuple[str, ...]] = {
    Machine.VERSION: tuple(VersionState),
    Machine.ATTEMPT: tuple(PlacementState),
    Machine.SESSION: tuple(SessionState),
    Machine.RECLAIM: tuple(ReclaimState),
    Machine.DEFAULT: tuple(DefaultState),
    Machine.ENGINE: tuple(EngineState),
    Machine.LEASE: tuple(LeaseState),
    Machine.ADAPTER: tuple(AdapterState),
    Machine.PROCESS: tuple(ProcessState),
}

PSEUDO_STATES: dict[Machine, frozenset[str]] = {
    Machine.VERSION: frozenset({VersionState.UNSEEN, VersionState.OTHER_EPOCH}),
    Machine.ATTEMPT: frozenset({PlacementState.UNSEEN, PlacementState.OTHER_EPOCH, PlacementState.FOREIGN}),
    Machine.SESSION: frozenset({SessionState.UNSEEN, SessionState.OTHER_EPOCH, SessionState.COMPACTED}),
    Machine.RECLAIM: frozenset(
        {ReclaimState.UNSEEN, ReclaimState.OTHER_EPOCH, ReclaimState.FOREIGN, ReclaimState.NOT_CLAIMED}
    ),
    Machine.DEFAULT: frozenset(),
    Machine.ENGINE: frozenset({EngineState.FOREIGN}),
    Machine.LEASE: frozenset(),
    Machine.ADAPTER: frozenset(),
    Machine.PROCESS: frozenset(),
}

INITIAL_STATES: dict[Machine, str] = {
    Machine.VERSION: VersionState.UNSEEN,
    Machine.ATTEMPT: PlacementState.UNSEEN,
    Machine.SESSION: SessionState.UNSEEN,
    Machine.RECLAIM: ReclaimState.NOT_CLAIMED,
    Machine.DEFAULT: DefaultState.NONE,
    Machine.ENGINE: EngineState.UP,
    Machine.LEASE: LeaseState.FREE,
    Machine.ADAPTER: AdapterState.ABSENT,
    Machine.PROCESS: ProcessState.UP,
}

# Wildcard sources ("*") are allowed only on rows that change nothing; they stand for every stored
# (non-pseudo) state of the machine.
WILDCARD = "*"
# A row whose target is SAME leaves the located entity's state as it was.
SAME = "="


def wildcard_states(machine: Machine) -> tuple[str, ...]:
    return tuple(s for s in STATES[machine] if s not in PSEUDO_STATES[machine])
