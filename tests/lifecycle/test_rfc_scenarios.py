"""One test per state-level row of RFC §7.1 (plus §3.4 and §5.2 as sequences), on the pure core.
Every step goes through `checked_step`: all invariants and the frame condition hold after each."""

from __future__ import annotations

from lifecycle_driver import Engine, Registry, digest_of, session, version

from versioned_lora.lifecycle import (
    Abort,
    AcquireRequest,
    AdapterState,
    BeginClose,
    BeginStaging,
    BindFirst,
    Bound,
    CapacityFreed,
    ClaimReclaim,
    CleanupAttempt,
    CleanupOnEngine,
    CloseAndRelease,
    Closed,
    Commit,
    Committed,
    ConfirmReclaim,
    EndStaging,
    FinishUnload,
    FreeStash,
    LoadDone,
    LoadPinned,
    OpenSession,
    PhysicalUnload,
    PlacementState,
    Reason,
    ReceiveBucket,
    ReclaimAdapter,
    ReclaimClaimed,
    ReclaimConfirmed,
    ReclaimEligible,
    ReclaimOnEngine,
    RecordCleaned,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    Rejected,
    ReleaseRequest,
    Reserve,
    Reserved,
    SessionState,
    StageOnEngine,
    StashBucket,
    UnloadDone,
    Unregister,
    VersionKey,
    VersionState,
    may_dispatch,
    reclaim_id,
)

A, B, C = version("A"), version("B"), version("C")
DIGEST = {A: digest_of("A"), B: digest_of("B"), C: digest_of("C")}
ENGINES = ("E0", "E1")


def reserve(r: Registry, v: VersionKey) -> str:
    result = r(Reserve(v, DIGEST[v]))
    assert isinstance(result, Reserved), result
    return result.attempt_token


def ready(r: Registry, v: VersionKey, token: str, engine: str) -> None:
    incarnation = r.state.incarnations[engine]
    r(RecordPrepared(v, token, engine, incarnation, DIGEST[v]))
    assert r(RecordReady(v, token, engine, incarnation, DIGEST[v])).state is PlacementState.READY  # type: ignore[union-attr]


def publish(r: Registry, v: VersionKey) -> str:
    token = reserve(r, v)
    for engine in ENGINES:
        ready(r, v, token, engine)
    assert isinstance(r(Commit(v, token, r.state.default_revision)), Committed)
    return token


def bind(r: Registry, seq: int) -> VersionKey:
    result = r(BindFirst(session(seq)))
    assert isinstance(result, Bound), result
    return result.version


def refused(result: object, reason: Reason) -> bool:
    return isinstance(result, Rejected) and result.reason is reason


# ---------------------------------------------------------------- RFC §3.4 / §7.1 row 1


def test_b_ready_on_e0_only_keeps_default_and_s_mid_binds_a() -> None:
    r = Registry()
    publish(r, A)
    s_old = bind(r, 0)
    token_b = reserve(r, B)
    ready(r, B, token_b, "E0")
    s_mid = bind(r, 1)
    assert s_old == s_mid == A and r.state.default == A
    assert refused(r(Commit(B, token_b, r.state.default_revision)), Reason.NOT_READY)
    ready(r, B, token_b, "E1")
    receipt = r(Commit(B, token_b, r.state.default_revision))
    assert isinstance(receipt, Committed) and receipt.receipt.previous_default == A
    assert r.state.versions[A].state is VersionState.RETIRED and r.state.default == B
    assert bind(r, 2) == B
    # Old sessions continue (tool turn, retry, resume: every later bind answers the same version).
    assert bind(r, 0) == A and bind(r, 1) == A
    assert r.state.session_refs[A] == 2 and r.state.session_refs[B] == 1
    assert may_dispatch(r.state, A) and may_dispatch(r.state, B)


def test_duplicate_publication_same_content_is_idempotent() -> None:
    r = Registry()
    token = publish(r, A)
    revision = r.state.default_revision
    replay = r(Reserve(A, DIGEST[A]))
    assert isinstance(replay, Reserved) and replay.attempt_token == token and replay.state is VersionState.PUBLISHED
    assert r.effects == ()  # nothing staged again
    before = r.state
    assert isinstance(r(Commit(A, token, revision - 1)), Committed)  # replayed commit: original receipt
    assert r.state == before and r.state.default_revision == revision
    token_b = reserve(r, B)
    assert r(Reserve(B, DIGEST[B])) == Reserved(B, r.state.versions[B].lora_name, token_b, VersionState.LOADING)
    assert len([v for v in r.state.versions.values() if v.state is not VersionState.FAILED_CLEAN]) == 2


