"""The engine's read-back of a loaded adapter from SGLang's LoRA memory pool (issue 46, item 1), scheduler process.

What the kernels read is the pool, not SGLang's CPU-side copy of the adapter (`LoRAAdapter.layers[i].weights`): an
adapter's weights reach the pool at the first batch that uses it (`LoRAManager.fetch_new_loras` ->
`LoRAMemoryPool.prepare_lora_batch` -> `load_lora_weight_to_buffer`), converted to the pool's dtype
(`utils.copy_weight_into_buffer`: ``Tensor.to``), so the read-back runs after the candidate's probe, and a pinned
adapter stays in its slot (`prepare_lora_batch` never evicts a pinned uid).

The layout read here is SGLang 0.5.23's, for dense (non-MoE) modules at tp=1 (the managed patch's configuration):

- `LoRAMemoryPool.A_buffer[module][layer]` is ``[max_loras, c * max_rank, in]`` and
  `B_buffer[module][layer]` ``[max_loras, out_total, max_rank]``, the slot at `get_buffer_id(lora_id)`;
- `LoRAAdapter.normalize_qkv_proj` / `normalize_gate_up_proj` stack q, k, v (gate, up) along dim 0 of A and of B
  (an absent k is ``zeros_like(v)``, an absent up ``zeros_like(gate)``), and `load_lora_weight_to_buffer` writes the
  stacked A at ``[slot, :r * c, :]`` and B at ``[slot, :, :r]`` (the standard, non-MoE path): member ``i``'s A is
  rows ``i*r .. (i+1)*r``, its B the rows after the members before it, columns ``:r``.

The kernels (`torch_ops.sgemm_lora_a_fwd` / `_b_fwd` of the torch-native backend) read A's rows ``:c * r`` and
B's columns ``:r`` of the slot; nothing else of it (the padding up to max rank) takes part. Within that region, what
no manifest tensor covers (an absent k or up, a pool module the adapter does not target, which the load zero-fills)
must be zero, or the engine would serve more than the snapshot: `stray_values` counts it, exactly (nonzero counts,
no float sums), and a read-back with any is refused.

Undoing that gives each manifest tensor as the pool holds it; they are hashed with the manifest's hash kind on the
hashing pool (`hashing.hash_tensors`: threads on the CPU, the chunk kernel on a GPU) and folded into the served
digest exactly as the publisher folds its snapshot's (`adapters/served.py`). The config is what the scheduler
applies them with: `LoRAAdapter.config` (r, lora_alpha, target_modules) and `LoRAAdapter.scaling`.
"""

from __future__ import annotations

import re
import time
from typing import Any

from versioned_lora.adapters.hashing import submit_tensors
from versioned_lora.adapters.manifest import Manifest, TensorEntry
from versioned_lora.adapters.served import served_config, served_digest

# A PEFT tensor name of a dense layer's LoRA matrix: (layer, module, A or B).
_LORA_MATRIX = re.compile(r"\.layers\.(\d+)\.(?:[A-Za-z_]+\.)*?([A-Za-z_]+)\.lora_([AB])\.weight$")
# The modules SGLang stacks into one pool buffer, in stacking order (`utils.get_stacked_multiply`).
STACKS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                      "gate_up_proj": ("gate_proj", "up_proj")}
_STACK_OF = {member: (stack, members) for stack, members in STACKS.items() for member in members}
# The sibling whose shape SGLang gives an absent member's zeros (normalize_qkv_proj: zeros_like(v);
# normalize_gate_up_proj: zeros_like(gate)).
_ABSENT_LIKE = {"k_proj": "v_proj", "up_proj": "gate_proj"}


class ReadBackError(Exception):
    """The pool does not hold the adapter in the layout read here: nothing is certified as served."""


def _place(entry: TensorEntry, pool: Any) -> tuple[str, int, str, int, str, tuple[str, ...]]:
    """(pool module, layer, A or B, index in the stack, member, stack members) of one manifest tensor."""
    match = _LORA_MATRIX.search(entry.name)
    if match is None or len(entry.shape) != 2:
        raise ReadBackError(f"tensor {entry.name!r} is not a dense layer's LoRA matrix: no pool slot to read")
    layer, module, which = int(match.group(1)), match.group(2), match.group(3)
    stack, members = _STACK_OF.get(module, (module, (module,)))
    if stack not in pool.A_buffer:  # an orphan up_proj, say, that SGLang keeps unstacked
        stack, members = module, (module,)
    if stack not in pool.A_buffer or stack not in pool.B_buffer:
        raise ReadBackError(f"tensor {entry.name!r}: the pool has no buffer for {stack!r} ({sorted(pool.A_buffer)})")
    return stack, layer, which, members.index(module), module, members


