"""The restart supervisor leaves the attempt its own Publisher is staging to that Publisher: an engine restart
reported in the middle of a publication (injected: the engine double's incarnation changes between two buckets,
and the supervisor runs right there) stages nothing a second time. The real core is behind a `LocalRegistry`; the
supervisor's rehydrates on real engines are tests/e2e/test_engine_kills.py's and test_routing_by_table.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_lost_replies_injected import RecordingEngine, candidate, deployment
from test_recover_from_the_store import HeldDigests

from versioned_lora.lifecycle.effects import StageOnEngine
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import Publisher, PublishStatus
from versioned_lora.runtime.supervisor import Reconciled, RestartSupervisor


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
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, "EngineRefused"), outcome

    asyncio.run(body())
