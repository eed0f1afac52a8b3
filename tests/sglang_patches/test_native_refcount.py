"""SGLang's native request refcount protects in-flight requests (RFC pre-validation §1).

The introspection endpoint reads ``LoRARegistry._counters[lora_id]``; these tests watch it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import PROMPT, client_for, hold_scheduler, loaded_adapter, refcount, run, wait_until

from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient

LONG_TOKENS = 1900  # in flight for seconds even at the ~400 tokens/s an idle host decodes (1500 was not: CI)
SHORT_TOKENS = 250


def test_unload_waits_for_the_long_request_and_unloads_once(engines, fixtures) -> None:
    async def body() -> None:
        async with (
            client_for(engines.e0, token=None) as client,
            loaded_adapter(client, fixtures.adapters["A"], "A") as a,
        ):
            long_task = asyncio.create_task(client.generate(PROMPT, a, LONG_TOKENS, ignore_eos=True))
            await wait_until(lambda: _is(refcount(client, a), 1), timeout_s=20)
            # "Short" still lasts ~1 s, so the count of 2 is observable by polling on a fast host.
            short_task = asyncio.create_task(client.generate(PROMPT, a, SHORT_TOKENS, ignore_eos=True))
            await wait_until(lambda: _is(refcount(client, a), 2), timeout_s=20)
            await short_task
            await wait_until(lambda: _is(refcount(client, a), 1), timeout_s=10)
            # Hold the long request in flight (SGLang's in-place pause; a test device) while the unload is watched
            # waiting for it: on a loaded host its tokens once ended before the unload was seen (CI).
            await hold_scheduler(client, True)
            try:
                assert not long_task.done()
                lora_id = (await client.adapter(a))["lora_id"]
                unload_issued = time.monotonic()
                unload_task = asyncio.create_task(client.unload_lora_adapter(a))
                await wait_until(lambda: _unregistered(client, a), timeout_s=10)
                status = await client.status()
                assert status["draining"] == [{"lora_id": lora_id, "refcount": 1}]
                await asyncio.sleep(0.5)
                assert not long_task.done()
                assert not unload_task.done(), "unload finished while a request still held the adapter"
            finally:
                await hold_scheduler(client, False)

            await long_task
            long_done = time.monotonic()
            result = await unload_task
            unload_done = time.monotonic()
            assert result["success"], result
            assert unload_issued < long_done <= unload_done

            # Unloaded exactly once: the counter is gone, and a second unload finds nothing to do.
            assert (await client.status())["draining"] == []
            with pytest.raises(EngineHTTPError, match="does not exist"):
                await client.unload_lora_adapter(a)

    run(body())


async def _is(value_coro, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return (await value_coro) == expected


async def _unregistered(client: SGLangClient, name: str) -> bool:
    return await client.adapter(name) is None
