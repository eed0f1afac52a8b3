"""Patch set "introspection": a read-only status endpoint on the SGLang HTTP server.

``GET /versioned_lora/status`` reports, for each adapter registered in the tokenizer manager's
``LoRARegistry`` (``sglang.srt.lora.lora_registry``), its name, ``lora_id`` and pinned flag from
``LoRARegistry._registry`` (name -> ``LoRARef``) and its native request refcount from
``LoRARegistry._counters[lora_id]`` (a ``ConcurrentCounter``; ``acquire`` increments it in
``TokenizerManager._resolve_lora_path`` and ``release`` decrements it in
``TokenizerManager._release_lora_once``). Counters of unregistered adapters whose unload still
waits (``_counters`` entries with no registry name) are listed under ``draining``. Plus the
server's pid and this engine incarnation.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from typing import Any

from versioned_lora.sglang_patches.mechanism import applied_patches, requested_patch_sets
from versioned_lora.spec.wire import STATUS_PATH

# Minted once per server process start: a READY or receipt from an older incarnation is stale.
# Nanoseconds since the epoch at start: unique per start and larger for a later start on one host.
INCARNATION = time.time_ns()
STARTED_AT = time.time()

# Other patch sets add sections to the status (the managed patch adds its adapters and audit).
STATUS_EXTENSIONS: list[Callable[[Any], Any]] = []  # each returns a dict or an awaitable of one


def lora_registry_snapshot(tokenizer_manager: Any) -> dict[str, Any]:
    registry = tokenizer_manager.lora_registry
    names = dict(registry._registry)  # name -> LoRARef
    counters = dict(registry._counters)  # lora_id -> ConcurrentCounter
    registered_ids = {ref.lora_id for ref in names.values()}
    adapters = [
        {
            "name": name,
            "lora_id": ref.lora_id,
            "pinned": bool(ref.pinned),
            "lora_path": ref.lora_path,
            "refcount": counters[ref.lora_id].value() if ref.lora_id in counters else None,
        }
        for name, ref in names.items()
    ]
    draining = [
        {"lora_id": lora_id, "refcount": counter.value()}
        for lora_id, counter in counters.items()
        if lora_id not in registered_ids
    ]
    return {"adapters": adapters, "draining": draining}


async def status_payload(tokenizer_manager: Any) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    for extension in STATUS_EXTENSIONS:
        section = extension(tokenizer_manager)
        sections.update(await section if inspect.isawaitable(section) else section)
    return {
        "pid": os.getpid(),
        "incarnation": INCARNATION,
        "started_at": STARTED_AT,
        "patches": [record.target for record in applied_patches()],
        # The patch sets this engine loaded (PATCHES_ENV): a test-only set ("test_faults") shows here.
        "patch_sets": requested_patch_sets(),
        # Requests handed to the scheduler and not finished (TokenizerManager.rid_to_state, ReqState.dispatched
        # and .finished), whatever they name: what shares the engine's batch and KV cache right now.
        "requests_in_flight": sum(1 for state in list(tokenizer_manager.rid_to_state.values())
                                  if state.dispatched and not state.finished),
        **lora_registry_snapshot(tokenizer_manager),
        **sections,
    }


def apply(role: str) -> None:
    if role != "server":
        return
    from sglang.srt.entrypoints import http_server

    if any(getattr(route, "path", None) == STATUS_PATH for route in http_server.app.routes):
        return

    async def versioned_lora_status() -> dict[str, Any]:
        return await status_payload(http_server.get_global_state().tokenizer_manager)

    http_server.app.add_api_route(STATUS_PATH, versioned_lora_status, methods=["GET"])
