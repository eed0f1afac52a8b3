"""Engine restarts and incarnations, bootstrap, the one pending attempt, retries, tombstone
compaction, and the engine process restart, on the pure core through `checked_step`."""

from __future__ import annotations

import random

import pytest
from lifecycle_driver import Engine, Registry, digest_of, session, version
from test_rfc_scenarios import DIGEST, ENGINES, A, B, C, bind, publish, ready, refused, reserve

from versioned_lora.lifecycle import (
    Abort,
    AdapterState,
    BeginClose,
    BeginStaging,
    BindFirst,
    ClaimReclaim,
    CleanupOnEngine,
    CloseAndRelease,
    Closed,
    Commit,
    ConfirmReclaim,
    EndStaging,
    EngineRestarted,
    EngineStarted,
    OpenSession,
    PlacementState,
    ProcessStatus,
    Reason,
    ReclaimAdapter,
    ReclaimOnEngine,
    RecordCleaned,
    RecordReady,
    RecordUnknown,
    Reserve,
    Reserved,
    Restarted,
    SessionKey,
    SessionState,
    SessionStatus,
    StageOnEngine,
    VersionKey,
    VersionState,
    default_version,
    pending_attempt,
    servable_on,
)


def test_bootstrap_bind_before_first_commit_is_no_published_version() -> None:
    r = Registry()
    assert refused(r(BindFirst(session(0))), Reason.NO_PUBLISHED_VERSION)
    assert r(OpenSession(session(0))) == SessionStatus(session(0), SessionState.OPEN, None)
    assert refused(r(BindFirst(session(0))), Reason.NO_PUBLISHED_VERSION)
    token = reserve(r, A)
    for engine in ENGINES:
        ready(r, A, token, engine)
    assert refused(r(BindFirst(session(0))), Reason.NO_PUBLISHED_VERSION)
    assert default_version(r.state) is None
    r(Commit(A, token, 0))
    assert r.rows[-1] == "commit.bootstrap" and r.state.default_revision == 1
    assert bind(r, 0) == A and default_version(r.state) == r.state.versions[A]
    assert r(OpenSession(session(0))).state is SessionState.BOUND  # type: ignore[union-attr]


def test_retired_version_never_default_again_on_replayed_commit() -> None:
    r = Registry()
    token_a = publish(r, A)
    publish(r, B)
    for revision in (0, 1, 2, 5):
        replay = r(Commit(A, token_a, revision))
        assert replay.receipt.default_revision == 1  # type: ignore[union-attr]
    assert r.state.default == B and r.state.versions[A].state is VersionState.RETIRED
    assert refused(r(Commit(A, "attempt@0-999", 2)), Reason.STALE_ATTEMPT)


def test_commit_checks_revision_and_token() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    for engine in ENGINES:
        ready(r, B, token, engine)
    assert refused(r(Commit(B, "attempt@0-999", 1)), Reason.STALE_ATTEMPT)
    assert refused(r(Commit(B, token, 0)), Reason.REVISION_MISMATCH)
    assert refused(r(Commit(VersionKey(0, "Z"), token, 1)), Reason.UNKNOWN_VERSION)
    assert refused(r(Commit(VersionKey(9, "B"), token, 1)), Reason.UNKNOWN_VERSION)
    assert refused(r(Reserve(VersionKey(9, "B"), DIGEST[B])), Reason.UNKNOWN_VERSION)


def test_one_pending_attempt() -> None:
    r = Registry(capacity=3)
    publish(r, A)
    reserve(r, B)
    assert refused(r(Reserve(C, DIGEST[C])), Reason.PUBLICATION_IN_PROGRESS)
    assert pending_attempt(r.state) == r.state.versions[B]


