"""Small helpers shared by the tests that talk to real engines."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from versioned_lora.adapters.sglang_client import SGLangClient

T = TypeVar("T")

# 20 prompt tokens; fixture vocab is 512.
PROMPT = list(range(10, 30))

# The shared secret the test engines require on managed endpoints.
TEST_TOKEN = "test-secret-7f3a"

# --abort-on-priority-when-disabled: SGLang's scheduler then answers a request that carries a
# `priority` with a real 503 from inside the request path (Scheduler._add_request_to_queue via
# _make_abort_req), after the tokenizer manager acquired the LoRA reference. The refcount tests use
# it as an on-demand 5xx; requests without a priority are unaffected.
TEST_ENGINE_ARGS = ("--abort-on-priority-when-disabled",)


def client_for(engine: Any, token: str | None = TEST_TOKEN) -> SGLangClient:
    # A generous timeout: on a loaded 2-core host a long test generation can take minutes; a timeout
    # here would only turn slowness into an UnknownOutcome.
    return SGLangClient(engine.url, timeout_s=600.0, token=token)


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


@dataclasses.dataclass(frozen=True)
class Staged:
    name: str
    attempt_token: str
    digest: str
    incarnation: int
    manifest_json: str
    source_path: str
    probe_input_ids: tuple[int, ...] = tuple(PROMPT)

    def begin_body(self) -> dict[str, Any]:
        return {
            "lora_name": self.name,
            "attempt_token": self.attempt_token,
            "incarnation": self.incarnation,
            "digest": self.digest,
            "manifest": self.manifest_json,
            "source_path": self.source_path,
        }

    def end_body(self) -> dict[str, Any]:
        return {
            "lora_name": self.name,
            "attempt_token": self.attempt_token,
            "incarnation": self.incarnation,
            "probe_input_ids": list(self.probe_input_ids),
        }


async def publish_from_disk(
    client: SGLangClient, adapter_dir: Path, label: str = "v", probe: Sequence[int] = PROMPT
) -> Staged:
    """Begin + end of a managed version staged from a PEFT directory (`end` probes with `probe`); returns its
    identity."""
    from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
    from versioned_lora.spec.identities import VersionKey, lora_name

    snapshot = snapshot_from_adapter_dir(adapter_dir)
    version = VersionKey(1, fresh_name(label))
    staged = Staged(
        name=lora_name(version, snapshot.digest),
        attempt_token=f"attempt-{uuid.uuid4().hex[:8]}",
        digest=snapshot.digest,
        incarnation=(await client.status())["incarnation"],
        manifest_json=snapshot.manifest.to_json(),
        source_path=str(adapter_dir),
        probe_input_ids=tuple(probe),
    )
    await client.managed("begin", **staged.begin_body())
    await client.managed("end", **staged.end_body())
    return staged


async def managed_view(client: SGLangClient, name: str) -> dict[str, Any] | None:
    return next((a for a in (await client.status())["managed"] if a["name"] == name), None)
