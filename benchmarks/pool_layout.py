"""SGLang 0.5.23's LoRA memory pool for a dense model, built outside SGLang (benchmarks/served_digest.py on the CPU,
benchmarks/served_digest_gpu.py on a GPU, where SGLang is not installed): `A_buffer[module][layer]` =
``[max_loras, c * max_rank, in]``, `B_buffer[module][layer]` = ``[max_loras, out_total, max_rank]``, q/k/v and
gate/up stacked, an adapter's tensors copied into its slot the way `LoRAAdapter.normalize_*` and
`LoRAMemoryPool.load_lora_weight_to_buffer` place them. The read-back (`managed/served_readback.read_back`) takes it
as the scheduler's `LoRAManager`: `memory_pool` and `loras`."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

# The modules SGLang stacks into one pool buffer (served_readback.STACKS), and the two it keeps alone.
POOL_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                            "gate_up_proj": ("gate_proj", "up_proj"),
                                            "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
LORA_ID = "bench-lora-id"


def pool_with(tensors: Mapping[str, torch.Tensor], dims: Mapping[str, tuple[int, int]], layers: int, rank: int,
              max_loras: int, slot: int, device: str = "cpu") -> SimpleNamespace:
    """The pool (bf16, on `device`) with `tensors` (PEFT names, every module of every layer) in slot `slot`.
    `dims`: module -> (in_features, out_features)."""
    a_buffer: dict[str, list[torch.Tensor]] = {}
    b_buffer: dict[str, list[torch.Tensor]] = {}
    for stack, members in POOL_MODULES.items():
        in_dim, out_total = dims[members[0]][0], sum(dims[m][1] for m in members)
        a_buffer[stack] = [torch.zeros(max_loras, len(members) * rank, in_dim, dtype=torch.bfloat16, device=device)
                           for _ in range(layers)]
        b_buffer[stack] = [torch.zeros(max_loras, out_total, rank, dtype=torch.bfloat16, device=device)
                           for _ in range(layers)]
        for layer in range(layers):
            part = "mlp" if stack in ("gate_up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}"
            a = torch.cat([tensors[f"{prefix}.{m}.lora_A.weight"] for m in members], 0)
            b = torch.cat([tensors[f"{prefix}.{m}.lora_B.weight"] for m in members], 0)
            a_buffer[stack][layer][slot, : a.shape[0], :].copy_(a)
            b_buffer[stack][layer][slot, :, : b.shape[1]].copy_(b)
    return SimpleNamespace(A_buffer=a_buffer, B_buffer=b_buffer, dtype=torch.bfloat16,
                           uid_to_buffer_id={LORA_ID: slot}, get_buffer_id=lambda uid: {LORA_ID: slot}[uid])


def manager_with(pool: SimpleNamespace, serving: Mapping[str, Any]) -> SimpleNamespace:
    """The scheduler's LoRAManager as the read-back sees it: the pool, and the adapter's config and scaling."""
    rank = int(serving["r"])
    adapter = SimpleNamespace(config=SimpleNamespace(r=rank, lora_alpha=serving["lora_alpha"],
                                                     target_modules=serving["target_modules"]),
                              scaling=serving["lora_alpha"] / rank)
    return SimpleNamespace(memory_pool=pool, loras={LORA_ID: adapter})