def test_retry_after_failed_clean_uses_a_fresh_token() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    r(Abort(B, token))
    assert refused(r(Abort(B, "attempt@0-999")), Reason.STALE_ATTEMPT)
    for engine in ENGINES:
        r(RecordCleaned(B, token, engine))
    assert r(Abort(B, token)).state is VersionState.FAILED_CLEAN  # type: ignore[union-attr]
    assert refused(r(Commit(B, token, 1)), Reason.STALE_ATTEMPT)
    assert refused(r(ClaimReclaim(B)), Reason.NOT_RECLAIMABLE)
    retry = r(Reserve(B, DIGEST[B]))
    assert isinstance(retry, Reserved) and retry.attempt_token != token
    assert refused(r(RecordReady(B, token, "E0", 0, DIGEST[B])), Reason.STALE_ATTEMPT)  # the old attempt is dead
    for engine in ENGINES:
        ready(r, B, retry.attempt_token, engine)
    r(Commit(B, retry.attempt_token, 1))
    assert r.state.default == B


def test_failed_clean_retry_respects_pending_and_capacity() -> None:
    r = Registry(capacity=2)
    publish(r, A)
    token = reserve(r, B)
    r(Abort(B, token))
    for engine in ENGINES:
        r(RecordCleaned(B, token, engine))
    token_c = reserve(r, C)
    assert refused(r(Reserve(B, DIGEST[B])), Reason.PUBLICATION_IN_PROGRESS)
    for engine in ENGINES:
        ready(r, C, token_c, engine)
    r(Commit(C, token_c, 1))
    assert refused(r(Reserve(B, DIGEST[B])), Reason.CAPACITY_ERROR)


def test_ready_from_old_incarnation_is_ignored() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    ready(r, B, token, "E0")
    r(EngineRestarted("E0", 1))
    assert r.state.placements[(B, "E0")].state is PlacementState.BEGUN  # its READY no longer counts
    assert refused(r(RecordReady(B, token, "E0", 0, DIGEST[B])), Reason.STALE_INCARNATION)
    ready(r, B, token, "E1")
    assert refused(r(Commit(B, token, 1)), Reason.NOT_READY)
    ready(r, B, token, "E0")  # staged again on the new incarnation, same attempt
    r(Commit(B, token, 1))
    assert r.state.default == B


def test_engine_restart_invalidates_ready_and_rehydrates() -> None:
    r = Registry(capacity=3)
    publish(r, A)
    bind(r, 0)  # keeps A in use after it retires
    publish(r, B)
    publish(r, C)  # B retires with no session: nobody needs it on a restarted engine
    assert servable_on(r.state, A, "E1") and servable_on(r.state, C, "E1")
    result = r(EngineRestarted("E1", 7))
    assert result == Restarted("E1", 7)
    rehydrate = {e.version: e for e in r.effects if isinstance(e, StageOnEngine)}
    assert set(rehydrate) == {A, C} and all(e.engine == "E1" and e.incarnation == 7 for e in rehydrate.values())
    assert r.state.placements[(B, "E1")].state is PlacementState.ABSENT
    assert not servable_on(r.state, A, "E1") and servable_on(r.state, A, "E0")
    assert r.state.default == C and r.state.default_revision == 3  # default unchanged
    for v in (A, C):
        ready(r, v, rehydrate[v].attempt_token, "E1")
    assert servable_on(r.state, A, "E1") and servable_on(r.state, C, "E1")
    assert refused(r(EngineRestarted("E1", 7)), Reason.STALE_INCARNATION)
    assert refused(r(EngineRestarted("E1", 3)), Reason.STALE_INCARNATION)


