"""Issue 41, the pure core: an engine effect's outcome is an input of the engine table and its rows decide. A failed
load frees its stash and ends CLEANED (the end refused LOAD_FAILED); a load that finishes after cleanup began is
unloaded at once; a failed unload keeps the adapter accounted (UNLOAD_FAILED, its slot held) until a resent cleanup
or reclaim retries it; the effects of a row come in the row's order."""

from __future__ import annotations

from lifecycle_driver import Engine

from versioned_lora.lifecycle import (
    AdapterState,
    BeginStaging,
    CleanupAttempt,
    EndStaging,
    FinishUnload,
    FreeStash,
    LoadDone,
    LoadFailed,
    LoadPinned,
    PhysicalUnload,
    ReadyLocal,
    ReceiveBucket,
    ReclaimAdapter,
    Rejected,
    UnloadDone,
    UnloadFailed,
    Unregister,
)
from versioned_lora.spec.model import SLOT_HOLDING_ADAPTER_STATES
from versioned_lora.spec.reasons import Reason

NAME, TOKEN, RID = "relax_policy_lora@0-B-0123456789ab", "attempt@0-2", "reclaim@0-B"


def _refused(result: object, reason: Reason) -> bool:
    return isinstance(result, Rejected) and result.reason is reason


def _loading() -> Engine:
    """B verified on the engine: SGLang's load of it runs."""
    engine = Engine()
    engine(BeginStaging(NAME, TOKEN, 0, "d", 1))
    engine(ReceiveBucket(NAME, TOKEN, 0, 0))
    engine(EndStaging(NAME, TOKEN, 0, True))
    assert engine.row == "end.verified" and engine.effects == (LoadPinned(NAME, TOKEN),)
    assert engine.state.adapters[NAME].state is AdapterState.LOADING
    return engine


def _state(engine: Engine) -> AdapterState:
    return engine.state.adapters[NAME].state


def test_a_load_done_is_ready_and_frees_the_stash_it_read() -> None:
    engine = _loading()
    assert _refused(engine(EndStaging(NAME, TOKEN, 0, True)), Reason.IN_USE)  # a second end while it loads
    assert engine.row == "end.loading" and engine.effects == ()
    ready = engine(LoadDone(NAME, TOKEN))
    assert engine.row == "loaded.ready" and isinstance(ready, ReadyLocal)
    assert engine.effects == (FreeStash(NAME, TOKEN),) and _state(engine) is AdapterState.READY


def test_a_failed_load_frees_its_stash_and_ends_clean_refused_typed() -> None:
    engine = _loading()
    assert _refused(engine(LoadFailed(NAME, TOKEN)), Reason.LOAD_FAILED)
    assert engine.row == "load_failed.cleaned" and engine.effects == (FreeStash(NAME, TOKEN),)
    assert _state(engine) is AdapterState.CLEANED and _state(engine) not in SLOT_HOLDING_ADAPTER_STATES
    engine(CleanupAttempt(NAME, TOKEN))  # the registry's cleanup then completes: nothing left to do
    assert engine.row == "cleanup.replay" and engine.effects == ()
    assert _refused(engine(BeginStaging(NAME, TOKEN, 0, "d", 1)), Reason.STALE_ATTEMPT)  # never recreated


def test_a_load_that_finishes_after_cleanup_began_is_unloaded_at_once() -> None:
    engine = _loading()
    assert _refused(engine(CleanupAttempt(NAME, TOKEN)), Reason.IN_USE)  # the end's deadline passed, its load runs
    assert engine.row == "cleanup.loading" and _state(engine) is AdapterState.CANCELLING
    assert _state(engine) in SLOT_HOLDING_ADAPTER_STATES
    assert _refused(engine(CleanupAttempt(NAME, TOKEN)), Reason.IN_USE) and engine.row == "cleanup.settling"
    assert _refused(engine(LoadDone(NAME, TOKEN)), Reason.STALE_ATTEMPT)  # the end learns cleanup came first
    assert engine.row == "loaded.after_cleanup"
    assert engine.effects == (FreeStash(NAME, TOKEN), Unregister(NAME), PhysicalUnload(NAME))
    assert _state(engine) is AdapterState.CLEANING
    engine(UnloadDone(NAME))
    assert engine.row == "unloaded.cleaned" and _state(engine) is AdapterState.CLEANED
    assert not isinstance(engine(CleanupAttempt(NAME, TOKEN)), Rejected)  # the cleanup asked again: clean
    assert engine.row == "cleanup.replay"


