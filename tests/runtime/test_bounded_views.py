"""The registry's views stay bounded over a long run (issue 48): `publication_view` holds the live versions and
the last few ended ones, `operations_view` is answered from counters kept as the state changes, and both agree
with a full recount of the state after every call, after a recovery, and with `all_versions`.

A real `RegistryCore` (SQLite journal) stepped through the table's own events, as a Publisher, a Reclaimer and a
session binder would report them. No Ray, no SGLang."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from lease_helpers import fence

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import (
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    ConfirmReclaim,
    OpenSession,
    ReclaimClaimed,
    RecordPrepared,
    RecordReady,
    RegistryEvent,
    Reserve,
    Reserved,
    SessionKey,
    VersionKey,
    VersionState,
)
from versioned_lora.runtime.interfaces import RegistryAnswer
from versioned_lora.runtime.views import ENDED_STATES, OPEN_SESSION_STATES, RECENT_ENDED
from versioned_lora.spec.model import occupied_slots

ENGINES = ("E0", "E1")
EPOCH = 3


def digest(version: VersionKey) -> str:
    return hashlib.sha256(version.version_id.encode()).hexdigest()


# How a step reaches the registry: `RegistryCore.submit_batch`, or a wrapper of it that observes each call.
Call = Callable[[str, Sequence[RegistryEvent]], tuple[RegistryAnswer, ...]]


def publish(core: RegistryCore, version: VersionKey, lease: int, call: Call | None = None) -> None:
    call = call or core.submit_batch
    reserved = call(f"reserve:{version.version_id}", [Reserve(version, digest(version), lease)])[0].result
    assert isinstance(reserved, Reserved), reserved
    token = reserved.attempt_token
    call(f"ready:{version.version_id}", [kind(version, token, engine, 0, digest(version))
                                         for engine in ENGINES for kind in (RecordPrepared, RecordReady)])
    revision = core.publication_view().default_revision
    call(f"commit:{version.version_id}", [Commit(version, token, revision, lease)])


def reclaim(core: RegistryCore, version: VersionKey, call: Call | None = None) -> None:
    call = call or core.submit_batch
    claimed = call(f"claim:{version.version_id}", [ClaimReclaim(version)])[0].result
    assert isinstance(claimed, ReclaimClaimed), claimed
    for engine in ENGINES:
        call(f"confirm:{version.version_id}:{engine}", [ConfirmReclaim(version, engine, claimed.reclaim_id)])


def assert_views_match_a_recount(core: RegistryCore) -> None:
    """What the counters answer equals what a walk of the whole state finds."""
    state = core.state()
    ops, everything = core.operations_view(), core.operations_view(all_versions=True)
    assert ops.occupied == everything.occupied == occupied_slots(state)
    assert ops.open_sessions == sum(1 for s in state.sessions.values() if s.state in OPEN_SESSION_STATES)
    view, full = core.publication_view(), core.publication_view(all_versions=True)
    assert set(full.versions) == set(state.versions) and full.ended_left_out == 0
    live = {k for k, v in state.versions.items() if v.state not in ENDED_STATES}
    ended = {k for k, v in state.versions.items() if v.state in ENDED_STATES}
    assert live <= set(view.versions)
    shown_ended = set(view.versions) - live
    assert len(shown_ended) == min(len(ended), RECENT_ENDED) and shown_ended <= ended
    assert view.ended_left_out == len(ended) - len(shown_ended)
    for key, shown in view.versions.items():
        assert shown == full.versions[key]  # the same rows, placements included
    assert {k: c for k, c in everything.reclaim_confirmed.items() if k in view.versions} == ops.reclaim_confirmed


def test_the_views_hold_live_versions_and_the_last_ended_ones_and_agree_with_a_recount(tmp_path: Path) -> None:
    core = RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, capacity=2, epoch=EPOCH, insecure=True)
    lease = fence(core)
    previous: VersionKey | None = None
    steps = 3 * RECENT_ENDED
    for index in range(steps):
        version = VersionKey(EPOCH, f"v{index:04d}")
        publish(core, version, lease)
        # A session binds the new default, one bound to the previous version closes: sessions come and go.
        session = SessionKey(EPOCH, 0, index)
        core.submit_batch(f"open:{session.seq}", [OpenSession(session), BindFirst(session)])
        assert_views_match_a_recount(core)
        if previous is not None:
            core.submit(f"close:{session.seq - 1}", CloseAndRelease(SessionKey(EPOCH, 0, session.seq - 1)))
            reclaim(core, previous)
            assert_views_match_a_recount(core)
        previous = version
    view = core.publication_view()
    # The current default, and the RECENT_ENDED versions reclaimed last, in the order they ended.
    ended = [k.version_id for k, v in view.versions.items() if v.state is VersionState.RECLAIMED]
    assert ended == [f"v{i:04d}" for i in range(steps - 1 - RECENT_ENDED, steps - 1)]
    assert view.ended_left_out == steps - 1 - RECENT_ENDED
    assert core.operations_view().open_sessions == 1
    core.close()

    # A recovered registry rebuilds its counters from the replayed state: the same answers.
    again = RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, capacity=2, epoch=EPOCH, insecure=True)
    assert_views_match_a_recount(again)
    assert again.publication_view() == view
    again.close()


def test_a_version_that_ends_inside_one_call_is_counted_once(tmp_path: Path) -> None:
    """A reserve and everything up to its reclaim in one batch, then a late confirmation of an ended version: the
    ended version is counted once, and the late row moves nothing."""
    core = RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, capacity=2, epoch=EPOCH, insecure=True)
    lease = fence(core)
    a, b = VersionKey(EPOCH, "a"), VersionKey(EPOCH, "b")
    publish(core, a, lease)
    publish(core, b, lease)
    claimed = core.submit("claim:a", ClaimReclaim(a)).result
    assert isinstance(claimed, ReclaimClaimed)
    core.submit_batch("confirm:a", [ConfirmReclaim(a, engine, claimed.reclaim_id) for engine in ENGINES])
    core.submit("confirm:a:late", ConfirmReclaim(a, "E0", claimed.reclaim_id))
    index = core.view_index()
    assert index.ended_count == 1 and list(index.live) == [b]
    assert_views_match_a_recount(core)
    core.close()
