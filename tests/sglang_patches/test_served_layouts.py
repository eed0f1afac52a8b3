"""The served digest's read-back against SGLang's real pool layout for every dense module (issue 46, item 1).

One tiny engine started with every linear module targeted (`--lora-target-modules` all seven, max rank 8): a
candidate on all seven modules at the max rank, one at half of it (the pool pads B's columns and A's rows past the
rank), and one on q, v, gate and down only (SGLang stacks zeros for the absent k and up, and zero-fills o and the
rest). Each is staged through the managed path, and the served digest and config the engine's `end` answers, read
back from its LoRA memory pool (`managed/served_readback.py`), equal the snapshot's (`Candidate.served_identity`).
The shared engines of the suite target q and v only; the 0.6B-shape engines of tests/zz_scale all seven at r=64."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_helpers import PROMPT, TEST_ENGINE_ARGS, engine_env, run
from test_staged_publication import _reclaim, linked

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.adapters.snapshot import snapshot_from_tensors
from versioned_lora.fixtures import ALL_LINEAR_MODULES, lora_module_shapes
from versioned_lora.spec.identities import VersionKey, lora_name

MAX_RANK = 8
CASES = {"all_seven_at_max_rank": (ALL_LINEAR_MODULES, MAX_RANK),
         "all_seven_at_half_rank": (ALL_LINEAR_MODULES, MAX_RANK // 2),
         "no_k_no_up_no_o": (("q_proj", "v_proj", "gate_proj", "down_proj"), MAX_RANK)}


@pytest.fixture(scope="module")
def all_linear(fixtures: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    directory = tmp_path_factory.mktemp("all-linear")
    config = EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(), log_path=directory / "engine.log",
                          max_lora_rank=MAX_RANK, lora_target_modules=ALL_LINEAR_MODULES,
                          extra_args=TEST_ENGINE_ARGS, env=engine_env())
    (engine,) = start_all([config])
    try:
        yield engine
    finally:
        engine.stop()


def _adapter(fixtures: Any, modules: tuple[str, ...], rank: int) -> dict[str, torch.Tensor]:
    model = json.loads((fixtures.model_dir / "config.json").read_text())
    dims = lora_module_shapes(model)
    rng = torch.Generator().manual_seed(rank * 100 + len(modules))
    out = {}
    for layer in range(model["num_hidden_layers"]):
        for module in modules:
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            in_dim, out_dim = dims[module]
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, generator=rng) * 0.05
            out[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=rng) * 0.05
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engines_read_back_of_every_dense_layout_is_the_snapshots_served_digest(
    all_linear: EngineProcess, fixtures: Any, case: str
) -> None:
    modules, rank = CASES[case]
    snapshot = snapshot_from_tensors(_adapter(fixtures, modules, rank),
                                     {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)})
    candidate = Candidate.build(lora_name(VersionKey(1, f"layout{uuid.uuid4().hex[:6]}"), snapshot.digest), snapshot,
                                64 * 1024)
    expected = candidate.served_identity()

    async def body() -> None:
        async with linked(all_linear) as (_client, link):
            attempt = f"attempt-{uuid.uuid4().hex[:8]}"
            await link.begin(candidate, attempt)
            for index in range(candidate.bucket_count):
                await link.transfer_bucket(candidate, attempt, index)
            ready = await link.end(candidate, attempt, PROMPT)
            served = ready["adapter"]["served"]
            assert "error" not in served, served
            assert (served["dtype"], served["digest"], served["config"]) == (
                expected.dtype, expected.digest, expected.config), (served, expected)
            await _reclaim(link, candidate.lora_name)

    run(body())