def test_a_load_that_fails_after_cleanup_began_leaves_only_its_stash_to_free() -> None:
    engine = _loading()
    engine(CleanupAttempt(NAME, TOKEN))
    assert _refused(engine(LoadFailed(NAME, TOKEN)), Reason.STALE_ATTEMPT)
    assert engine.row == "load_failed.after_cleanup" and engine.effects == (FreeStash(NAME, TOKEN),)
    assert _state(engine) is AdapterState.CLEANED


def test_a_failed_cleanup_unload_stays_accounted_and_the_resent_cleanup_retries_it() -> None:
    engine = _loading()
    engine(LoadDone(NAME, TOKEN))
    engine(CleanupAttempt(NAME, TOKEN))
    assert engine.row == "cleanup.ready" and engine.effects == (Unregister(NAME), PhysicalUnload(NAME))
    assert _refused(engine(UnloadFailed(NAME)), Reason.UNLOAD_FAILED)  # the cleanup is refused, typed
    assert engine.row == "unload_failed.cleanup" and _state(engine) is AdapterState.UNLOAD_FAILED
    assert _state(engine) in SLOT_HOLDING_ADAPTER_STATES  # SGLang still holds the weights
    engine(CleanupAttempt(NAME, TOKEN))
    assert engine.row == "cleanup.retry_unload" and engine.effects == (PhysicalUnload(NAME),)
    engine(UnloadDone(NAME))
    assert _state(engine) is AdapterState.CLEANED


def test_a_failed_reclaim_unload_stays_accounted_and_the_resent_reclaim_retries_it_once() -> None:
    engine = _loading()
    engine(LoadDone(NAME, TOKEN))
    engine(ReclaimAdapter(NAME, RID))
    engine(FinishUnload(NAME, RID))
    assert engine.row == "unload.drained" and _state(engine) is AdapterState.UNLOADING
    engine(ReclaimAdapter(NAME, RID))  # asked again while it unloads: no receipt yet, no second unload
    assert engine.row == "reclaim.replay" and engine.effects == ()
    engine(UnloadFailed(NAME))
    assert engine.row == "unload_failed.reclaim" and _state(engine) is AdapterState.UNLOAD_FAILED
    assert _refused(engine(ReclaimAdapter(NAME, "reclaim@forged")), Reason.NOT_RECLAIMABLE)
    engine(FinishUnload(NAME, RID))
    assert engine.row == "unload.replay" and engine.effects == ()
    engine(ReclaimAdapter(NAME, RID))
    assert engine.row == "reclaim.retry_unload" and engine.effects == (PhysicalUnload(NAME),)
    engine(UnloadDone(NAME))
    assert engine.row == "unloaded.reclaimed" and _state(engine) is AdapterState.UNLOADED
    assert _state(engine) not in SLOT_HOLDING_ADAPTER_STATES


def test_an_outcome_nobody_awaits_changes_nothing() -> None:
    engine = _loading()
    before = engine.state
    assert _refused(engine(LoadDone(NAME, "attempt@other")), Reason.STALE_ATTEMPT)
    assert _refused(engine(LoadFailed(NAME, "attempt@other")), Reason.STALE_ATTEMPT)
    engine(UnloadDone(NAME))
    assert engine.row == "unloaded.unawaited"
    engine(UnloadFailed(NAME))
    assert engine.row == "unload_failed.unawaited" and engine.state == before
    engine(LoadDone(NAME, TOKEN))
    engine(LoadDone(NAME, TOKEN))
    assert engine.row == "loaded.unawaited"
    engine(LoadFailed(NAME, TOKEN))
    assert engine.row == "load_failed.unawaited" and _state(engine) is AdapterState.READY
