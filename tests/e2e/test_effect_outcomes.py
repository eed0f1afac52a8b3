"""Issue 41: what an engine effect's outcome does is the table's, on real engines. A failed load (injected:
`managed/faults.py`'s ``fail_load``) frees its stash and the attempt ends FAILED_CLEAN with a typed reason; a failed
physical unload (injected: ``fail_unload``) keeps the adapter accounted and the reclaim resent completes it, the slot
counted once; a cleanup that overtakes the load inside `end` (the ``load`` hold point) leaves nothing pinned under a
CLEANED placement, and the engine's status and SGLang's `lora_registry` agree.

Everything but the named fault is real: the Ray registry actor, the Publisher, the Reclaimer, both CPU engines."""

from __future__ import annotations

import asyncio
from typing import Any

from deployment import Deployment, unloads
from engine_helpers import PROMPT, client_for, run, wait_until
from test_publication_e2e import deployed

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.sglang_client import ManagedRefusal, SGLangClient
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.spec.states import VersionState

RECLAIM_DEADLINE_S = 15.0


async def _arm(d: Deployment, engine: str, point: str, name: str, release: bool = False) -> None:
    """Arm (or release) an injected fault or hold point on one engine (`managed/faults.py`, `hold_points.py`): an
    injected fault fails SGLang's operation for that name on every call until released."""
    async with client_for(d.clients[engine].base_url) as client:
        await client.managed("test_hold", point=point, lora_name=name, **({"release": True} if release else {}))


async def _view(client: SGLangClient, name: str) -> dict[str, Any] | None:
    return next((m for m in (await client.status())["managed"] if m["name"] == name), None)


async def _agrees_with_sglang(client: SGLangClient) -> None:
    """The engine's table and SGLang's `LoRARegistry` name the same pinned managed adapters: every managed adapter
    the status says is pinned is registered in SGLang, pinned; every one it says is not is absent there."""
    status = await client.status()
    registered = {a["name"]: a for a in status["adapters"]}
    for managed in status["managed"]:
        there = registered.get(managed["name"])
        if managed["state"] in ("READY",):
            assert there is not None and there["pinned"], (managed, there)
        else:
            assert there is None, (managed, there)