def _b_rows(manifest: Manifest, entry: TensorEntry, members: tuple[str, ...], index: int) -> int:
    """Where member `index`'s B starts in its stack: after the members before it, an absent one the size SGLang gave
    its zeros (k takes v's, up takes gate's)."""
    sizes: dict[str, int] = {}
    names = {m: entry.name.replace(f".{members[index]}.", f".{m}.") for m in members}
    present = {e.name: e for e in manifest.tensors}
    for member in members:
        found = present.get(names[member])
        if found is not None:
            sizes[member] = found.shape[0]
    start = 0
    for member in members[:index]:
        size = sizes.get(member)
        if size is None and member in _ABSENT_LIKE:  # absent: SGLang stacked zeros shaped like its sibling
            size = sizes.get(_ABSENT_LIKE[member])
        if size is None:
            raise ReadBackError(f"tensor {entry.name!r}: {member} precedes it in the pool's {members} stack and "
                                "the adapter has none, which SGLang does not stack")
        start += size
    return start


def unstacked(pool: Any, buffer_id: int, manifest: Manifest, rank: int) -> dict[str, Any]:
    """Each manifest tensor as the pool's slot `buffer_id` holds it (views of the pool: nothing is copied here)."""
    out: dict[str, Any] = {}
    for entry in manifest.tensors:
        stack, layer, which, index, _member, members = _place(entry, pool)
        rows, cols = entry.shape
        if which == "A":
            if rows != rank:
                raise ReadBackError(f"tensor {entry.name!r}: rank {rows}, the loaded adapter's is {rank}")
            slot = pool.A_buffer[stack][layer][buffer_id]
            view = slot[index * rank: (index + 1) * rank, :cols]
        else:
            if cols != rank:
                raise ReadBackError(f"tensor {entry.name!r}: rank {cols}, the loaded adapter's is {rank}")
            slot = pool.B_buffer[stack][layer][buffer_id]
            start = _b_rows(manifest, entry, members, index)
            view = slot[start: start + rows, :rank]
        if tuple(view.shape) != (rows, cols):
            raise ReadBackError(f"tensor {entry.name!r}: the pool's slot gives shape {tuple(view.shape)}, "
                                f"the manifest's is {(rows, cols)}")
        out[entry.name] = view
    return out


def stray_values(pool: Any, buffer_id: int, views: dict[str, Any], manifest: Manifest, rank: int) -> list[str]:
    """Where the region the kernels read of slot `buffer_id` holds nonzero values no manifest tensor accounts for:
    one line per (module, layer, A or B), empty when there are none."""
    import torch

    covered: dict[tuple[str, int, str], int] = {}
    for entry in manifest.tensors:
        stack, layer, which, *_ = _place(entry, pool)
        key = (stack, layer, which)
        covered[key] = covered.get(key, 0) + int(torch.count_nonzero(views[entry.name]))
    found: list[str] = []
    for stack in sorted(set(pool.A_buffer) & set(pool.B_buffer)):
        width = len(STACKS.get(stack, (stack,)))
        for layer, (a, b) in enumerate(zip(pool.A_buffer[stack], pool.B_buffer[stack], strict=True)):
            if a.dim() != 3 or b.dim() != 3:
                raise ReadBackError(f"pool module {stack!r} is not a dense [slots, rows, cols] buffer: not read here")
            for which, region in (("A", a[buffer_id, : width * rank]), ("B", b[buffer_id, :, :rank])):
                extra = int(torch.count_nonzero(region)) - covered.get((stack, layer, which), 0)
                if extra:
                    found.append(f"{stack} layer {layer} {which}: {extra} nonzero values outside its tensors")
    return found


def read_back(lora_manager: Any, lora_id: str, manifest: Manifest, threads: int | None = None) -> dict[str, Any]:
    """The served identity of loaded adapter `lora_id`, read from the pool: ``dtype``, ``digest``, ``config`` (as
    `adapters/served.py` spells them) and ``read_s``. Raises ReadBackError when the pool does not hold it."""
    began = time.monotonic()
    pool = lora_manager.memory_pool  # LoRAManager.memory_pool: the LoRAMemoryPool the kernels read
    adapter = lora_manager.loras.get(lora_id)  # LoRAManager.loras: lora_id -> LoRAAdapter
    if adapter is None:
        raise ReadBackError(f"lora_id {lora_id!r} is not loaded in this scheduler")
    if lora_id not in pool.uid_to_buffer_id:
        raise ReadBackError(f"lora_id {lora_id!r} holds no pool slot (no batch has used it yet)")
    buffer_id = pool.get_buffer_id(lora_id)  # LoRAMemoryPool.get_buffer_id: uid -> slot
    rank = int(adapter.config.r)
    views = unstacked(pool, buffer_id, manifest, rank)
    pending = submit_tensors(views, manifest.hash_kind, threads)  # hashed on the pool while the strays are counted
    stray = stray_values(pool, buffer_id, views, manifest, rank)
    hashes = pending.result()
    if stray:
        raise ReadBackError(f"the kernels of slot {buffer_id} read values the snapshot does not have: "
                            + "; ".join(stray[:4]) + (f" (and {len(stray) - 4} more)" if len(stray) > 4 else ""))
    dtype = str(pool.dtype).removeprefix("torch.")
    digest = served_digest({name: (tuple(int(d) for d in v.shape), hashes[name]) for name, v in views.items()},
                           dtype, manifest.hash_kind)
    config = served_config(adapter.config.r, adapter.config.lora_alpha, adapter.config.target_modules,
                           adapter.scaling)
    return {"dtype": dtype, "digest": digest, "config": config, "read_s": round(time.monotonic() - began, 6)}
