"""The scheduler's read-back of an adapter from the LoRA pool (managed/served_readback.py), over a pool-shaped double
whose slot is stacked by SGLang's own `LoRAAdapter.normalize_qkv_proj` and placed as 0.5.23's
`load_lora_weight_to_buffer` places it: the faults injected here (stale padding, a value where the kernels read a
zero block, a flipped byte) are ones a real engine does not produce on demand. The real pool's layout is held by
tests/e2e/test_served_digest.py, whose engines' read-back equals the snapshot's served record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.lora.lora import LoRAAdapter

from versioned_lora.adapters.manifest import V2_HASH, manifest_from_tensors
from versioned_lora.sglang_patches.managed.served_readback import ReadBackError, read_back

RANK, MAX_RANK, HIDDEN, Q_OUT, KV_OUT, SLOT = 4, 8, 32, 32, 16, 1
CONFIG = {"r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _adapter() -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(3)
    out = {}
    for layer in range(2):
        for module, rows in (("q_proj", Q_OUT), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=rng, dtype=torch.float32)
            out[f"{prefix}.lora_B.weight"] = torch.randn(rows, RANK, generator=rng, dtype=torch.float32)
    return out


def _loaded(tensors: dict[str, torch.Tensor]) -> SimpleNamespace:
    """A LoRAManager-shaped value whose pool holds `tensors` in slot SLOT, as SGLang 0.5.23 puts them there."""
    pool = SimpleNamespace(
        A_buffer={"qkv_proj": [torch.zeros(3, 3 * MAX_RANK, HIDDEN, dtype=torch.bfloat16) for _ in range(2)],
                  "o_proj": [torch.zeros(3, MAX_RANK, Q_OUT, dtype=torch.bfloat16) for _ in range(2)]},
        B_buffer={"qkv_proj": [torch.zeros(3, Q_OUT + 2 * KV_OUT, MAX_RANK, dtype=torch.bfloat16) for _ in range(2)],
                  "o_proj": [torch.zeros(3, HIDDEN, MAX_RANK, dtype=torch.bfloat16) for _ in range(2)]},
        dtype=torch.bfloat16, uid_to_buffer_id={"id": SLOT}, get_buffer_id=lambda uid: {"id": SLOT}[uid])
    for layer in range(2):
        weights = {n: t for n, t in tensors.items() if f".layers.{layer}." in n}
        LoRAAdapter.normalize_qkv_proj(None, list(weights), weights)  # type: ignore[arg-type]  # SGLang's stacking
        stacked_a = weights[f"base_model.model.model.layers.{layer}.self_attn.qkv_proj.lora_A.weight"]
        stacked_b = weights[f"base_model.model.model.layers.{layer}.self_attn.qkv_proj.lora_B.weight"]
        pool.A_buffer["qkv_proj"][layer][SLOT, : 3 * RANK].copy_(stacked_a)  # [buffer_id, :lora_rank * c, :]
        pool.B_buffer["qkv_proj"][layer][SLOT, :, :RANK].copy_(stacked_b)  # [buffer_id, :, :lora_rank]
    adapter = SimpleNamespace(config=SimpleNamespace(r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                              scaling=2.0)
    return SimpleNamespace(memory_pool=pool, loras={"id": adapter})


def test_the_read_back_of_a_stacked_padded_slot_is_the_snapshots_served_record() -> None:
    tensors = _adapter()
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="bfloat16")
    manager = _loaded(tensors)
    answer = read_back(manager, "id", manifest)
    assert manifest.served is not None and (answer["dtype"], answer["digest"]) == ("bfloat16", manifest.served.digest)
    # Stale values in the padding past the rank (an evicted adapter's: SGLang does not clear it) are not read by the
    # kernels, so they change nothing.
    manager.memory_pool.A_buffer["qkv_proj"][0][SLOT, 3 * RANK:] = 1.0
    manager.memory_pool.B_buffer["qkv_proj"][1][SLOT, :, RANK:] = 1.0
    assert read_back(manager, "id", manifest)["digest"] == manifest.served.digest


@pytest.mark.parametrize("where", ["absent_k_A", "absent_k_B", "untargeted_o_proj"])
def test_injected_value_where_the_kernels_read_a_zero_block_is_refused(where: str) -> None:
    tensors = _adapter()
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="bfloat16")
    manager = _loaded(tensors)
    pool = manager.memory_pool
    if where == "absent_k_A":
        pool.A_buffer["qkv_proj"][1][SLOT, RANK, 0] = 0.5  # k's rows of A: zeros_like(v) in SGLang's stacking
    elif where == "absent_k_B":
        pool.B_buffer["qkv_proj"][0][SLOT, Q_OUT, 0] = 0.5  # k's rows of B
    else:
        pool.A_buffer["o_proj"][0][SLOT, 0, 0] = 0.5
    with pytest.raises(ReadBackError, match="nonzero values outside its tensors"):
        read_back(manager, "id", manifest)


def test_injected_flipped_byte_changes_the_served_digest_and_an_absent_slot_is_refused() -> None:
    tensors = _adapter()
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="bfloat16")
    manager = _loaded(tensors)
    manager.memory_pool.B_buffer["qkv_proj"][1][SLOT].view(torch.uint8)[5, 1] ^= 0x01
    assert manifest.served is not None and read_back(manager, "id", manifest)["digest"] != manifest.served.digest
    manager.memory_pool.uid_to_buffer_id.clear()  # no batch brought it into the pool
    with pytest.raises(ReadBackError, match="no pool slot"):
        read_back(manager, "id", manifest)
    with pytest.raises(ReadBackError, match="not loaded"):
        read_back(manager, "other", manifest)
