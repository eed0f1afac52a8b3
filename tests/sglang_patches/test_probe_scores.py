"""The probe's scores on real engines (issue 46, item 2): what `PROBE_ULPS` is measured on.

Each candidate is staged on a real SGLang CPU engine (begin, buckets over gloo, end) and the engine's teacher-forced
scores of the probe (`end`'s receipt) are compared with a transformers + PEFT forward of the same snapshot, in units
in the last place of bf16 at the top logit that forward measures (`spread_ulps`). The candidates are the fixture's
adapters A, B, C and, as an RL loop makes them, each of them moved a little (seeded noise on every tensor) several
times: on the tiny fixture (the session's engines; top logits near 1) and on the real-logit fixture (its own engine;
top logits 20-30, where one bf16 step is 0.125). Beside it, how many of the same correct candidates the check of
before would have refused (the engine's greedy token the reference's, its logprob within 0.02 nats).

Printed, one line per fixture: `probe_scores fixture=... candidates=N spread_ulps_max=... tolerance_ulps=...
old_check_refusals=...`. Asserted: every candidate within the tolerance `2 * PROBE_ULPS` ulps with half of it to
spare (the measured spread at most PROBE_ULPS), so a correct candidate is never refused on these fixtures.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_helpers import TEST_ENGINE_ARGS, client_for, engine_env, run
from safetensors.torch import load_file

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.adapters.probe_check import PROBE_ULPS, largest_difference, ulp
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_tensors
from versioned_lora.fixtures import REAL_LOGITS, TINY_PROBE_PROMPT, Fixtures, build_fixtures
from versioned_lora.spec.identities import VersionKey, lora_name
from versioned_lora.spec.wire import SOURCE_ROOT_ENV

PROBE = list(TINY_PROBE_PROMPT)
MOVES = 3  # training-like moves of each adapter
OLD_EPSILON = 0.02  # the fixed-nats check of before


@pytest.fixture(scope="module")
def real_logits() -> Fixtures:
    return build_fixtures(fixture=REAL_LOGITS)


@pytest.fixture(scope="module")
def real_logits_engine(real_logits: Fixtures, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One engine serving the real-logit fixture's model (its adapters have the tiny fixture's shape)."""
    directory = tmp_path_factory.mktemp("real-logits")
    config = EngineConfig(model_dir=real_logits.model_dir, port=free_port_block(), log_path=directory / "engine.log",
                          extra_args=TEST_ENGINE_ARGS, env=engine_env(**{SOURCE_ROOT_ENV: str(real_logits.root)}))
    (engine,) = start_all([config])
    try:
        yield engine
    finally:
        engine.stop()


def candidates(fixtures: Fixtures) -> list[Snapshot]:
    """A, B, C, and each moved MOVES times by seeded noise of 1% of the tensor's own scale."""
    out = []
    for name in sorted(fixtures.adapters):
        directory = fixtures.adapters[name]
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        config = json.loads((directory / "adapter_config.json").read_text())
        out.append(snapshot_from_tensors(tensors, config))
        for move in range(MOVES):
            generator = torch.Generator().manual_seed(1000 * ord(name) + move)
            moved = {key: t + 0.01 * t.float().std() * torch.randn(t.shape, generator=generator).to(t.dtype)
                     for key, t in tensors.items()}
            out.append(snapshot_from_tensors(moved, config))
    return out


async def engine_probes(engine: Any, snapshots: list[Snapshot]) -> list[dict[str, Any]]:
    """Each snapshot staged on the engine, its `end` probe read, then reclaimed (the engine's slots stay free)."""
    probes = []
    async with client_for(engine) as client:
        link = await EngineLink.connect(client)
        try:
            for snapshot in snapshots:
                name = lora_name(VersionKey(1, f"p{uuid.uuid4().hex[:8]}"), snapshot.digest)
                candidate = Candidate.build(name, snapshot, 64 * 1024)
                attempt = f"attempt-{uuid.uuid4().hex[:8]}"
                await link.begin(candidate, attempt)
                for index in range(candidate.bucket_count):
                    await link.transfer_bucket(candidate, attempt, index)
                probes.append((await link.end(candidate, attempt, PROBE))["adapter"]["probe"])
                await link.reclaim(name, f"teardown-{name}", wait_s=60)
        finally:
            link.close()
    return probes


def measured(fixtures: Fixtures, engine: Any) -> dict[str, Any]:
    snapshots = candidates(fixtures)
    probes = run(engine_probes(engine, snapshots))
    reference = ReferenceModel(fixtures.model_dir)
    spreads, old_refusals, tops = [], 0, []
    for snapshot, probe in zip(snapshots, probes, strict=True):
        expected = reference.probe(snapshot, PROBE)
        difference = largest_difference(probe["scores"], expected.scores)
        assert difference is not None, (probe, expected)
        spreads.append(difference.nats / ulp(expected.top_logit))
        tops.append(expected.top_logit)
        first = reference.first_token(snapshot, PROBE)
        old_ok = probe["token_id"] == first.token_id and abs(probe["logprob"] - first.logprob) <= OLD_EPSILON
        old_refusals += not old_ok
    figures = {"fixture": fixtures.name, "candidates": len(snapshots), "top_logit_max": round(max(tops), 2),
               "spread_ulps_max": round(max(spreads), 3), "tolerance_ulps": 2 * PROBE_ULPS,
               "old_check_refusals": old_refusals}
    print("probe_scores " + " ".join(f"{k}={v}" for k, v in figures.items()))
    return figures


def test_probe_scores_of_correct_candidates_lie_well_within_the_tolerance_on_the_tiny_fixture(
    engines: Any, fixtures: Fixtures
) -> None:
    figures = measured(fixtures, engines.e0)
    assert figures["candidates"] == 3 * (1 + MOVES)
    assert figures["spread_ulps_max"] <= PROBE_ULPS, figures


def test_probe_scores_of_correct_candidates_lie_well_within_the_tolerance_at_real_logit_magnitudes(
    real_logits: Fixtures, real_logits_engine: EngineProcess
) -> None:
    figures = measured(real_logits, real_logits_engine)
    assert figures["top_logit_max"] >= 20.0, figures  # the magnitudes a trained model has
    assert figures["spread_ulps_max"] <= PROBE_ULPS, figures
