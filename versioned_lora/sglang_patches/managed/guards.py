"""Keep SGLang's ordinary LoRA paths away from managed adapters.

A managed adapter's name lives in the reserved namespace ``relax_policy_lora@...`` and is loaded,
cleaned and reclaimed only through versioned-lora's endpoints, which drive the engine-side machine
of the spec table. The stock paths that could otherwise load, overwrite, unload, evict or silently
reload such a name are wrapped here; for any other name they stay exactly stock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from versioned_lora.sglang_patches.mechanism import replace_attribute
from versioned_lora.spec.identities import LORA_NAME_PREFIX
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.wire import EngineRefusal

PATCH_SET = "managed"


def is_managed_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(LORA_NAME_PREFIX)


class ManagedVersionUnavailable(ValueError):
    """A request named a managed version this engine does not serve now (not loaded, reclaiming or
    reclaimed). SGLang's generate handler turns a ValueError into an HTTP error with this status."""

    status_code = HTTPStatus.CONFLICT
    reason = Reason.VERSION_UNAVAILABLE

    def __init__(self, name: str, state: str) -> None:
        from versioned_lora.sglang_patches.managed import metrics

        metrics.count_refusal("generate", Reason.VERSION_UNAVAILABLE)  # raised once per refused request
        super().__init__(
            f"{Reason.VERSION_UNAVAILABLE}: managed LoRA version {name!r} is {state} on this engine; it is never "
            f"reloaded implicitly and requests are not rerouted to another version"
        )


def _refusal(operation: str, name: str) -> Any:
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    return LoRAUpdateOutput(
        success=False,
        error_message=(
            f"{EngineRefusal.MANAGED_ADAPTER}: {name!r} is a versioned-lora managed adapter; {operation} through "
            f"SGLang's ordinary LoRA endpoints is refused (use the versioned-lora publication and reclaim protocol)"
        ),
    )


def install(may_serve: Callable[[str], str | None]) -> None:
    """`may_serve(name)` returns None if requests may acquire the managed `name` now, else its state."""
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    # TokenizerControlMixin.load_lora_adapter / load_lora_adapter_from_tensors: a stock load of a
    # managed name would overwrite it (or create one outside the protocol). /load_lora_adapter
    # answers 400 on success=False.
    for method in ("load_lora_adapter", "load_lora_adapter_from_tensors"):
        original = getattr(TokenizerManager, method)
        replace_attribute(PATCH_SET, TokenizerManager, method, _refuse_managed(original, "load"),
                          why="stock load must not create or overwrite a managed adapter")

    # TokenizerControlMixin.unload_lora_adapter: a managed adapter is unloaded only by reclaim or
    # cleanup, which first make sure no session can use it.
    replace_attribute(PATCH_SET, TokenizerManager, "unload_lora_adapter",
                      _refuse_managed(TokenizerManager.unload_lora_adapter, "unload"),
                      why="stock unload must not remove a managed adapter")

    # LoRARegistry.lru_lora_name: the eviction inside the load path picks the LRU *unpinned*
    # adapter; managed adapters are always loaded pinned, and we also skip them by name so that no
    # flag mix-up can ever evict one.
    replace_attribute(PATCH_SET, LoRARegistry, "lru_lora_name", _lru_skipping_managed,
                      why="LRU eviction must never pick a managed adapter")

    # TokenizerManager._resolve_lora_path: for a name not in the registry, stock SGLang reloads it
    # from lora_ref_cache ("Reloading evicted adapter") — a late request could bring a reclaimed
    # version back under a new lora_id. For managed names we fail fast instead, before any acquire.
    original_resolve = TokenizerManager._resolve_lora_path

    @functools.wraps(original_resolve)
    async def resolve_refusing_managed_reload(self: Any, obj: Any) -> Any:
        names = obj.lora_path if isinstance(obj.lora_path, list) else [obj.lora_path]
        for name in names:
            if is_managed_name(name):
                state = may_serve(name)
                if state is not None:
                    raise ManagedVersionUnavailable(name, state)
        return await original_resolve(self, obj)

    replace_attribute(PATCH_SET, TokenizerManager, "_resolve_lora_path", resolve_refusing_managed_reload,
                      why="no implicit reload of a managed adapter; unavailable versions fail fast")


def _refuse_managed(original: Callable[..., Any], operation: str) -> Callable[..., Any]:
    @functools.wraps(original)
    async def guarded(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        if is_managed_name(obj.lora_name):
            return _refusal(operation, obj.lora_name)
        return await original(self, obj, *args, **kwargs)

    return guarded


async def _lru_skipping_managed(self: Any, exclude_pinned: bool = False) -> str | None:
    async with self._registry_lock.reader_lock:
        for name, ref in self._registry.items():
            if is_managed_name(name):
                continue
            if exclude_pinned and ref.pinned:
                continue
            return name
        return None
