"""Test-only injected faults of what an engine serves (issue 46, item 1), part of the "test_faults" patch set only
(`hold_points.apply`): what a real engine does not produce on demand.

- ``flip_pool_byte``: after SGLang copies the named candidate into its LoRA memory pool
  (`LoRAMemoryPool.load_lora_weight_to_buffer`), one byte of its slot is flipped: the high byte of the
  largest-magnitude element of its first A matrix gets its sign bit inverted, so the served weights (and the
  probe's logprobs) change while every byte the publisher sent and the engine verified is intact;
- ``alter_alpha``: the named candidate is loaded with twice its manifest's ``lora_alpha`` (the config handed to
  SGLang's load from the verified stash is changed), so the engine applies the right weights at the wrong scale;
- ``drop_module``: the named candidate is loaded with the last of its manifest's target modules left out of the
  config (its tensors still reach the pool: SGLang stacks weights by their names).

Both are armed like every engine fault, in the server (``POST /versioned_lora/test_hold``, point and lora_name); the
server's side forwards the arming to the scheduler over the staging channel at the load (by attempt token for the
config, by the new lora_id for the pool), and the scheduler's side carries them out. Nothing here is loaded on an
engine started without the test-only set.
"""

from __future__ import annotations

from typing import Any

from versioned_lora.sglang_patches.mechanism import replace_attribute

PATCH_SET = "test_faults"
FLIP_POOL_BYTE, ALTER_ALPHA, DROP_MODULE = "flip_pool_byte", "alter_alpha", "drop_module"
CONFIG_FAULTS = (ALTER_ALPHA, DROP_MODULE)
SCHEDULER_FAULTS = (FLIP_POOL_BYTE, *CONFIG_FAULTS)

# Scheduler process: what the server armed (lora_ids whose pool slot gets a flipped byte; attempt -> the config
# fault its load gets).
_flips: set[str] = set()
_configs: dict[str, str] = {}


def install_server() -> None:
    """Server process: forward an armed fault to the scheduler around the candidate's load
    (`ManagedEngine._load_pinned`, this project's own method, wrapped only on an engine started with the test-only
    set)."""
    from versioned_lora.sglang_patches.managed import hold_points, staging_channel
    from versioned_lora.sglang_patches.managed.engine_side import ManagedEngine

    stock = ManagedEngine._load_pinned

    async def load_pinned(self: ManagedEngine, name: str, attempt_token: str) -> Any:
        for fault in CONFIG_FAULTS:
            if hold_points.HOLDS.take(fault, name):
                await staging_channel.call("test_fault", fault=fault, key=attempt_token)
        outcome = await stock(self, name, attempt_token)
        instance = self.loaded.get(name)
        if instance is not None and hold_points.HOLDS.take(FLIP_POOL_BYTE, name):
            # Before the probe: the adapter reaches the pool at its first batch, which is the probe's.
            await staging_channel.call("test_fault", fault=FLIP_POOL_BYTE, key=instance.lora_id)
        return outcome

    ManagedEngine._load_pinned = load_pinned  # type: ignore[method-assign]


def install_scheduler() -> None:
    """Scheduler process: the channel call that arms a fault, the flip after SGLang's copy into the pool, and the
    altered config of the load from the stash."""
    from sglang.srt.lora.mem_pool import LoRAMemoryPool

    from versioned_lora.sglang_patches.managed import scheduler_side

    stock_dispatch = scheduler_side.dispatch

    def dispatch(method: str, payload: dict[str, Any]) -> dict[str, Any]:
        if method != "test_fault":
            return stock_dispatch(method, payload)
        if payload["fault"] == FLIP_POOL_BYTE:
            _flips.add(str(payload["key"]))
        else:
            _configs[str(payload["key"])] = str(payload["fault"])
        return {"armed": payload["fault"]}

    scheduler_side.dispatch = dispatch  # read by _serve_channel when the scheduler starts, after this

    stock_verified = scheduler_side.StashStore.verified

    def verified(self: Any, attempt: str) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors, config = stock_verified(self, attempt)
        fault = _configs.pop(attempt, None)
        if fault == ALTER_ALPHA:
            config = {**config, "lora_alpha": config["lora_alpha"] * 2}
        elif fault == DROP_MODULE:
            config = {**config, "target_modules": list(config["target_modules"])[:-1]}
        return tensors, config

    scheduler_side.StashStore.verified = verified  # type: ignore[method-assign]

    stock_load = LoRAMemoryPool.load_lora_weight_to_buffer

    def load_lora_weight_to_buffer(self: Any, uid: Any, buffer_id: int, *args: Any, **kwargs: Any) -> Any:
        result = stock_load(self, uid, buffer_id, *args, **kwargs)
        if uid in _flips:
            _flips.discard(uid)
            flip_one_byte(self, buffer_id)
        return result

    replace_attribute(PATCH_SET, LoRAMemoryPool, "load_lora_weight_to_buffer", load_lora_weight_to_buffer,
                      why="test-only: flip one byte of an armed adapter's pool slot after SGLang's copy")


def flip_one_byte(pool: Any, buffer_id: int) -> None:
    """Invert the sign bit of the largest-magnitude element of the slot's first A buffer (layer 0, first module in
    name order): one byte, a change the probe sees, and no NaN or Inf (only the sign moves)."""
    import torch

    module = sorted(pool.A_buffer)[0]
    slot = pool.A_buffer[module][0][buffer_id]
    flat = slot.reshape(-1)
    index = int(flat.abs().argmax())
    high = flat.element_size() - 1  # little-endian: the sign bit is in the element's last byte
    flat.view(torch.uint8).view(-1, flat.element_size())[index, high] ^= 0x80
