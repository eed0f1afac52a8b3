"""The seed's two SGLang lifecycle defects, re-checked on 0.5.23 as regression tests.

(a) Every way a request can end before or while it is scheduled releases its native LoRA
    reference: the refcount returns to 0 and an unload then completes within a bound.
(b) Stock SGLang implicitly reloads an unloaded adapter when a late request names it
    (``TokenizerManager._resolve_lora_path`` + ``lora_ref_cache``). Pinned here as today's
    behaviour for *unmanaged* adapters; managed adapters refuse it (tests/sglang_patches,
    managed-adapter tests).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import httpx
import pytest
from engine_helpers import PROMPT, client_for, loaded_adapter, lora_ids, refcount, run, wait_until

from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient

UNLOAD_BOUND_S = 10.0
LONG_TOKENS = 800


async def _over_context_400(client: SGLangClient, name: str) -> None:
    with pytest.raises(EngineHTTPError) as info:
        await client.generate(PROMPT * 200, name, 4)
    assert info.value.status_code == 400


async def _invalid_temperature_400(client: SGLangClient, name: str) -> None:
    with pytest.raises(EngineHTTPError) as info:
        await client.generate(PROMPT, name, 4, temperature=-1.0)
    assert info.value.status_code == 400


async def _client_disconnect_while_running(client: SGLangClient, name: str) -> None:
    task = asyncio.create_task(client.generate(PROMPT, name, LONG_TOKENS, ignore_eos=True))
    await wait_until(lambda: _refcount_is(client, name, 1))
    task.cancel()  # closes the HTTP connection; SGLang notices on its next poll and aborts


async def _disconnect_before_dispatch(client: SGLangClient, name: str) -> None:
    # A fresh connection that sends the request and goes away at once, before the engine answers.
    async with httpx.AsyncClient(base_url=client.base_url) as raw:
        task = asyncio.create_task(
            raw.post("/generate", json={"input_ids": PROMPT, "lora_path": name,
                                        "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}})
        )
        await asyncio.sleep(0.01)
        task.cancel()


async def _abort_while_running(client: SGLangClient, name: str) -> None:
    rid = uuid.uuid4().hex
    task = asyncio.create_task(client.generate(PROMPT, name, LONG_TOKENS, ignore_eos=True, rid=rid))
    await wait_until(lambda: _refcount_is(client, name, 1))
    await asyncio.sleep(0.3)
    await client.abort_request(rid)
    generation = await task
    assert generation.finish_reason["type"] == "abort"


async def _abort_while_queued(client: SGLangClient, name: str) -> None:
    # The KV pool holds 8192 tokens and admission reserves room for max_new_tokens, so of twelve
    # 2000-token requests about four run and the rest wait in the scheduler's queue. Aborting all of
    # them hits queued ones too: those come back with no generated token. Newest first: while the running
    # ones still hold the pool, the queued ones cannot be admitted between two aborts (oldest first, each abort
    # of a running request freed room, and a queued one could start and emit a token before its own abort).
    rids = [uuid.uuid4().hex for _ in range(12)]
    tasks = [asyncio.create_task(client.generate(PROMPT, name, 2000, ignore_eos=True, rid=rid)) for rid in rids]
    await wait_until(lambda: _refcount_is(client, name, len(rids)))
    await asyncio.sleep(0.3)
    for rid in reversed(rids):
        await client.abort_request(rid)
    generations = await asyncio.gather(*tasks)
    assert all(g.finish_reason["type"] == "abort" for g in generations)
    assert any(len(g.output_ids) == 0 for g in generations), "no request was still queued when aborted"


async def _refcount_is(client: SGLangClient, name: str, expected: int) -> bool:
    return await refcount(client, name) == expected


PATHS: dict[str, Callable[[SGLangClient, str], Awaitable[None]]] = {
    "over_context_400": _over_context_400,
    "invalid_temperature_400": _invalid_temperature_400,
    "client_disconnect_while_running": _client_disconnect_while_running,
    "disconnect_before_dispatch": _disconnect_before_dispatch,
    "abort_while_running": _abort_while_running,
    "abort_while_queued": _abort_while_queued,
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_request_end_path_releases_native_reference(engines, fixtures, path: str) -> None:
    async def body() -> None:
        async with (
            client_for(engines.e1, token=None) as client,
            loaded_adapter(client, fixtures.adapters["A"], "A") as a,
        ):
            await PATHS[path](client, a)
            await wait_until(lambda: _refcount_is(client, a, 0), timeout_s=15)
            result = await asyncio.wait_for(client.unload_lora_adapter(a), UNLOAD_BOUND_S)
            assert result["success"], result
            assert (await client.status())["draining"] == []

    run(body())


def test_stock_sglang_implicitly_reloads_an_unloaded_adapter(engines, fixtures) -> None:
    async def body() -> None:
        async with (
            client_for(engines.e1, token=None) as client,
            loaded_adapter(client, fixtures.adapters["B"], "B") as b,
        ):
            first = await client.generate(PROMPT, b, 4)
            old_id = lora_ids(await client.status())[b]
            assert (await client.unload_lora_adapter(b))["success"]
            assert await client.adapter(b) is None

            late = await client.generate(PROMPT, b, 4)  # today: 200, adapter silently comes back
            new_id = lora_ids(await client.status())[b]
            assert new_id != old_id
            assert late.logprobs == first.logprobs
            assert late.cached_tokens == 0  # new lora_id, cold namespace

    run(body())
