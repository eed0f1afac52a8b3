"""RFC §3.4, §5.2 and the §7.1 rows end to end: real Ray registry actor, two real SGLang CPU engines,
gloo transfer groups, the Publisher, the Reclaimer and the SessionBinder.

RFC §3.4's generations are compared with clean single-version baselines: each version served by a fresh
engine process that never held anything else, over the same full prefix. The trained adapter is compared
with a transformers + PEFT forward of the same weights (`ReferenceModel`). The tolerance is fixed here,
before any run: batched (scenario) against solo (fresh baseline) runs of the CPU engine measured 0, bit for
bit, in the gpu_validation harness, and the engine against PEFT 0.004 nats; 0.02 is the same epsilon the
publisher's probe check uses. Tokens must be equal as well, and A's and B's differ on the fixture prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import torch
from deployment import Deployment, engine_wide_deltas
from engine_helpers import PROMPT, TEST_ENGINE_ARGS, client_for, engine_env, publish_from_disk, run, wait_until

from versioned_lora.adapters import engine_staging
from versioned_lora.adapters.engine_process import EngineConfig, free_port_block, start_all
from versioned_lora.adapters.sglang_client import UnknownOutcome
from versioned_lora.adapters.snapshot import snapshot_from_peft_model
from versioned_lora.lifecycle import Reserve
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.runtime.session_binder import NoPublishedVersion
from versioned_lora.spec.states import VersionState
from versioned_lora.spec.wire import PROTOCOL_MISMATCH, PROTOCOL_VERSION, SOURCE_ROOT_ENV

LOGPROB_TOLERANCE = 0.02  # fixed before the run (see the module docstring)
TOOL_TOKENS = [401, 402, 403]
# The baselines' `end` probe: its first token starts no scored prefix, so the first scored request on a baseline
# engine finds nothing in the radix cache (the probe is cached under the same adapter).
BASELINE_PROBE = [7, 8, 9]


@attrs.frozen
class Served:
    """One generation as the deployment answered it: which version, the full prefix, what came back."""

    version: str
    prefix: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


async def assert_match_clean_baselines(fixtures, log_dir: Path, served: list[Served]) -> None:  # type: ignore[no-untyped-def]
    """Serve every version of `served` from its own fresh engine process that never held anything else, and
    require each generation's tokens and logprobs there, for the same full prefix: the first request on each
    baseline engine shows `cached_tokens == 0`, so the comparison starts from a clean cache."""
    versions = sorted({s.version for s in served})
    configs = [
        EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(), log_path=log_dir / f"baseline-{v}.log",
                     extra_args=TEST_ENGINE_ARGS, env=engine_env(**{SOURCE_ROOT_ENV: str(fixtures.root)}))
        for v in versions
    ]  # fmt: skip
    processes = await asyncio.to_thread(start_all, configs)
    try:
        for version, process in zip(versions, processes, strict=True):
            client = client_for(process)
            try:
                status = await client.status()
                assert not status["managed"] and not status["adapters"], status  # holds nothing before
                staged = await publish_from_disk(client, fixtures.adapters[version], f"baseline-{version}",
                                                 probe=BASELINE_PROBE)  # fmt: skip
                assert [a["name"] for a in (await client.status())["adapters"]] == [staged.name]  # only this one
                for i, generation in enumerate(s for s in served if s.version == version):
                    clean = await client.generate(list(generation.prefix), staged.name,
                                                  len(generation.output_ids), ignore_eos=True)  # fmt: skip
                    if i == 0:
                        assert clean.cached_tokens == 0, clean.cached_tokens
                    assert tuple(clean.output_ids) == generation.output_ids, (version, generation, clean)
                    worst = max(abs(a - b) for a, b in zip(clean.logprobs, generation.logprobs, strict=True))
                    assert worst <= LOGPROB_TOLERANCE, (version, worst, generation, clean.logprobs)
            finally:
                await client.aclose()
    finally:
        for process in processes:
            await asyncio.to_thread(process.stop)


async def _engines_idle(deployment: Deployment) -> None:
    """Test isolation: a request an earlier test left decoding (a cancelled caller whose engine has not yet
    noticed the disconnect) shares the engine's KV cache and its native refcounts with this test's requests.
    Wait until no engine holds one; an engine that still does after a minute leaked it, and the test says so."""
    for name, engine_client in deployment.clients.items():
        await _engine_idle(name, engine_client.base_url)


async def _engine_idle(name: str, url: str) -> None:
    seen: list[object] = [None]
    async with client_for(url) as client:

        async def idle() -> bool:
            try:
                seen[0] = (await client.status())["requests_in_flight"]
            except UnknownOutcome:  # an engine a test killed and is restarting: nothing of ours in it
                return True
            return seen[0] == 0

        await wait_until(idle, timeout_s=60, poll_s=0.2, last=lambda: f"{name}: requests in flight {seen[0]}")


@asynccontextmanager
async def deployed(engines, fixtures, tmp_path, capacity: int = 2) -> AsyncIterator[Deployment]:  # type: ignore[no-untyped-def]
    deployment = Deployment(engines, fixtures, tmp_path, capacity=capacity)
    await _engines_idle(deployment)
    await deployment.publisher.sync_incarnations()
    try:
        yield deployment
    finally:
        # Test teardown (not the protocol): unload whatever this deployment left on the engines so
        # later tests find free managed slots (signed by the test's own client: it stands where the registry does).
        for deployment_client in deployment.clients.values():
            async with client_for(deployment_client.base_url) as client:
                try:
                    status = await client.status()
                except UnknownOutcome:  # an engine a test killed: its restart starts with nothing loaded
                    continue
                for adapter in status["managed"]:
                    if adapter["state"] in ("READY", "STAGING") and str(deployment.epoch) in adapter["name"]:
                        await client.managed("reclaim", lora_name=adapter["name"], reclaim_id="teardown", wait_s=60)
        await deployment.close()


def assert_matches_reference(
    deployment: Deployment, label: str, prefix: list[int], logprobs: tuple[float, ...], output_ids: tuple[int, ...]
) -> None:
    """Every generated token's logprob equals the reference forward of the same version over the same
    full prefix (teacher-forced on the engine's own tokens) within the tolerance."""
    snapshot = deployment.candidates[next(v for v in deployment.candidates if v.version_id == label)].snapshot
    expected = deployment.reference.score(snapshot, prefix, output_ids)
    worst = max(abs(e - lp) for e, lp in zip(expected, logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE, (label, worst, expected, logprobs)


def test_rfc_3_4_publish_b_while_a_serves(engines, fixtures, tmp_path) -> None:
    served: list[Served] = []

    def keep(version: str, prefix: list[int], generation) -> None:  # type: ignore[no-untyped-def]
        served.append(Served(version, tuple(prefix), tuple(generation.output_ids), tuple(generation.logprobs)))

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            audit_before = await d.audit()
            binder = d.binder
            with pytest.raises(NoPublishedVersion):  # before the bootstrap commit
                await binder.bind_first(binder.open("S_early@E0"))

            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed  # bootstrap through the same protocol

            s_old = binder.open("S_old@E0")
            assert (await binder.bind_first(s_old)).version == a_version
            old_turn = await binder.generate(s_old, PROMPT, 4)
            keep("A", PROMPT, old_turn)

            # B: READY on E0 only (E1's end is held), then S_mid still binds A.
            b_version, b = d.candidate("B")
            e1 = d.ports["E1"]
            release = asyncio.Event()
            real_end = e1.end

            async def held_end(candidate, attempt_token):  # type: ignore[no-untyped-def]
                await release.wait()
                return await real_end(candidate, attempt_token)

            e1.end = held_end  # type: ignore[method-assign]
            publication = asyncio.create_task(d.publisher.publish(b_version, b))
            for _ in range(600):
                view = await d.registry.publication_view()
                placement = view.versions.get(b_version)
                if placement and placement.placements["E0"].state.name == "READY":
                    break
                await asyncio.sleep(0.05)
            assert view.versions[b_version].placements["E1"].state.name != "READY"
            assert view.default == a_version
            s_mid = binder.open("S_mid@E1")
            assert (await binder.bind_first(s_mid)).version == a_version

            release.set()
            outcome = await publication
            e1.end = real_end  # type: ignore[method-assign]
            assert outcome.committed, outcome
            assert set(outcome.phases) >= {"reserve", "begin", "bucket_0", "bucket_3", "end", "commit"}

            s_new = binder.open("S_new@E1")
            assert (await binder.bind_first(s_new)).version == b_version
            states = await d.registry.version_states([a_version, b_version])
            assert states == {a_version: VersionState.RETIRED, b_version: VersionState.PUBLISHED}

            # Old sessions continue on A (tool turn with the full prefix, a retry, a resume), on both
            # engines; the new session runs on B. Each is checked against a clean baseline below.
            prefix = PROMPT + list(old_turn.output_ids) + TOOL_TOKENS
            tool_turn = await binder.generate(s_old, prefix, 4)
            keep("A", prefix, tool_turn)
            retry = await binder.generate(s_old, prefix, 4)
            keep("A", prefix, retry)
            assert retry.output_ids == tool_turn.output_ids
            mid = await binder.generate(s_mid, PROMPT, 6)
            keep("A", PROMPT, mid)
            resume_prefix = PROMPT + list(mid.output_ids[:3])
            resumed = await binder.generate(s_mid, resume_prefix, 3)
            keep("A", resume_prefix, resumed)
            new = await binder.generate(s_new, PROMPT, 6)
            keep("B", PROMPT, new)
            assert new.output_ids != mid.output_ids

            for key in (s_old, s_mid, s_new):
                await binder.finish(key)
            assert engine_wide_deltas(audit_before, await d.audit()) == dict.fromkeys(
                engine_wide_deltas(audit_before, audit_before), 0
            )

    run(body())
    # Every generation above against A alone and B alone, each in a fresh engine process.
    assert {s.version for s in served} == {"A", "B"} and len(served) == 6
    run(assert_match_clean_baselines(fixtures, tmp_path, served))


def test_rfc_5_2_capacity_rejects_c_until_a_is_reclaimed(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            c_version, c = d.candidate("C")
            assert (await d.publisher.publish(a_version, a)).committed
            sessions = [d.binder.open(f"S{i}@E{i % 2}") for i in range(3)]
            for key in sessions:
                assert (await d.binder.bind_first(key)).version == a_version
                await d.binder.generate(key, PROMPT, 2)
            assert (await d.publisher.publish(b_version, b)).committed

            audit_before = await d.audit()
            refused = await d.publisher.publish(c_version, c)
            assert (refused.status, refused.reason) == ("REJECTED", "CAPACITY_ERROR")
            after_refusal = await d.audit()
            for engine in d.clients:  # zero begin and zero transfer calls reached the engines
                assert after_refusal[engine]["managed_begin"] == audit_before[engine]["managed_begin"]

            not_yet = await d.reclaimer.reclaim(a_version)
            assert (not_yet.status, not_yet.reason) == ("REJECTED", "NOT_RECLAIMABLE")  # sessions still hold A
            for key in sessions:
                await d.binder.finish(key)
            reclaimed = await d.reclaimer.reclaim(a_version)
            assert reclaimed.status == "RECLAIMED" and set(reclaimed.confirmed) == {"E0", "E1"}
            after_reclaim = await d.audit()
            for engine in d.clients:  # each engine unloaded A exactly once
                assert after_reclaim[engine]["physical_unload"] == audit_before[engine]["physical_unload"] + 1
            # A repeated reclaim retries the same claim key: answered from the journal (claim.retired's answer,
            # same reclaim id), its engine calls are replays (reclaim.replay) and change nothing.
            again = await d.reclaimer.reclaim(a_version)
            assert (await d.audit()) == after_reclaim
            assert (again.status, again.reclaim_id) == ("RECLAIMED", reclaimed.reclaim_id)

            accepted = await d.publisher.publish(c_version, c)
            assert accepted.committed
            view = await d.registry.publication_view()
            assert view.default == c_version and view.managed_count() <= 2
            assert engine_wide_deltas(audit_before, await d.audit()) == dict.fromkeys(
                engine_wide_deltas(audit_before, audit_before), 0
            )

    run(body())


def test_duplicate_publication_and_content_conflict(engines, fixtures, tmp_path) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            assert (await d.publisher.publish(a_version, a)).committed
            audit = await d.audit()
            replay = await d.publisher.publish(a_version, a)  # same key, same content: nothing happens again
            assert (replay.status, replay.version_state) == ("REPLAYED", "PUBLISHED")
            assert await d.audit() == audit
            _, other = d.candidate("B")
            conflict = await d.registry.submit(Reserve(a_version, other.snapshot.digest))
            assert isinstance(conflict.result, Rejected) and str(conflict.result.reason) == "VERSION_CONFLICT"

    run(body())


def test_an_engine_speaking_another_protocol_version_is_refused_before_any_begin(
    engines, fixtures, tmp_path, monkeypatch
) -> None:
    """The real engines advertise protocol PROTOCOL_VERSION; this publisher is made to speak the next one (the
    engines cannot be made to speak another version on demand, the publisher's constant can). The first link
    to each engine incarnation reads the advertised version and refuses, typed, before a `begin` is sent; the
    attempt is aborted and cleaned (FAILED_CLEAN), and the same version publishes once both ends agree."""
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            a_version, a = d.candidate("A")
            before = await d.audit()
            monkeypatch.setattr(engine_staging, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
            refused = await d.publisher.publish(a_version, a)
            assert (refused.status, refused.reason) == ("FAILED_CLEAN", PROTOCOL_MISMATCH), refused
            assert refused.detail is not None and refused.detail.startswith(f"{PROTOCOL_MISMATCH}: engine E")
            assert f"speaks managed protocol {PROTOCOL_VERSION}, this publisher {PROTOCOL_VERSION + 1}" in (
                refused.detail)
            after = await d.audit()
            assert {e: a["managed_begin"] for e, a in after.items()} == {
                e: a["managed_begin"] for e, a in before.items()}  # no begin reached either engine
            view = await d.registry.publication_view()
            assert view.versions[a_version].state is VersionState.FAILED_CLEAN and view.default is None
            assert view.managed_count() == 0  # cleaned on both (nothing was staged): the slot is free
            monkeypatch.undo()
            assert (await d.publisher.publish(a_version, a)).committed

    run(body())


def test_really_trained_adapter_is_published_and_served_exactly(engines, fixtures, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(str(fixtures.model_dir), dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
        ),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(1, 500, (4, 24))
    losses = []
    for _ in range(5):  # real optimizer steps on CPU
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    snapshot = snapshot_from_peft_model(model)

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            version, candidate = d.candidate("trained", snapshot=snapshot)
            assert (await d.publisher.publish(version, candidate)).committed
            for engine in ("E0", "E1"):
                session = d.binder.open(f"S_trained@{engine}")
                served = await d.binder.generate(session, PROMPT, 4)
                assert_matches_reference(d, "trained", PROMPT, served.logprobs, served.output_ids)
                await d.binder.finish(session)

    run(body())


def test_every_training_rank_gets_the_same_outcome(engines, fixtures, tmp_path) -> None:
    import concurrent.futures
    import datetime
    import json
    import subprocess
    import sys
    from pathlib import Path

    from versioned_lora.adapters.rank_outcome import publish_on_every_rank
    from versioned_lora.adapters.transfer import free_port, init_transfer_group

    port, world = free_port(), 3
    script = Path(__file__).with_name("rank_process.py")
    # Rank 0 hosts the rendezvous store: start it first, so the other ranks find it listening.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        rank0 = pool.submit(
            init_transfer_group,
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=world,
            group_name="trainer-ranks",
            device="cpu",
            timeout=datetime.timedelta(seconds=300),
        )
        time.sleep(2.0)
        others = [
            subprocess.Popen(
                [sys.executable, str(script), str(port), str(rank), str(world), "3"], stdout=subprocess.PIPE, text=True
            )
            for rank in (1, 2)
        ]
        group = rank0.result()

    async def scenario() -> list:
        async with deployed(engines, fixtures, tmp_path) as d:
            loop = asyncio.get_running_loop()
            outcomes = []

            async def on_all_ranks(version, candidate, probe_ok=True):  # type: ignore[no-untyped-def]
                if not probe_ok:
                    d.publisher.probe_check = lambda *_: False  # the engines' probe "disagrees": a failure
                result = await asyncio.to_thread(
                    publish_on_every_rank,
                    0,
                    group,
                    version,
                    lambda: asyncio.run_coroutine_threadsafe(d.publisher.publish(version, candidate), loop).result(),
                )
                outcomes.append(result)

            a_version, a = d.candidate("A")
            b_version, b = d.candidate("B")
            await on_all_ranks(a_version, a)  # success
            await d.publisher.publish(b_version, b)
            c_version, c = d.candidate("C")
            await on_all_ranks(c_version, c)  # capacity rejection
            assert (await d.reclaimer.reclaim(a_version)).status == "RECLAIMED"
            await on_all_ranks(*d.candidate("C2", snapshot=c.snapshot), probe_ok=False)  # failure
            return outcomes

    mine = run(scenario())
    theirs = [[json.loads(line) for line in proc.communicate(timeout=120)[0].splitlines()] for proc in others]
    assert [o.status for o in mine][:2] == ["COMMITTED", "REJECTED"] and mine[1].reason == "CAPACITY_ERROR"
    assert mine[2].status == "FAILED_CLEAN" and mine[2].reason == "PROBE_MISMATCH"
    expected = [{"status": o.status, "reason": o.reason, "version": list(o.version)} for o in mine]
    assert theirs == [expected, expected]
