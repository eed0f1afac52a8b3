"""Conformance: the model's predictions (model_checks/conformance.py, the table through engine_step)
against a real SGLang engine for the same operation sequence: state, refcount (native and mirrored),
loaded names, physical unload count (audit delta) and the reclaim receipt."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import PROMPT, client_for, managed_view, publish_from_disk, run, wait_until

from model_checks.conformance import CONFORMANCE_SEQUENCE, Observation, expected_observations
from versioned_lora.adapters.sglang_client import EngineHTTPError

LONG_TOKENS = 1500
pytestmark = pytest.mark.engines


def test_engine_matches_the_model_on_publish_generate_reclaim_drain(engines, fixtures) -> None:
    async def body() -> None:
        async with client_for(engines.e0) as client:
            audit0 = (await client.status())["audit"]["physical_unload"]
            staged = None
            long_task: asyncio.Task | None = None
            seen: list[Observation] = []
            for op in CONFORMANCE_SEQUENCE:
                kind = op[0]
                if kind == "publish":
                    staged = await publish_from_disk(client, fixtures.adapters["A"], label="conf")
                elif kind == "generate":
                    assert (await client.generate(PROMPT, staged.name, 4)).output_ids
                elif kind == "start_long":
                    long_task = asyncio.create_task(client.generate(PROMPT, staged.name, LONG_TOKENS, ignore_eos=True))
                    await wait_until(lambda name=staged.name: _refcount_is(client, name, 1))
                elif kind == "finish_long":
                    await long_task
                    await wait_until(lambda name=staged.name: _state_is(client, name, "UNLOADED"))
                elif kind == "reclaim":
                    await client.managed("reclaim", lora_name=staged.name, reclaim_id=op[1], wait_s=0.5)
                elif kind == "generate_refused":
                    with pytest.raises(EngineHTTPError) as refused:
                        await client.generate(PROMPT, staged.name, 2)
                    assert refused.value.status_code == 409
                seen.append(await _observe(client, staged.name, audit0))
            expected = expected_observations(CONFORMANCE_SEQUENCE, staged.name, staged.attempt_token, staged.digest,
                                             staged.incarnation)
            for op, got, want in zip(CONFORMANCE_SEQUENCE, seen, expected, strict=True):
                assert got == want, (op, got, want)

    run(body())


async def _observe(client, name: str, audit0: int) -> Observation:
    view = await managed_view(client, name)
    assert view is not None
    assert view["native_refcount"] == view["mirrored_refcount"]
    # Physically loaded in SGLang: a registered name, or an unregistered one whose weights still
    # serve in-flight requests (DRAINING) — SGLang keeps them until the one physical unload.
    status = await client.status()
    registered = name in {a["name"] for a in status["adapters"]}
    loaded = registered or any(d["lora_id"] == view["lora_id"] for d in status["draining"])
    receipt = view["reclaim_receipt"]
    unloads = status["audit"]["physical_unload"] - audit0
    return Observation(view["state"], view["mirrored_refcount"], loaded, unloads,
                       None if receipt is None else receipt["reclaim_id"])


async def _refcount_is(client, name: str, n: int) -> bool:
    view = await managed_view(client, name)
    return view is not None and view["mirrored_refcount"] == n


async def _state_is(client, name: str, state: str) -> bool:
    view = await managed_view(client, name)
    return view is not None and view["state"] == state
