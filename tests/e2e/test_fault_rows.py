"""RFC §7.1 fault rows end to end on real engines and a real Ray registry actor.

Faults a real process cannot produce on demand are injected and named as such: a held sender (the
port stops after bucket i), a lost commit reply (`LostReplyInjector`). Everything else is real:
`kill -9` of an engine's server and scheduler, of the registry actor's worker, of a publisher process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deployment import Deployment
from engine_helpers import PROMPT, TEST_TOKEN, run
from held_transfer import HeldAfterBucket
from lease_helpers import fence_of
from test_publication_e2e import deployed

from versioned_lora.lifecycle import RecordReady, Reserve
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import RegistryUnavailable
from versioned_lora.spec.states import VersionState


def _kill_actor_worker(d: Deployment) -> None:
    import ray

    os.kill(ray.get(d.handle.pid.remote()), signal.SIGKILL)


def test_engine_killed_mid_transfer_keeps_old_default_then_cleans_after_restart(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            d.publisher.deadlines = Deadlines(bucket=6.0, cleanup=10.0)
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            session = d.binder.open("S_a@E0")
            before = await d.binder.generate(session, PROMPT, 6)

            b_version, b = d.candidate("B")
            assert b.bucket_count >= 3
            e1 = HeldAfterBucket(d.ports["E1"], after=1)  # injected: the sender holds E1's transfer after bucket 1
            d.publisher.engines["E1"] = e1
            publication = asyncio.create_task(d.publisher.publish(b_version, b))
            await asyncio.wait_for(e1.held.wait(), 60)
            stashes = (await d.clients["E1"].status())["staging"]["stashes"]
            assert [s["received"] for s in stashes.values()] == [[0, 1]]  # bucket 1 is stashed on E1

            engines.e1.kill_hard()  # kill -9 of E1's server, scheduler and detokenizer
            outcome = await publication
            assert outcome.status == "UNKNOWN", outcome  # E1's cleanup cannot be confirmed
            view = await d.registry.publication_view()
            assert view.default == a_version
            assert view.versions[b_version].state is VersionState.ABORTED
            assert view.managed_count() == 2  # the candidate keeps its slot until both engines confirm

            # The old default keeps serving on E0 with unchanged numbers.
            again = await d.binder.generate(session, PROMPT, 6)
            assert (again.output_ids, again.logprobs) == (before.output_ids, before.logprobs)

            engines.e1.restart()
            d.publisher.engines["E1"] = d.ports["E1"]
            await d.publisher.sync_incarnations()  # new incarnation: A must be rehydrated on E1
            await d.publisher.rehydrate(a_version, a, "E1")
            recovered = await d.publisher.recover()  # finish B's cleanup on the new incarnation
            assert [o.status for o in recovered] == ["FAILED_CLEAN"]
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN
            assert view.managed_count() == 1 and view.default == a_version

            on_e1 = d.binder.open("S_a2@E1")
            rehydrated = await d.binder.generate(on_e1, PROMPT, 6)
            assert (rehydrated.output_ids, rehydrated.logprobs) == (before.output_ids, before.logprobs)
            for key in (session, on_e1):
                await d.binder.finish(key)

    run(body())


class LostReplyInjector:
    """Fault injection: a registry port whose reply to the first call with a matching key is lost
    after the registry applied it (the caller sees RegistryUnavailable, as after a dropped reply)."""

    def __init__(self, inner: Any, key_prefix: str) -> None:
        self.inner = inner
        self.key_prefix = key_prefix
        self.dropped: list[str] = []

    async def submit(self, event: Any, key: str | None = None) -> Any:
        answer = await self.inner.submit(event, key=key)
        if key and key.startswith(self.key_prefix) and not self.dropped:
            self.dropped.append(key)
            raise RegistryUnavailable(f"injected: reply to {key} lost")
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_lost_commit_reply_is_resolved_by_the_same_commit(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            lossy = LostReplyInjector(d.registry, "commit:")
            d.publisher.registry = lossy
            a_version, a = d.candidate("A")
            outcome = await d.publisher.publish(a_version, a)
            assert outcome.committed and lossy.dropped
            view = await d.registry.publication_view()
            assert view.default_revision == 1  # applied exactly once
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(b_version, b)).committed
            assert (await d.registry.publication_view()).default_revision == 2

    run(body())


def test_ready_from_an_old_incarnation_is_ignored(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            b_version, b = d.candidate("B")
            reserved = await d.registry.submit(Reserve(b_version, b.snapshot.digest, await fence_of(d.registry)))
            token = reserved.result.attempt_token
            current = (await d.registry.publication_view()).incarnations["E0"]
            stale = await d.registry.submit(RecordReady(b_version, token, "E0", current - 1, b.snapshot.digest))
            assert isinstance(stale.result, Rejected) and str(stale.result.reason) == "STALE_INCARNATION"
            view = await d.registry.publication_view()
            assert view.versions[b_version].placements["E0"].state.name != "READY"
            assert await d.publisher.abort_and_clean(b_version, token, {}) == "FAILED_CLEAN"

    run(body())


def test_registry_actor_killed_between_reserve_and_commit_and_between_claim_and_confirm(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            e0 = d.ports["E0"]
            real_transfer = e0.transfer_bucket
            killed: list[float] = []

            async def transfer_then_kill(candidate, attempt_token, index):  # type: ignore[no-untyped-def]
                await real_transfer(candidate, attempt_token, index)
                if index == 0 and not killed:
                    _kill_actor_worker(d)  # after reserve, before commit
                    killed.append(time.monotonic())

            e0.transfer_bucket = transfer_then_kill  # type: ignore[method-assign]
            outcome = await d.publisher.publish(a_version, a)
            e0.transfer_bucket = real_transfer  # type: ignore[method-assign]
            assert killed and outcome.committed, outcome

            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(b_version, b)).committed
            real_reclaim = e0.reclaim

            async def kill_then_reclaim(lora_name, reclaim_id, wait_s, capability=None):  # type: ignore[no-untyped-def]
                if len(killed) == 1:
                    _kill_actor_worker(d)  # after claim, before confirm
                    killed.append(time.monotonic())
                return await real_reclaim(lora_name, reclaim_id, wait_s, capability)

            e0.reclaim = kill_then_reclaim  # type: ignore[method-assign]
            reclaimed = await d.reclaimer.reclaim(a_version)
            assert len(killed) == 2 and reclaimed.status == "RECLAIMED", reclaimed
            # The reclaim's outcome is in the journal: one more kill -9 and the replay reproduce the state.
            digest_after = await d.registry.state_digest()
            _kill_actor_worker(d)
            assert await d.registry.state_digest() == digest_after
            states = await d.registry.version_states([a_version, b_version])
            assert states == {a_version: VersionState.RECLAIMED, b_version: VersionState.PUBLISHED}

    run(body())


PUBLISHER_SCRIPT = Path(__file__).with_name("publisher_process.py")


def test_publisher_killed_mid_attempt_is_recovered_by_the_next_one(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            import ray

            # This test's own cluster, by address: "auto" picks any cluster on the host (another test run's).
            address = ray.get_runtime_context().gcs_address
            child = subprocess.Popen(
                [sys.executable, str(PUBLISHER_SCRIPT), d.registry_name, str(d.epoch),
                 engines.e0.url, engines.e1.url, TEST_TOKEN, str(fixtures.adapters["B"]), address],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            try:
                line, seen = "", []
                deadline = time.monotonic() + 180
                while "HELD" not in line and time.monotonic() < deadline:
                    line = child.stdout.readline() if child.stdout else ""
                    seen.append(line)
                    if child.poll() is not None:
                        seen.extend(child.stdout.readlines() if child.stdout else [])
                        break
                assert "HELD" in line, "publisher process did not reach the hold:\n" + "".join(seen)[-3000:]
                child.send_signal(signal.SIGKILL)  # the publisher dies mid-attempt
                child.wait(30)
            finally:
                if child.poll() is None:
                    child.kill()
            view = await d.registry.publication_view()
            pending = [v for v in view.versions.values() if v.state is VersionState.LOADING]
            assert len(pending) == 1
            recovered = await d.publisher.recover()  # the next publisher finishes the cleanup
            assert [o.status for o in recovered] == ["FAILED_CLEAN"]
            for client in d.clients.values():
                assert (await client.status())["staging"]["stashes"] == {}
            view = await d.registry.publication_view()
            assert view.default == a_version and view.managed_count() == 1

    run(body())