def test_same_version_other_content_always_conflicts() -> None:
    r = Registry()
    other = digest_of("A'")
    assert refused(r(Reserve(A, other)), Reason.CAPACITY_ERROR) is False
    r2 = Registry()
    token = reserve(r2, A)
    assert refused(r2(Reserve(A, other)), Reason.VERSION_CONFLICT)
    for engine in ENGINES:
        ready(r2, A, token, engine)
    r2(Commit(A, token, 0))
    publish(r2, B)
    assert refused(r2(Reserve(A, other)), Reason.VERSION_CONFLICT)  # RETIRED
    r2(ClaimReclaim(A))
    for engine in ENGINES:
        r2(ConfirmReclaim(A, engine, reclaim_id(A)))
    assert r2.state.versions[A].state is VersionState.RECLAIMED
    assert refused(r2(Reserve(A, other)), Reason.VERSION_CONFLICT)  # forever within the epoch
    assert r2.state.versions[A].digest == DIGEST[A]


def test_single_engine_failure_keeps_old_default() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    ready(r, B, token, "E0")
    # E1 fails; the publisher aborts the attempt.
    assert r(Abort(B, token)).state is VersionState.ABORTED  # type: ignore[union-attr]
    assert set(r.effects) == {CleanupOnEngine(e, B, r.state.versions[B].lora_name, token) for e in ENGINES}
    assert r.state.default == A and bind(r, 0) == A
    assert refused(r(Commit(B, token, r.state.default_revision)), Reason.STALE_ATTEMPT)


def test_manifest_or_digest_mismatch_is_rejected_and_keeps_old_default() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    assert refused(r(RecordReady(B, token, "E0", 0, digest_of("tampered"))), Reason.VERSION_CONFLICT)
    assert r.state.placements[(B, "E0")].state is PlacementState.BEGUN
    engine = Engine("E0")
    name = r.state.versions[B].lora_name
    engine(BeginStaging(name, token, 0, DIGEST[B], 1))
    engine(ReceiveBucket(name, token, 0, 0))
    assert refused(engine(EndStaging(name, token, 0, manifest_ok=False)), Reason.MANIFEST_MISMATCH)
    assert engine.state.adapters[name].state is AdapterState.CLEANED
    assert not any(isinstance(e, LoadPinned) for e in engine.effects) and FreeStash(name, token) in engine.effects
    assert r.state.default == A


def test_lost_commit_ack_does_not_clean_b() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    for engine in ENGINES:
        ready(r, B, token, engine)
    revision = r.state.default_revision
    receipt = r(Commit(B, token, revision))  # the reply is lost on the way back
    assert refused(r(Reserve(C, DIGEST[C])), Reason.CAPACITY_ERROR)  # A and B hold both slots
    assert refused(r(Abort(B, token)), Reason.STALE_ATTEMPT)  # a timed-out publisher cannot clean B
    assert r.effects == ()
    assert r(Commit(B, token, revision)) == receipt  # querying/retrying the same commit
    assert r.state.versions[B].state is VersionState.PUBLISHED and r.state.default == B


def test_commit_pending_blocks_next_publication() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    r(RecordUnknown(B, token, "E1"))  # E1's READY reply was lost: unknown, not failed
    assert r.state.placements[(B, "E1")].state is PlacementState.UNKNOWN
    assert refused(r(Commit(B, token, r.state.default_revision)), Reason.NOT_READY)
    assert refused(r(Reserve(C, DIGEST[C])), Reason.PUBLICATION_IN_PROGRESS)
    ready(r, B, token, "E1")  # the publisher queried E1 and learnt it is READY
    ready(r, B, token, "E0")
    assert isinstance(r(Commit(B, token, r.state.default_revision)), Committed)