def test_restart_during_cleanup_and_reclaim_reissues_them() -> None:
    r = Registry(capacity=3)
    publish(r, A)
    publish(r, B)
    rid = r(ClaimReclaim(A)).reclaim_id  # type: ignore[union-attr]
    r(ConfirmReclaim(A, "E1", rid))
    token = reserve(r, C)
    r(Abort(C, token))
    r(RecordCleaned(C, token, "E1"))
    r(EngineRestarted("E0", 1))
    name_a, name_c = r.state.versions[A].lora_name, r.state.versions[C].lora_name
    assert ReclaimOnEngine("E0", A, name_a, rid) in r.effects
    assert CleanupOnEngine("E0", C, name_c, token) in r.effects
    r(EngineRestarted("E1", 1))
    assert not any(isinstance(e, ReclaimOnEngine | CleanupOnEngine) for e in r.effects)  # E1 had confirmed both
    r(RecordCleaned(C, token, "E0"))
    r(ConfirmReclaim(A, "E0", rid))  # the new incarnation answered UNLOADED(absent)
    assert r.state.versions[A].state is VersionState.RECLAIMED
    assert r.state.versions[C].state is VersionState.FAILED_CLEAN


def test_rehydrate_finishing_after_claim_counts_for_nothing() -> None:
    r = Registry()
    publish(r, A)
    bind(r, 0)
    publish(r, B)
    r(EngineRestarted("E0", 1))
    stage = next(e for e in r.effects if isinstance(e, StageOnEngine) and e.version == A)
    r(CloseAndRelease(session(0)))
    r(ClaimReclaim(A))
    assert refused(r(RecordReady(A, stage.attempt_token, "E0", 1, DIGEST[A])), Reason.STALE_ATTEMPT)
    engine = Engine("E0", 1)
    engine(BeginStaging(stage.lora_name, stage.attempt_token, 1, DIGEST[A], 2))
    engine(ReclaimAdapter(stage.lora_name, r.state.versions[A].reclaim_id or ""))
    assert engine.state.adapters[stage.lora_name].absent


def test_reclaim_on_incarnation_lacking_the_name_is_unloaded_absent() -> None:
    engine = Engine("E0", 0)
    engine(BeginStaging("a", "t", 0, "d", 0))
    engine(EndStaging("a", "t", 0, True))
    assert engine(EngineStarted(1)) == ProcessStatus("E0", 1)
    assert engine.state.adapters == {} or len(engine.state.adapters) == 0
    assert refused(engine(EngineStarted(1)), Reason.STALE_INCARNATION)
    result = engine(ReclaimAdapter("a", "rid"))
    assert result.state is AdapterState.UNLOADED and result.absent and engine.effects == ()  # type: ignore[union-attr]
    assert refused(engine(BeginStaging("a", "t2", 1, "d", 0)), Reason.STALE_ATTEMPT)  # never loaded again


def test_unknown_outcome_keeps_capacity() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    r(RecordUnknown(B, token, "E0"))
    r(RecordUnknown(B, token, "E0"))
    assert refused(r(RecordUnknown(B, "attempt@0-999", "E0")), Reason.STALE_ATTEMPT)
    r(Abort(B, token))
    r(RecordUnknown(B, token, "E0"))  # the cleanup's reply was lost
    assert r.state.placements[(B, "E0")].state is PlacementState.CLEANING
    assert r.state.versions[B].state is VersionState.ABORTED
    assert refused(r(Reserve(C, DIGEST[C])), Reason.PUBLICATION_IN_PROGRESS)
    assert refused(r(RecordCleaned(B, "attempt@0-999", "E0")), Reason.STALE_ATTEMPT)


def test_cleaned_receipt_never_removes_a_live_attempt() -> None:
    r = Registry()
    token = reserve(r, A)
    assert refused(r(RecordCleaned(A, token, "E0")), Reason.STALE_ATTEMPT)
    assert refused(r(RecordCleaned(VersionKey(0, "Z"), token, "E0")), Reason.UNKNOWN_VERSION)
    assert refused(r(RecordUnknown(VersionKey(0, "Z"), token, "E0")), Reason.UNKNOWN_VERSION)
    assert refused(r(RecordReady(VersionKey(0, "Z"), token, "E0", 0, "d")), Reason.UNKNOWN_VERSION)
    assert refused(r(RecordReady(A, token, "E0", 0, digest_of("other"))), Reason.VERSION_CONFLICT)
    assert refused(r(ConfirmReclaim(A, "E0", "rid")), Reason.NOT_RECLAIMABLE)
    assert refused(r(ConfirmReclaim(VersionKey(0, "Z"), "E0", "rid")), Reason.UNKNOWN_VERSION)
    assert refused(r(ClaimReclaim(VersionKey(0, "Z"))), Reason.UNKNOWN_VERSION)
    assert refused(r(Abort(VersionKey(0, "Z"), token)), Reason.UNKNOWN_VERSION)


