"""Patch set "managed": versioned-lora managed adapters inside SGLang 0.5.23's server process.

- `guards`: SGLang's ordinary load/unload/LRU/implicit-reload paths refuse managed names.
- `engine_side`: the engine-side machine of the spec table, driven here, and its effects.
- `endpoints`: ``/versioned_lora/{begin,receive_bucket,end,cleanup,reclaim}`` (+ status section).
- `generate_gate`: what ``/generate`` and every other request path take (fields, vocabulary, cache keys).
- `generate_envelope`: ``/generate``'s refusals made by FastAPI's parse and SGLang's own checks, typed too.
- `route_gate`: generation goes through ``/generate`` only; the other serving routes are refused, typed.
- `audit`: counters of pause/flush/abort_all/base-weight updates.

Everything lives in the server (tokenizer-manager) process, where SGLang keeps its LoRARegistry;
the scheduler and detokenizer stay stock except for what staging needs there.
"""

from __future__ import annotations

import functools
from typing import Any

from versioned_lora.sglang_patches import introspection, preflight
from versioned_lora.sglang_patches.managed import (
    audit,
    endpoints,
    generate_envelope,
    generate_gate,
    guards,
    metrics,
    route_gate,
    scheduler_side,
    staging_channel,
)
from versioned_lora.sglang_patches.managed.engine_side import ManagedEngine
from versioned_lora.sglang_patches.managed.staging import StockLoads
from versioned_lora.sglang_patches.mechanism import replace_attribute

PATCH_SET = "managed"

_engine: ManagedEngine | None = None
_stock_loads: dict[str, Any] = {}  # TokenizerManager's load methods before the guards wrap them


def current_engine() -> ManagedEngine:
    """The one ManagedEngine of this server, created on first use (the tokenizer manager exists only
    once `launch_server` has started the subprocesses)."""
    global _engine
    if _engine is None:
        from sglang.srt.entrypoints import http_server

        tm = http_server.get_global_state().tokenizer_manager
        stock = StockLoads(from_path=functools.partial(_stock_loads["load_lora_adapter"], tm),
                           from_tensors=functools.partial(_stock_loads["load_lora_adapter_from_tensors"], tm))
        _engine = ManagedEngine(tm, introspection.INCARNATION, stock)
    return _engine


def _limits() -> generate_gate.Limits:
    from sglang.srt.entrypoints import http_server

    return generate_gate.Limits(http_server.get_global_state().tokenizer_manager,
                                lambda: current_engine().names_by_lora_id.keys())


class _LazyEngine:
    """Lets the endpoints be registered before the engine exists."""

    def __getattr__(self, name: str) -> Any:
        return getattr(current_engine(), name)


def apply(role: str) -> None:
    if role == "scheduler":
        scheduler_side.install()
        return
    if role != "server":
        return
    from sglang.srt.entrypoints import http_server
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    preflight.check([preflight.MANAGED_PATCH_SET])  # before anything starts: never without the token and the key
    for method in ("load_lora_adapter", "load_lora_adapter_from_tensors"):
        _stock_loads.setdefault(method, getattr(TokenizerManager, method))
    staging_channel.choose_address()  # inherited by the scheduler process launch_server spawns
    audit.install()
    guards.install(may_serve=lambda name: current_engine().unavailable_state(name))
    _install_refcount_mirror(LoRARegistry)
    generate_gate.install(limits=_limits)
    generate_envelope.install()  # /generate's refusals before (and beside) the gate: typed too
    endpoints.install(http_server.app, _LazyEngine())  # type: ignore[arg-type]
    route_gate.install(http_server.app)
    introspection.STATUS_EXTENSIONS.append(lambda _tm: endpoints.status_extension(current_engine()))
    metrics.install(lambda: current_engine().status())  # /metrics, when the engine runs with --enable-metrics


def _install_refcount_mirror(registry_class: Any) -> None:
    """Mirror SGLang's native request refcount of managed names into the engine-side machine.

    LoRARegistry.acquire (called by TokenizerManager._resolve_lora_path) increments the native
    counter of each named adapter; LoRARegistry.release (from TokenizerManager._release_lora_once,
    exactly once per request) decrements it. The machine needs the count to decide DRAINING vs
    UNREGISTERED and to refuse unloading while requests hold the adapter. The mirror is stepped
    *before* the native decrement, so when wait_for_unload wakes the machine already agrees.
    If the machine refuses an acquire (the version started reclaiming between the guard in
    _resolve_lora_path and the native acquire), the request gives its native references back and
    fails with VERSION_UNAVAILABLE: nothing is dispatched for a version once it is reclaiming.
    """
    stock_acquire = registry_class.acquire
    stock_release = registry_class.release

    @functools.wraps(stock_acquire)
    async def acquire(self: Any, lora_name: Any) -> Any:
        lora_ids = await stock_acquire(self, lora_name)
        engine = current_engine()
        pairs = zip(lora_name, lora_ids, strict=True) if isinstance(lora_name, list) else [(lora_name, lora_ids)]
        mirrored: list[str] = []
        for name, lora_id in pairs:
            if not guards.is_managed_name(name):
                continue
            if engine.on_acquired(name) is not None:
                for taken in mirrored:
                    engine.on_released(taken)
                await stock_release(self, lora_ids)
                raise guards.ManagedVersionUnavailable(name, engine.unavailable_state(name) or "gone")
            mirrored.append(lora_id)
        return lora_ids

    @functools.wraps(stock_release)
    async def release(self: Any, lora_id: Any) -> Any:
        # TokenizerManager._release_lora_once schedules release(obj.lora_id) for every request that named a
        # LoRA, also one refused before acquire ran (a guard, a bad field): then lora_id is None, stock
        # release raises TypeError in a task nobody awaits, and the log fills with "Task exception was never
        # retrieved". Nothing was acquired, so nothing is released.
        if lora_id is None or (isinstance(lora_id, list) and all(one is None for one in lora_id)):
            return None
        for one in lora_id if isinstance(lora_id, list) else [lora_id]:
            if one is not None:
                current_engine().on_released(one)
        return await stock_release(self, lora_id)

    replace_attribute(PATCH_SET, registry_class, "acquire", acquire, why="mirror native refcount of managed names")
    replace_attribute(PATCH_SET, registry_class, "release", release, why="mirror native refcount of managed names")