def test_candidate_capacity_freed_only_after_both_cleaned() -> None:
    r = Registry()
    publish(r, A)
    token = reserve(r, B)
    r(Abort(B, token))
    assert refused(r(Reserve(C, DIGEST[C])), Reason.PUBLICATION_IN_PROGRESS)
    r(RecordCleaned(B, token, "E0"))
    r(RecordUnknown(B, token, "E1"))  # E1's cleanup outcome unknown: keep capacity
    assert r.state.versions[B].state is VersionState.ABORTED
    assert refused(r(Reserve(C, DIGEST[C])), Reason.PUBLICATION_IN_PROGRESS)
    assert r(Abort(B, token)).state is VersionState.ABORTED  # type: ignore[union-attr]
    assert r.effects == (CleanupOnEngine("E1", B, r.state.versions[B].lora_name, token),)  # re-issued
    r(RecordCleaned(B, token, "E1"))
    assert r.state.versions[B].state is VersionState.FAILED_CLEAN and r.effects == (CapacityFreed(B),)
    r(RecordCleaned(B, token, "E1"))  # duplicate receipt
    assert isinstance(r(Reserve(C, DIGEST[C])), Reserved)
    assert r.state.default == A


def test_late_control_after_cleanup_never_recreates() -> None:
    engine = Engine("E0")
    name, token = "relax_policy_lora@0-B-x", "attempt@0-2"
    engine(CleanupAttempt(name, token))  # cleanup overtakes begin
    assert engine.row == "cleanup.before_begin" and engine.effects == ()
    for late in (
        BeginStaging(name, token, 0, "d", 2),
        ReceiveBucket(name, token, 0, 0),
        EndStaging(name, token, 0, True),
    ):
        assert refused(engine(late), Reason.STALE_ATTEMPT)
        assert engine.effects == ()
    assert engine.state.adapters[name].state is AdapterState.CLEANED
    # Registry side: a READY arriving after the abort never revives the attempt.
    r = Registry()
    publish(r, A)
    token_b = reserve(r, B)
    r(Abort(B, token_b))
    assert refused(r(RecordReady(B, token_b, "E0", 0, DIGEST[B])), Reason.STALE_ATTEMPT)
    assert refused(r(RecordPrepared(B, token_b, "E0", 0, DIGEST[B])), Reason.STALE_ATTEMPT)


def test_cleanup_during_staging_frees_stash_and_after_ready_unloads_once() -> None:
    engine = Engine("E0")
    engine(BeginStaging("b", "t1", 0, "d", 2))
    engine(ReceiveBucket("b", "t1", 0, 0))
    engine(CleanupAttempt("b", "t1"))
    assert engine.effects == (FreeStash("b", "t1"),)
    engine(BeginStaging("b", "t2", 0, "d", 1))  # a fresh attempt of the same name after cleanup
    engine(ReceiveBucket("b", "t2", 0, 0))
    engine(EndStaging("b", "t2", 0, True))
    assert engine.effects == (LoadPinned("b", "t2"),)  # the stash is freed once the load that reads it is over
    engine(LoadDone("b", "t2"))
    assert engine.row == "loaded.ready" and engine.effects == (FreeStash("b", "t2"),)
    engine(CleanupAttempt("b", "t2"))
    assert engine.effects == (Unregister("b"), PhysicalUnload("b"))
    engine(UnloadDone("b"))
    assert engine.row == "unloaded.cleaned" and engine.state.adapters["b"].state is AdapterState.CLEANED
    engine(CleanupAttempt("b", "t2"))
    assert engine.row == "cleanup.replay" and engine.effects == ()


def test_duplicate_receive_runs_no_second_collective() -> None:
    engine = Engine("E0")
    engine(BeginStaging("b", "t", 0, "d", 3))
    engine(ReceiveBucket("b", "t", 0, 0))
    assert engine.effects == (StashBucket("b", "t", 0),)
    engine(ReceiveBucket("b", "t", 0, 0))
    assert engine.row == "bucket.duplicate" and engine.effects == ()
    assert refused(engine(ReceiveBucket("b", "t", 0, 2)), Reason.BAD_BUCKET)
    assert refused(engine(EndStaging("b", "t", 0, True)), Reason.INCOMPLETE_TRANSFER)
    assert refused(engine(ReceiveBucket("b", "t", 1, 1)), Reason.STALE_INCARNATION)


