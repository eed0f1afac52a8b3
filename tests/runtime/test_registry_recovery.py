"""The registry actor under kill -9 (RFC §2; DESIGN.md §3 unknown outcomes): the actor's worker process is
killed with SIGKILL by its pid (never `ray.kill`), between calls and in the middle of a batch. After Ray
restarts it, the recovered state's canonical digest equals the digest after the last durable call, and a
retry with the same idempotency key is answered from the journal without a second effect.

A shadow `RegistryCore` in this process receives the same calls: the core is deterministic, so it tells
what the actor's state must be after each acknowledged call."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from engine_helpers import capability_key_file
from lease_helpers import fence_of
from registry_helpers import A, B, digest_of, new_actor, publish, refs

from versioned_lora.adapters.journal import JournalConfigMismatch, JournalCorrupt, dumps_row, loads, state_digest
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.capabilities import parse_key
from versioned_lora.lifecycle import (
    BindFirst,
    CloseAndRelease,
    Closed,
    ProtocolError,
    RecordReady,
    RegistryEvent,
    Reserve,
    SessionKey,
    VersionKey,
)
from versioned_lora.runtime.interfaces import MAX_BATCH, BatchTooLarge, IdempotencyKeyReused

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

pytestmark = pytest.mark.usefixtures("ray_cluster")
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def binds(shard: int, start: int, count: int) -> list[RegistryEvent]:
    return [BindFirst(SessionKey(0, shard, seq)) for seq in range(start, start + count)]


def kill_actor(handle: Any) -> int:
    pid: int = ray.get(handle.pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_for_marker(marker: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, "the actor never reached the armed fault point"
        time.sleep(0.01)
    return int(marker.read_text())


def test_kill_between_calls_recovers_the_same_state_and_answers_retries_from_the_journal(tmp_path: Path) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        await registry.submit_batch(binds(0, 0, 200))
        close_key = "close-s0-0"
        first = await registry.submit(CloseAndRelease(SessionKey(0, 0, 0)), key=close_key)
        assert first.result == Closed(SessionKey(0, 0, 0), released=True) and not first.from_journal
        reserved = await registry.submit(Reserve(B, digest_of(B), await fence_of(registry)),
                                         key="reserve-B")  # B pending: LOADING
        digest = await registry.state_digest()
        stats = ray.get(handle.journal_stats.remote())

        old_pid = kill_actor(handle)
        assert await registry.state_digest() == digest  # the client waits for the restart
        new_pid = ray.get(handle.pid.remote())
        assert new_pid != old_pid
        recovered = ray.get(handle.journal_stats.remote())
        assert recovered["replayed_calls"] == stats["calls"] and recovered["last_seq"] == stats["last_seq"]

        # The retried close is answered from the journal: released=True as the first time, no second release.
        retry = await registry.submit(CloseAndRelease(SessionKey(0, 0, 0)), key=close_key)
        assert retry.from_journal and retry.result == first.result and retry.journal_seq == first.journal_seq
        again = await registry.submit(Reserve(B, digest_of(B), await fence_of(registry)),
                                      key="reserve-B")
        assert again.from_journal and again.result == reserved.result and again.effects == reserved.effects
        assert await registry.state_digest() == digest
        assert ray.get(handle.journal_stats.remote())["last_seq"] == stats["last_seq"]
        assert refs(ray.get(handle.state.remote()), A) == 199
        with pytest.raises(IdempotencyKeyReused):
            await registry.submit(CloseAndRelease(SessionKey(0, 0, 1)), key=close_key)

    run(scenario())


@pytest.mark.parametrize("point", ["mid_batch", "before_commit"])
def test_kill_in_the_middle_of_a_batch_loses_the_unacknowledged_batch_only(tmp_path: Path, point: str) -> None:
    handle, registry = new_actor(tmp_path)
    # The same reclaim-id salt as the actor's: the two registries must reach equal states.
    shadow = RegistryCore(tmp_path / "shadow.sqlite", id_salt=ray.get(handle.state.remote()).id_salt,
                          capability_key=parse_key(capability_key_file().read_text()))

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        await publish_shadow(shadow)
        assert await registry.state_digest() == shadow.state_digest()
        before = shadow.state_digest()

        batch = binds(1, 0, MAX_BATCH)
        marker = tmp_path / f"{point}.pid"
        ray.get(handle.arm_fault.remote(point, after_events=100, hold_s=60.0, marker=str(marker)))
        pending = handle.submit_batch.remote("batch-1", batch)  # the raw call: no client retry
        pid = wait_for_marker(marker)  # the actor wrote its own os.getpid(): it is busy holding the batch
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pending)

        # Never acknowledged, never durable: the restarted actor holds the state before the batch.
        assert await registry.state_digest() == before
        # The client retries with the same key: applied now, exactly once ...
        answers = await registry.submit_batch(batch, key="batch-1")
        assert not any(a.from_journal for a in answers) and len(answers) == MAX_BATCH
        expected = shadow.submit_batch("batch-1", batch)
        # The first differing answer, not the whole batch: pytest's diff of MAX_BATCH answers takes many minutes.
        assert next(((i, a, e) for i, (a, e) in enumerate(zip(answers, expected, strict=True)) if a != e),
                    None) is None
        after = await registry.state_digest()
        assert after == shadow.state_digest() != before
        # ... and a second retry is answered from the journal, changing nothing.
        replay = await registry.submit_batch(batch, key="batch-1")
        assert all(a.from_journal for a in replay) and [a.result for a in replay] == [a.result for a in answers]
        assert await registry.state_digest() == after
        assert refs(ray.get(handle.state.remote()), A) == MAX_BATCH

    run(scenario())


def test_kill_after_commit_before_reply_is_resolved_by_the_client_retry(tmp_path: Path) -> None:
    """The batch is durable but its reply is lost: the RayRegistry client retries the same key after the
    restart and gets the journal's answer; the state moved exactly once."""
    handle, registry = new_actor(tmp_path)
    # The same reclaim-id salt as the actor's: the two registries must reach equal states.
    shadow = RegistryCore(tmp_path / "shadow.sqlite", id_salt=ray.get(handle.state.remote()).id_salt,
                          capability_key=parse_key(capability_key_file().read_text()))

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        await publish_shadow(shadow)
        batch = binds(2, 0, 64)
        expected = shadow.submit_batch("batch-2", batch)
        marker = tmp_path / "after_commit.pid"
        ray.get(handle.arm_fault.remote("after_commit", hold_s=60.0, marker=str(marker)))
        call = asyncio.create_task(registry.submit_batch(batch, key="batch-2"))
        pid = await asyncio.to_thread(wait_for_marker, marker)
        os.kill(pid, signal.SIGKILL)
        answers = await call
        assert all(a.from_journal for a in answers)  # answered by the restarted actor, from its journal
        assert [a.result for a in answers] == [a.result for a in expected]
        assert await registry.state_digest() == shadow.state_digest()
        assert refs(ray.get(handle.state.remote()), A) == 64

    run(scenario())


