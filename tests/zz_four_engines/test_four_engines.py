"""Issue 22, part 3: four engines (tiny fixture) through the whole path.

Real parts only: the session's two tiny engines plus two more started here (E2, E3), a real Ray registry
actor, the Publisher, the Reclaimer and one SessionBinder over SGLangBackend with the library's own router
(`sticky_by_session`: the session id's CRC-32 modulo four), gloo transfer in buckets.

A is published and twelve sessions spread across the four engines by the router. B's publication is under
way when E2 is `kill -9`'d right after its second bucket landed (the transfer to E2 is wrapped to kill it at
that point; nothing is simulated). The publication aborts, the default stays A and the other three engines
keep serving it with unchanged numbers. E2 restarts (a new incarnation holding nothing); once the registry
adopts it, E2's sessions are served by the others and E2 gets no request for A until A's rehydrate there is
READY; then it serves A again with the same numbers. B's failed attempt is cleaned, B is published again on
all four, new sessions spread over the four on B, A's sessions close and A's reclaim is confirmed by all four
engines, each unloading A exactly once.

This module sorts after every test of the session's tiny engines but before tests/zz_scale (which stops
them); it reuses the session's two engines, so `make test` starts two more engines here, not four. Its two
engines stop at the module's end, before tests/zz_scale starts its own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_helpers import PROMPT, TEST_ENGINE_ARGS, TEST_TOKEN, capability_key_file, engine_env, run

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.demo.stack import Stack
from versioned_lora.fixtures import Fixtures
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.session_binder import SessionKey
from versioned_lora.spec.states import VersionState

FOUR = ("E0", "E1", "E2", "E3")
KILLED = "E2"
KILL_AFTER_BUCKET = 1
SESSIONS = 12  # S0..S11: the router's CRC-32 puts three of them on each engine
UNLOAD_AFTER_RECLAIM_S = 60.0
GIB = 2**30


def host_used_gib() -> float:
    vm = psutil.virtual_memory()
    return round((vm.total - vm.available) / GIB, 2)


@pytest.fixture(scope="module")
def four_engines(engines: Any, fixtures: Fixtures, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[list[EngineProcess]]:
    """The session's E0 and E1 and two more engines configured like them, started together."""
    log_dir = Path(os.environ.get("VERSIONED_LORA_ENGINE_LOGS", tmp_path_factory.mktemp("four-engine-logs")))
    configs = []
    for index in (2, 3):
        configs.append(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                    log_path=log_dir / f"E{index}.log", extra_args=TEST_ENGINE_ARGS,
                                    env=engine_env()))
    extra = start_all(configs)
    try:
        yield [engines.e0, engines.e1, *extra]
    finally:
        for engine in extra:
            engine.stop()


async def generate_where(stack: Stack, binder: Any, key: SessionKey) -> tuple[str, tuple[Any, ...]]:
    """One generation of the session; returns the engine the backend sent it to (the only engine whose
    count rose: generations here are one at a time) and (output ids, logprobs)."""
    before = stack.backend.sent.copy()
    response = await binder.generate(key, PROMPT, 4)
    grown = [name for name in FOUR if stack.backend.sent[name] > before[name]]
    assert len(grown) == 1 and stack.backend.sent[grown[0]] == before[grown[0]] + 1, (before, stack.backend.sent)
    return grown[0], (tuple(response.output_ids), tuple(response.logprobs))


