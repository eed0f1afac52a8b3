"""Properties of one step that the spec's state and (before, after) invariants cannot state, because
they relate the step to its *event*, its *answer* or its *effects*. They are written from the
design (DESIGN.md §2-§3), independently of the table's rows, and checked by the model checker
(drivers.py, on every registry/engine step a driver's call makes) and by the Hypothesis machines (stateful.py).

Why they exist: a table mutant that drops an effect (the engine counts a bucket it never received),
loses a compare-and-swap guard (a commit with a stale expected revision moves the default), or lets
a forged reclaim id through (an unload or a receipt for somebody else's reclaim) keeps every state
invariant true; only the relation between event, state change, answer and effects shows it.
"""

from __future__ import annotations

from typing import Any

from versioned_lora.lifecycle import (
    AllocateStash,
    ArmLeaseTimer,
    CapacityFreed,
    CleanupOnEngine,
    FreeStash,
    LoadPinned,
    PhysicalUnload,
    ReclaimEligible,
    ReclaimOnEngine,
    Rejected,
    StageOnEngine,
    StashBucket,
    Unregister,
)
from versioned_lora.spec import events as ev
from versioned_lora.spec.model import OCCUPYING_STATES, EngineAdapterState, RegistryState
from versioned_lora.spec.states import AdapterState, PlacementState, SessionState, VersionState

# Physically present in SGLang (weights loaded): what an unload must end and only an unload ends.
# The stash is held from begin until the load that reads it is over (issue 41: freed by the load's outcome).
_STASHED = frozenset({AdapterState.STAGING, AdapterState.LOADING, AdapterState.CANCELLING})
# A physical unload runs (its outcome not known yet) in these.
_UNLOADING = frozenset({AdapterState.CLEANING, AdapterState.UNLOADING})
# SGLang serves the name (registered) in these: leaving one for an unload or a drain unregisters it.
_REGISTERED = frozenset({AdapterState.READY, AdapterState.CANCELLING})
_UNREGISTERED = frozenset({AdapterState.CLEANING, AdapterState.UNREGISTERED, AdapterState.DRAINING})
_RECLAIMED_ADAPTER = frozenset({AdapterState.UNREGISTERED, AdapterState.DRAINING, AdapterState.UNLOADING,
                                AdapterState.UNLOAD_FAILED, AdapterState.UNLOADED})
# Inputs that report what SGLang did with an effect: the call happened, so a refusal they answer (to the call that
# commanded it) may still move the machine.
_OUTCOMES = (ev.LoadDone, ev.LoadFailed, ev.UnloadDone, ev.UnloadFailed)
_CLEANUP_PLACEMENTS = frozenset({PlacementState.CLEANING, PlacementState.CLEANED})
_ABORTED_VERSIONS = frozenset({VersionState.ABORTED, VersionState.FAILED_CLEAN})


def _of(effects: tuple[Any, ...], kind: type) -> list[Any]:
    return [x for x in effects if isinstance(x, kind)]


# ---------------------------------------------------------------- registry


def registry_state_problems(s: RegistryState) -> list[str]:
    """State predicates the spec does not list, stated here so the checker and Hypothesis share them."""
    problems = []
    for (key, engine), p in s.placements.items():
        # A cleanup (CLEANING/CLEANED) exists only because the attempt was aborted: an unknown outcome
        # or a late message never counts as a cleanup (DESIGN §3: keep the resource, never assume).
        if p.state in _CLEANUP_PLACEMENTS and s.versions[key].state not in _ABORTED_VERSIONS:
            problems.append(f"property cleanup_only_after_abort: {key.version_id}@{engine} is {p.state} while "
                            f"the version is {s.versions[key].state}")
    for key, v in s.versions.items():
        if v.state is VersionState.ABORTED and all(
                s.placements[(key, e)].state is PlacementState.CLEANED for e in s.config.engines):
            # the slot is freed when every engine is clean: an aborted version cleaned everywhere is FAILED_CLEAN
            problems.append(f"property cleaned_everywhere_means_failed_clean: {key.version_id} is still ABORTED")
    return problems


