"""Unknown outcomes end to end: the real Ray registry actor, two real engines, the Publisher, the Reclaimer and
the SessionBinder, with the registry's replies to one kind of call lost for longer than that call's deadline.

The loss is injected (a real registry cannot lose a reply on demand): `LostReplies` lets every call reach the
actor, which applies and journals it, and then drops the reply. What must hold (RFC §3.4, DESIGN.md §1): a
call whose reply is lost may have landed, so it keeps its resource and capacity, nothing is cleaned or
unloaded on the strength of it, no next publication starts, and the same call under the same key resolves it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from deployment import unloads
from engine_helpers import PROMPT, run
from test_publication_e2e import deployed

from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import RegistryUnavailable
from versioned_lora.runtime.publisher import PublisherRefusal, PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.spec.states import VersionState

LOSS_S = 3.0  # replies are lost this long: longer than every deadline below
DEADLINES = Deadlines(commit=0.5, abort=0.5, cleanup=30.0)


class LostReplies:
    """Fault injection: a registry port whose replies to calls with a key starting with `prefix` are lost
    for `LOSS_S` seconds after the first such call, after the actor applied the call. For each lost reply
    it asks the actor whether the call is in its journal (the request landed; only the reply is lost)."""

    def __init__(self, inner: Any, handle: Any, prefix: str) -> None:
        self.inner, self.handle, self.prefix = inner, handle, prefix
        self.until: float | None = None
        self.lost: list[str] = []
        self.journaled: list[bool] = []

    async def submit(self, event: Any, key: str | None = None) -> Any:
        answer = await self.inner.submit(event, key=key)
        if key is not None and key.startswith(self.prefix):
            self.until = self.until or time.monotonic() + LOSS_S
            if time.monotonic() < self.until:
                self.lost.append(key)
                self.journaled.append(await self.handle.journal_has.remote(key))
                raise RegistryUnavailable(f"injected: reply to {key} lost")
        return answer

    async def wait_out(self) -> None:
        assert self.until is not None, "no reply was lost"
        await asyncio.sleep(max(0.0, self.until - time.monotonic()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def managed_states(d: Any, lora_name: str) -> dict[str, str | None]:
    """Each engine's managed state of `lora_name` (None: the engine does not know the name)."""
    states: dict[str, str | None] = {}
    for engine, client in d.clients.items():
        adapters = {a["name"]: a["state"] for a in (await client.status())["managed"]}
        states[engine] = adapters.get(lora_name)
    return states


