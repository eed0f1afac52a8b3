"""Enumerating events: the successor function a model checker or a Hypothesis state machine needs.

`candidate_events(state, domain)` lists concrete events over a finite domain: the "correct" ones
(built from the identities in the state: live tokens, current incarnations) plus, with
`domain.faulty`, their late, duplicated, stale and forged variants. `enabled_events` keeps the ones
whose firing row changes the state; `successors` steps them.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from versioned_lora.lifecycle.core import CORE, Core, RegistryStep
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
    EngineEvent,
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
    RecordUnknown,
    RegistryEvent,
    ReleaseLease,
    ReleaseRequest,
    RenewLease,
    Reserve,
    TakeOverLease,
    UnloadDone,
    UnloadFailed,
)
from versioned_lora.spec.identities import SessionKey, VersionKey, reclaim_id
from versioned_lora.spec.model import EngineAdapterState, RegistryState

STALE_TOKEN = "attempt@stale"
FORGED_RECLAIM_ID = "reclaim@forged"
CONFLICTING_DIGEST = "f" * 64
PUBLISHERS = ("publisher", "rival")  # the lease's holders a domain draws from: the publisher and a second one
LEASE_TTL_S = 30.0


@attrs.frozen
class EventDomain:
    """Which versions the publisher may reserve (with their digests) and which sessions exist."""

    versions: tuple[tuple[VersionKey, str], ...]
    sessions: tuple[SessionKey, ...]
    faulty: bool = True  # include stale, duplicated and forged variants
    max_incarnation: int = 3  # bounds restarts so the space stays finite
    # The publisher lease's events (acquire, renew, release, expire, take over by either of PUBLISHERS). Off: no
    # lease is ever granted, so publication stays unfenced, as in a registry that never took a lease.
    lease: bool = True
    max_fence: int = 3  # bounds grants (each mints a fence) so the space stays finite


def candidate_events(state: RegistryState, domain: EventDomain) -> tuple[RegistryEvent, ...]:
    return tuple(_registry_candidates(state, domain))


def _registry_candidates(s: RegistryState, domain: EventDomain) -> Iterator[RegistryEvent]:
    for session in domain.sessions:
        yield OpenSession(session)
        yield BindFirst(session)
        yield BeginClose(session)
        yield CloseAndRelease(session)
    if domain.faulty:  # a message from another deployment epoch
        stray_session = SessionKey(s.config.epoch + 1, 0, 0)
        yield from (OpenSession(stray_session), BindFirst(stray_session))
        yield from (BeginClose(stray_session), CloseAndRelease(stray_session))
        for key, digest in domain.versions[:1]:
            stray = VersionKey(s.config.epoch + 1, key.version_id)
            yield from (Reserve(stray, digest), Commit(stray, STALE_TOKEN, 0), Abort(stray, STALE_TOKEN))
            yield ClaimReclaim(stray)
            for engine in s.config.engines[:1]:
                yield RecordPrepared(stray, STALE_TOKEN, engine, s.incarnations[engine], digest)
                yield RecordReady(stray, STALE_TOKEN, engine, s.incarnations[engine], digest)
                yield RecordUnknown(stray, STALE_TOKEN, engine)
                yield RecordCleaned(stray, STALE_TOKEN, engine)
                yield ConfirmReclaim(stray, engine, FORGED_RECLAIM_ID)
    yield from _lease_candidates(s, domain)
    # The publisher's fence: the live lease's while the publisher holds it, else none (a registry that never
    # granted a lease takes unfenced calls). Faulty: the rival's, an expired one's, none at all.
    lease = s.lease
    fence = lease.fence if lease.holder == PUBLISHERS[0] else NO_FENCE
    stale_fences = {f for f in (NO_FENCE, lease.fence - 1, lease.fence) if f >= 0 and f != fence}
    if not domain.faulty:
        stale_fences = set()
    for key, digest in domain.versions:
        yield Reserve(key, digest, fence)
        version = s.versions.get(key)
        token = STALE_TOKEN if version is None else version.attempt_token
        yield Commit(key, token, s.default_revision, fence)
        yield Abort(key, token)
        yield ClaimReclaim(key)
        for other in sorted(stale_fences):
            yield Reserve(key, digest, other)
            yield Commit(key, token, s.default_revision, other)
        if domain.faulty:
            yield Reserve(key, CONFLICTING_DIGEST, fence)
            yield Commit(key, STALE_TOKEN, s.default_revision, fence)
            yield Commit(key, token, s.default_revision + 1, fence)
            yield Abort(key, STALE_TOKEN)
        for engine in s.config.engines:
            placement = s.placements.get((key, engine))
            live = token if placement is None or placement.attempt_token is None else placement.attempt_token
            incarnation = s.incarnations[engine]
            yield RecordPrepared(key, live, engine, incarnation, digest)
            yield RecordReady(key, live, engine, incarnation, digest)
            yield RecordUnknown(key, live, engine)
            yield RecordCleaned(key, live, engine)
            yield ConfirmReclaim(key, engine, reclaim_id(key, s.id_salt))
            if domain.faulty:
                for record in (RecordPrepared, RecordReady):
                    yield record(key, live, engine, incarnation - 1, digest)
                    yield record(key, STALE_TOKEN, engine, incarnation, digest)
                    yield record(key, live, engine, incarnation, CONFLICTING_DIGEST)
                yield RecordUnknown(key, STALE_TOKEN, engine)
                yield RecordCleaned(key, STALE_TOKEN, engine)
                yield ConfirmReclaim(key, engine, FORGED_RECLAIM_ID)
    for engine in s.config.engines:
        if s.incarnations[engine] < domain.max_incarnation:
            yield EngineRestarted(engine, s.incarnations[engine] + 1)
        if domain.faulty:
            yield EngineRestarted(engine, s.incarnations[engine])


def _lease_candidates(s: RegistryState, domain: EventDomain) -> Iterator[RegistryEvent]:
    """Each publisher acquires, renews and releases under the live fence; the registry's timer expires it and
    an operator takes it over. Faulty: calls under the fence before the live one (a publisher that lost it).
    A grant while `max_fence` fences have been granted is left out (a held lease is still asked for)."""
    if not domain.lease:
        return
    live = s.lease.fence
    may_grant = live < domain.max_fence
    for holder in PUBLISHERS:
        if may_grant or s.lease.holder is not None:
            yield AcquireLease(holder, LEASE_TTL_S)
        yield RenewLease(holder, live)
        yield ReleaseLease(holder, live)
        if may_grant:
            yield TakeOverLease(holder, live, LEASE_TTL_S)
    yield ExpireLease(live)
    if domain.faulty and live > 0:
        yield RenewLease(PUBLISHERS[0], live - 1)
        yield ReleaseLease(PUBLISHERS[0], live - 1)
        yield ExpireLease(live - 1)
        yield TakeOverLease(PUBLISHERS[1], live - 1, LEASE_TTL_S)


def enabled_events(state: RegistryState, domain: EventDomain, core: Core = CORE) -> tuple[RegistryEvent, ...]:
    """Candidate events whose row changes the state (refusals and idempotent re-answers excluded)."""
    return tuple(e for e in candidate_events(state, domain) if core.fired_row(state, e).changes_state)


def successors(
    state: RegistryState, domain: EventDomain, core: Core = CORE
) -> tuple[tuple[RegistryEvent, RegistryStep], ...]:
    return tuple((e, core.step(state, e)) for e in enabled_events(state, domain, core))


# ---------------------------------------------------------------- engine side


@attrs.frozen
class AdapterPlan:
    lora_name: str
    digest: str
    bucket_count: int


@attrs.frozen
class EngineEventDomain:
    adapters: tuple[AdapterPlan, ...]
    attempt_tokens: tuple[str, ...]
    reclaim_ids: tuple[str, ...] = (FORGED_RECLAIM_ID,)
    max_incarnation: int = 3


def candidate_engine_events(state: EngineAdapterState, domain: EngineEventDomain) -> tuple[EngineEvent, ...]:
    return tuple(_engine_candidates(state, domain))


def _engine_candidates(s: EngineAdapterState, domain: EngineEventDomain) -> Iterator[EngineEvent]:
    for plan in domain.adapters:
        name = plan.lora_name
        for token in domain.attempt_tokens:
            for incarnation in (s.incarnation, s.incarnation - 1):
                yield BeginStaging(name, token, incarnation, plan.digest, plan.bucket_count)
                for index in range(plan.bucket_count + 1):
                    yield ReceiveBucket(name, token, incarnation, index)
                yield EndStaging(name, token, incarnation, True)
                yield EndStaging(name, token, incarnation, False)
            yield CleanupAttempt(name, token)
            yield LoadDone(name, token)
            yield LoadFailed(name, token)
        yield AcquireRequest(name)
        yield UnloadDone(name)
        yield UnloadFailed(name)
        yield ReleaseRequest(name)
        for rid in domain.reclaim_ids:
            yield ReclaimAdapter(name, rid)
            yield FinishUnload(name, rid)
    if s.incarnation < domain.max_incarnation:
        yield EngineStarted(s.incarnation + 1)
    yield EngineStarted(s.incarnation)


def enabled_engine_events(
    state: EngineAdapterState, domain: EngineEventDomain, core: Core = CORE
) -> tuple[EngineEvent, ...]:
    return tuple(e for e in candidate_engine_events(state, domain) if core.engine_fired_row(state, e).changes_state)
