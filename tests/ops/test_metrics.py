"""Metrics scraped over HTTP and parsed with prometheus_client's text parser: the registry actor's
(`ray.util.metrics`, from Ray's Prometheus endpoint) and the managed patch's additions to SGLang's `/metrics`,
after a publication, a capacity refusal, a session, a second publication and a reclaim.

The engine here runs with `--enable-metrics` (the session's shared engines do not), in a one-engine deployment
of its own: a real SGLang process, the real registry actor on the session's Ray cluster."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deployment import reference_model
from engine_helpers import PROMPT, TEST_ENGINE_ARGS, TEST_TOKEN, capability_key_file, engine_env, run
from prometheus_client.parser import text_string_to_metric_families

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block
from versioned_lora.adapters.sglang_client import EngineHTTPError, ManagedRefusal, SGLangClient
from versioned_lora.demo.engine_counters import Counts, EngineCounters
from versioned_lora.demo.stack import Stack
from versioned_lora.spec.wire import SOURCE_ROOT_ENV

SCRAPE_DEADLINE_S = 90.0  # Ray's metrics agent exports every few seconds


@pytest.fixture(scope="module")
def metrics_engine(fixtures, tmp_path_factory) -> Iterator[EngineProcess]:  # type: ignore[no-untyped-def]
    log_dir = Path(os.environ.get("VERSIONED_LORA_ENGINE_LOGS", tmp_path_factory.mktemp("metrics-engine")))
    engine = EngineProcess(EngineConfig(
        model_dir=fixtures.model_dir, port=free_port_block(), log_path=log_dir / "metrics-engine.log",
        extra_args=(*TEST_ENGINE_ARGS, "--enable-metrics"),
        env=engine_env(**{SOURCE_ROOT_ENV: str(fixtures.root)}),
    ))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def samples(text: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for samples whose name starts with `prefix`."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def registry_series(text: str, registry: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The registry actor's series (Ray adds `ray_` and its own labels; `registry` tells actors apart)."""
    ours = {}
    for (name, labels), value in samples(text, "ray_versioned_lora_registry_").items():
        as_dict = dict(labels)
        if as_dict.get("registry") != registry:
            continue
        kept = tuple((k, v) for k, v in labels if k in ("state", "version", "outcome", "reason", "result", "le"))
        ours[(name, kept)] = value
    return ours


