"""Every key a Publisher sends is derived from driver state and from what its rows read (issue 43): no uuid, no clock.
Two Publishers stepped from the same driver state (`PublisherState`) against registries with the same history send the
same calls under the same keys; and a publisher idle for longer than `max_no_progress` still acquires the lease (its
acquire has a deadline of its own) and publishes. The real core behind a `LocalRegistry`, engine ports that record
every call (a double: `test_lost_replies_injected.RecordingEngine`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from immutables import Map
from test_lost_replies_injected import ENGINES, RecordingEngine, candidate

from versioned_lora.adapters.ray_registry import LocalRegistry
from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import LeaseGranted, drivers
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import Publisher, PublishStatus


class RecordsKeys:
    """A registry port that records the key of every call it passes on, each answered after `latency_s` (as a
    registry in another process is: an in-process one answers before a timer due now could fire)."""

    def __init__(self, inner: LocalRegistry, latency_s: float = 0.0) -> None:
        self.inner = inner
        self.latency_s = latency_s
        self.keys: list[str] = []

    async def submit(self, event: Any, key: str | None = None) -> Any:
        self.keys.append(str(key))
        await asyncio.sleep(self.latency_s)
        return await self.inner.submit(event, key=key)

    async def publication_view(self) -> Any:
        await asyncio.sleep(self.latency_s)
        return await self.inner.publication_view()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _keys_of_a_publication(tmp: Path, state: drivers.PublisherState) -> tuple[list[str], PublishStatus]:
    registry = RecordsKeys(LocalRegistry(RegistryCore(tmp / "journal.sqlite", engines=ENGINES, insecure=True)))
    publisher = Publisher(registry, {name: RecordingEngine(name) for name in ENGINES}, lambda *_: True,
                          state=state)
    a_version, a = candidate("A")
    outcome = await publisher.publish(a_version, a)
    return registry.keys, outcome.status


def test_injected_two_publishers_stepped_from_the_same_driver_state_derive_the_same_reserve_and_lease_keys(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        a_version, a = candidate("A")
        unknown = drivers.PublisherState(Map({(a_version, a.digest): "reserve:left-unknown-by-a-crashed-run"}))
        for label, state in (("fresh", drivers.PublisherState()), ("unknown", unknown)):
            (tmp_path / f"{label}-1").mkdir()
            (tmp_path / f"{label}-2").mkdir()
            first, status = await _keys_of_a_publication(tmp_path / f"{label}-1", state)
            second, again = await _keys_of_a_publication(tmp_path / f"{label}-2", state)
            assert status is again is PublishStatus.COMMITTED
            assert first == second, (first, second)
            lease = next(k for k in first if k.startswith("lease:"))
            reserve = next(k for k in first if k.startswith("reserve:"))
            assert lease == "lease:publisher:0"  # the fence read: none granted yet
            if state is unknown:  # the reserve left unknown is sent again under its key (row reserve.deadline)
                assert reserve == "reserve:left-unknown-by-a-crashed-run"
            else:  # derived from the version's last attempt the registry held: none
                assert reserve == f"reserve:0:A:{a.digest}:none"

    asyncio.run(body())


def test_injected_a_publisher_idle_longer_than_max_no_progress_acquires_the_lease_and_publishes(
    tmp_path: Path,
) -> None:
    """The acquire's deadline is its own (`Deadlines.acquire`, row keeper.start), not what is left of a publication's
    no-progress bound: before, a publisher idle for longer than `max_no_progress` failed `acquire_lease()` at once."""

    async def body() -> None:
        core = RegistryCore(tmp_path / "journal.sqlite", engines=ENGINES, insecure=True)
        registry = RecordsKeys(LocalRegistry(core), 0.05)
        publisher = Publisher(registry, {name: RecordingEngine(name) for name in ENGINES}, lambda *_: True,
                              Deadlines(max_no_progress=0.2))
        await asyncio.sleep(0.5)  # idle, longer than max_no_progress
        granted = await publisher.acquire_lease()
        assert isinstance(granted, LeaseGranted) and publisher.fence == granted.fence
        await asyncio.sleep(0.5)
        a_version, a = candidate("A")
        assert (await publisher.publish(a_version, a)).committed
        assert (await registry.publication_view()).default == a_version

    asyncio.run(body())