def test_injected_failed_load_frees_its_stash_and_the_attempt_ends_failed_clean_typed(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            b_version, b = d.candidate("B")
            await _arm(d, "E1", "fail_load", b.lora_name)
            outcome = await d.publisher.publish(b_version, b)
            await _arm(d, "E1", "fail_load", b.lora_name, release=True)

            status = await d.clients["E1"].status()
            stashes = status["staging"]["stashes"]
            assert outcome.attempt_token not in stashes, stashes  # the failed load's stash is freed
            on_e1 = await _view(d.clients["E1"], b.lora_name)
            assert on_e1 is not None and on_e1["state"] == "CLEANED" and not on_e1["pinned"], on_e1
            assert await d.clients["E1"].adapter(b.lora_name) is None  # SGLang holds nothing of that name
            await _agrees_with_sglang(d.clients["E1"])
            assert outcome.status is PublishStatus.FAILED_CLEAN, outcome
            # typed: the engine's table refused E1's end LOAD_FAILED (an engine's refusal is the outcome's reason, its
            # code first in the detail, as for every refusal of a staging)
            assert (outcome.reason, outcome.detail.split(":")[0]) == ("LOAD_FAILED", "LOAD_FAILED"), outcome
            view = await d.registry.publication_view()
            assert view.versions[b_version].state is VersionState.FAILED_CLEAN
            assert view.managed_count() == 0

    run(body())


def test_injected_failed_unload_stays_accounted_and_the_resent_reclaim_completes_it_once(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            assert (await d.publisher.publish(a_version, a)).committed
            assert (await d.publisher.publish(b_version, b)).committed  # A is RETIRED, no session holds it
            before = await d.audit()

            await _arm(d, "E1", "fail_unload", a.lora_name)  # SGLang's unload of A fails on E1 until released
            d.reclaimer.deadlines = Deadlines(reclaim=RECLAIM_DEADLINE_S)
            first = await d.reclaimer.reclaim(a_version)  # E1 is asked again and again until the deadline
            assert first.status is ReclaimStatus.PENDING and "E1" not in first.confirmed, first
            on_e1 = await _view(d.clients["E1"], a.lora_name)
            # SGLang still holds A's weights: the table says so, and the slot stays held on the engine and in the
            # registry (A RECLAIMING holds its managed slot until E1 confirms).
            assert on_e1 is not None and on_e1["state"] == "UNLOAD_FAILED" and on_e1["pinned"], on_e1
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.RECLAIMING and view.managed_count() == 2

            await _arm(d, "E1", "fail_unload", a.lora_name, release=True)  # the cause is gone
            again = await d.reclaimer.reclaim(a_version)  # the same claim resent: the row retries the unload
            assert again.status is ReclaimStatus.RECLAIMED and again.reclaim_id == first.reclaim_id, again
            on_e1 = await _view(d.clients["E1"], a.lora_name)
            assert on_e1 is not None and on_e1["state"] == "UNLOADED" and not on_e1["pinned"], on_e1
            after = await d.audit()
            deltas = {e: unloads(after)[e] - unloads(before)[e] for e in after}
            assert deltas == {"E0": 1, "E1": 1}, deltas  # the slot freed once on each engine
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.RECLAIMED and view.managed_count() == 1
            await _agrees_with_sglang(d.clients["E1"])

    run(body())


def test_cleanup_overtaking_the_load_inside_end_leaves_nothing_pinned_under_cleaned(engines, fixtures) -> None:
    """`end` held at the `load` hold point (verified, SGLang's load not begun) while the registry's cleanup comes,
    as it does after the publisher's `end` deadline: the load that then finishes is unloaded at once."""
    from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
    from versioned_lora.spec.identities import VersionKey, lora_name

    snapshot = snapshot_from_adapter_dir(fixtures.adapters["B"])
    name = lora_name(VersionKey(1, f"overtaken{id(snapshot) % 10**8}"), snapshot.digest)
    candidate = Candidate.build(name, snapshot, 8 * 1024)
    attempt = f"attempt-overtaken-{id(candidate) % 10**8}"

    async def body() -> None:
        async with client_for(engines.e1) as client:
            link = await EngineLink.connect(client)
            try:
                await link.begin(candidate, attempt)
                for index in range(candidate.bucket_count):
                    await link.transfer_bucket(candidate, attempt, index)
                await client.managed("test_hold", point="load", lora_name=name)
                end = asyncio.create_task(link.end(candidate, attempt, PROMPT))

                async def held() -> bool:
                    return bool((await client.status())["hold_points"]["held"].get("load") == name)

                await wait_until(held, timeout_s=120)
                try:  # the registry's cleanup, as the settle driver sends it after `end.deadline`
                    await client.managed("cleanup", lora_name=name, attempt_token=attempt)
                    overtaken = None
                except ManagedRefusal as refused:
                    overtaken = refused.reason
                await client.managed("test_hold", point="load", lora_name=name, release=True)
                try:
                    answer: Any = await end
                except ManagedRefusal as refused:
                    answer = refused.reason
                if overtaken is not None:  # the cleanup was told to come again once the load settled
                    await client.managed("cleanup", lora_name=name, attempt_token=attempt)

                view = await _view(client, name)
                assert view is not None and view["state"] == "CLEANED", view
                assert await client.adapter(name) is None, "SGLang holds the cleaned candidate pinned"
                assert not view["pinned"], view
                await _agrees_with_sglang(client)
                assert answer == "STALE_ATTEMPT", answer  # the end answers that cleanup came first
                assert overtaken in (None, "IN_USE"), overtaken
            finally:
                link.close()
                if await client.adapter(name) is not None:  # teardown of what the defect leaves: later tests' slots
                    try:
                        await client.unload_lora_adapter(name)
                    except Exception:  # best effort: the assertion above already failed
                        pass

    run(body())
