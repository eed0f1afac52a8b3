"""Cache keys on real engines (issue 19, upstream SGLang #24638): a request naming a managed version cannot choose
its KV namespace, and no request reaches a managed version's namespace unless it names that version.

SGLang 0.5.23 keys the radix cache by (tokens, extra_key + lora_id, cache_salt). Measured on 0.5.23 before the
fix (one managed engine, the fixture model, adapter A published as managed version M, 20-token prompts):
- a base request (no LoRA) with ``extra_key`` = M's lora_id, on a prompt M had served: 200, cached_tokens=19,
  i.e. served from M's radix KV;
- the other way: such a base request first, then M on the same prompt: cached_tokens=19 and M's first greedy
  logprob -5.4716 instead of -5.6285 (a stock-loaded copy of A on a cold namespace): M served base-model KV;
- M with ``extra_key``="mine" or ``cache_salt``="mine" on a prompt M had cached: cached_tokens=0, i.e. the
  request chose a namespace of its own.
After: each of those requests is refused on /generate with CACHE_KEY_REFUSED naming the field (and in the
tokenizer manager, for every route that is served), /v1/completions is not served at all on a managed engine
(404 ROUTE_NOT_SERVED), and M's KV holds only what M computed (the poisoning attempt leaves M cold and exact).
"""

from __future__ import annotations

import random

import httpx
from conftest import Boundary
from engine_helpers import client_for, fresh_name, run


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(20)]


def test_managed_kv_namespace_cannot_be_chosen_or_reached(boundary: Boundary, fixtures) -> None:  # type: ignore[no-untyped-def]
    m, lora_id = boundary.m.name, boundary.m_lora_id
    measured: dict[str, object] = {}

    async def body() -> None:
        async with client_for(boundary.engine) as client:
            p, q = _prompt(1), _prompt(2)
            await client.generate(p, m, max_new_tokens=4)
            measured["managed_warm_cached"] = (await client.generate(p, m, max_new_tokens=4)).cached_tokens
            raw = client._http
            refused = {}
            for label, payload in {
                "base_extra_key_lora_id": {"input_ids": p, "extra_key": lora_id},
                "base_extra_key_poison": {"input_ids": q, "extra_key": lora_id},
                "managed_extra_key": {"input_ids": p, "lora_path": m, "extra_key": "mine"},
                "managed_cache_salt": {"input_ids": p, "lora_path": m, "cache_salt": "mine"},
            }.items():
                answer = await raw.post("/generate", json={**payload, "sampling_params": {"max_new_tokens": 4},
                                                           "return_logprob": True})
                refused[label] = (answer.status_code, answer.json()["error"]["reason"])
            completion = await raw.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 2,
                                                                 "extra_key": lora_id})
            # The OpenAI routes are not served by a managed engine at all (managed/route_gate.py); the cache-key
            # rule still holds inside the tokenizer manager for every route that is (the Engine API, the probe).
            measured["completions_extra_key_lora_id"] = (completion.status_code, completion.json()["error"]["reason"])
            measured["refused"] = refused
            # The poisoning attempt was refused: M on q is cold, and exactly what a cold copy of A computes.
            served = await client.generate(q, m, max_new_tokens=4)
            reference = fresh_name("ref")
            assert (await client.load_lora_adapter(reference, str(fixtures.adapters["A"])))["success"]
            try:
                clean = await client.generate(q, reference, max_new_tokens=4)
            finally:
                await client.unload_lora_adapter(reference)
            measured["after_poison_attempt_cached"] = served.cached_tokens
            measured["after_poison_attempt_logprobs_equal_clean"] = served.logprobs == clean.logprobs

    run(body())
    print(f"\ncache_keys_after: {measured}")
    assert measured["managed_warm_cached"] == 19
    assert all(outcome == (400, "CACHE_KEY_REFUSED") for outcome in measured["refused"].values()), measured
    assert measured["completions_extra_key_lora_id"] == (404, "ROUTE_NOT_SERVED"), measured
    assert measured["after_poison_attempt_cached"] == 0
    assert measured["after_poison_attempt_logprobs_equal_clean"] is True
    assert httpx.get(f"{boundary.url}/health", timeout=30).status_code == 200
