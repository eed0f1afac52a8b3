"""EngineLink.connect forms the two-rank group with both sides joining at once; a side that fails ends the join
at once instead of leaving the other to wait out its group timeout. The failures are injected (a real rank 0
fails to form only on faults a test cannot produce on demand, e.g. its port taken by another socket); the
successful join against a real engine runs in every e2e test."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from versioned_lora.adapters import engine_link
from versioned_lora.adapters.engine_link import EngineLink
from versioned_lora.runtime.interfaces import EngineRefused

GUARD_S = 60  # far below the join's timeout below: hitting it means connect waited for the other side


class EngineThatNeverJoins:
    """A status answer, then an init_group that waits until cancelled (records that it was)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.cancelled, self.asked = refuse, False, False

    async def status(self) -> dict[str, Any]:
        return {"incarnation": 7}

    async def managed(self, operation: str, **body: Any) -> dict[str, Any]:
        assert operation == "init_group" and body["master_port"] > 0
        self.asked = True
        if self.refuse:
            raise EngineRefused("BAD_REQUEST", "init_group refused")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return {}


def connect(client: Any, release: threading.Event | None = None) -> EngineLink:
    loop = asyncio.new_event_loop()  # not asyncio.run, which would join a still-waiting rank 0 thread first
    try:
        return loop.run_until_complete(asyncio.wait_for(EngineLink.connect(client, timeout_s=3600), GUARD_S))
    finally:
        if release is not None:
            release.set()
        loop.close()


def test_injected_rank_zero_failure_ends_the_join_and_cancels_the_engines_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fails(**kwargs: Any) -> Any:
        raise RuntimeError("rank 0 could not form its side")

    monkeypatch.setattr(engine_link, "init_transfer_group", fails)
    engine = EngineThatNeverJoins()
    with pytest.raises(RuntimeError, match="rank 0 could not form its side"):
        connect(engine)
    assert engine.asked and engine.cancelled


def test_injected_engine_refusal_ends_the_join_without_waiting_for_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Event()

    def waits_for_a_peer(**kwargs: Any) -> Any:
        released.wait(GUARD_S * 2)  # a rank 0 whose peer never comes: joins only at its timeout
        raise RuntimeError("rank 0 timed out")

    monkeypatch.setattr(engine_link, "init_transfer_group", waits_for_a_peer)
    with pytest.raises(EngineRefused, match="init_group refused"):
        connect(EngineThatNeverJoins(refuse=True), release=released)