def registry_step_problems(before: RegistryState, event: Any, after: RegistryState, result: Any,
                           effects: tuple[Any, ...]) -> list[str]:
    problems = (registry_state_problems(after) + registry_acceptance_problems(before, event, after, result)
                + registry_refusal_problems(before, event, after, result, effects))
    if isinstance(result, Rejected) and after != before:
        problems.append(f"property refusal_changes_nothing: {event!r} was refused ({result.reason}) but moved "
                        "the registry")
    if (after.default, after.default_revision) != (before.default, before.default_revision):
        # Only commit(version, attempt_token, expected_default_revision) moves the default (compare and swap).
        v = before.versions.get(event.version) if isinstance(event, ev.Commit) else None
        if not (isinstance(event, ev.Commit) and v is not None and event.attempt_token == v.attempt_token
                and event.expected_default_revision == before.default_revision and after.default == event.version):
            problems.append(f"property default_moves_only_by_matching_commit: {event!r} moved the default from "
                            f"{before.default}@{before.default_revision} to {after.default}@{after.default_revision}")
    engines = after.config.engines
    for key, v in after.versions.items():
        old = before.versions.get(key)
        was = None if old is None else old.state
        if v.state is was:
            continue
        if v.state is VersionState.LOADING:  # a new attempt: every engine must be asked to stage it
            staged = {x.engine for x in _of(effects, StageOnEngine)
                      if x.version == key and x.attempt_token == v.attempt_token
                      and x.incarnation == after.incarnations[x.engine]}
            if staged != set(engines):
                problems.append(f"property new_attempt_staged_everywhere: {key.version_id} LOADING, stage effects "
                                f"for {sorted(staged)}")
        elif v.state is VersionState.ABORTED:
            cleaned = {x.engine for x in _of(effects, CleanupOnEngine) if x.version == key
                       and x.attempt_token == v.attempt_token}
            if cleaned != set(engines):
                problems.append(f"property abort_cleans_everywhere: {key.version_id} ABORTED, cleanup effects for "
                                f"{sorted(cleaned)}")
        elif v.state is VersionState.RECLAIMING:
            asked = {x.engine for x in _of(effects, ReclaimOnEngine) if x.version == key
                     and x.reclaim_id == v.reclaim_id}
            if asked != set(engines):
                problems.append(f"property reclaim_asks_every_engine: {key.version_id} RECLAIMING, reclaim effects "
                                f"for {sorted(asked)}")
        freed = was in OCCUPYING_STATES and v.state not in OCCUPYING_STATES
        if freed and not any(x.version == key for x in _of(effects, CapacityFreed)):
            problems.append(f"property freed_slot_announced: {key.version_id} {was}->{v.state} without "
                                "CapacityFreed")
    for x in _of(effects, CapacityFreed):
        old, new = before.versions.get(x.version), after.versions.get(x.version)
        if old is None or new is None or old.state not in OCCUPYING_STATES or new.state in OCCUPYING_STATES:
            problems.append(f"property freed_slot_announced: CapacityFreed({x.version.version_id}) but the version "
                            f"did not leave an occupying state")
    problems += _lease_problems(before, event, after, result, effects)
    if isinstance(event, ev.EngineRestarted) and after.incarnations[event.engine] != before.incarnations[event.engine]:
        # The new incarnation holds nothing: every attempt now BEGUN there must be staged again.
        staged = {(x.version, x.attempt_token) for x in _of(effects, StageOnEngine) if x.engine == event.engine}
        for (key, engine), p in after.placements.items():
            if engine == event.engine and p.state is PlacementState.BEGUN and (key, p.attempt_token) not in staged:
                problems.append(f"property restart_restages: {key.version_id}@{engine} BEGUN after the restart "
                                "but no stage effect")
    return problems


def _fenced(b: RegistryState, fence: int) -> bool:
    """Whether a Reserve or Commit under `fence` may act: the live lease's fence, or no lease in a registry that
    never required or granted one (RFC §3: one publisher; the lease is how a second one is kept out)."""
    if not b.config.publisher_lease and b.lease.fence == 0:
        return True
    return b.lease.holder is not None and fence == b.lease.fence