def ray_metrics_url() -> str:
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def test_registry_and_engine_metrics_after_a_publication_and_a_reclaim(metrics_engine, fixtures, tmp_path) -> None:
    async def body() -> None:
        stack = Stack([metrics_engine.url], TEST_TOKEN, tmp_path, fixtures, probe_prompt=PROMPT,
                      reference=reference_model(fixtures.model_dir), capability_key_file=capability_key_file())
        http = httpx.AsyncClient(timeout=30.0)
        try:
            engine_metrics = f"{metrics_engine.url}/metrics"
            before = samples((await http.get(engine_metrics)).text, "versioned_lora_engine_")
            assert before[("versioned_lora_engine_managed_adapters", (("state", "READY"),))] == 0

            await stack.publisher.sync_incarnations()
            a_version, a = stack.candidate("A")
            b_version, b = stack.candidate("B")
            c_version, c = stack.candidate("C")
            assert (await stack.publisher.publish(a_version, a)).committed
            binder = stack.new_binder(stack.backend, shard=0)
            session = binder.open("S_metrics")
            await binder.bind_first(session)
            assert (await stack.publisher.publish(b_version, b)).committed
            refused = await stack.publisher.publish(c_version, c)
            assert refused.reason == "CAPACITY_ERROR"
            assert (await binder.finish(session)).released
            assert (await stack.reclaimer.reclaim(a_version)).status == "RECLAIMED"
            client = stack.clients["E0"]
            with pytest.raises(EngineHTTPError):  # A is reclaimed: a request naming it is refused
                await client.generate(PROMPT, a.lora_name, 2)
            async with SGLangClient(metrics_engine.url, token="not-the-engine-token") as stranger:
                with pytest.raises(ManagedRefusal) as refusal:  # a managed call with a wrong token
                    await stranger.managed("reclaim")
            assert refusal.value.reason == "UNAUTHORIZED"

            # SGLang's /metrics: managed adapters by state, native refcounts of the held ones, refusals.
            after = samples((await http.get(engine_metrics)).text, "versioned_lora_engine_")
            by_state = {dict(labels)["state"]: value for (name, labels), value in after.items()
                        if name == "versioned_lora_engine_managed_adapters"}
            assert by_state == {"ABSENT": 0, "STAGING": 0, "LOADING": 0, "CANCELLING": 0, "READY": 1, "CLEANING": 0,
                                "UNREGISTERED": 0, "DRAINING": 0, "UNLOADING": 0, "UNLOAD_FAILED": 0, "UNLOADED": 1,
                                "CLEANED": 0}
            refs = {dict(labels)["version"]: value for (name, labels), value in after.items()
                    if name == "versioned_lora_engine_native_refcount"}
            assert refs == {"B": 0}
            refusals = {tuple(v for _, v in labels): value - before.get((name, labels), 0)
                        for (name, labels), value in after.items() if name == "versioned_lora_engine_refusals_total"}
            assert {k: v for k, v in refusals.items() if v} == {("generate", "VERSION_UNAVAILABLE"): 1,
                                                               ("reclaim", "UNAUTHORIZED"): 1}

            # Ray's endpoint: the registry actor's gauges and counters.
            expected = {
                ("ray_versioned_lora_registry_versions", (("state", "PUBLISHED"),)): 1.0,
                ("ray_versioned_lora_registry_versions", (("state", "RECLAIMED"),)): 1.0,
                ("ray_versioned_lora_registry_versions", (("state", "RETIRED"),)): 0.0,
                ("ray_versioned_lora_registry_versions", (("state", "LOADING"),)): 0.0,
                ("ray_versioned_lora_registry_capacity_used_slots", ()): 1.0,
                ("ray_versioned_lora_registry_capacity_slots", ()): 2.0,
                # A is reclaimed: its series is gone (recorded at 0 once, then no more: Ray's agent drops it);
                # B's stays while B is live (the actor records its live gauges again every few seconds).
                ("ray_versioned_lora_registry_session_refs", (("version", "A"),)): None,
                ("ray_versioned_lora_registry_session_refs", (("version", "B"),)): 0.0,
                ("ray_versioned_lora_registry_publications_total",
                 (("outcome", "committed"), ("reason", "none"))): 2.0,
                ("ray_versioned_lora_registry_publications_total",
                 (("outcome", "rejected"), ("reason", "CAPACITY_ERROR"))): 1.0,
                ("ray_versioned_lora_registry_reclaims_total", (("outcome", "claimed"), ("reason", "none"))): 1.0,
                ("ray_versioned_lora_registry_reclaims_total", (("outcome", "reclaimed"), ("reason", "none"))): 1.0,
                ("ray_versioned_lora_registry_binds_total", (("result", "bound"),)): 1.0,
                ("ray_versioned_lora_registry_closes_total", ()): 1.0,
                ("ray_versioned_lora_registry_open_sessions", ()): 0.0,
            }
            url = ray_metrics_url()
            deadline = time.monotonic() + SCRAPE_DEADLINE_S  # A's series leaves after two export intervals (20 s)
            while True:
                series = registry_series((await http.get(url)).text, stack.registry_name)
                got = {key: series.get(key) for key in expected}
                if got == expected or time.monotonic() > deadline:
                    break
                await asyncio.sleep(2.0)
            assert got == expected
            calls = series[("ray_versioned_lora_registry_call_seconds_count", ())]
            assert calls >= 10  # reserve, prepared, ready, commit (x2), a refused reserve, bind, close, claim, confirm
        finally:
            await http.aclose()
            await stack.close()

    run(body())



def test_the_scheduler_counters_the_online_benchmark_reads_count_one_generation_exactly(metrics_engine) -> None:
    """`demo.engine_counters` against the real engine: one greedy generation of 9 tokens on an idle engine is one
    prefill pass (its first token) and 8 decode passes of one token each, in the counters read over HTTP."""
    tokens = 9

    async def body() -> tuple[Counts, Counts]:
        counters = EngineCounters({"E0": metrics_engine.url})
        try:
            before = (await counters.read())["E0"]
            async with SGLangClient(metrics_engine.url, token=TEST_TOKEN) as client:
                generation = await client.generate(PROMPT, None, tokens, ignore_eos=True)
            assert len(generation.output_ids) == tokens
            # The scheduler steps its counters after it hands the pass's tokens on: wait for them to settle.
            deadline = time.monotonic() + 5.0
            while True:
                after = (await counters.read())["E0"]
                if after.minus(before).decode_tokens >= tokens - 1 or time.monotonic() > deadline:
                    return before, after
                await asyncio.sleep(0.05)
        finally:
            await counters.close()

    before, after = run(body())
    assert after.minus(before) == Counts(decode_tokens=tokens - 1, decode_passes=tokens - 1, prefill_passes=1)