def test_tombstones_compact_into_low_water_marks() -> None:
    r = Registry()
    publish(r, A)
    rng = random.Random(7)
    seqs = list(range(200))
    for seq in seqs:
        bind(r, seq)
    rng.shuffle(seqs)
    held = []
    for seq in seqs:
        r(BeginClose(session(seq)))
        r(CloseAndRelease(session(seq)))
        held.append(len(r.state.sessions))
    # Memory: open sessions plus tombstones above the mark; fully closed shard leaves nothing behind.
    assert len(r.state.sessions) == 0 and r.state.low_water[0] == 200 and A not in r.state.session_refs
    assert max(held) <= 200
    assert r(CloseAndRelease(session(3))) == Closed(session(3), released=False)
    assert refused(r(BeginClose(SessionKey(1, 0, 0))), Reason.SESSION_CLOSED)
    assert refused(r(CloseAndRelease(SessionKey(1, 0, 0))), Reason.SESSION_CLOSED)
    assert refused(r(OpenSession(SessionKey(1, 0, 0))), Reason.SESSION_CLOSED)
    assert refused(r(BindFirst(SessionKey(1, 0, 0))), Reason.SESSION_CLOSED)


def test_close_before_open_then_mark_sweeps_over_it() -> None:
    r = Registry()
    publish(r, A)
    r(OpenSession(session(0)))
    r(CloseAndRelease(session(2)))  # close before open, above the mark
    r(BeginClose(session(1)))  # begin_close on an unseen key reserves it
    assert r.state.sessions[session(1)].state is SessionState.FINALIZING
    assert refused(r(OpenSession(session(1))), Reason.SESSION_CLOSED)
    r(CloseAndRelease(session(1)))
    assert r.rows[-1] == "close.unbound"
    r(CloseAndRelease(session(0)))
    assert r.state.low_water[0] == 3 and len(r.state.sessions) == 0


@pytest.mark.parametrize("shards", [1, 4])
def test_in_order_closes_keep_memory_o_open(shards: int) -> None:
    r = Registry()
    publish(r, A)
    for seq in range(50):
        for shard in range(shards):
            r(BindFirst(session(seq, shard)))
            if seq >= 5:
                r(CloseAndRelease(session(seq - 5, shard)))
        assert len(r.state.sessions) <= 5 * shards
    assert all(r.state.low_water[s] == 45 for s in range(shards))


def test_bind_during_publication_and_after_many_swaps() -> None:
    r = Registry(capacity=2)
    publish(r, A)
    versions = [A]
    for i in range(5):
        new = version(f"V{i}")
        DIGEST[new] = digest_of(new.version_id)
        token = reserve(r, new)
        bound = bind(r, i)
        assert bound == versions[-1]
        r(CloseAndRelease(session(i)))
        for engine in ENGINES:
            ready(r, new, token, engine)
        r(Commit(new, token, r.state.default_revision))
        old = versions[-1]
        rid = r(ClaimReclaim(old)).reclaim_id  # type: ignore[union-attr]
        for engine in ENGINES:
            r(ConfirmReclaim(old, engine, rid))
        versions.append(new)
    assert r.state.default == versions[-1] and r.state.default_revision == 6
    assert sum(1 for v in r.state.versions.values() if v.state is VersionState.RECLAIMED) == 5
    assert refused(r(Reserve(B, DIGEST[B])), Reason.CAPACITY_ERROR) is False