def test_bind_close_concurrency_one_binding_one_ref() -> None:
    r = Registry()
    publish(r, A)
    for _ in range(64):  # every waiter's bind, and every retry after a lost reply
        assert bind(r, 7) == A
    assert r.state.session_refs[A] == 1
    publish(r, B)
    assert bind(r, 7) == A  # the binding never changes, whatever the default
    r(BeginClose(session(7)))
    assert refused(r(BindFirst(session(7))), Reason.SESSION_CLOSED)
    closes = [r(CloseAndRelease(session(7))) for _ in range(3)]
    assert [c.released for c in closes] == [True, False, False]  # type: ignore[union-attr]
    assert A not in r.state.session_refs
    assert r.effects == ()  # the third close re-answers; the release happened once
    assert r.rows[-3] == "close.finalizing_bound"


def test_closed_never_reopened_by_late_open_bind() -> None:
    r = Registry()
    publish(r, A)
    r(CloseAndRelease(session(5)))  # close before open: a tombstone above the mark
    assert r.state.sessions[session(5)].state is SessionState.CLOSED
    for late in (OpenSession(session(5)), BindFirst(session(5))):
        assert refused(r(late), Reason.SESSION_CLOSED)
    assert r(BeginClose(session(5))).state is SessionState.CLOSED  # type: ignore[union-attr]
    r(CloseAndRelease(session(0)))  # at the mark: compacts immediately
    assert r.state.low_water[0] == 1 and session(0) not in r.state.sessions
    for late in (OpenSession(session(0)), BindFirst(session(0))):
        assert refused(r(late), Reason.SESSION_CLOSED)
    assert isinstance(r(CloseAndRelease(session(0))), Closed)
    assert sum(r.state.session_refs.values()) == 0


def test_native_refcount_release_exactly_once() -> None:
    engine = Engine("E0")
    engine(BeginStaging("a", "t", 0, "d", 0))
    engine(EndStaging("a", "t", 0, True))
    engine(LoadDone("a", "t"))
    engine(AcquireRequest("a"))  # r1
    engine(AcquireRequest("a"))  # r2
    engine(ReleaseRequest("a"))  # r1 ends with a 500/503
    assert engine.state.adapters["a"].native_refs == 1
    engine(ReleaseRequest("a"))  # r2 ends
    engine(ReleaseRequest("a"))  # a duplicate terminal
    assert engine.row == "release.duplicate" and engine.state.adapters["a"].native_refs == 0


def test_session_refs_zero_but_engine_refs_keep_a_pinned() -> None:
    engine = Engine("E0")
    engine(BeginStaging("a", "t", 0, "d", 0))
    engine(EndStaging("a", "t", 0, True))
    engine(LoadDone("a", "t"))
    engine(AcquireRequest("a"))
    engine(ReclaimAdapter("a", "rid"))
    assert engine.state.adapters["a"].state is AdapterState.DRAINING
    assert refused(engine(AcquireRequest("a")), Reason.VERSION_UNAVAILABLE)  # no new requests
    assert refused(engine(FinishUnload("a", "rid")), Reason.IN_USE)  # never unloaded while referenced
    engine(ReleaseRequest("a"))
    assert engine.state.adapters["a"].state is AdapterState.UNREGISTERED
    engine(FinishUnload("a", "rid"))
    assert engine.effects == (PhysicalUnload("a"),)
    engine(UnloadDone("a"))
    engine(FinishUnload("a", "rid"))
    assert engine.row == "unload.replay" and engine.effects == ()


def test_capacity_two_rejects_c_before_begin() -> None:
    r = Registry()
    publish(r, A)
    s_a = bind(r, 0)
    publish(r, B)
    result = r(Reserve(C, DIGEST[C]))
    assert refused(result, Reason.CAPACITY_ERROR) and r.effects == ()  # no StageOnEngine: no begin, no NCCL
    assert C not in r.state.versions
    assert refused(r(ClaimReclaim(A)), Reason.NOT_RECLAIMABLE)  # S_old still bound to A
    r(BeginClose(session(0)))
    r(CloseAndRelease(session(0)))
    assert s_a == A and r.effects == (ReclaimEligible(A),)
    claimed = r(ClaimReclaim(A))
    assert isinstance(claimed, ReclaimClaimed) and not may_dispatch(r.state, A)
    assert refused(r(Reserve(C, DIGEST[C])), Reason.CAPACITY_ERROR)  # RECLAIMING still holds the slot
    r(ConfirmReclaim(A, "E0", claimed.reclaim_id))
    assert refused(r(Reserve(C, DIGEST[C])), Reason.CAPACITY_ERROR)
    r(ConfirmReclaim(A, "E1", claimed.reclaim_id))
    assert r.state.versions[A].state is VersionState.RECLAIMED
    assert isinstance(r(Reserve(C, DIGEST[C])), Reserved) and r.state.default == B