def test_injected_lost_commit_replies_keep_the_new_default_loaded_and_block_the_next_publication(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            d.publisher.deadlines = DEADLINES
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            b_version, b = d.candidate("B")
            lossy = LostReplies(d.registry, d.handle, "commit:")
            d.publisher.registry = lossy
            before = await d.audit()

            outcome = await d.publisher.publish(b_version, b)
            assert (outcome.status, outcome.reason) == (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN")
            assert lossy.lost and all(lossy.journaled)  # the commit was in the journal before the deadline fired
            view = await d.registry.publication_view()
            assert view.default == b_version and view.versions[b_version].state is VersionState.PUBLISHED
            assert view.versions[a_version].state is VersionState.RETIRED

            # A second publication started meanwhile is refused before anything reaches the registry or an engine.
            c_version, c = d.candidate("C")
            before_c = await d.audit()
            refused = await d.publisher.publish(c_version, c)
            assert (refused.status, refused.reason) == (PublishStatus.REJECTED, PublisherRefusal.COMMIT_UNRESOLVED)
            assert c_version not in (await d.registry.publication_view()).versions
            mid = await d.audit()
            assert {e: mid[e]["managed_begin"] for e in mid} == {e: before_c[e]["managed_begin"] for e in before_c}

            # B stays loaded and serves on both engines after the publication returned.
            assert await managed_states(d, b.lora_name) == {"E0": "READY", "E1": "READY"}
            for engine in ("E0", "E1"):
                session = d.binder.open(f"S_b@{engine}")
                assert (await d.binder.bind_first(session)).version == b_version
                served = await d.binder.generate(session, PROMPT, 3)
                assert len(served.output_ids) == 3
                await d.binder.finish(session)

            resolved = await d.publisher.resolve()  # the same commit key, answered from the journal
            assert resolved is not None and resolved.committed and resolved.default_revision == 2
            assert (await d.registry.publication_view()).default_revision == 2  # applied once
            assert unloads(await d.audit()) == unloads(before)  # no cleanup, no unload anywhere
            assert await managed_states(d, b.lora_name) == {"E0": "READY", "E1": "READY"}

    run(body())


def test_injected_lost_abort_replies_clean_nothing_until_the_same_abort_is_answered(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            d.publisher.deadlines = DEADLINES
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            b_version, b = d.candidate("B")
            d.publisher.probe_check = lambda *_: False  # both engines' probes "disagree": a certain failure
            lossy = LostReplies(d.registry, d.handle, "abort:")
            d.publisher.registry = lossy
            before = await d.audit()

            outcome = await d.publisher.publish(b_version, b)
            assert outcome.status is PublishStatus.UNKNOWN and lossy.lost and all(lossy.journaled)
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.ABORTED and view.default == a_version
            assert view.managed_count() == 2  # the slot stays taken
            assert unloads(await d.audit()) == unloads(before)  # nothing cleaned on a lost answer
            assert await managed_states(d, b.lora_name) == {"E0": "READY", "E1": "READY"}

            await lossy.wait_out()
            recovered = await d.publisher.recover()  # the same abort key: its answer names the cleanups
            assert [o.status for o in recovered] == [PublishStatus.FAILED_CLEAN]
            assert unloads(await d.audit()) == {e: n + 1 for e, n in unloads(before).items()}
            assert await managed_states(d, b.lora_name) == {"E0": "CLEANED", "E1": "CLEANED"}
            assert (await d.registry.publication_view()).managed_count() == 1

    run(body())


@pytest.mark.parametrize("lost", ["claim:", "confirm:"])
def test_injected_lost_reclaim_replies_unload_nothing_on_a_lost_claim_and_keep_the_slot(
    engines, fixtures, tmp_path, lost
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            assert (await d.publisher.publish(b_version, b)).committed
            lossy = LostReplies(d.registry, d.handle, lost)
            d.reclaimer.registry = lossy
            d.reclaimer.deadlines = DEADLINES
            before = await d.audit()

            first = await d.reclaimer.reclaim(a_version)
            assert lossy.lost and all(lossy.journaled)
            if lost == "claim:":
                assert (first.status, first.reason) == (ReclaimStatus.UNKNOWN, "CLAIM_OUTCOME_UNKNOWN")
                assert (await d.registry.publication_view()).versions[a_version].state is VersionState.RECLAIMING
                assert unloads(await d.audit()) == unloads(before)  # no engine was asked to unload
                assert await managed_states(d, a.lora_name) == {"E0": "READY", "E1": "READY"}
            else:
                # Each engine unloaded A once and its confirm landed; only the replies were lost, and the
                # reclaim driver sent the same confirm keys again within the reclaim deadline (row
                # confirm.lost), answered from the journal.
                assert (first.status, set(first.confirmed)) == (ReclaimStatus.RECLAIMED, {"E0", "E1"})
                assert d.reclaimer.last_loop is not None and "confirm.lost" in d.reclaimer.last_loop.fired
                assert unloads(await d.audit()) == {e: n + 1 for e, n in unloads(before).items()}

            await lossy.wait_out()
            done = await d.reclaimer.reclaim(a_version)  # the same claim key and reclaim id
            assert done.status is ReclaimStatus.RECLAIMED and set(done.confirmed) == {"E0", "E1"}
            assert unloads(await d.audit()) == {e: n + 1 for e, n in unloads(before).items()}  # exactly once
            assert (await d.registry.publication_view()).managed_count() == 1

    run(body())


def test_injected_lost_session_replies_dispatch_nothing_and_release_once(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed

            async def refs() -> int:
                return int((await d.handle.state.remote()).session_refs.get(a_version, 0))

            for lost in ("bind:", "bclose:", "close:"):
                lossy = LostReplies(d.registry, d.handle, lost)
                binder = d.new_binder(d.backend, shard=len(lost))
                # Each caller is told UNKNOWN after 1.5 s (inside the loss); the driver retries the same key, at
                # most 1 s apart (driver_loop.RETRY_PAUSE_S), so a caller after the loss is answered in time.
                binder.deadlines = Deadlines(report=1.5)
                session = binder.open(f"S_{lost}@E1")
                if lost == "bind:":
                    with pytest.raises(RegistryUnavailable):
                        await _with_registry(binder, lossy).generate(session, PROMPT, 2)
                    # Bound in the registry (one ref), unknown here: nothing was dispatched.
                    assert binder.record(session).binding is None and await refs() == 1  # type: ignore[union-attr]
                    await lossy.wait_out()
                    served = await binder.generate(session, PROMPT, 2)  # the same bind key
                    assert len(served.output_ids) == 2 and await refs() == 1
                    await binder.finish(session)
                else:
                    assert (await binder.bind_first(session)).version == a_version and await refs() == 1
                    with pytest.raises(RegistryUnavailable):
                        await _with_registry(binder, lossy).finish(session)
                    assert await refs() == (1 if lost == "bclose:" else 0)  # a lost close reply: it landed
                    await lossy.wait_out()
                    report = await binder.finish(session)  # the same keys
                    assert report.released
                assert await refs() == 0  # released exactly once

    run(body())


def _with_registry(binder: Any, registry: Any) -> Any:
    binder._registry = registry  # the binder's port, swapped for the injected one
    return binder
