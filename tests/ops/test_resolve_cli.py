"""`versioned-lora resolve` settles an unknown commit outcome left by a publisher that lost the registry at its
commit and then died (injected: its commit requests never reach the registry), through the Publisher's
recovery, under the very key the lost commit used."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from engine_helpers import run
from ops_helpers import cli, connection_args
from test_publication_e2e import deployed

from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import RegistryUnavailable
from versioned_lora.runtime.publisher import DEFAULT_HOLDER, PublishStatus, UnknownReason


class DroppedCommits:
    """Fault injection: a registry port on which every commit request is lost before it reaches the actor."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.dropped: list[str] = []

    async def submit(self, event: Any, key: str | None = None) -> Any:
        if key is not None and key.startswith("commit:"):
            self.dropped.append(key)
            raise RegistryUnavailable(f"injected: commit request {key} lost")
        return await self.inner.submit(event, key=key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_resolve_settles_an_injected_unknown_commit_outcome_under_the_same_key(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            conn = connection_args(d, tmp_path)
            nothing = await cli("resolve", *conn)
            assert nothing.code == 0 and nothing.receipt() == {"resolved": [], "exit": 0}, nothing.stdout
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed

            lossy = DroppedCommits(d.registry)
            d.publisher.registry = lossy
            d.publisher.deadlines = Deadlines(commit=0.5)
            outcome = await d.publisher.publish(b_version, b)
            assert (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, UnknownReason.COMMIT_OUTCOME_UNKNOWN)
            # The publisher dies: its background retry of the commit ends with it.
            task = d.publisher._commit_task
            assert task is not None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            lost_key = lossy.dropped[0]
            fence = d.publisher.fence
            assert lost_key == f"commit:{outcome.attempt_token}:1:{fence}" and set(lossy.dropped) == {lost_key}
            assert not await d.handle.journal_has.remote(lost_key)

            status = (await cli("status", "--json", *connection_args(d, tmp_path, token=False))).json()
            assert [(x["kind"], x["version"], x["run"]) for x in status["blocking"]] == [
                ("READY_UNCOMMITTED", "B", "versioned-lora resolve"),
                ("CAPACITY_FULL", None, "versioned-lora reclaim")]
            assert status["registry"]["default"]["version_id"] == "A"

            # The dead publisher's successor resolves it under the same holder name (a restarted trainer): it keeps
            # the lease's fence (lease.acquire_replay), so its commit is the very call the lost one was.
            resolved = await cli("resolve", "--holder", DEFAULT_HOLDER, *conn)
            assert resolved.code == 0, resolved.stdout + resolved.stderr
            assert resolved.receipt()["resolved"] == [
                {"version_id": "B", "action": "publication", "status": "COMMITTED", "reason": None}]
            assert await d.handle.journal_has.remote(lost_key)  # the same commit, under the same key
            view = await d.registry.publication_view()
            assert view.default == VersionKey(d.epoch, "B") and view.default_revision == 2
            status = (await cli("status", "--json", *connection_args(d, tmp_path, token=False))).json()
            assert [x["kind"] for x in status["blocking"]] == ["CAPACITY_FULL"]

    run(body())