def _lease_problems(b: RegistryState, e: Any, a: RegistryState, result: Any, effects: tuple[Any, ...]) -> list[str]:
    problems = []
    started = [k for k, v in a.versions.items() if v.state is VersionState.LOADING
               and (k not in b.versions or b.versions[k].state is not VersionState.LOADING)]
    if (started or a.default != b.default) and not (isinstance(e, ev.Reserve | ev.Commit) and _fenced(b, e.fence)):
        problems.append(f"property only_the_lease_holder_publishes: {e!r} started or committed a publication "
                        f"under lease {b.lease!r}")
    if a.lease.fence < b.lease.fence or (a.lease.holder is not None and a.lease != b.lease
                                         and a.lease.fence != b.lease.fence + 1):
        problems.append(f"property lease_grants_a_new_fence: {b.lease!r} -> {a.lease!r} by {e!r}")
    granted = a.lease.holder is not None and not isinstance(result, Rejected) and (
        a.lease != b.lease or isinstance(e, ev.RenewLease | ev.AcquireLease))
    armed = _of(effects, ArmLeaseTimer)
    if granted and armed != [ArmLeaseTimer(a.lease.fence, a.lease.ttl_s)]:
        problems.append(f"property lease_timer_armed_on_grant: {e!r} left {a.lease!r} with timer effects {armed}")
    if not granted and armed:
        problems.append(f"property lease_timer_armed_on_grant: {e!r} armed {armed} without a grant")
    return problems


# ---------------------------------------------------------------- engine side


def engine_step_problems(before: EngineAdapterState, event: Any, after: EngineAdapterState, result: Any,
                         effects: tuple[Any, ...]) -> list[str]:
    problems = engine_acceptance_problems(before, event, after, result) + engine_refusal_problems(
        before, event, after, result)
    if isinstance(event, ev.EngineStarted):
        if isinstance(result, Rejected) and after != before:
            problems.append(f"property refusal_changes_nothing: {event!r} was refused but moved the engine")
        # A newer incarnation is a new process: it holds no managed adapter (DESIGN §3); an older or
        # equal one is a stale report and changes nothing.
        newer = event.incarnation > before.incarnation
        if newer and (after.incarnation != event.incarnation or any(
                x.state is not AdapterState.ABSENT for x in after.adapters.values())):
            problems.append(f"property new_process_holds_nothing: after {event!r} the engine is incarnation "
                            f"{after.incarnation} holding {sorted(str(x.state) for x in after.adapters.values())}")
        if not newer and after != before:
            problems.append(f"property stale_start_changes_nothing: {event!r} moved the engine")
        return problems  # a new process: everything the old one held is gone without any effect
    name = event.lora_name
    b = before.adapters.get(name)
    a = after.adapters.get(name)
    was = AdapterState.ABSENT if b is None else b.state
    now = AdapterState.ABSENT if a is None else a.state
    # A refusal changes nothing, except that a transfer refused at `end` is dropped (CLEANED), never kept; an outcome
    # reports what already happened; and a cleanup refused while the load runs marks that load for undoing.
    undo = isinstance(event, ev.CleanupAttempt) and now is AdapterState.CANCELLING
    if isinstance(result, Rejected) and after != before and now is not AdapterState.CLEANED \
            and not isinstance(event, _OUTCOMES) and not undo:
        problems.append(f"property refusal_changes_nothing: {event!r} was refused ({result.reason}) but moved "
                        f"the adapter {was}->{now}")

    def expect(cond: bool, kind: type, what: str) -> None:
        got = bool(_of(effects, kind))
        if cond != got:
            problems.append(f"property {what}: {event!r} {was}->{now} {'without' if cond else 'with'} "
                            f"{kind.__name__}")

    expect(now is AdapterState.STAGING and was is not AdapterState.STAGING, AllocateStash, "stash_iff_staging_starts")
    expect(was in _STASHED and now not in _STASHED, FreeStash, "stash_freed_iff_its_load_is_over")
    received = (a.buckets_received if a else 0) - (b.buckets_received if b else 0)
    expect(now is AdapterState.STAGING and was is AdapterState.STAGING and received > 0, StashBucket,
           "bucket_counted_iff_stashed")
    expect(now is AdapterState.LOADING and was is not AdapterState.LOADING, LoadPinned, "load_iff_loading")
    expect(now in _UNLOADING and was not in _UNLOADING, PhysicalUnload, "unload_iff_unloading_starts")
    expect(was in _REGISTERED and now in _UNREGISTERED, Unregister, "unregister_iff_leaving_service")
    # What SGLang did decides, nothing else: a load that finished is served or undone, a failed one leaves nothing;
    # an unload that finished frees the slot, a failed one keeps it (UNLOAD_FAILED) until a resent call retries it.
    if isinstance(event, ev.LoadDone) and was is AdapterState.LOADING and b is not None \
            and event.attempt_token == b.attempt_token and now is not AdapterState.READY:
        problems.append(f"property loaded_is_served: {event!r} left {now}")
    if isinstance(event, ev.LoadDone) and was is AdapterState.CANCELLING and b is not None \
            and event.attempt_token == b.attempt_token and now is not AdapterState.CLEANING:
        problems.append(f"property load_after_cleanup_is_undone: {event!r} left {now}")
    if isinstance(event, ev.LoadFailed) and was in (AdapterState.LOADING, AdapterState.CANCELLING) and b is not None \
            and event.attempt_token == b.attempt_token and now is not AdapterState.CLEANED:
        problems.append(f"property failed_load_is_clean: {event!r} left {now}")
    if isinstance(event, ev.UnloadFailed) and was in _UNLOADING and now is not AdapterState.UNLOAD_FAILED:
        problems.append(f"property failed_unload_stays_accounted: {event!r} left {now}")
    # Unload and its receipt are idempotent *per reclaim id*: another id gets no receipt, no unload.
    forged = (isinstance(event, ev.ReclaimAdapter | ev.FinishUnload) and was in _RECLAIMED_ADAPTER
              and b is not None and event.reclaim_id != b.reclaim_id)
    if forged and not (isinstance(result, Rejected) and after == before):
        problems.append(f"property receipt_only_for_its_reclaim_id: {event!r} on {was} (reclaim id "
                        f"{b.reclaim_id if b else None}) answered {type(result).__name__}")
    if isinstance(event, ev.AcquireRequest):
        took = (a.native_refs if a else 0) - (b.native_refs if b else 0)
        ok = not isinstance(result, Rejected)
        if ok != (took == 1 and now is AdapterState.READY):
            problems.append(f"property acquire_ok_iff_ref_taken_on_ready: {was}->{now} refs {took:+d}, "
                            f"answer {type(result).__name__}")
    return problems


