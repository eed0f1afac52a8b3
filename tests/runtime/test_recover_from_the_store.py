"""`Publisher.recover` with a snapshot store commits an attempt a crashed publisher left READY everywhere only when
the store holds its bytes: a publisher writes the snapshot before it sends its commit, so an attempt whose
snapshot is missing is one whose publisher died before that write, and committing it would make a default that no
later publisher can rehydrate. The crash between the engines' READY and the store write is injected (the attempt
is driven to READY through the registry by hand, as that publisher's reports would have left it); the real core
is behind a `LocalRegistry`, the engines record calls (`test_lost_replies_injected.RecordingEngine`).

The other half of that rule is here too: `publish` has the snapshot in the store before its commit is sent, and
a store that cannot take it (a full disk, injected) fails the attempt before any commit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from lease_helpers import fence_of
from test_lost_replies_injected import candidate, deployment

from versioned_lora.lifecycle import Commit, RecordPrepared, RecordReady, Reserve, Reserved, VersionKey
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import Publisher, PublishStatus
from versioned_lora.spec.states import VersionState


class HeldDigests:
    """A snapshot store that holds exactly `digests` (SnapshotStorePort; the real store's reads and writes are
    tests/adapters/test_snapshot_store.py's)."""

    def __init__(self, *digests: str) -> None:
        self.digests = set(digests)

    def put_candidate(self, candidate: Any) -> None:
        self.digests.add(candidate.digest)

    def holds(self, digest: str) -> bool:
        return digest in self.digests

    def candidate(self, digest: str, lora_name: str) -> Any:
        raise AssertionError("recover reads no snapshot")


async def ready_everywhere_without_a_commit(registry: Any, version: VersionKey, digest: str) -> None:
    reserved = (await registry.submit(Reserve(version, digest, await fence_of(registry)))).result
    assert isinstance(reserved, Reserved), reserved
    await registry.submit_batch([kind(version, reserved.attempt_token, engine, 0, digest)
                                 for engine in ("E0", "E1") for kind in (RecordPrepared, RecordReady)])


def recovered(tmp_path: Path, stored: bool) -> tuple[list[PublishStatus], Any, list[tuple[str, str]]]:
    async def body() -> tuple[list[PublishStatus], Any, list[tuple[str, str]]]:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        await ready_everywhere_without_a_commit(registry, version, shipped.digest)
        store = HeldDigests(*([shipped.digest] if stored else []))
        outcomes = await Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=store).recover()
        view = await registry.publication_view()
        return [o.status for o in outcomes], view, [c for e in engines.values() for c in e.destructive()]

    return asyncio.run(body())


def test_injected_crash_before_the_store_write_is_recovered_by_an_abort_not_a_commit(tmp_path: Path) -> None:
    statuses, view, cleaned = recovered(tmp_path, stored=False)
    assert statuses == [PublishStatus.FAILED_CLEAN]
    assert view.default is None and view.versions[VersionKey(0, "A")].state is VersionState.FAILED_CLEAN
    assert [kind for kind, _ in cleaned] == ["cleanup", "cleanup"]  # one cleanup on each engine


def test_injected_crash_after_the_store_write_is_recovered_by_the_commit(tmp_path: Path) -> None:
    statuses, view, cleaned = recovered(tmp_path, stored=True)
    assert statuses == [PublishStatus.COMMITTED]
    assert view.default == VersionKey(0, "A") and cleaned == []


class CommitSeesTheStore:
    """The registry port, noting at each Commit whether the store already holds the committed digest."""

    def __init__(self, inner: Any, store: HeldDigests, digest: str) -> None:
        self.inner, self.store, self.digest = inner, store, digest
        self.held_at_commit: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def submit(self, event: Any, key: str | None = None) -> Any:
        if isinstance(event, Commit):
            self.held_at_commit.append(self.store.holds(self.digest))
        return await self.inner.submit(event, key)


def test_a_publication_writes_its_snapshot_before_it_sends_its_commit(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        store = HeldDigests()
        port = CommitSeesTheStore(registry, store, shipped.digest)
        publisher = Publisher(port, engines, lambda *_: True, Deadlines(), snapshots=store)
        outcome = await publisher.publish(version, shipped)
        assert outcome.committed and port.held_at_commit == [True]
        assert "store" in outcome.phases

    asyncio.run(body())


class FullDisk(HeldDigests):
    def put_candidate(self, candidate: Any) -> None:
        raise OSError(28, "No space left on device")


def test_a_snapshot_the_store_cannot_take_fails_the_attempt_before_its_commit(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        outcome = await Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=FullDisk()).publish(
            version, shipped)
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "OSError")
        view = await registry.publication_view()
        assert view.default is None and view.versions[version].state is VersionState.FAILED_CLEAN

    asyncio.run(body())


def test_injected_crash_mid_staging_is_settled_by_the_table_commit_refused_then_abort(tmp_path: Path) -> None:
    """An attempt the crashed publisher left READY on one engine only: recover sends the commit and the registry
    refuses it (commit.not_ready); the settle driver's row commit.refused aborts it and cleans both engines. The
    publisher decides nothing from the view but which attempts are pending."""

    async def body() -> None:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        reserved = (await registry.submit(Reserve(version, shipped.digest, await fence_of(registry)))).result
        assert isinstance(reserved, Reserved), reserved
        token = reserved.attempt_token
        await registry.submit_batch([RecordPrepared(version, token, "E0", 0, shipped.digest),
                                     RecordPrepared(version, token, "E1", 0, shipped.digest),
                                     RecordReady(version, token, "E0", 0, shipped.digest)])
        publisher = Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=HeldDigests(shipped.digest))
        (outcome,) = await publisher.recover()
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "NOT_READY")
        assert publisher.settle_loops[-1].fired[:3] == ["settle.commit", "revision.read", "commit.refused"]
        view = await registry.publication_view()
        assert view.default is None and view.versions[version].state is VersionState.FAILED_CLEAN
        assert sorted(e.name for e in engines.values() for kind, _ in e.calls if kind == "cleanup") == ["E0", "E1"]

    asyncio.run(body())
