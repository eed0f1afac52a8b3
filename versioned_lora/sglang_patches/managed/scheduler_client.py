"""Server-process side of the scheduler calls (see `ipc`): call a `StashStore` method, get JSON back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from versioned_lora.sglang_patches.managed import ipc


class SchedulerCallFailed(Exception):
    pass


def install() -> None:
    """Server role: register the IPC types and a communicator for our replies. Must run before the
    TokenizerManager is built (TokenizerControlMixin.init_communicators reads _COMMUNICATOR_SPECS)."""
    from sglang.srt.managers import tokenizer_control_mixin

    ipc.register_types()
    spec = (ipc.COMMUNICATOR_NAME, ipc.VersionedLoraSchedulerReply)
    if spec not in tokenizer_control_mixin._COMMUNICATOR_SPECS:
        tokenizer_control_mixin._COMMUNICATOR_SPECS.append(spec)


async def call(tokenizer_manager: Any, method: str, **payload: Any) -> dict[str, Any]:
    communicator = getattr(tokenizer_manager, f"{ipc.COMMUNICATOR_NAME}_communicator")
    replies = await communicator(ipc.VersionedLoraSchedulerCall(method=method, payload=ipc.encode(payload)))
    reply = replies[0]
    if not reply.ok:
        raise SchedulerCallFailed(f"{method}: {reply.error}")
    return ipc.decode(reply.payload)


async def poll(
    tokenizer_manager: Any,
    method: str,
    done: Callable[[dict[str, Any]], bool],
    deadline_s: float,
    interval_s: float = 0.005,
    **payload: Any,
) -> dict[str, Any] | None:
    """Call `method` until `done(answer)` or the deadline passes (then None)."""
    deadline = time.monotonic() + deadline_s
    while True:
        answer = await call(tokenizer_manager, method, **payload)
        if done(answer):
            return answer
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval_s)