# ---------------------------------------------------------------- acceptance: a correct message is never refused
#
# The table's refusals are for late, stale, forged and premature messages. The converse matters as
# much: the one message the protocol sends next, with the live token, the current incarnation and
# the right digest, must be accepted and must move the machine where DESIGN §3 says. A table that
# refuses it keeps every safety invariant (nothing happens) and only stalls; these catch that at once.

_LIVE_VERSIONS = frozenset({VersionState.LOADING, VersionState.PUBLISHED, VersionState.RETIRED})
_PREPARABLE = frozenset({PlacementState.BEGUN, PlacementState.UNKNOWN})
_READYABLE = frozenset({PlacementState.BEGUN, PlacementState.PREPARED, PlacementState.UNKNOWN})


def _registry_should_accept(b: RegistryState, e: Any) -> str | None:
    """What a correct `e` must achieve from `b` (a description), or None if `e` is not such a message."""
    if isinstance(e, ev.Reserve):
        v = b.versions.get(e.version)
        fresh = v is None or (v.state is VersionState.FAILED_CLEAN and v.digest == e.digest)
        pending = any(x.state in _ABORTED_VERSIONS - {VersionState.FAILED_CLEAN} or x.state is VersionState.LOADING
                      for x in b.versions.values())
        occupied = sum(1 for x in b.versions.values() if x.state in OCCUPYING_STATES)
        if (e.version.epoch == b.config.epoch and fresh and not pending and occupied < b.config.capacity
                and _fenced(b, e.fence)):
            return "reserve_takes_a_free_slot"
    elif isinstance(e, ev.RecordPrepared | ev.RecordReady):
        v, p = b.versions.get(e.version), b.placements.get((e.version, e.engine))
        states = _PREPARABLE if isinstance(e, ev.RecordPrepared) else _READYABLE
        if (v is not None and p is not None and v.state in _LIVE_VERSIONS and p.state in states
                and p.attempt_token == e.attempt_token and e.incarnation == b.incarnations[e.engine]
                and e.digest == v.digest):
            return "current_report_recorded"
    elif isinstance(e, ev.Commit):
        v = b.versions.get(e.version)
        if (v is not None and v.state is VersionState.LOADING and e.attempt_token == v.attempt_token
                and e.expected_default_revision == b.default_revision and _fenced(b, e.fence)
                and all(b.placements[(e.version, x)].state is PlacementState.READY
                        and b.placements[(e.version, x)].incarnation == b.incarnations[x] for x in b.config.engines)):
            return "ready_commit_publishes"
    elif isinstance(e, ev.Abort):
        v = b.versions.get(e.version)
        if v is not None and v.state is VersionState.LOADING and e.attempt_token == v.attempt_token:
            return "abort_of_the_live_attempt_aborts"
    elif isinstance(e, ev.ClaimReclaim):
        v = b.versions.get(e.version)
        if v is not None and v.state is VersionState.RETIRED and b.session_refs.get(e.version, 0) == 0:
            return "unreferenced_retired_is_claimed"
    elif isinstance(e, ev.ConfirmReclaim):
        v = b.versions.get(e.version)
        if (v is not None and v.state is VersionState.RECLAIMING and e.reclaim_id == v.reclaim_id
                and e.engine not in v.reclaim_confirmed):
            return "receipt_counts"
    elif isinstance(e, ev.RecordCleaned):
        p = b.placements.get((e.version, e.engine))
        if p is not None and p.state is PlacementState.CLEANING and p.attempt_token == e.attempt_token:
            return "cleanup_receipt_counts"
    elif isinstance(e, ev.AcquireLease | ev.TakeOverLease) and b.lease.holder is None:
        return "free_lease_is_granted"
    elif isinstance(e, ev.ExpireLease | ev.ReleaseLease) and b.lease.holder is not None and e.fence == b.lease.fence \
            and (isinstance(e, ev.ExpireLease) or e.holder == b.lease.holder):
        return "live_lease_ends"
    elif isinstance(e, ev.BindFirst) and b.default is not None and e.session.epoch == b.config.epoch:
        record = b.sessions.get(e.session)
        compacted = e.session.seq < b.low_water.get(e.session.shard, 0)
        if not compacted and (record is None or record.state is SessionState.OPEN):
            return "first_bind_binds_to_default"
    return None


