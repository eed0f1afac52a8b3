"""KV namespaces follow SGLang's engine-local ``lora_id`` (RFC pre-validation §2, RFC §6)."""

from __future__ import annotations

import asyncio

from engine_helpers import PROMPT, client_for, fresh_name, loaded_adapter, lora_ids, run


def test_kv_isolation_on_freshly_loaded_names(engines, fixtures) -> None:
    async def body() -> None:
        async with (
            client_for(engines.e0, token=None) as client,
            loaded_adapter(client, fixtures.adapters["A"], "A") as a,
            loaded_adapter(client, fixtures.adapters["B"], "B") as b,
        ):
            a_cold = await client.generate(PROMPT, a, max_new_tokens=4)
            b_cold = await client.generate(PROMPT, b, max_new_tokens=4)
            b_warm = await client.generate(PROMPT, b, max_new_tokens=4)
            a_warm = await client.generate(PROMPT, a, max_new_tokens=4)
            base = await client.generate(PROMPT, None, max_new_tokens=4)

            # A warm does not make B's first request hit A's cache, and each hits its own.
            assert [a_cold.cached_tokens, b_cold.cached_tokens] == [0, 0]
            assert b_warm.cached_tokens == len(PROMPT) - 1
            assert a_warm.cached_tokens == len(PROMPT) - 1

            # Greedy decoding is repeatable per version ...
            assert (a_warm.output_ids, a_warm.logprobs) == (a_cold.output_ids, a_cold.logprobs)
            assert (b_warm.output_ids, b_warm.logprobs) == (b_cold.output_ids, b_cold.logprobs)
            # ... and base, A and B are pairwise distinguishable.
            first_logprobs = {base.logprobs[0], a_cold.logprobs[0], b_cold.logprobs[0]}
            assert len(first_logprobs) == 3

    run(body())


def test_lora_ids_are_engine_local_and_reload_gives_cold_namespace(engines, fixtures) -> None:
    name = fresh_name("A")

    async def body() -> None:
        async with client_for(engines.e0, token=None) as c0, client_for(engines.e1, token=None) as c1:
            for client in (c0, c1):
                assert (await client.load_lora_adapter(name, str(fixtures.adapters["A"])))["success"]
            try:
                id0 = lora_ids(await c0.status())[name]
                id1 = lora_ids(await c1.status())[name]
                assert id0 != id1

                g0, g1 = await asyncio.gather(
                    c0.generate(PROMPT, name, max_new_tokens=4), c1.generate(PROMPT, name, max_new_tokens=4)
                )
                assert g0.output_ids == g1.output_ids
                assert g0.logprobs == g1.logprobs
                assert (await c0.generate(PROMPT, name, max_new_tokens=4)).cached_tokens == len(PROMPT) - 1

                # Unload and reload the same name on E0: new lora_id, cold namespace, same numbers.
                assert (await c0.unload_lora_adapter(name))["success"]
                assert (await c0.load_lora_adapter(name, str(fixtures.adapters["A"])))["success"]
                reloaded_id = lora_ids(await c0.status())[name]
                assert reloaded_id not in (id0, id1)
                again = await c0.generate(PROMPT, name, max_new_tokens=4)
                assert again.cached_tokens == 0
                assert again.logprobs == g0.logprobs
            finally:
                for client in (c0, c1):
                    if await client.adapter(name) is not None:
                        await client.unload_lora_adapter(name)

    run(body())
