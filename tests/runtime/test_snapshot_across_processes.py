"""Snapshot immutability is covered in tests/adapters/test_snapshot_immutability.py (a real optimizer
step leaves the snapshot's tensors and digest unchanged) and the digest's stability across two fresh
interpreters in tests/adapters/test_manifest_digest.py. What this adds: the training side's snapshot
taken in one Ray worker process (a real PEFT model after a real optimizer step), and the same weights
read back in this process, give the same digest; and the frozen copy did not follow a second step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.fixtures import Fixtures

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE_ID = "qwen3-tiny@fixture-rev1"


@ray.remote(num_cpus=0)
def train_and_snapshot(model_dir: str, adapter_dir: str, out_dir: str) -> tuple[str, str, str]:
    """In a Ray worker: one real optimizer step, snapshot, save; then a second step the snapshot must not see."""
    import torch
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    from versioned_lora.adapters.snapshot import snapshot_from_peft_model

    torch.manual_seed(0)
    base = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[1, 17, 42, 99, 300, 7, 256, 3]])

    def train_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    snapshot = snapshot_from_peft_model(model, base_model=BASE_ID)
    snapshot.save_adapter_dir(Path(out_dir))
    train_step()  # the live weights move on ...
    live = snapshot_from_peft_model(model, base_model=BASE_ID).digest
    snapshot.verify()  # ... the frozen copy does not
    return snapshot.digest, live, str(os.getpid())


def test_same_weights_same_digest_in_a_ray_worker_and_here(fixtures: Fixtures, tmp_path: Path) -> None:
    out = tmp_path / "snapshot"
    digest, live_after_second_step, worker_pid = ray.get(
        train_and_snapshot.remote(str(fixtures.model_dir), str(fixtures.adapters["A"]), str(out)), timeout=300
    )
    assert int(worker_pid) != os.getpid()
    here = snapshot_from_adapter_dir(out, base_model=BASE_ID)
    assert here.digest == digest
    assert live_after_second_step != digest
    assert snapshot_from_adapter_dir(fixtures.adapters["A"], base_model=BASE_ID).digest != digest  # it trained