def _registry_accepted(b: RegistryState, e: Any, a: RegistryState, what: str) -> bool:
    if what == "reserve_takes_a_free_slot":
        return a.versions[e.version].state is VersionState.LOADING
    if what == "current_report_recorded":
        want = PlacementState.PREPARED if isinstance(e, ev.RecordPrepared) else PlacementState.READY
        return a.placements[(e.version, e.engine)].state is want
    if what == "ready_commit_publishes":
        return a.default == e.version and a.versions[e.version].state is VersionState.PUBLISHED
    if what == "abort_of_the_live_attempt_aborts":
        return a.versions[e.version].state is VersionState.ABORTED
    if what == "unreferenced_retired_is_claimed":
        return a.versions[e.version].state is VersionState.RECLAIMING
    if what == "receipt_counts":
        return e.engine in a.versions[e.version].reclaim_confirmed
    if what == "cleanup_receipt_counts":
        return a.placements[(e.version, e.engine)].state is PlacementState.CLEANED
    if what == "free_lease_is_granted":
        return a.lease.holder == e.holder and a.lease.fence == b.lease.fence + 1
    if what == "live_lease_ends":
        return a.lease.holder is None and a.lease.fence == b.lease.fence
    record = a.sessions.get(e.session)  # first_bind_binds_to_default
    return record is not None and record.state is SessionState.BOUND and record.version == b.default


def registry_acceptance_problems(before: RegistryState, event: Any, after: RegistryState, result: Any) -> list[str]:
    what = _registry_should_accept(before, event)
    if what is None or (not isinstance(result, Rejected) and _registry_accepted(before, event, after, what)):
        return []
    return [f"property {what}: {event!r} answered {result!r}"]


