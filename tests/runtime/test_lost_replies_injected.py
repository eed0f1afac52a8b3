"""Lost registry replies past their deadlines, injected, with the real core behind a `LocalRegistry` and
engine ports that record every call (a double: these tests are about what the Publisher and Reclaimer
do with an unknown outcome, which a real registry cannot produce on demand). The same faults run end to
end on real engines and the Ray actor in `tests/e2e/test_unknown_outcomes.py`.

The rule under test (RFC §3.4, DESIGN.md §1): a call whose reply is lost may have landed. Its outcome is
unknown: it keeps the resource and the capacity, nothing is cleaned or reclaimed on the strength of it,
and it is resolved only by the same call under the same key.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from versioned_lora.adapters.ray_registry import LocalRegistry
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.dispatch_gate import DispatchGate, VersionUnavailable
from versioned_lora.runtime.interfaces import EngineRefused, ReadyReceipt, RegistryUnavailable, ServedIdentity
from versioned_lora.runtime.publisher import Publisher, PublisherRefusal, PublishStatus
from versioned_lora.runtime.reclaimer import Reclaimer, ReclaimStatus
from versioned_lora.runtime.session_binder import SessionBinder
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.states import VersionState

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

ENGINES = ("E0", "E1")


@attrs.frozen
class FakeCandidate:
    lora_name: str
    digest: str
    bucket_count: int = 2

    def served_identity(self) -> ServedIdentity:
        # A double's own: what its engines below read back (the real check is runtime/served_check.py's).
        return ServedIdentity("bfloat16", self.digest, "{}")


def candidate(label: str) -> tuple[VersionKey, FakeCandidate]:
    version = VersionKey(0, label)
    digest = (label.encode().hex() * 64)[:64]
    return version, FakeCandidate(lora_name(version, digest), digest)


class RecordingEngine:
    """Accepts every staging call and records it; `end` answers READY in incarnation 0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str]] = []

    async def incarnation(self) -> int:
        return 0

    async def begin(self, candidate: Any, attempt_token: str) -> None:
        self.calls.append(("begin", candidate.lora_name))

    async def transfer_bucket(self, candidate: Any, attempt_token: str, index: int) -> None:
        self.calls.append(("bucket", candidate.lora_name))

    async def end(self, candidate: Any, attempt_token: str) -> ReadyReceipt:
        self.calls.append(("end", candidate.lora_name))
        return ReadyReceipt(candidate.lora_name, candidate.digest, attempt_token, 0, 7, -1.0, (-1.0, -2.0),
                            candidate.served_identity())

    def drop_link(self) -> None:
        self.calls.append(("drop_link", ""))

    def expect_registry_keys(self, key_ids: tuple[str, ...]) -> None:
        pass  # a double of the engine: no key of its own to compare

    async def cleanup(self, lora_name: str, attempt_token: str, capability: str | None = None) -> None:
        self.calls.append(("cleanup", lora_name))

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float, capability: str | None = None) -> bool:
        self.calls.append(("reclaim", lora_name))
        return True

    def destructive(self) -> list[tuple[str, str]]:
        return [call for call in self.calls if call[0] in ("cleanup", "reclaim")]


class LosesReplies:
    """A registry port that applies every call but loses the reply to calls whose key starts with
    `prefix` until `until` (monotonic seconds), as a registry unreachable for that long would."""

    def __init__(self, inner: LocalRegistry, prefix: str, lose_for_s: float) -> None:
        self.inner = inner
        self.prefix = prefix
        self.until = time.monotonic() + lose_for_s
        self.lost: list[str] = []
        self.applied_before_loss: list[bool] = []

    async def submit(self, event: Any, key: str | None = None) -> Any:
        answer = await self.inner.submit(event, key=key)
        if key is not None and key.startswith(self.prefix) and time.monotonic() < self.until:
            self.lost.append(key)
            # The request landed, only its reply is lost: the journal holds the key.
            self.applied_before_loss.append(self.inner.core.journal_has(key))
            raise RegistryUnavailable(f"injected: reply to {key} lost")
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def deployment(tmp_path: Path) -> tuple[LocalRegistry, dict[str, RecordingEngine]]:
    # Insecure (no key): the engines are doubles, which check no capability.
    registry = LocalRegistry(RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, insecure=True))
    return registry, {name: RecordingEngine(name) for name in ENGINES}


def publisher(registry: Any, engines: dict[str, RecordingEngine], **deadlines: float) -> Publisher:
    return Publisher(registry, engines, lambda *_: True, Deadlines(**deadlines))