def test_batch_limits_atomicity_and_journal_guards(tmp_path: Path) -> None:
    handle, registry = new_actor(tmp_path)

    async def scenario() -> None:
        await publish(registry, A, revision=0)
        digest, stats = await registry.state_digest(), ray.get(handle.journal_stats.remote())
        with pytest.raises(BatchTooLarge):
            await registry.submit_batch(binds(3, 0, MAX_BATCH + 1))
        with pytest.raises(BatchTooLarge):  # the actor refuses it too, for callers that skip the client
            ray.get(handle.submit_batch.remote("too-big", binds(3, 0, MAX_BATCH + 1)))
        # A pair no row covers (a bug) anywhere in a batch applies none of it.
        foreign = RecordReady(A, "attempt@0-1", "E9", 0, digest_of(A))
        with pytest.raises(ProtocolError):
            await registry.submit_batch([*binds(3, 0, 10), foreign, *binds(3, 10, 10)])
        # A call that changes nothing is answered without a journal row (no fsync).
        noop = await registry.submit(BindFirst(SessionKey(1, 0, 0)))  # another epoch: refused
        assert noop.journal_seq is None
        assert await registry.state_digest() == digest
        assert ray.get(handle.journal_stats.remote())["last_seq"] == stats["last_seq"]

    run(scenario())


