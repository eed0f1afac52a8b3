"""Patch set "cpu": let SGLang 0.5.23's LoRA path run on a host without a CUDA driver.

Applied only when ``torch.cuda.is_available()`` is false; on a GPU host it does nothing, so the
same launcher serves both. In the server it starts the children from a fork server (faster engine starts); in the
scheduler it makes the LoRA path and rope run without a driver.
"""

from __future__ import annotations

import types
from typing import Any

from versioned_lora.sglang_patches.mechanism import replace_attribute

PATCH_SET = "cpu"

# Modules that pass ``pin_memory=True`` to torch factories (torch.tensor/zeros/empty/ones_like...)
# while building per-batch LoRA metadata:
#   sglang.srt.lora.layers            (ColumnParallelLinearWithLoRA.__init__ and siblings)
#   sglang.srt.lora.backend.torch_backend  (TorchNativeLoRABackend.prepare_lora_batch)
#   sglang.srt.lora.lora              (LoRAAdapter.initialize_weights)
# Pinning asks the CUDA driver for page-locked memory, so without a driver every one of those
# calls raises "Found no NVIDIA driver". Pinned memory only speeds host->device copies, and on a
# CPU-only host there is no device copy, so dropping the flag changes nothing else.
_PINNING_MODULES = (
    "sglang.srt.lora.layers",
    "sglang.srt.lora.backend.torch_backend",
    "sglang.srt.lora.lora",
)


class _TorchWithoutPinning(types.ModuleType):
    """A stand-in for the ``torch`` module seen by one SGLang module: same attributes, but every
    factory call drops ``pin_memory``."""

    def __init__(self, torch_module: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._torch, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def without_pinning(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return attr(*args, **kwargs)

        return without_pinning


def _tensor_pin_memory_noop(self: Any, *args: Any, **kwargs: Any) -> Any:
    # torch.Tensor.pin_memory: called as ``.pin_memory()`` in torch_backend.prepare_lora_batch,
    # layers.py (output_offset_cpu) and lora.py; on a driverless host the page-locked copy is
    # impossible and pointless, so the tensor itself is the right answer.
    return self


# What the scheduler and the detokenizer import before they run (process_entry's targets and the SGLang modules
# they call): the fork server imports them once, and each child forked from it starts with them imported.
_CHILD_MODULES = (
    "versioned_lora.sglang_patches.process_entry",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
)


class _StartChildrenFromAForkServer:
    """Replaces ``sglang.srt.entrypoints.engine._set_envs_and_config`` (SGLang 0.5.23), which ends by setting
    multiprocessing's start method to *spawn* for the scheduler and detokenizer processes ``launch_server`` starts
    next: each of them then imported torch, transformers and SGLang from nothing, about 15 CPU-s apiece on a CPU
    host, a third of an engine's start (49.8 CPU-s, 2026-12-07). After the original runs, the start method is
    *forkserver*, with the children's modules preloaded: one process imports them once and forks both children,
    which start with nothing imported by the server and no patch applied (process_entry applies each child's own,
    as under spawn). 33.4 CPU-s an engine start on this host (issue 42). A CPU host only: a fork server that
    imported SGLang on a GPU host could hold CUDA state that a forked child must not inherit, and spawn stays."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, server_args: Any) -> Any:
        import multiprocessing

        done = self.original(server_args)
        multiprocessing.set_start_method("forkserver", force=True)
        multiprocessing.set_forkserver_preload(list(_CHILD_MODULES))
        return done


def apply(role: str) -> None:
    import importlib

    import torch

    if torch.cuda.is_available():
        return
    if role == "server":
        engine = importlib.import_module("sglang.srt.entrypoints.engine")
        replace_attribute(
            PATCH_SET, engine, "_set_envs_and_config", _StartChildrenFromAForkServer(engine._set_envs_and_config),
            why="children forked from a server that imported their modules once, not spawned from nothing",
        )
        return
    # Only the scheduler builds LoRA batches and runs rope; the server and detokenizer never touch
    # these modules, so they stay stock there.
    if role != "scheduler":
        return
    for module_name in _PINNING_MODULES:
        module = importlib.import_module(module_name)
        replace_attribute(
            PATCH_SET, module, "torch", _TorchWithoutPinning(torch),
            why="factories called with pin_memory=True fail without a CUDA driver",
        )
    replace_attribute(
        PATCH_SET, torch.Tensor, "pin_memory", _tensor_pin_memory_noop,
        why="Tensor.pin_memory() fails without a CUDA driver; pinning is meaningless on a CPU-only host",
    )

    # sglang.srt.layers.rotary_embedding.base: RotaryEmbedding.__init__ imports
    # vllm._custom_ops.rotary_embedding unless the module flag ``_is_cpu`` is true, and forward_cpu
    # takes the AMX kernel path (needs the CPU sgl_kernel, not on PyPI) when
    # ``_is_cpu_amx_available``. With _is_cpu=True and AMX off, rope falls back to forward_native.
    # ``is_cpu()`` itself is false here because SGLANG_USE_CPU_ENGINE is unset (setting it would
    # require the CPU sgl_kernel everywhere).
    rope_base = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    replace_attribute(PATCH_SET, rope_base, "_is_cpu", True, why="rope: skip the vllm._custom_ops import")
    replace_attribute(
        PATCH_SET, rope_base, "_is_cpu_amx_available", False, why="rope: no AMX sgl_kernel; use forward_native"
    )