def test_injected_lost_commit_reply_past_its_deadline_keeps_the_committed_default(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version, a = candidate("A")
        lossy = LosesReplies(registry, "commit:", lose_for_s=1.5)
        pub = publisher(lossy, engines, commit=0.3)

        outcome = await pub.publish(a_version, a)
        assert (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN")
        assert lossy.lost and all(lossy.applied_before_loss)  # the commit landed before the deadline fired
        view = await registry.publication_view()
        assert view.default == a_version and view.versions[a_version].state is VersionState.PUBLISHED
        assert pub.commit_unresolved
        # A second publication is refused by the publisher itself until the commit's outcome is known.
        b_version, b = candidate("B")
        refused = await pub.publish(b_version, b)
        assert (refused.status, refused.reason) == (PublishStatus.REJECTED, PublisherRefusal.COMMIT_UNRESOLVED)
        assert b_version not in (await registry.publication_view()).versions

        resolved = await pub.resolve()  # the same commit key, retried until answered (from the journal)
        assert resolved is not None and resolved.committed and resolved.default_revision == 1
        assert not pub.commit_unresolved
        assert all(engine.destructive() == [] for engine in engines.values())  # nothing cleaned or unloaded
        assert (await registry.publication_view()).default_revision == 1  # applied exactly once
        # The rows that decided it: the deadline made it unknown, the lost replies were retried, never aborted.
        fired = pub.settle_loops[-1].fired
        assert (fired[0], fired[-1]) == ("settle.commit", "commit.committed")
        assert {"commit.lost", "commit.deadline"} <= set(fired) and not any(r.startswith("abort.") for r in fired)
        assert (await pub.publish(b_version, b)).committed

    asyncio.run(body())


def test_injected_commit_survives_the_callers_cancellation(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version, a = candidate("A")
        lossy = LosesReplies(registry, "commit:", lose_for_s=1.0)
        pub = publisher(lossy, engines, commit=30.0)
        task = asyncio.create_task(pub.publish(a_version, a))
        while not lossy.lost:
            await asyncio.sleep(0.01)
        task.cancel()  # the caller gives up while the commit's reply is lost
        try:
            await task
        except asyncio.CancelledError:
            pass
        resolved = await pub.resolve()
        assert resolved is not None and resolved.committed
        assert all(engine.destructive() == [] for engine in engines.values())

    asyncio.run(body())


def test_injected_lost_abort_reply_cleans_nothing_until_the_same_abort_is_answered(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        z_version, z = candidate("Z")
        a_version, a = candidate("A")
        lossy = LosesReplies(registry, "abort:", lose_for_s=1.0)
        pub = publisher(lossy, engines, commit=0.3, abort=0.3)
        assert (await pub.publish(z_version, z)).committed  # an earlier, resolved commit of this publisher
        engines["E1"].end = _refuse_end  # type: ignore[method-assign]  # a certain failure before commit
        outcome = await pub.publish(a_version, a)
        assert outcome.status is PublishStatus.UNKNOWN
        assert lossy.lost and all(lossy.applied_before_loss)
        assert (await registry.publication_view()).versions[a_version].state is VersionState.ABORTED
        assert all(engine.destructive() == [] for engine in engines.values())  # no cleanup on a lost answer

        await asyncio.sleep(1.0)
        recovered = await pub.recover()  # the same abort key, answered from the journal with its cleanups
        assert [(o.version, o.status) for o in recovered] == [(a_version, PublishStatus.FAILED_CLEAN)]
        assert all(engine.destructive() == [("cleanup", a.lora_name)] for engine in engines.values())

    asyncio.run(body())


async def _refuse_end(candidate: Any, attempt_token: str) -> ReadyReceipt:
    raise EngineRefused("MANIFEST_MISMATCH", "injected")


def test_injected_refused_abort_after_a_landed_commit_cleans_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version, a = candidate("A")
        pub = publisher(registry, engines)
        outcome = await pub.publish(a_version, a)
        assert outcome.committed
        # A stray abort of the committed attempt (a confused caller, a replayed message): abort.after_commit.
        status = await pub.abort_and_clean(a_version, outcome.attempt_token or "", {})
        assert status is PublishStatus.UNKNOWN
        assert all(engine.destructive() == [] for engine in engines.values())
        assert (await registry.publication_view()).default == a_version

    asyncio.run(body())


async def _published_and_retired(registry: LocalRegistry, engines: dict[str, RecordingEngine]) -> VersionKey:
    pub = publisher(registry, engines)
    a_version, a = candidate("A")
    b_version, b = candidate("B")
    assert (await pub.publish(a_version, a)).committed
    assert (await pub.publish(b_version, b)).committed
    return a_version


def test_injected_lost_claim_reply_reclaims_nothing_until_the_same_claim_is_answered(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version = await _published_and_retired(registry, engines)
        lossy = LosesReplies(registry, "claim:", lose_for_s=1.0)
        reclaimer = Reclaimer(lossy, engines, Deadlines(commit=0.3))
        outcome = await reclaimer.reclaim(a_version)
        assert (outcome.status, outcome.reason) == (ReclaimStatus.UNKNOWN, "CLAIM_OUTCOME_UNKNOWN")
        assert lossy.lost and all(lossy.applied_before_loss)
        assert (await registry.publication_view()).versions[a_version].state is VersionState.RECLAIMING
        assert all(engine.destructive() == [] for engine in engines.values())

        await asyncio.sleep(1.0)
        done = await reclaimer.reclaim(a_version)
        assert done.status is ReclaimStatus.RECLAIMED and set(done.confirmed) == set(ENGINES)
        name = (await registry.publication_view()).versions[a_version].lora_name
        assert all(engine.destructive() == [("reclaim", name)] for engine in engines.values())

    asyncio.run(body())


def test_injected_engines_an_answered_claim_tells_the_process_gate_at_once_a_lost_one_does_not(
        tmp_path: Path) -> None:
    """A gate whose cached view is an hour fresh still refuses a version the moment this process's Reclaimer
    has its claim answered; a claim whose reply was lost tells it nothing (the engines refuse in the meantime)."""
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version = await _published_and_retired(registry, engines)
        gate, told = DispatchGate(registry, max_staleness_s=3600.0), DispatchGate(registry, max_staleness_s=3600.0)
        assert await gate.check(a_version) == await told.check(a_version) == frozenset(ENGINES)  # RETIRED, cached

        lossy = LosesReplies(registry, "claim:", lose_for_s=1.0)
        assert (await Reclaimer(lossy, engines, Deadlines(commit=0.3), gate=told).reclaim(a_version)).status \
            is ReclaimStatus.UNKNOWN
        assert await told.check(a_version) == frozenset(ENGINES)  # unknown: not told, the cached view stands

        await asyncio.sleep(1.0)
        done = await Reclaimer(registry, engines, Deadlines(), gate=told).reclaim(a_version)
        assert done.status is ReclaimStatus.RECLAIMED
        with pytest.raises(VersionUnavailable):
            await told.check(a_version)
        assert await gate.check(a_version) == frozenset(ENGINES)  # a gate no reclaimer told: stale for its window

    asyncio.run(body())


def test_injected_lost_confirm_replies_are_resolved_by_the_same_confirms(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version = await _published_and_retired(registry, engines)
        lossy = LosesReplies(registry, "confirm:", lose_for_s=1.0)
        reclaimer = Reclaimer(lossy, engines, Deadlines(commit=0.3, reclaim=30.0))
        outcome = await reclaimer.reclaim(a_version)
        # The confirms landed, only their replies were lost: within the reclaim deadline the driver sends
        # the same confirm keys again (row confirm.lost), answered from the journal.
        assert set(lossy.lost) == {f"confirm:{outcome.reclaim_id}:{e}" for e in ENGINES}
        assert all(lossy.applied_before_loss)
        assert reclaimer.last_loop is not None and "confirm.lost" in reclaimer.last_loop.fired
        assert (outcome.status, outcome.confirmed) == (ReclaimStatus.RECLAIMED, tuple(ENGINES))
        again = await reclaimer.reclaim(a_version)
        # The same claim key: answered from the journal, it names the same engines and reclaim id again.
        assert (again.status, again.confirmed, again.reclaim_id) == (ReclaimStatus.RECLAIMED, tuple(ENGINES),
                                                                    outcome.reclaim_id)

    asyncio.run(body())


def test_injected_confirm_replies_lost_past_the_reclaim_deadline_leave_it_pending(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version = await _published_and_retired(registry, engines)
        lossy = LosesReplies(registry, "confirm:", lose_for_s=1.5)
        reclaimer = Reclaimer(lossy, engines, Deadlines(commit=0.3, reclaim=0.5))
        outcome = await reclaimer.reclaim(a_version)
        # No confirm answer in time: no engine counts as confirmed and the outcome is PENDING, although the
        # registry (which did apply the confirms) has it RECLAIMED; the next reclaim learns that.
        assert all(lossy.applied_before_loss)
        assert (outcome.status, outcome.confirmed) == (ReclaimStatus.PENDING, ())
        assert (await registry.version_states([a_version]))[a_version] is VersionState.RECLAIMED
        await asyncio.sleep(1.5)
        again = await reclaimer.reclaim(a_version)
        assert again.status is ReclaimStatus.RECLAIMED

    asyncio.run(body())


def test_injected_lost_bind_and_close_replies_are_resolved_by_the_same_keys(tmp_path: Path) -> None:
    """A lost `bind_first` reply: the binding is unknown, nothing is dispatched, and the retry (same key)
    returns the same version with one session ref. Lost `begin_close`/`close` replies: the retried
    `finish` reuses its keys, so the ref is released exactly once."""

    async def body() -> None:
        registry, engines = deployment(tmp_path)
        pub = publisher(registry, engines)
        a_version, a = candidate("A")
        assert (await pub.publish(a_version, a)).committed
        lossy = LosesReplies(registry, "bind:", lose_for_s=0.5)
        # The caller is told UNKNOWN after 0.2 s; the driver goes on retrying the same key until answered.
        binder = SessionBinder(lossy, backend=None, epoch=0, shard=0,  # type: ignore[arg-type]  # no generation here
                               deadlines=Deadlines(report=0.2))
        key = binder.open("s1")
        with pytest.raises(RegistryUnavailable):
            await binder.bind_first(key)
        assert binder.record(key).binding is None  # type: ignore[union-attr]  # unknown: nothing to dispatch with
        assert registry.core.state().session_refs.get(a_version) == 1  # it did land
        await asyncio.sleep(0.5)
        binding = await binder.bind_first(key)
        assert binding.version == a_version and registry.core.state().session_refs.get(a_version) == 1

        for prefix in ("bclose:", "close:"):
            other = binder.open(f"s-{prefix}")
            await binder.bind_first(other)
            lossy.prefix, lossy.until = prefix, time.monotonic() + 0.5
            with pytest.raises(RegistryUnavailable):
                await binder.finish(other)
            await asyncio.sleep(0.5)
            refs = registry.core.state().session_refs.get(a_version, 0)
            assert refs == (2 if prefix == "bclose:" else 1)  # a lost close reply: the close itself landed
            report = await binder.finish(other)  # the same keys: after a lost close, answered from the journal
            assert report.released and registry.core.state().session_refs.get(a_version) == 1
        report = await binder.finish(key)
        assert report.released and registry.core.state().session_refs.get(a_version, 0) == 0

    asyncio.run(body())


def test_a_candidate_whose_name_is_not_its_versions_is_refused_before_reserve(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        a_version, a = candidate("A")
        wrong = attrs.evolve(a, lora_name=a.lora_name.replace("-A-", "-B-"))
        refused = await publisher(registry, engines).publish(a_version, wrong)
        assert (refused.status, refused.reason) == (PublishStatus.REJECTED, PublisherRefusal.NAME_MISMATCH)
        assert (await registry.publication_view()).versions == {}  # nothing reserved
        assert all(engine.calls == [] for engine in engines.values())

    asyncio.run(body())


class HangsOnBucket(RecordingEngine):
    """E1: bucket 1 never answers (a gloo send stuck in its collective)."""

    async def transfer_bucket(self, candidate: Any, attempt_token: str, index: int) -> None:
        await super().transfer_bucket(candidate, attempt_token, index)
        if index == 1:
            await asyncio.Event().wait()


def test_injected_bucket_past_its_deadline_drops_the_link_and_the_attempt_is_aborted(tmp_path: Path) -> None:
    """Rows bucket.deadline (the link is dropped: its group may hold a half-done send) and stage.failed, run by the
    real executor: only E1's link is dropped, no engine gets an `end`, and both get the cleanup the abort's answer
    names."""

    async def body() -> None:
        registry, engines = deployment(tmp_path)
        engines["E1"] = HangsOnBucket("E1")
        a_version, a = candidate("A")
        outcome = await publisher(registry, engines, bucket=0.5).publish(a_version, a)
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "PhaseDeadlineMissed")
        assert "phase bucket_1 missed its 0.5s deadline" in outcome.detail
        assert ("drop_link", "") in engines["E1"].calls and ("drop_link", "") not in engines["E0"].calls
        for engine in engines.values():
            ops = [op for op, _ in engine.calls]
            assert ops[:3] == ["begin", "bucket", "bucket"] and "end" not in ops and ops[-1] == "cleanup"

    asyncio.run(body())