def engine_acceptance_problems(before: EngineAdapterState, event: Any, after: EngineAdapterState,
                               result: Any) -> list[str]:
    if isinstance(event, ev.EngineStarted):
        return []
    b, a = before.adapters.get(event.lora_name), after.adapters.get(event.lora_name)
    was = AdapterState.ABSENT if b is None else b.state
    now = AdapterState.ABSENT if a is None else a.state
    current = getattr(event, "incarnation", before.incarnation) == before.incarnation
    live = b is not None and getattr(event, "attempt_token", None) == b.attempt_token
    what, ok = None, False
    if isinstance(event, ev.BeginStaging) and current and (
            was is AdapterState.ABSENT
            or (was is AdapterState.CLEANED and b is not None and event.attempt_token not in b.cleaned_attempts)):
        what, ok = "begin_stages", now is AdapterState.STAGING
    elif isinstance(event, ev.ReceiveBucket) and current and live and was is AdapterState.STAGING \
            and b is not None and event.index == b.buckets_received < b.bucket_count:
        what, ok = "next_bucket_counted", a is not None and a.buckets_received == b.buckets_received + 1
    elif isinstance(event, ev.EndStaging) and current and live and event.manifest_ok and was is AdapterState.STAGING \
            and b is not None and b.buckets_received == b.bucket_count:
        what, ok = "complete_verified_end_loads", now is AdapterState.LOADING
    elif isinstance(event, ev.AcquireRequest) and was is AdapterState.READY:
        what, ok = "ready_adapter_serves", a is not None and a.native_refs == b.native_refs + 1  # type: ignore[union-attr]
    elif isinstance(event, ev.ReleaseRequest) and b is not None and b.native_refs > 0:
        what, ok = "release_drops_one_ref", a is not None and a.native_refs == b.native_refs - 1
    elif isinstance(event, ev.ReclaimAdapter) and was is AdapterState.READY:
        what, ok = "reclaim_unregisters", now in (AdapterState.UNREGISTERED, AdapterState.DRAINING)
    elif isinstance(event, ev.FinishUnload) and was is AdapterState.UNREGISTERED and b is not None \
            and event.reclaim_id == b.reclaim_id:
        what, ok = "drained_adapter_unloads", now is AdapterState.UNLOADING
    elif isinstance(event, ev.CleanupAttempt) and (was is AdapterState.ABSENT
                                                   or (live and was is AdapterState.STAGING)):
        what, ok = "cleanup_cleans", now is AdapterState.CLEANED
    if what is None or (ok and not isinstance(result, Rejected)):
        return []
    return [f"property {what}: {event!r} on {was} answered {result!r}"]


# ---------------------------------------------------------------- refusals the design requires, and idempotent replays


def registry_refusal_problems(before: RegistryState, event: Any, after: RegistryState, result: Any,
                              effects: tuple[Any, ...]) -> list[str]:
    """DESIGN §2-§3: stale tokens, other digests, older incarnations and other reclaim ids are refused
    and change nothing; a late close never reopens and a close always ends the session."""
    must_refuse = None
    if isinstance(event, ev.RecordPrepared | ev.RecordReady | ev.RecordUnknown | ev.RecordCleaned):
        v, p = before.versions.get(event.version), before.placements.get((event.version, event.engine))
        if p is not None and p.attempt_token != event.attempt_token:
            must_refuse = "stale_attempt_refused"
        elif isinstance(event, ev.RecordPrepared | ev.RecordReady) and v is not None:
            if event.digest != v.digest:
                must_refuse = "other_digest_refused"
            elif event.incarnation != before.incarnations[event.engine]:
                must_refuse = "older_incarnation_refused"
            elif v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
                # a rehydrate that reports after the version was claimed for reclaim counts for nothing
                must_refuse = "report_after_claim_refused"
    elif isinstance(event, ev.ConfirmReclaim):
        v = before.versions.get(event.version)
        if v is not None and v.reclaim_id is not None and event.reclaim_id != v.reclaim_id:
            must_refuse = "other_reclaim_id_refused"
    elif isinstance(event, ev.Commit):
        v = before.versions.get(event.version)
        if v is not None and event.attempt_token != v.attempt_token:
            must_refuse = "stale_commit_refused"
    problems = []
    if must_refuse and not (isinstance(result, Rejected) and after == before):
        problems.append(f"property {must_refuse}: {event!r} answered {result!r}")
    if isinstance(event, ev.CloseAndRelease) and event.session.epoch == before.config.epoch:
        record = after.sessions.get(event.session)
        closed = event.session.seq < after.low_water.get(event.session.shard, 0) or (
            record is not None and record.state is SessionState.CLOSED)
        if not closed:
            problems.append(f"property close_ends_the_session: after {event!r} the session is "
                            f"{record.state if record else 'UNSEEN'}")
    if isinstance(event, ev.EngineRestarted) and event.incarnation > before.incarnations[event.engine] \
            and after.incarnations[event.engine] != event.incarnation:
        problems.append(f"property newer_incarnation_adopted: {event!r} left {after.incarnations[event.engine]}")
    for key, v in after.versions.items():
        # RFC §5: the reclaimer learns of an unreferenced RETIRED version from ReclaimEligible.
        eligible = v.state is VersionState.RETIRED and after.session_refs.get(key, 0) == 0
        old = before.versions.get(key)
        was_eligible = old is not None and old.state is VersionState.RETIRED and before.session_refs.get(key, 0) == 0
        if eligible and not was_eligible and not any(x.version == key for x in _of(effects, ReclaimEligible)):
            problems.append(f"property reclaim_eligible_announced: {key.version_id} became RETIRED and unreferenced "
                            "without ReclaimEligible")
    return problems