def test_checkpointed_journal_recovers_in_process_and_refuses_another_config(tmp_path: Path) -> None:
    """The same class without Ray: a checkpoint bounds the replay; the recovered digest is the same."""
    path = tmp_path / "core.sqlite"
    core = RegistryCore(path, checkpoint_every=300, insecure=True)
    run(publish_shadow(core))
    for index in range(6):
        core.submit_batch(f"b{index}", binds(0, index * 100, 100))
    core.submit_batch("c0", [CloseAndRelease(SessionKey(0, 0, seq)) for seq in range(50)])
    digest, state = core.state_digest(), core.state()
    core.close()
    reopened = RegistryCore(path, checkpoint_every=300, insecure=True)
    assert reopened.state_digest() == digest == state_digest(reopened.state())
    assert reopened.state() == state
    stats = reopened.journal_stats()
    assert stats["checkpoint_seq"] > 0 and reopened.recovery.replayed_calls < stats["calls"]
    reopened.close()
    with pytest.raises(JournalConfigMismatch):
        RegistryCore(path, capacity=3, insecure=True)


def test_a_checkpoint_written_over_many_calls_recovers_the_state_it_was_taken_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slices of 16 records, one per call: a checkpoint of ~400 sessions takes ~25 later calls, which keep
    changing the state meanwhile. A crash before it is finished recovers from the journal alone; after it,
    from the checkpoint plus the later calls, to exactly the live state."""
    from versioned_lora.adapters import journal, registry_core

    monkeypatch.setattr(journal, "CHECKPOINT_SLICE", 16)
    monkeypatch.setattr(registry_core, "CHECKPOINT_BUDGET_S", 0.0)
    path = tmp_path / "core.sqlite"
    core = RegistryCore(path, checkpoint_every=400, insecure=True)
    run(publish_shadow(core))
    for index in range(4):
        core.submit_batch(f"b{index}", binds(0, index * 100, 100))
    assert core.journal_stats()["checkpoint_seq"] == 0  # begun, a slice written: not stored yet
    crashed = RegistryCore(path, checkpoint_every=400, insecure=True)  # what a restart now would see
    assert crashed.state() == core.state() and crashed.recovery.replayed_calls == crashed.journal_stats()["calls"]
    crashed.close()
    taken_at = core.journal_stats()["last_seq"]
    calls = 0
    while core.journal_stats()["checkpoint_seq"] == 0:
        core.submit_batch(f"c{calls}", [CloseAndRelease(SessionKey(0, 0, calls))])
        calls += 1
        assert calls < 100
    assert calls > 10 and core.journal_stats()["checkpoint_seq"] == taken_at
    state = core.state()
    core.close()
    reopened = RegistryCore(path, checkpoint_every=400, insecure=True)
    assert reopened.state() == state and reopened.recovery.replayed_calls == calls
    reopened.close()


def test_parts_of_superseded_checkpoints_are_deleted_a_few_per_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each checkpoint is stored as parts; once a newer one is stored, the older parts go, a few per call, and
    a reopened journal still recovers from the newest."""
    import sqlite3

    from versioned_lora.adapters import journal

    monkeypatch.setattr(journal, "CHECKPOINT_SLICE", 16)
    path = tmp_path / "core.sqlite"
    core = RegistryCore(path, checkpoint_every=200, insecure=True)
    run(publish_shadow(core))
    seqs_with_parts: set[int] = set()
    for index in range(12):
        core.submit_batch(f"b{index}", binds(0, index * 100, 100))
        with sqlite3.connect(path) as db:
            seqs_with_parts |= {seq for (seq,) in db.execute("SELECT DISTINCT seq FROM checkpoint_parts")}
    for index in range(40):  # calls with no new checkpoint: the stale parts drain
        core.submit_batch(f"c{index}", [CloseAndRelease(SessionKey(0, 0, index))])
    stored = core.journal_stats()["checkpoint_seq"]
    state = core.state()
    core.close()
    with sqlite3.connect(path) as db:
        left = {seq for (seq,) in db.execute("SELECT DISTINCT seq FROM checkpoint_parts")}
    assert len(seqs_with_parts) >= 3 and left == {stored}
    reopened = RegistryCore(path, checkpoint_every=200, insecure=True)
    assert reopened.state() == state
    reopened.close()


