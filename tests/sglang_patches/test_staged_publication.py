"""Staged publication inside real SGLang engines (RFC §3.2): begin → buckets over gloo → verified end
with a real probe; cleanup races; tampering; a stalled sender; rehydrate after a real restart."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import pytest
import torch
from engine_helpers import PROMPT, Staged, client_for, managed_view, run

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.manifest import MANIFEST_FORMAT_V2, V2_HASH
from versioned_lora.adapters.probe_check import PROBE_ULPS, agree, tolerance
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.sglang_client import ManagedRefusal, SGLangClient
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir, snapshot_from_tensors
from versioned_lora.sglang_patches.managed.endpoints import MAX_BEGIN_BODY, MAX_CONTROL_BODY
from versioned_lora.sglang_patches.managed.scheduler_side import STASH_LOAD_FORMAT
from versioned_lora.spec.identities import VersionKey, lora_name

SMALL_BUCKETS = 8 * 1024  # the fixture adapters are ~28 KB: 4 buckets


def _candidate(adapter_dir: Path, max_bucket_bytes: int = SMALL_BUCKETS, hash_kind: str = "sha256") -> Candidate:
    snapshot = snapshot_from_adapter_dir(adapter_dir, hash_kind=hash_kind)
    name = lora_name(VersionKey(1, f"s{uuid.uuid4().hex[:8]}"), snapshot.digest)
    return Candidate.build(name, snapshot, max_bucket_bytes)


def _attempt() -> str:
    return f"attempt-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def linked(engine) -> AsyncIterator[tuple[SGLangClient, EngineLink]]:  # type: ignore[no-untyped-def]
    async with client_for(engine) as client:
        link = await EngineLink.connect(client)
        try:
            yield client, link
        finally:
            link.close()


async def _publish(link: EngineLink, candidate: Candidate, attempt: str) -> dict:
    await link.begin(candidate, attempt)
    for index in range(candidate.bucket_count):
        await link.transfer_bucket(candidate, attempt, index)
    return await link.end(candidate, attempt, PROMPT)


async def _reclaim(link: EngineLink, name: str) -> None:
    await link.reclaim(name, f"teardown-{name}", wait_s=60)


async def _collectives(client: SGLangClient) -> int:
    return int((await client.status())["staging"]["collectives"])


@pytest.fixture(scope="module")
def reference(fixtures) -> ReferenceModel:
    return ReferenceModel(fixtures.model_dir)


@pytest.mark.parametrize("hash_kind", ["sha256", V2_HASH])
def test_happy_path_over_buckets_probe_matches_a_peft_forward(engines, fixtures, reference, hash_kind: str) -> None:
    candidate = _candidate(fixtures.adapters["B"], hash_kind=hash_kind)
    assert candidate.snapshot.manifest.hash_kind == hash_kind
    assert candidate.bucket_count >= 3
    expected = reference.probe(candidate.snapshot, PROMPT)
    within = tolerance(expected.top_logit, "bfloat16", PROBE_ULPS)

    async def body() -> None:
        async with linked(engines.e0) as (client, link):
            attempt = _attempt()
            prepared = await link.begin(candidate, attempt)
            assert prepared["adapter"]["state"] == "STAGING"  # PREPARED
            for index in range(candidate.bucket_count):
                answer = await link.transfer_bucket(candidate, attempt, index)
                assert answer["adapter"]["buckets_received"] == index + 1
            ready = await link.end(candidate, attempt, PROMPT)
            receipt = ready["result"]
            assert (receipt["lora_name"], receipt["digest"], receipt["attempt_token"], receipt["incarnation"]) == (
                candidate.lora_name, candidate.snapshot.digest, attempt, link.incarnation)
            probe = ready["adapter"]["probe"]
            assert ready["adapter"]["lora_id"] and ready["adapter"]["pinned"]
            # Where `end` spent its time, as the status view reports it (benchmarks/end_phase.py reads these).
            parts = ready["adapter"]["end_parts"]
            assert set(parts) == {"verify_wait_s", "verify_tail_s", "load_s", "probe_s", "served_s"}, parts
            # What the engine read back from its LoRA pool is the snapshot as served (issue 46, item 1), under
            # either manifest version (a v1 one records none: the candidate computes it from its tensors).
            identity = candidate.served_identity()
            assert ready["adapter"]["served"]["digest"] == identity.digest, ready["adapter"]["served"]
            assert ready["adapter"]["served"]["config"] == identity.config
            assert all(isinstance(v, float) and 0 <= v < 60 for v in parts.values()), parts
            # The candidate's teacher-forced scores of the probe, one per token after the first, agree with the
            # reference forward's within the probe check's tolerance.
            assert len(probe["scores"]) == len(PROMPT) - 1
            assert agree(probe["scores"], expected.scores, within), (probe["scores"], expected, within)
            served = await client.generate(PROMPT, candidate.lora_name, 1)
            assert served.logprobs[0] == pytest.approx(probe["logprob"], abs=1e-6)
            # Loaded from the verified stash's own tensors (SGLang names such a load's path "__tensor__"),
            # not from a file; the stash itself is gone once loaded.
            models = (await client._http.get("/v1/models")).json()["data"]
            assert {m["id"]: m["root"] for m in models}[candidate.lora_name] == "__tensor__"
            assert attempt not in (await client.status())["staging"]["stashes"]
            await _reclaim(link, candidate.lora_name)

    run(body())


def test_late_control_duplicate_receive_and_cleanup_before_during_after(engines, fixtures) -> None:
    async def body() -> None:
        async with linked(engines.e1) as (client, link):
            # Cleanup before begin: the late begin, bucket and end create nothing.
            early = _candidate(fixtures.adapters["A"])
            attempt = _attempt()
            await link.cleanup(early.lora_name, attempt)
            for late in (link.begin(early, attempt), link.receive_bucket_again(early, attempt, 0),
                         link.end(early, attempt, PROMPT)):
                with pytest.raises(ManagedRefusal) as refused:
                    await late
                assert refused.value.reason == "STALE_ATTEMPT"
            assert (await managed_view(client, early.lora_name))["state"] == "CLEANED"
            assert attempt not in (await client.status())["staging"]["stashes"]

            # Cleanup during the transfer: stash freed, late bucket/end refused, no collective added.
            during = _candidate(fixtures.adapters["B"])
            attempt = _attempt()
            await link.begin(during, attempt)
            await link.transfer_bucket(during, attempt, 0)
            before = await _collectives(client)
            again = await link.receive_bucket_again(during, attempt, 0)  # a duplicate receive
            assert again["adapter"]["buckets_received"] == 1
            assert await _collectives(client) == before
            await link.cleanup(during.lora_name, attempt)
            await link.cleanup(during.lora_name, attempt)  # idempotent
            assert attempt not in (await client.status())["staging"]["stashes"]
            for late in (link.receive_bucket_again(during, attempt, 1), link.end(during, attempt, PROMPT)):
                with pytest.raises(ManagedRefusal) as refused:
                    await late
                assert refused.value.reason == "STALE_ATTEMPT"
            assert await _collectives(client) == before

            # Cleanup after end: the loaded candidate is unloaded once; a late end loads nothing.
            after = _candidate(fixtures.adapters["C"])
            attempt = _attempt()
            await _publish(link, after, attempt)
            unloads = (await client.status())["audit"]["physical_unload"]
            await link.cleanup(after.lora_name, attempt)
            await link.cleanup(after.lora_name, attempt)
            status = await client.status()
            assert status["audit"]["physical_unload"] == unloads + 1
            assert after.lora_name not in {a["name"] for a in status["adapters"]}
            with pytest.raises(ManagedRefusal) as refused:
                await link.end(after, attempt, PROMPT)
            assert refused.value.reason == "STALE_ATTEMPT"
            assert await client.adapter(after.lora_name) is None

    run(body())


def test_two_attempts_staged_at_once_over_one_link_take_turns_on_its_group(engines, fixtures) -> None:
    """A restart's rehydrates stage several versions on one engine at once, over its one link. The group's
    collectives pair up by their order on each side; before the link sent one bucket at a time, the engine could
    post its receives in another order than the sends went out, and gloo aborted its scheduler ("Received data
    size doesn't match expected size", the CI run at b9822d6). Bucket sizes differ between the two plans, so any
    crossing would be that abort."""
    first = _candidate(fixtures.adapters["A"])
    second = _candidate(fixtures.adapters["C"], max_bucket_bytes=5 * 1024)
    sizes = [[b.nbytes for b in c.plan.buckets] for c in (first, second)]
    assert all(a != b for a, b in zip(*sizes, strict=False)), sizes

    async def body() -> None:
        async with linked(engines.e1) as (client, link):
            incarnation = link.incarnation
            for _ in range(3):  # a few rounds: the crossing was a race
                attempts = [_attempt(), _attempt()]
                ready = await asyncio.gather(*(_publish(link, c, a) for c, a in zip((first, second), attempts,
                                                                                     strict=True)))
                assert [r["result"]["attempt_token"] for r in ready] == attempts
                for candidate, attempt in zip((first, second), attempts, strict=True):
                    await link.cleanup(candidate.lora_name, attempt)
            status = await client.status()
            assert int(status["incarnation"]) == incarnation and link.poisoned is None
            assert not set(attempts) & set(status["staging"]["stashes"])

    run(body())


def _tampered(snapshot: Snapshot, name: str) -> dict[str, torch.Tensor]:
    tensors = snapshot.to_peft_state()
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] += 1.0  # the sender changed a weight after the manifest was fixed
    return tensors


@pytest.mark.parametrize(("hash_kind", "bucket"), [("sha256", "first"), ("sha256", "last"), (V2_HASH, "last")])
def test_end_rejects_weights_altered_after_the_manifest_and_loads_nothing(
    engines, fixtures, hash_kind: str, bucket: str
) -> None:
    # Each bucket is hashed as it lands: a change in the first bucket (hashed long before `end`) and one in the
    # last (hashed after it landed) are refused alike, with the typed mismatch.
    async def body() -> None:
        async with linked(engines.e0) as (client, link):
            candidate = _candidate(fixtures.adapters["A"], hash_kind=hash_kind)
            attempt = _attempt()
            loads = (await client.status())["audit"]["physical_load"]
            await link.begin(candidate, attempt)
            slots = candidate.plan.buckets[0 if bucket == "first" else -1].slots
            altered = _tampered(candidate.snapshot, slots[-1].name)
            for index in range(candidate.bucket_count):
                await link.transfer_bucket(candidate, attempt, index, tensors=altered)
            with pytest.raises(ManagedRefusal) as refused:
                await link.end(candidate, attempt, PROMPT)
            assert refused.value.reason == "MANIFEST_MISMATCH" and "sha256" in str(refused.value)
            status = await client.status()
            assert status["audit"]["physical_load"] == loads
            assert await client.adapter(candidate.lora_name) is None
            assert (await managed_view(client, candidate.lora_name))["state"] == "CLEANED"
            assert attempt not in status["staging"]["stashes"]

    run(body())


def _broken_copy(source: Path, target: Path, how: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = target / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    if how == "shape":
        tensors[name] = torch.cat([tensors[name], tensors[name][:1]])
    elif how == "dtype":
        tensors[name] = tensors[name].to(torch.float16)
    elif how == "missing":
        del tensors[name]
    elif how == "extra":
        tensors[name.replace("layers.0", "layers.1").replace("q_proj", "k_proj")] = tensors[name].clone()
    save_file(tensors, weights)
    return target


@pytest.mark.parametrize("how", ["shape", "dtype", "missing", "extra"])
def test_end_rejects_wrong_shape_dtype_missing_or_extra_tensor(engines, fixtures, tmp_path, how: str) -> None:
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["B"])
    broken = _broken_copy(fixtures.adapters["B"], tmp_path / how, how)

    async def body() -> None:
        async with client_for(engines.e1) as client:
            status = await client.status()
            staged = Staged(lora_name(VersionKey(1, f"w{uuid.uuid4().hex[:8]}"), snapshot.digest), _attempt(),
                            snapshot.digest, status["incarnation"], snapshot.manifest.to_json(), str(broken))
            await client.managed("begin", **staged.begin_body())
            with pytest.raises(ManagedRefusal) as refused:
                await client.managed("end", **staged.end_body())
            assert refused.value.reason == "MANIFEST_MISMATCH"
            assert await client.adapter(staged.name) is None
            assert (await client.status())["audit"]["physical_load"] == status["audit"]["physical_load"]

    run(body())


def test_bad_control_input_is_a_typed_error_that_changes_nothing(engines, fixtures) -> None:
    async def body() -> None:
        async with linked(engines.e0) as (client, link):
            candidate = _candidate(fixtures.adapters["C"])
            attempt = _attempt()
            before = await client.status()

            def begin_body(**overrides: object) -> dict:
                return {"lora_name": candidate.lora_name, "attempt_token": attempt, "incarnation": link.incarnation,
                        "digest": candidate.snapshot.digest, "manifest": candidate.snapshot.manifest.to_json(),
                        "group_name": link.group_name, "max_bucket_bytes": SMALL_BUCKETS,
                        "plan_digest": candidate.plan.digest(), **overrides}

            cases = {
                "BUCKET_TOO_LARGE": begin_body(max_bucket_bytes=2**40),
                "PLAN_MISMATCH": begin_body(plan_digest="0" * 64),
                "DIGEST_MISMATCH": begin_body(digest="f" * 64),
                "MALFORMED_MANIFEST": begin_body(manifest='{"tensors": 3}'),
                "STALE_INCARNATION": begin_body(incarnation=link.incarnation - 1),
                "NOT_MANAGED": begin_body(lora_name="plain-name"),
            }
            for reason, body in cases.items():
                with pytest.raises(ManagedRefusal) as refused:
                    await client.managed("begin", **body)
                assert refused.value.reason == reason, (reason, refused.value)
            # A manifest of a format version or hash kind this engine does not know (a newer publisher).
            known = candidate.snapshot.manifest.to_dict()
            unknowns = ({"format": "versioned-lora/manifest/v3"},
                        {"format": MANIFEST_FORMAT_V2, "hash": "sha256-chunked-4096"})
            for unknown in unknowns:
                with pytest.raises(ManagedRefusal) as refused:
                    await client.managed("begin", **begin_body(manifest=json.dumps({**known, **unknown})))
                assert refused.value.reason == "UNSUPPORTED_MANIFEST", (unknown, refused.value)

            with pytest.raises(ManagedRefusal) as unknown:  # an attempt this engine never began
                await link.receive_bucket_again(candidate, "attempt-unknown", 0)
            assert unknown.value.reason == "STALE_ATTEMPT"
            oversized = await client._http.post("/versioned_lora/receive_bucket", content=b"{" + b" " * 70_000 + b"}")
            assert oversized.status_code == 413
            huge_begin = b"{" + b" " * MAX_BEGIN_BODY + b"}"  # begin carries the manifest: a larger bound
            assert (await client._http.post("/versioned_lora/begin", content=huge_begin)).status_code == 413
            # A stock load-from-tensors that names a stash (the managed load's format) under an ordinary name:
            # no stash of that attempt was verified, so the scheduler loads nothing.
            forged = await client._http.post("/load_lora_adapter_from_tensors", json={
                "lora_name": "forged-stash-load", "config_dict": {}, "load_format": STASH_LOAD_FORMAT,
                "serialized_named_tensors": [base64.b64encode(attempt.encode()).decode()]})
            assert forged.status_code == 400 and "STASH_NOT_VERIFIED" in forged.text, forged.text

            after = await client.status()
            assert await managed_view(client, candidate.lora_name) is None
            assert after["staging"]["stashes"] == before["staging"]["stashes"]
            assert after["adapters"] == before["adapters"]
            # Every refused begin reached the engine (counted) and changed nothing else.
            assert after["audit"]["managed_begin"] == before["audit"]["managed_begin"] + len(cases) + len(unknowns)
            assert {k: v for k, v in after["audit"].items() if k != "managed_begin"} == {
                k: v for k, v in before["audit"].items() if k != "managed_begin"}

    run(body())


def test_begin_takes_the_manifest_of_a_full_size_adapter(engines) -> None:
    """A LoRA on every attention projection of a deep model has thousands of tensors; its manifest (~200
    bytes a tensor) is far beyond the 64 KiB of the other control calls, and `begin` must still take it."""
    tensors = {f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{ab}.weight": torch.zeros(8, 8)
               for layer in range(300) for module in ("q_proj", "v_proj") for ab in "AB"}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    snapshot = snapshot_from_tensors(tensors, config)
    assert len(snapshot.manifest.to_json()) > 3 * MAX_CONTROL_BODY
    candidate = Candidate.build(lora_name(VersionKey(1, f"big{uuid.uuid4().hex[:6]}"), snapshot.digest), snapshot,
                                SMALL_BUCKETS)

    async def body() -> None:
        async with linked(engines.e0) as (client, link):
            attempt = _attempt()
            prepared = await link.begin(candidate, attempt)
            assert prepared["adapter"]["state"] == "STAGING" and prepared["adapter"]["bucket_count"] == len(
                candidate.plan.buckets)
            await link.cleanup(candidate.lora_name, attempt)
            assert (await managed_view(client, candidate.lora_name))["state"] == "CLEANED"
            assert attempt not in (await client.status())["staging"]["stashes"]

    run(body())


# A forward pass as the scheduler logs it (SGLang 0.5.23's `SchedulerMetricsReporter.report_prefill_stats` /
# `report_decode_stats`: every prefill, and a decode line every `decode_log_interval` = 40 steps), with its second.
SCHEDULER_STEP = re.compile(rb"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (?:Decode|Prefill) batch", re.MULTILINE)


def scheduler_steps(log: Path, offset: int) -> list[float]:
    """The wall-clock second of every forward pass the engine logged past `offset` in its log."""
    return [datetime.strptime(m.group(1).decode(), "%Y-%m-%d %H:%M:%S").timestamp()
            for m in SCHEDULER_STEP.finditer(log.read_bytes()[offset:])]


def test_decode_keeps_progressing_while_the_sender_stalls_mid_attempt(engines, fixtures) -> None:
    """A scheduler that waited for a bucket's missing bytes would stop its forward passes for the whole bucket
    deadline. So the engine's own record of its forward passes (its log) must go on before, through and after
    the refusal, with no gap reaching half the deadline (12 s: a stopped scheduler and a loaded host stay far
    apart). One request cannot outlast the deadline (the fixture's context is 2048 tokens), so requests follow
    each other until one has run wholly after the refusal.

    The client's chunk arrivals are printed beside it, not asserted: in one CI run (2026-12-03, b6aac64's
    clean clone) they paused 8.96 s while the engine log showed decode batches in every one of those seconds
    and the rest of the stream came at the request's end, so the client's view measures the HTTP stream's
    delivery as much as the scheduler."""
    deadline_s = 12.0
    tokens = 1800  # per request: several seconds of decode at the few hundred tokens a second of this host
    log = engines.e1.config.log_path

    async def body() -> None:
        async with linked(engines.e1) as (client, link):
            candidate = _candidate(fixtures.adapters["A"])
            attempt = _attempt()
            await link.begin(candidate, attempt, bucket_deadline_s=deadline_s)
            await link.transfer_bucket(candidate, attempt, 0)
            offset = log.stat().st_size

            # The publisher stops sending: bucket 1 is requested but its bytes never come.
            stalled = asyncio.create_task(client.managed("receive_bucket", lora_name=candidate.lora_name,
                                                         attempt_token=attempt, incarnation=link.incarnation,
                                                         index=1))
            asked_at = time.time()
            refused_at: list[float] = []
            stalled.add_done_callback(lambda _task: refused_at.append(time.time()))
            arrivals: list[float] = []
            for _ in range(6):  # a bound, not a target: about 3 requests on an idle host, 5 on a loaded one
                started = time.time()
                progress = await client.stream_progress(PROMPT, None, tokens)
                assert progress[-1][1] == tokens
                arrivals += [at for at, _tokens in progress]
                # Until a whole request ran after the refusal: the engine logs one line per 40 decode passes
                # (SGLang's decode_log_interval), so a request that merely ends after it may log its last line
                # before it (one CI run: last line at +13 s, refusal at +14.1 s).
                if refused_at and refused_at[0] < started:
                    break
            with pytest.raises(ManagedRefusal) as missed:
                await stalled
            assert missed.value.reason == "BUCKET_DEADLINE" and missed.value.status_code == 504

            steps = scheduler_steps(log, offset)
            step_gaps = [later - earlier for earlier, later in itertools.pairwise(steps)]
            client_gap = max(later - earlier for earlier, later in itertools.pairwise(arrivals))
            where = (f"{len(steps)} forward passes logged from {steps[0] - asked_at:+.0f}s to "
                     f"{steps[-1] - asked_at:+.0f}s of the stalled receive, longest gap {max(step_gaps):.0f}s (1 s "
                     f"resolution); refused at {refused_at[0] - asked_at:+.1f}s (bucket deadline {deadline_s}s); "
                     f"client: {len(arrivals)} chunks, longest gap {client_gap:.2f}s")
            print(f"decode during stalled transfer: {where}")
            # Log seconds are truncated: a pass logged in the refusal's second lies at or before it.
            assert steps[0] <= refused_at[0] < steps[-1] + 1, f"the stall did not lie inside the decode: {where}"
            assert max(step_gaps) < deadline_s / 2, where
            await link.cleanup(candidate.lora_name, attempt)

    run(body())


def test_rehydrate_after_a_real_restart_restores_identical_logprobs(engines, fixtures) -> None:
    candidate = _candidate(fixtures.adapters["B"])

    async def body() -> tuple[list[float], int]:
        async with linked(engines.e1) as (client, link):
            await _publish(link, candidate, _attempt())
            served = await client.generate(PROMPT, candidate.lora_name, 6)
            return served.logprobs, link.incarnation

    before, old_incarnation = run(body())
    engines.e1.restart()

    async def after_restart() -> None:
        async with linked(engines.e1) as (client, link):
            assert link.incarnation > old_incarnation
            assert await managed_view(client, candidate.lora_name) is None  # a new process holds nothing
            stale = {"lora_name": candidate.lora_name, "attempt_token": _attempt(), "incarnation": old_incarnation,
                     "digest": candidate.snapshot.digest, "manifest": candidate.snapshot.manifest.to_json(),
                     "group_name": link.group_name, "max_bucket_bytes": SMALL_BUCKETS,
                     "plan_digest": candidate.plan.digest()}
            with pytest.raises(ManagedRefusal) as refused:
                await client.managed("begin", **stale)
            assert refused.value.reason == "STALE_INCARNATION"

            ready = await _publish(link, candidate, _attempt())  # the rehydrate attempt
            assert ready["result"]["incarnation"] == link.incarnation
            again = await client.generate(PROMPT, candidate.lora_name, 6)
            assert again.logprobs == before
            await _reclaim(link, candidate.lora_name)

    run(after_restart())


def test_an_engine_verifies_pipelined_unless_told_to_run_the_after_last_bucket_baseline(fixtures) -> None:
    from versioned_lora.sglang_patches.managed.scheduler_side import StashStore

    candidate = _candidate(fixtures.adapters["A"])
    manifest, plan = candidate.snapshot.manifest, candidate.plan
    for mode, pipelined, threads in (("pipelined", True, None), ("after-last-bucket", False, 1)):
        store = StashStore("cpu", mode)
        store.allocate("attempt-1", plan.to_json(), manifest.to_json(), "group")
        verifier = store.stashes["attempt-1"].hashing
        assert (verifier.pipelined, verifier.threads) == (pipelined, threads), mode
    with pytest.raises(ValueError, match="VERSIONED_LORA_VERIFY_MODE='serial'"):
        StashStore("cpu", "serial")
