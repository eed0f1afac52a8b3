"""Audit counters of the engine-wide operations a managed publication must never need.

The RFC's promise is that publishing a LoRA version pauses nothing, flushes nothing, aborts
nothing and leaves base weights alone. Tests and the benchmark assert it by per-test deltas of
these counters, so every stock entry point that can do one of those things is counted here, in
the server process, whoever calls it (HTTP, Engine API or our own code).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

from versioned_lora.sglang_patches.mechanism import replace_attribute

PATCH_SET = "managed"

COUNTS: collections.Counter[str] = collections.Counter()

# TokenizerManager method -> audit counter. Methods live on TokenizerManager or its mixins
# (sglang.srt.managers.tokenizer_manager / tokenizer_control_mixin); we wrap them on the class.
_COUNTED_METHODS = {
    "pause_generation": "pause_generation",
    "continue_generation": "continue_generation",
    "flush_cache": "flush_cache",
    "update_weights_from_disk": "base_weight_update",
    "update_weights_from_distributed": "base_weight_update",
    "update_weights_from_tensor": "base_weight_update",
    "update_weights_from_ipc": "base_weight_update",
}


def _counting_async(counter: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTS[counter] += 1
        return await original(self, *args, **kwargs)

    return counted


def _counting_abort(original: Callable[..., Any]) -> Callable[..., Any]:
    # TokenizerManager.abort_request(rid, abort_all): only abort_all is an engine-wide operation;
    # a per-request abort is ordinary session traffic.
    @functools.wraps(original)
    def counted(self: Any, rid: str = "", abort_all: bool = False) -> Any:
        COUNTS["abort_all" if abort_all else "abort_request"] += 1
        return original(self, rid=rid, abort_all=abort_all)

    return counted


def install() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for method, counter in _COUNTED_METHODS.items():
        original = getattr(TokenizerManager, method)
        replace_attribute(PATCH_SET, TokenizerManager, method, _counting_async(counter, original),
                          why=f"audit counter {counter}")
    replace_attribute(PATCH_SET, TokenizerManager, "abort_request", _counting_abort(TokenizerManager.abort_request),
                      why="audit counter abort_all")


def snapshot() -> dict[str, int]:
    keys = {*_COUNTED_METHODS.values(), "abort_all", "abort_request", "physical_unload", "physical_load",
            "managed_begin"}
    return {key: COUNTS[key] for key in sorted(keys)}
