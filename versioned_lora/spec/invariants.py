"""Safety invariants (state predicates and step predicates) and liveness properties, as named data.

The tests check every invariant after every step; the model checker (issue #4) checks them on every
reachable state and uses LIVENESS for its strongly-connected-component analysis: under weak fairness
with a finite fault budget, no obligation may stay open forever, i.e. none may be present in every
state of a terminal component.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable

import attrs

from versioned_lora.spec.identities import VersionKey, lora_name
from versioned_lora.spec.model import (
    PENDING_STATES,
    REF_HOLDING_SESSION_STATES,
    EngineAdapterState,
    RegistryState,
    occupied_slots,
    session_refs,
)
from versioned_lora.spec.states import AdapterState, PlacementState, SessionState, VersionState


@attrs.frozen
class Invariant:
    name: str
    doc: str
    holds: Callable[[RegistryState], bool]


@attrs.frozen
class StepInvariant:
    """A predicate over one step (before, after): properties of histories, not of single states."""

    name: str
    doc: str
    holds: Callable[[RegistryState, RegistryState], bool]


@attrs.frozen
class EngineInvariant:
    name: str
    doc: str
    holds: Callable[[EngineAdapterState], bool]


@attrs.frozen
class EngineStepInvariant:
    name: str
    doc: str
    holds: Callable[[EngineAdapterState, EngineAdapterState], bool]


@attrs.frozen
class Liveness:
    name: str
    doc: str
    obligations: Callable[[RegistryState], frozenset[Hashable]]


# ---------------------------------------------------------------- registry: state invariants

_RECLAIM_STATES = frozenset({VersionState.RECLAIMING, VersionState.RECLAIMED})
_COMMITTED_STATES = frozenset(
    {VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED}
)


def _capacity_never_exceeded(s: RegistryState) -> bool:
    return occupied_slots(s) <= s.config.capacity


def _one_published_default(s: RegistryState) -> bool:
    published = [v.key for v in s.versions.values() if v.state is VersionState.PUBLISHED]
    if s.default is None:
        return not published and s.default_revision == 0
    return published == [s.default] and s.default_revision >= 1


def _session_refs_match_bindings(s: RegistryState) -> bool:
    # BOUND always carries its version; OPEN and tombstones never do; FINALIZING may (close before bind).
    for r in s.sessions.values():
        if (r.state is SessionState.BOUND) != (r.version is not None) and r.state is not SessionState.FINALIZING:
            return False
    bound = Counter(
        r.version for r in s.sessions.values() if r.state in REF_HOLDING_SESSION_STATES and r.version is not None
    )
    stored = {v: n for v, n in s.session_refs.items() if n != 0}
    return stored == dict(bound) and all(n > 0 for n in s.session_refs.values())


def _sessions_bind_only_committed(s: RegistryState) -> bool:
    return all(
        r.version in s.versions and s.versions[r.version].state in _COMMITTED_STATES
        for r in s.sessions.values()
        if r.version is not None
    )


def _no_dispatch_once_reclaiming(s: RegistryState) -> bool:
    # Nothing can dispatch for a version no live session is bound to, and binding only reads the default.
    return all(session_refs(s, v.key) == 0 for v in s.versions.values() if v.state in _RECLAIM_STATES)


def _reclaim_only_when_unreferenced(s: RegistryState) -> bool:
    return all(
        v.reclaim_id is not None and session_refs(s, v.key) == 0
        for v in s.versions.values()
        if v.state in _RECLAIM_STATES
    )


def _reclaimed_means_every_engine_confirmed(s: RegistryState) -> bool:
    engines = frozenset(s.config.engines)
    return all(
        (v.reclaim_confirmed == engines) if v.state is VersionState.RECLAIMED else (v.reclaim_confirmed < engines)
        for v in s.versions.values()
        if v.state in _RECLAIM_STATES
    ) and all(not v.reclaim_confirmed for v in s.versions.values() if v.state not in _RECLAIM_STATES)


def _at_most_one_pending_attempt(s: RegistryState) -> bool:
    return sum(1 for v in s.versions.values() if v.state in PENDING_STATES) <= 1


def _names_follow_identity(s: RegistryState) -> bool:
    return all(
        k == v.key and k.epoch == s.config.epoch and v.lora_name == lora_name(k, v.digest)
        for k, v in s.versions.items()
    )


def _every_version_placed_on_every_engine(s: RegistryState) -> bool:
    return len(s.placements) == len(s.versions) * len(s.config.engines) and all(
        (k, e) in s.placements for k in s.versions for e in s.config.engines
    )


def _failed_clean_means_cleaned_everywhere(s: RegistryState) -> bool:
    return all(
        s.placements[(v.key, e)].state is PlacementState.CLEANED
        for v in s.versions.values()
        if v.state is VersionState.FAILED_CLEAN
        for e in s.config.engines
    )


def _committed_versions_have_receipts(s: RegistryState) -> bool:
    return all((v.commit is not None) == (v.state in _COMMITTED_STATES) for v in s.versions.values())


def _sessions_above_low_water(s: RegistryState) -> bool:
    return all(k.epoch == s.config.epoch and k.seq >= s.low_water.get(k.shard, 0) for k in s.sessions)


def _tombstones_never_at_the_mark(s: RegistryState) -> bool:
    # Compaction moves each mark over every contiguous closed seq, so the key at the mark is never closed.
    return all(
        not (r.state is SessionState.CLOSED and k.seq == s.low_water.get(k.shard, 0)) for k, r in s.sessions.items()
    )


def _lease_held_under_a_granted_fence(s: RegistryState) -> bool:
    return s.lease.holder is None or s.lease.fence >= 1


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("capacity_never_exceeded", "Versions holding a slot never exceed the capacity.",
              _capacity_never_exceeded),
    Invariant("one_published_default", "No default before bootstrap; afterwards exactly one, and it is PUBLISHED.",
              _one_published_default),
    Invariant("session_refs_match_bindings", "session_refs(v) == bound, unreleased sessions on v.",
              _session_refs_match_bindings),
    Invariant("sessions_bind_only_committed", "A session is only ever bound to a committed version.",
              _sessions_bind_only_committed),
    Invariant("no_dispatch_once_reclaiming", "No live session can dispatch on a RECLAIMING/RECLAIMED version.",
              _no_dispatch_once_reclaiming),
    Invariant("reclaim_only_when_unreferenced", "RECLAIMING/RECLAIMED versions have a reclaim id and zero refs.",
              _reclaim_only_when_unreferenced),
    Invariant("reclaimed_means_every_engine_confirmed", "RECLAIMED iff every engine confirmed its reclaim id.",
              _reclaimed_means_every_engine_confirmed),
    Invariant("at_most_one_pending_attempt", "At most one attempt is LOADING or ABORTED-not-clean.",
              _at_most_one_pending_attempt),
    Invariant("names_follow_identity", "lora_name is derived from (epoch, version_id, digest).",
              _names_follow_identity),
    Invariant("every_version_placed_on_every_engine", "Each version has exactly one placement per engine.",
              _every_version_placed_on_every_engine),
    Invariant("failed_clean_means_cleaned_everywhere", "FAILED_CLEAN only after every engine cleaned.",
              _failed_clean_means_cleaned_everywhere),
    Invariant("committed_versions_have_receipts", "A version has a commit receipt iff it was committed.",
              _committed_versions_have_receipts),
    Invariant("sessions_above_low_water", "No session record sits below its shard's low-water mark.",
              _sessions_above_low_water),
    Invariant("tombstones_never_at_the_mark", "Compaction never leaves a closed seq at the mark.",
              _tombstones_never_at_the_mark),
    Invariant("lease_held_under_a_granted_fence", "A held publisher lease has a fence (1 and up).",
              _lease_held_under_a_granted_fence),
)  # fmt: skip

# ---------------------------------------------------------------- registry: step invariants

# The version lifecycle as DESIGN.md §3 states it (FAILED_CLEAN -> LOADING is a fresh attempt of the
# same content). Written by hand, independently of the table, so that a wrong row is caught.
VERSION_SUCCESSORS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.LOADING: frozenset({VersionState.PUBLISHED, VersionState.ABORTED}),
    VersionState.PUBLISHED: frozenset({VersionState.RETIRED}),
    VersionState.RETIRED: frozenset({VersionState.RECLAIMING}),
    VersionState.RECLAIMING: frozenset({VersionState.RECLAIMED}),
    VersionState.RECLAIMED: frozenset(),
    VersionState.ABORTED: frozenset({VersionState.FAILED_CLEAN}),
    VersionState.FAILED_CLEAN: frozenset({VersionState.LOADING}),
}


def _version_states_follow_lifecycle(b: RegistryState, a: RegistryState) -> bool:
    for key, before in b.versions.items():
        after = a.versions.get(key)
        if after is None:
            return False
        if after.state is not before.state and after.state not in VERSION_SUCCESSORS[before.state]:
            return False
    return all(v.state is VersionState.LOADING for k, v in a.versions.items() if k not in b.versions)


def _key_digest_fixed(b: RegistryState, a: RegistryState) -> bool:
    return all(k in a.versions and a.versions[k].digest == v.digest for k, v in b.versions.items())


def _retired_never_default_again(b: RegistryState, a: RegistryState) -> bool:
    if a.default is None or a.default == b.default:
        return a.default == b.default or b.default is None
    was = b.versions.get(a.default)
    return was is not None and was.state is VersionState.LOADING and a.default_revision == b.default_revision + 1


def _binding_never_changes(b: RegistryState, a: RegistryState) -> bool:
    for key, before in b.sessions.items():
        if before.version is None:
            continue
        after = a.sessions.get(key)
        if after is not None and after.version not in (before.version, None):
            return False
        if after is not None and after.version is None and after.state is not SessionState.CLOSED:
            return False
    return True


def _closed_never_reopened(b: RegistryState, a: RegistryState) -> bool:
    for key, before in b.sessions.items():
        if before.state is SessionState.CLOSED:
            after = a.sessions.get(key)
            if after is not None and after.state is not SessionState.CLOSED:
                return False
    return all(a.low_water.get(shard, 0) >= mark for shard, mark in b.low_water.items())


def _commit_only_when_ready_everywhere(b: RegistryState, a: RegistryState) -> bool:
    for key, after in a.versions.items():
        before = b.versions.get(key)
        if before is not None and before.state is VersionState.LOADING and after.state is VersionState.PUBLISHED:
            for e in b.config.engines:
                p = b.placements[(key, e)]
                if p.state is not PlacementState.READY or p.incarnation != b.incarnations[e]:
                    return False
    return True


def _capacity_freed_only_when_clean(b: RegistryState, a: RegistryState) -> bool:
    for key, after in a.versions.items():
        before = b.versions.get(key)
        if before is None or before.state is after.state:
            continue
        if after.state is VersionState.FAILED_CLEAN and not all(
            a.placements[(key, e)].state is PlacementState.CLEANED for e in a.config.engines
        ):
            return False
    return True


def _lease_fences_only_grow(b: RegistryState, a: RegistryState) -> bool:
    # A fence, once granted, is never granted again: whatever it fenced stays refused.
    return a.lease.fence >= b.lease.fence and (a.lease.holder is None or a.lease.fence > b.lease.fence
                                               or a.lease == b.lease)


STEP_INVARIANTS: tuple[StepInvariant, ...] = (
    StepInvariant("version_states_follow_lifecycle", "Version states only move along DESIGN.md §3's arrows.",
                  _version_states_follow_lifecycle),
    StepInvariant("key_digest_fixed", "key -> digest is fixed for the epoch; versions are never forgotten.",
                  _key_digest_fixed),
    StepInvariant("retired_never_default_again", "Only a LOADING version becomes default, with revision + 1.",
                  _retired_never_default_again),
    StepInvariant("binding_never_changes", "A session's binding never changes (it is dropped only at CLOSED).",
                  _binding_never_changes),
    StepInvariant("closed_never_reopened", "A tombstone stays closed and low-water marks never move back.",
                  _closed_never_reopened),
    StepInvariant("commit_only_when_ready_everywhere", "Commit needs READY on every engine in its incarnation.",
                  _commit_only_when_ready_everywhere),
    StepInvariant("capacity_freed_only_when_clean", "ABORTED -> FAILED_CLEAN only when every engine is clean.",
                  _capacity_freed_only_when_clean),
    StepInvariant("lease_fences_only_grow", "A new holder gets a new fence; fences never go back.",
                  _lease_fences_only_grow),
)  # fmt: skip

# ---------------------------------------------------------------- engine side


def _native_refs_only_while_loaded(s: EngineAdapterState) -> bool:
    return all(
        (a.native_refs > 0) <= (a.state in (AdapterState.READY, AdapterState.DRAINING)) and a.native_refs >= 0
        for a in s.adapters.values()
    )


def _draining_iff_referenced(s: EngineAdapterState) -> bool:
    return all(
        (a.state is AdapterState.DRAINING) == (a.native_refs > 0 and a.reclaim_id is not None)
        for a in s.adapters.values()
        if a.state is not AdapterState.READY
    )


def _buckets_within_plan(s: EngineAdapterState) -> bool:
    return all(0 <= a.buckets_received <= a.bucket_count for a in s.adapters.values())


def _reclaim_states_carry_reclaim_id(s: EngineAdapterState) -> bool:
    # UNLOAD_FAILED is reached from a reclaim (with its id) or from a cleanup (without one).
    reclaiming = (AdapterState.UNREGISTERED, AdapterState.DRAINING, AdapterState.UNLOADING, AdapterState.UNLOADED)
    return all(
        (a.reclaim_id is not None) == (a.state in reclaiming)
        for a in s.adapters.values()
        if a.state is not AdapterState.UNLOAD_FAILED
    )


ENGINE_INVARIANTS: tuple[EngineInvariant, ...] = (
    EngineInvariant("native_refs_only_while_loaded", "Requests hold a name only while READY or DRAINING.",
                    _native_refs_only_while_loaded),
    EngineInvariant("draining_iff_referenced", "An unregistered name is DRAINING exactly while refcount > 0.",
                    _draining_iff_referenced),
    EngineInvariant("buckets_within_plan", "Never more buckets than the plan.", _buckets_within_plan),
    EngineInvariant("reclaim_states_carry_reclaim_id",
                    "UNREGISTERED/DRAINING/UNLOADING/UNLOADED carry their reclaim id.",
                    _reclaim_states_carry_reclaim_id),
)  # fmt: skip


def _nothing_unloaded_while_referenced(b: EngineAdapterState, a: EngineAdapterState) -> bool:
    if a.incarnation != b.incarnation:
        return True  # a restart: the old process and its requests are gone
    for name, before in b.adapters.items():
        after = a.adapters.get(name)
        gone = after is None or (
            after.state in (AdapterState.UNLOADED, AdapterState.CLEANED) and after.state is not before.state
        )
        if gone and before.native_refs > 0:
            return False
    return True


def _cleaned_attempt_never_restaged(b: EngineAdapterState, a: EngineAdapterState) -> bool:
    for name, before in b.adapters.items():
        after = a.adapters.get(name)
        restaged = after is not None and after.state is AdapterState.STAGING and before.state is not after.state
        if restaged and after is not None and after.attempt_token in before.cleaned_attempts:
            return False
    return True


def _unloaded_is_final(b: EngineAdapterState, a: EngineAdapterState) -> bool:
    if a.incarnation != b.incarnation:
        return True
    return all(
        (after := a.adapters.get(name)) is not None and after.state is AdapterState.UNLOADED
        for name, before in b.adapters.items()
        if before.state is AdapterState.UNLOADED
    )


ENGINE_STEP_INVARIANTS: tuple[EngineStepInvariant, ...] = (
    EngineStepInvariant("nothing_unloaded_while_referenced", "Nothing is unloaded or cleaned while referenced.",
                        _nothing_unloaded_while_referenced),
    EngineStepInvariant("cleaned_attempt_never_restaged", "A late begin for a cleaned attempt creates nothing.",
                        _cleaned_attempt_never_restaged),
    EngineStepInvariant("unloaded_is_final", "Within an incarnation an unloaded name is never loaded again.",
                        _unloaded_is_final),
)  # fmt: skip

# ---------------------------------------------------------------- liveness


def _open_attempts(s: RegistryState) -> frozenset[Hashable]:
    return frozenset(("attempt", v.key, v.attempt_token) for v in s.versions.values() if v.state in PENDING_STATES)


def _unreferenced_retired(s: RegistryState) -> frozenset[Hashable]:
    return frozenset(
        ("reclaim", v.key)
        for v in s.versions.values()
        if v.state is VersionState.RECLAIMING or (v.state is VersionState.RETIRED and session_refs(s, v.key) == 0)
    )


LIVENESS: tuple[Liveness, ...] = (
    Liveness("attempt_terminates", "Every attempt ends committed or FAILED_CLEAN.", _open_attempts),
    Liveness("retired_unused_version_reclaimed", "Every RETIRED version whose sessions all closed ends RECLAIMED.",
             _unreferenced_retired),
)  # fmt: skip


def violated(state: RegistryState) -> tuple[str, ...]:
    return tuple(inv.name for inv in INVARIANTS if not inv.holds(state))


def violated_by_step(before: RegistryState, after: RegistryState) -> tuple[str, ...]:
    return tuple(inv.name for inv in STEP_INVARIANTS if not inv.holds(before, after))


def engine_violated(state: EngineAdapterState) -> tuple[str, ...]:
    return tuple(inv.name for inv in ENGINE_INVARIANTS if not inv.holds(state))


def engine_violated_by_step(before: EngineAdapterState, after: EngineAdapterState) -> tuple[str, ...]:
    return tuple(inv.name for inv in ENGINE_STEP_INVARIANTS if not inv.holds(before, after))


__all__ = [
    "ENGINE_INVARIANTS",
    "ENGINE_STEP_INVARIANTS",
    "INVARIANTS",
    "LIVENESS",
    "STEP_INVARIANTS",
    "VERSION_SUCCESSORS",
    "EngineInvariant",
    "EngineStepInvariant",
    "Invariant",
    "Liveness",
    "StepInvariant",
    "VersionKey",
    "engine_violated",
    "engine_violated_by_step",
    "violated",
    "violated_by_step",
]