def test_repeated_reclaim_and_late_receipt() -> None:
    r = Registry()
    publish(r, A)
    publish(r, B)
    claimed = r(ClaimReclaim(A))
    assert isinstance(claimed, ReclaimClaimed)
    name = r.state.versions[A].lora_name
    assert set(r.effects) == {ReclaimOnEngine(e, A, name, claimed.reclaim_id) for e in ENGINES}
    assert r(ClaimReclaim(A)) == claimed  # same stable reclaim id
    assert refused(r(ConfirmReclaim(A, "E0", "reclaim@forged")), Reason.NOT_RECLAIMABLE)
    r(ConfirmReclaim(A, "E0", claimed.reclaim_id))
    r(ConfirmReclaim(A, "E0", claimed.reclaim_id))  # duplicate receipt
    assert r.state.versions[A].state is VersionState.RECLAIMING
    assert r(ClaimReclaim(A)) == claimed and r.effects == (ReclaimOnEngine("E1", A, name, claimed.reclaim_id),)
    done = r(ConfirmReclaim(A, "E1", claimed.reclaim_id))
    assert done == ReclaimConfirmed(A, "E1", VersionState.RECLAIMED)
    assert r(ConfirmReclaim(A, "E1", claimed.reclaim_id)) == done  # a late receipt
    assert r(ClaimReclaim(A)) == ReclaimClaimed(A, claimed.reclaim_id, VersionState.RECLAIMED)
    # Engine side: each engine unloads once per reclaim id, whatever the repeats.
    engine = Engine("E0")
    engine(BeginStaging(name, "t", 0, "d", 0))
    engine(EndStaging(name, "t", 0, True))
    engine(LoadDone(name, "t"))
    unloads = 0
    for event in (
        ReclaimAdapter(name, claimed.reclaim_id),
        ReclaimAdapter(name, claimed.reclaim_id),
        FinishUnload(name, claimed.reclaim_id),
        ReclaimAdapter(name, claimed.reclaim_id),
        FinishUnload(name, claimed.reclaim_id),
    ):
        engine(event)
        unloading = sum(isinstance(e, PhysicalUnload) for e in engine.effects)
        unloads += unloading
        if unloading:
            engine(UnloadDone(name))
    assert unloads == 1
    assert refused(engine(ReclaimAdapter(name, "reclaim@forged")), Reason.NOT_RECLAIMABLE)


def test_exact_version_missing_is_an_error_not_a_fallback() -> None:
    engine = Engine("E0")
    assert refused(engine(AcquireRequest("relax_policy_lora@0-A-0123")), Reason.VERSION_UNAVAILABLE)
    assert "relax_policy_lora@0-A-0123" not in engine.state.adapters  # never an implicit reload
    r = Registry()
    assert not may_dispatch(r.state, A)


def test_rfc_5_2_release_a_before_c() -> None:
    r = Registry()
    publish(r, A)
    bind(r, 0)
    publish(r, B)
    assert refused(r(Reserve(C, DIGEST[C])), Reason.CAPACITY_ERROR)
    r(BeginClose(session(0)))
    r(CloseAndRelease(session(0)))
    rid = r(ClaimReclaim(A)).reclaim_id  # type: ignore[union-attr]
    for engine in ENGINES:
        r(ConfirmReclaim(A, engine, rid))
    assert r.effects == (CapacityFreed(A),)
    token = reserve(r, C)
    assert r.state.default == B
    assert {e.engine for e in r.effects if isinstance(e, StageOnEngine) and e.attempt_token == token} == set(ENGINES)