def engine_refusal_problems(before: EngineAdapterState, event: Any, after: EngineAdapterState,
                            result: Any) -> list[str]:
    problems: list[str] = []
    if isinstance(event, ev.EngineStarted):
        return problems
    b, a = before.adapters.get(event.lora_name), after.adapters.get(event.lora_name)
    stale = getattr(event, "incarnation", before.incarnation) != before.incarnation
    if stale and not (isinstance(result, Rejected) and after == before):
        problems.append(f"property older_incarnation_refused: {event!r} answered {result!r}")
    other_attempt = (isinstance(event, ev.ReceiveBucket | ev.EndStaging | ev.CleanupAttempt | ev.LoadDone
                                | ev.LoadFailed) and b is not None
                     and b.state in (AdapterState.STAGING, AdapterState.LOADING, AdapterState.READY)
                     and event.attempt_token != b.attempt_token)
    if other_attempt and not (isinstance(result, Rejected) and after == before):
        # stale tokens are rejected and never revive, load or clean anything (DESIGN §2)
        problems.append(f"property other_attempt_refused: {event!r} on {b.state} answered {result!r}")  # type: ignore[union-attr]
    if isinstance(event, ev.EndStaging) and not event.manifest_ok and a is not None \
            and a.state is AdapterState.READY and (b is None or b.state is not AdapterState.READY):
        problems.append(f"property bad_manifest_never_loads: {event!r} loaded the adapter")
    if b is not None and a is not None and not b.cleaned_attempts <= a.cleaned_attempts:
        forgot = sorted(b.cleaned_attempts - a.cleaned_attempts)
        problems.append(f"property cleaned_attempts_kept: {event!r} forgot {forgot}")
    # The attempt this step cleaned (moved into CLEANED, or a cleanup accepted on a CLEANED adapter) is remembered.
    into_cleaned = a is not None and a.state is AdapterState.CLEANED and (
        b is None or b.state is not AdapterState.CLEANED
        or (isinstance(event, ev.CleanupAttempt) and not isinstance(result, Rejected)))
    ended = isinstance(event, ev.CleanupAttempt | ev.EndStaging | ev.LoadFailed) and into_cleaned
    if ended and event.attempt_token not in a.cleaned_attempts:  # type: ignore[union-attr]
        problems.append(f"property cleaned_attempt_remembered: {event!r} left the adapter CLEANED without "
                        "remembering the attempt (a late begin could recreate it)")
    replay = (isinstance(event, ev.BeginStaging) and not stale and b is not None
              and b.state in (AdapterState.STAGING, AdapterState.LOADING, AdapterState.READY)
              and event.attempt_token == b.attempt_token)
    if replay and (isinstance(result, Rejected) or after != before):
        problems.append(f"property duplicate_begin_is_idempotent: {event!r} answered {result!r}")
    if isinstance(event, ev.BeginStaging) and not stale and a is not None and a.state is AdapterState.STAGING \
            and (b is None or b.state is not AdapterState.STAGING):
        plan = (a.attempt_token, a.digest, a.bucket_count, a.buckets_received)
        if plan != (event.attempt_token, event.digest, event.bucket_count, 0):
            problems.append(f"property begin_fixes_the_plan: {event!r} left {plan}")
    return problems