@pytest.mark.timeout(900)
def test_four_engines_publish_spread_kill_one_mid_publication_reconcile_and_reclaim_on_all(
    four_engines: list[EngineProcess], fixtures: Fixtures, ray_cluster: None, tmp_path: Path
) -> None:
    figures: dict[str, Any] = {"host_used_gib_after_start": host_used_gib()}
    stack = Stack([engine.url for engine in four_engines], TEST_TOKEN, tmp_path, fixtures,
                  deadlines=Deadlines(bucket=6.0, cleanup=10.0), client_timeout_s=600.0,
                  capability_key_file=capability_key_file())
    binder = stack.new_binder(stack.backend, shard=0)
    killed = four_engines[FOUR.index(KILLED)]

    async def body() -> None:
        await stack.publisher.sync_incarnations()
        a_version, a = stack.candidate("A")
        assert (await stack.publisher.publish(a_version, a)).committed
        assert (await stack.registry.dispatch_view([a_version]))[a_version].engines == set(FOUR)

        # Twelve sessions on A, spread over all four engines by the router; every engine serves A alike.
        home: dict[SessionKey, str] = {}
        served: dict[SessionKey, tuple[Any, ...]] = {}
        for i in range(SESSIONS):
            key = binder.open(f"S{i}")
            home[key], served[key] = await generate_where(stack, binder, key)
        assert set(home.values()) == set(FOUR), home
        reference = next(iter(served.values()))
        assert all(numbers == reference for numbers in served.values())
        on_killed = [key for key, engine in home.items() if engine == KILLED]

        # B's publication; E2 is killed (-9: server, scheduler, detokenizer) after its bucket 1 landed.
        b_version, b = stack.candidate("B")
        assert b.bucket_count > KILL_AFTER_BUCKET + 1
        port = stack.ports[KILLED]
        transfer = port.transfer_bucket
        kills: list[int] = []

        async def transfer_then_kill(candidate: Any, attempt_token: str, index: int) -> Any:
            result = await transfer(candidate, attempt_token, index)
            if index == KILL_AFTER_BUCKET and not kills:
                killed.kill_hard()
                kills.append(index)
            return result

        port.transfer_bucket = transfer_then_kill  # type: ignore[method-assign]
        outcome = await stack.publisher.publish(b_version, b)
        port.transfer_bucket = transfer  # type: ignore[method-assign]
        figures["b_first_attempt"] = {"status": str(outcome.status), "reason": outcome.reason}
        assert kills == [KILL_AFTER_BUCKET] and outcome.status == "UNKNOWN", outcome  # E2's cleanup unconfirmed
        view = await stack.registry.publication_view()
        assert view.default == a_version and view.versions[b_version].state is VersionState.ABORTED
        # The three live engines keep serving A with the same numbers.
        for key, engine in home.items():
            if engine != KILLED:
                assert await generate_where(stack, binder, key) == (engine, reference)

        # Reconcile: E2 restarts; once the registry has its new incarnation, A is not servable there and E2's
        # sessions go to the others (E2 gets nothing) until A's rehydrate on E2 is READY.
        started = time.monotonic()
        killed.restart()
        figures["restart_s"] = round(time.monotonic() - started, 1)
        await stack.publisher.sync_incarnations()
        assert (await stack.registry.dispatch_view([a_version]))[a_version].engines == set(FOUR) - {KILLED}
        for key in on_killed:
            engine, numbers = await generate_where(stack, binder, key)
            assert engine != KILLED and numbers == reference
        await stack.publisher.rehydrate(a_version, a, KILLED)
        recovered = await stack.publisher.recover()  # B's cleanup, finished on E2's new incarnation
        assert [str(o.status) for o in recovered] == ["FAILED_CLEAN"], recovered
        view = await stack.registry.publication_view()
        assert view.versions[b_version].state is VersionState.FAILED_CLEAN and view.managed_count() == 1
        assert (await stack.registry.dispatch_view([a_version]))[a_version].engines == set(FOUR)
        for key in on_killed:
            assert await generate_where(stack, binder, key) == (KILLED, reference)

        # B again, on all four; new sessions bind to it and spread over the four.
        again = await stack.publisher.publish(b_version, b)
        assert again.committed, again
        figures["b_publish_s"] = round(sum(again.phases.values()), 3)
        on_b: dict[SessionKey, str] = {}
        b_numbers: set[tuple[Any, ...]] = set()
        for i in range(SESSIONS, 2 * SESSIONS):
            key = binder.open(f"S{i}")
            on_b[key], numbers = await generate_where(stack, binder, key)
            b_numbers.add(numbers)
        assert set(on_b.values()) == set(FOUR), on_b
        assert len(b_numbers) == 1 and b_numbers != {reference}  # B serves alike everywhere, not as A does

        # A's sessions close; A's reclaim is confirmed by all four, each unloading A once.
        for key in home:
            await binder.finish(key)
        before = {e: c["physical_unload"] for e, c in (await stack.audit()).items()}
        reclaimed = await stack.reclaimer.reclaim(a_version)
        assert str(reclaimed.status) == "RECLAIMED" and sorted(reclaimed.confirmed) == list(FOUR), reclaimed
        answered = time.monotonic()
        # An engine may answer UNLOADED before its scheduler answered the unload (tests/zz_scale): awaited.
        while True:
            now = {e: c["physical_unload"] for e, c in (await stack.audit()).items()}
            if all(now[e] >= before[e] + 1 for e in FOUR) or time.monotonic() - answered > UNLOAD_AFTER_RECLAIM_S:
                break
            await asyncio.sleep(0.2)
        assert now == {e: before[e] + 1 for e in FOUR}, (before, now)
        assert (await stack.registry.version_states([a_version]))[a_version] is VersionState.RECLAIMED
        for key in on_b:
            await binder.finish(key)
        figures["requests_sent"] = dict(stack.backend.sent)
        figures["host_used_gib_at_end"] = host_used_gib()

    async def guarded() -> None:
        try:
            await body()
        finally:
            try:  # teardown, not the protocol: free this epoch's managed slots on the session's engines
                await stack.unload_leftovers()
            finally:
                await stack.close()

    run(guarded())
    print(f"\nfour engines: {figures}")