@pytest.mark.parametrize("tamper", ["checkpoint part", "checkpoint head", "call answers"])
def test_a_tampered_journal_refuses_to_recover(tmp_path: Path, tamper: str) -> None:
    """Recovery checks the checkpoint's digest over its parts and head, and every replayed answer against
    the stored one: a changed byte is JournalCorrupt, never a silently different state."""
    import sqlite3

    path = tmp_path / "core.sqlite"
    core = RegistryCore(path, checkpoint_every=150, insecure=True)
    run(publish_shadow(core))
    for index in range(3):
        core.submit_batch(f"b{index}", binds(0, index * 100, 100))
    core.submit_batch("late", binds(1, 0, 5))  # a call after the checkpoint, replayed on recovery
    assert 0 < core.journal_stats()["checkpoint_seq"] < core.journal_stats()["last_seq"]
    core.close()
    intact = RegistryCore(path, checkpoint_every=150, insecure=True)  # untampered, it recovers
    intact.close()
    db = sqlite3.connect(path)

    def flip_last_byte(table: str, column: str, where: str) -> None:
        (data,) = db.execute(f"SELECT {column} FROM {table} WHERE {where}").fetchone()
        changed = bytes(data[:-1]) + bytes([data[-1] ^ 1])
        db.execute(f"UPDATE {table} SET {column}=? WHERE {where}", (changed,))

    if tamper == "checkpoint part":
        flip_last_byte("checkpoint_parts", "data", "part=0")
    elif tamper == "checkpoint head":
        flip_last_byte("checkpoints", "state", "seq=(SELECT MAX(seq) FROM checkpoints)")
    else:  # the late call's answers name another adapter than the replay gives
        (answers,) = db.execute("SELECT answers FROM calls WHERE key='late'").fetchone()
        assert "relax_policy_lora@" in answers
        db.execute("UPDATE calls SET answers=? WHERE key='late'", (answers.replace("@0-A-", "@0-B-"),))
    db.commit()
    db.close()
    with pytest.raises(JournalCorrupt):
        RegistryCore(path, checkpoint_every=150, insecure=True)


async def publish_shadow(core: RegistryCore) -> None:
    from versioned_lora.adapters.ray_registry import LocalRegistry

    await publish(LocalRegistry(core), A, revision=0)


def test_journal_rows_read_back_exactly_whatever_their_values() -> None:
    """Rows are written by orjson; a value it refuses (an integer beyond 64 bits) takes the standard encoder,
    and both read back equal, integers exact."""
    value = (SessionKey(1, 2, 3), VersionKey(1, "A"), "é", 1.5, None, True, frozenset({"x", "y"}))
    assert loads(dumps_row(value)) == value
    huge = (SessionKey(1, 2, 2**70), 2**64 + 1)
    assert loads(dumps_row(huge)) == huge
