"""The restart supervisor (the `supervise` driver run by `runtime/supervisor.py`) with injected faults: it leaves
the attempt its own Publisher is staging to that Publisher (an engine restart reported in the middle of a
publication: the engine double's incarnation changes between two buckets, and the supervisor runs right there);
an adoption whose reply is lost past its deadline stages nothing until reconciled again; a version READY there
already is not staged twice; a snapshot missing from the store fails its rehydrate and says why. The real core is
behind a `LocalRegistry`; the supervisor's rehydrates on real engines are tests/e2e/test_engine_kills.py's and
test_routing_by_table.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_lost_replies_injected import LosesReplies, RecordingEngine, candidate, deployment
from test_recover_from_the_store import HeldDigests

from versioned_lora.lifecycle.effects import StageOnEngine
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import ReadyReceipt
from versioned_lora.runtime.publisher import Publisher, PublishStatus
from versioned_lora.runtime.supervisor import Reconciled, ReconcileStatus, RestartSupervisor


class RestartsAfterFirstBucket(RecordingEngine):
    """E1: after its first bucket it "restarts" (a new incarnation), and the supervisor is run at that moment."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.incarnation_now = 0
        self.supervisor: RestartSupervisor | None = None
        self.reconciled: list[Reconciled] = []

    async def incarnation(self) -> int:
        return self.incarnation_now

    async def transfer_bucket(self, candidate: Any, attempt_token: str, index: int) -> None:
        await super().transfer_bucket(candidate, attempt_token, index)
        if index == 0 and self.supervisor is not None:
            self.incarnation_now = 1
            self.reconciled.append(await self.supervisor.reconcile(self.name))


def test_injected_restart_mid_publication_leaves_the_in_flight_attempt_to_its_publisher(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        e1 = engines["E1"] = RestartsAfterFirstBucket("E1")
        version, shipped = candidate("A")
        publisher = Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=HeldDigests())
        e1.supervisor = RestartSupervisor(publisher)
        outcome = await publisher.publish(version, shipped)

        (reconciled,) = e1.reconciled
        assert (reconciled.engine, reconciled.incarnation, reconciled.rehydrated, reconciled.failed) == (
            "E1", 1, (), ())
        (left,) = reconciled.left
        assert isinstance(left, StageOnEngine) and left.version == version and left.engine == "E1"
        assert left.attempt_token == outcome.attempt_token  # the attempt being published, not a rehydrate
        assert [kind for kind, _ in e1.calls].count("begin") == 1  # the supervisor began nothing
        # E1's READY is of the old incarnation: the registry refuses it, so the attempt is aborted and cleaned.
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "STALE_INCARNATION"), outcome

    asyncio.run(body())


class Restartable(RecordingEngine):
    """An engine whose incarnation the test moves (a restart), answering `end` in the incarnation it runs."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.incarnation_now = 0

    async def incarnation(self) -> int:
        return self.incarnation_now

    async def end(self, candidate: Any, attempt_token: str) -> ReadyReceipt:
        self.calls.append(("end", candidate.lora_name))
        return ReadyReceipt(candidate.lora_name, candidate.digest, attempt_token, self.incarnation_now, 7, -1.0,
                            (-1.0, -2.0), candidate.served_identity())


class Holds:
    """A snapshot store holding the candidates it was given (SnapshotStorePort; the real store's reads and writes,
    verified by digest, are tests/adapters/test_snapshot_store.py's)."""

    def __init__(self) -> None:
        self.candidates: dict[str, Any] = {}

    def put_candidate(self, candidate: Any) -> None:
        self.candidates[candidate.digest] = candidate

    def holds(self, digest: str) -> bool:
        return digest in self.candidates

    def candidate(self, digest: str, lora_name: str) -> Any:
        return self.candidates[digest]


def test_injected_restart_report_lost_past_its_deadline_stages_nothing_until_reconciled_again(tmp_path: Path) -> None:
    """The adoption's reply lost past its deadline: UNKNOWN, nothing staged on the strength of it (row
    adopt.deadline). Reconciling again sends the same key, answered from the journal: A is rehydrated once. A third
    reconcile finds A READY there (row placement.ready) and stages nothing twice."""

    async def body() -> None:
        registry, engines = deployment(tmp_path)
        e1 = engines["E1"] = Restartable("E1")
        version, shipped = candidate("A")
        publisher = Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=Holds())
        assert (await publisher.publish(version, shipped)).status is PublishStatus.COMMITTED
        e1.incarnation_now, e1.calls = 1, []

        lossy = LosesReplies(registry, "incarnation:", lose_for_s=1.0)
        supervisor = RestartSupervisor(Publisher(lossy, engines, lambda *_: True, Deadlines(report=0.3),
                                                 snapshots=publisher.snapshots))
        first = await supervisor.reconcile("E1")
        assert (first.status, first.incarnation, first.rehydrated, first.failed) == (
            ReconcileStatus.UNKNOWN, 1, (), ())
        assert lossy.applied_before_loss and all(lossy.applied_before_loss)  # the request landed, its reply did not
        assert e1.calls == []  # nothing staged on an adoption not known to have landed
        assert (await registry.dispatch_view([version]))[version].engines == {"E0"}  # and nothing routed to E1

        await asyncio.sleep(1.0)  # the registry is reachable again
        second = await supervisor.reconcile("E1")
        assert (second.status, second.rehydrated, second.failed) == (ReconcileStatus.RECONCILED, (version,), ())
        assert [kind for kind, _ in e1.calls] == ["begin", "bucket", "bucket", "end"]
        assert (await registry.dispatch_view([version]))[version].engines == {"E0", "E1"}

        third = await supervisor.reconcile("E1")
        assert (third.status, third.rehydrated) == (ReconcileStatus.RECONCILED, (version,))
        assert supervisor.last_loop is not None and "placement.ready" in supervisor.last_loop.fired
        assert len(e1.calls) == 4  # nothing staged twice

    asyncio.run(body())


def test_injected_rehydrate_without_the_snapshot_fails_and_says_why(tmp_path: Path) -> None:
    """The store lost the version's snapshot: the rehydrate fails (row rehydrate.refused), the engine stays short
    of READY for it (no request routed there), and the reason names the missing snapshot."""

    async def body() -> None:
        registry, engines = deployment(tmp_path)
        e1 = engines["E1"] = Restartable("E1")
        version, shipped = candidate("A")
        store = Holds()
        publisher = Publisher(registry, engines, lambda *_: True, Deadlines(), snapshots=store)
        assert (await publisher.publish(version, shipped)).status is PublishStatus.COMMITTED
        store.candidates.clear()
        e1.incarnation_now = 1
        reconciled = await RestartSupervisor(publisher).reconcile("E1")
        assert (reconciled.status, reconciled.rehydrated) == (ReconcileStatus.RECONCILED, ())
        ((failed, why),) = reconciled.failed
        assert failed == version and why.startswith("KeyError"), why
        assert (await registry.dispatch_view([version]))[version].engines == {"E0"}

    asyncio.run(body())
