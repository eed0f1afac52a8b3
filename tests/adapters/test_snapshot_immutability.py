"""Snapshots on the tiny Qwen3 fixture with real PEFT: immutable under a real optimizer step, the same digest
from every source (live model, adapter dir, exported tensors), and a saved directory PEFT loads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from versioned_lora.adapters.manifest import ManifestMismatch, MismatchKind
from versioned_lora.adapters.snapshot import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    MANIFEST_FILE,
    Snapshot,
    SnapshotError,
    snapshot_from_adapter_dir,
    snapshot_from_peft_model,
    snapshot_from_tensors,
)
from versioned_lora.fixtures import Fixtures

BASE_ID = "qwen3-tiny@fixture-rev1"


def load_peft(fixtures: Fixtures, adapter: str, trainable: bool = False) -> PeftModel:
    base = Qwen3ForCausalLM.from_pretrained(fixtures.model_dir, dtype=torch.bfloat16)
    return PeftModel.from_pretrained(base, fixtures.adapters[adapter], is_trainable=trainable)


def live_storage_ptrs(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


def prompt_ids() -> torch.Tensor:
    return torch.tensor([[1, 17, 42, 99, 300, 7, 256, 3, 88, 5, 61, 400]])


def test_snapshot_is_unchanged_by_a_real_optimizer_step(fixtures: Fixtures) -> None:
    model = load_peft(fixtures, "A", trainable=True)
    snapshot = snapshot_from_peft_model(model, base_model=BASE_ID)
    frozen_bytes = {name: t.clone() for name, t in snapshot.tensors.items()}
    digest = snapshot.digest

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # PEFT keeps LoRA weights in fp32
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = prompt_ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()

    # The live adapter did move ...
    after = snapshot_from_peft_model(model, base_model=BASE_ID)
    assert after.digest != digest
    moved = [n for n in snapshot.tensors if not torch.equal(after.tensors[n], snapshot.tensors[n])]
    assert len(moved) == len(snapshot.tensors), "every LoRA tensor gets a gradient here"
    # ... and the snapshot did not.
    assert snapshot.digest == digest
    snapshot.verify()
    for name, tensor in snapshot.tensors.items():
        assert torch.equal(tensor, frozen_bytes[name]), name
    copies = {t.untyped_storage().data_ptr() for t in snapshot.tensors.values()}
    assert not copies & live_storage_ptrs(model)
    assert len(copies) == len(snapshot.tensors)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in snapshot.tensors.values())


@pytest.mark.parametrize("adapter", ["A", "B"])
def test_same_digest_from_adapter_dir_and_loaded_model(fixtures: Fixtures, adapter: str) -> None:
    from_dir = snapshot_from_adapter_dir(fixtures.adapters[adapter], base_model=BASE_ID)
    from_model = snapshot_from_peft_model(load_peft(fixtures, adapter), base_model=BASE_ID)
    assert from_dir.digest == from_model.digest
    assert list(from_dir.tensors) == list(from_model.tensors)
    # Names are PEFT's saved names, exactly what adapter_model.safetensors holds.
    assert set(from_dir.tensors) == set(load_file(str(fixtures.adapters[adapter] / ADAPTER_WEIGHTS_FILE)))
    assert all(".default." not in name for name in from_model.tensors)


def test_same_digest_from_exported_tensors_and_config(fixtures: Fixtures) -> None:
    """The Relax shape: a dict of tensors in PEFT naming plus a config (dict or LoraConfig)."""
    model = load_peft(fixtures, "A")
    exported = {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    config_dict = json.loads((fixtures.adapters["A"] / ADAPTER_CONFIG_FILE).read_text())
    reference = snapshot_from_adapter_dir(fixtures.adapters["A"], base_model=BASE_ID)
    from_dict = snapshot_from_tensors(exported, config_dict, base_model=BASE_ID)
    from_config = snapshot_from_tensors(exported, model.peft_config["default"], base_model=BASE_ID)
    sparse = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    from_sparse = snapshot_from_tensors(exported, sparse, base_model=BASE_ID)
    assert from_dict.digest == from_config.digest == from_sparse.digest == reference.digest
    # The copies own their memory: writing the exported tensors afterwards changes nothing.
    assert not {t.untyped_storage().data_ptr() for t in from_dict.tensors.values()} & live_storage_ptrs(model)
    with torch.no_grad():
        next(iter(exported.values())).add_(1.0)
    from_dict.verify()
    assert from_dict.digest == reference.digest


def test_digest_depends_on_serving_config_and_base_identity(fixtures: Fixtures) -> None:
    path = fixtures.adapters["A"]
    plain = snapshot_from_adapter_dir(path)
    assert "base_model" not in plain.serving_config
    assert snapshot_from_adapter_dir(path, base_model=BASE_ID).digest != plain.digest
    assert snapshot_from_adapter_dir(path, base_model="other-base").digest != plain.digest
    exported = dict(plain.tensors)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    assert snapshot_from_tensors(exported, config).digest == plain.digest
    assert snapshot_from_tensors(exported, {**config, "lora_alpha": 8}).digest != plain.digest
    assert snapshot_from_tensors(exported, {**config, "use_rslora": True}).digest != plain.digest
    assert snapshot_from_tensors(exported, {**config, "lora_dropout": 0.3}).digest == plain.digest  # training-only


def test_save_adapter_dir_round_trips_and_loads_in_peft(fixtures: Fixtures, tmp_path: Path) -> None:
    model = load_peft(fixtures, "B")
    snapshot = snapshot_from_peft_model(model, base_model=BASE_ID)
    saved = snapshot.save_adapter_dir(tmp_path / "B-saved")
    assert sorted(p.name for p in saved.iterdir()) == sorted(
        [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, MANIFEST_FILE]
    )
    assert (saved / MANIFEST_FILE).read_bytes() == snapshot.manifest.to_json_bytes()
    assert snapshot_from_adapter_dir(saved, base_model=BASE_ID).digest == snapshot.digest
    assert json.loads((saved / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] == BASE_ID

    # PEFT loads it and computes exactly what the snapshotted model computes.
    reloaded = load_peft_from(fixtures, saved)
    with torch.no_grad():
        expected = model(input_ids=prompt_ids()).logits
        actual = reloaded(input_ids=prompt_ids()).logits
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, base_logits(fixtures)), "the adapter must change the output"

    with pytest.raises(FileExistsError):
        snapshot.save_adapter_dir(saved)
    (tmp_path / "empty").mkdir()
    assert snapshot.save_adapter_dir(tmp_path / "empty") == tmp_path / "empty"


def load_peft_from(fixtures: Fixtures, path: Path) -> PeftModel:
    base = Qwen3ForCausalLM.from_pretrained(fixtures.model_dir, dtype=torch.bfloat16)
    return PeftModel.from_pretrained(base, path)


def base_logits(fixtures: Fixtures) -> torch.Tensor:
    base = Qwen3ForCausalLM.from_pretrained(fixtures.model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        logits: torch.Tensor = base(input_ids=prompt_ids()).logits
    return logits


def test_to_peft_state_hands_out_copies(fixtures: Fixtures) -> None:
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["C"])
    state = snapshot.to_peft_state()
    for tensor in state.values():
        tensor.zero_()
    snapshot.verify()


def test_writing_a_stored_tensor_is_caught_by_verify(fixtures: Fixtures) -> None:
    """Stored tensors are read-only by contract; verify() is how an engine or test proves nobody broke it."""
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["C"])
    name = next(iter(snapshot.tensors))
    snapshot.tensors[name][0, 0] += 1
    with pytest.raises(ManifestMismatch) as info:
        snapshot.verify()
    assert info.value.kinds() == {MismatchKind.SHA256}


def test_bad_sources_raise_snapshot_error(fixtures: Fixtures, tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="needs"):
        snapshot_from_adapter_dir(tmp_path)
    with pytest.raises(SnapshotError, match="peft_type"):
        snapshot_from_tensors({}, {"peft_type": "IA3", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]})
    with pytest.raises(SnapshotError, match="lacks"):
        snapshot_from_tensors({}, {"lora_alpha": 8, "target_modules": ["q_proj"]})
    with pytest.raises(SnapshotError, match="adapter"):
        snapshot_from_peft_model(load_peft(fixtures, "A"), adapter_name="nope")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    assert isinstance(snapshot_from_tensors({"x.lora_A.weight": torch.ones(4, 2)}, config), Snapshot)
