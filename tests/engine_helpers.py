"""Small helpers shared by the tests that talk to real engines."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from versioned_lora.adapters.sglang_client import SGLangClient

T = TypeVar("T")

# 20 prompt tokens; fixture vocab is 512.
PROMPT = list(range(10, 30))


def fresh_name(label: str) -> str:
    """A name never loaded before: a fresh ``lora_id`` and so a cold KV namespace (no flush needed)."""
    return f"{label}-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def loaded_adapter(
    client: SGLangClient, adapter_dir: Path, label: str, pinned: bool = False
) -> AsyncIterator[str]:
    name = fresh_name(label)
    result = await client.load_lora_adapter(name, str(adapter_dir), pinned=pinned)
    assert result["success"], result
    try:
        yield name
    finally:
        if await client.adapter(name) is not None:
            await client.unload_lora_adapter(name)


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, poll_s: float = 0.05) -> float:
    """Poll until `predicate()` is true; returns the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return time.monotonic()
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"condition not reached within {timeout_s}s")


async def refcount(client: SGLangClient, name: str) -> int | None:
    entry = await client.adapter(name)
    return None if entry is None else entry["refcount"]


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def lora_ids(status: dict[str, Any]) -> dict[str, str]:
    return {a["name"]: a["lora_id"] for a in status["adapters"]}
