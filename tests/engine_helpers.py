"""Small helpers shared by the tests that talk to real engines."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from versioned_lora import capabilities
from versioned_lora.adapters.engine_process import DEFAULT_PATCHES
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.capabilities import KEY_FILE_ENV, Action, mint
from versioned_lora.spec.wire import TOKEN_ENV

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

# The test flag for engine-side faults (issue 41): the default patch sets plus the test-only "test_faults" set (hold
# points, injected faults: managed/hold_points.py). Only engines started with it have them.
TEST_PATCHES = (*DEFAULT_PATCHES, "test_faults")


# ---- the registry's capability key of the test session (issue 19) -------------------------------------------
#
# Every managed engine requires the registry's capability key; the suite's engines share one, written once per
# test process by a child process into a 0600 file. The registry actors of the e2e tests read that file in
# their own processes (`capability_key_file`), and the Publisher and Reclaimer only pass on what the registry
# answered: their clients (`demo.Stack`'s) never sign. Tests that call an engine's cleanup or reclaim by hand
# stand where the registry stands, and their clients (`client_for`) sign those calls with the key.

_KEY_FILE = Path(tempfile.gettempdir()) / f"versioned-lora-test-{os.getpid()}" / "capability.key"


def capability_key_file() -> Path:
    if not _KEY_FILE.exists():
        subprocess.run([sys.executable, "-c", "import sys, pathlib; from versioned_lora.capabilities import "
                        "write_key_file; write_key_file(pathlib.Path(sys.argv[1]))", str(_KEY_FILE)], check=True)
    return _KEY_FILE


def engine_env(**extra: str) -> dict[str, str]:
    """What a test engine with the managed patch set is started with: the token and the session's key file."""
    return {TOKEN_ENV: TEST_TOKEN, KEY_FILE_ENV: str(capability_key_file()), **extra}


_ACTIONS = {"cleanup": (Action.CLEANUP, "attempt_token"), "reclaim": (Action.RECLAIM, "reclaim_id")}


class RegistrySigningClient(SGLangClient):
    """A test's own client: its cleanups and reclaims carry the capability the registry would mint for them
    (unless the test gives one, or a body whose name or reference is not a string: then it is sent as given)."""

    def __init__(self, *args: Any, key: bytes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._key = key

    async def managed(self, operation: str, http_timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        action = _ACTIONS.get(operation)
        if action is not None and "capability" not in body:
            name, reference = body.get("lora_name"), body.get(action[1])
            if isinstance(name, str) and isinstance(reference, str):
                body["capability"] = mint(self._key, action[0], name, reference)
        return await super().managed(operation, http_timeout_s, **body)


def client_for(engine: Any, token: str | None = TEST_TOKEN, sign: bool = True) -> SGLangClient:
    """`sign=False`: a client that holds no key, as the Publisher's and the Reclaimer's do."""
    # A generous timeout: on a loaded 2-core host a long test generation can take minutes; a timeout
    # here would only turn slowness into an UnknownOutcome.
    url = engine if isinstance(engine, str) else engine.url
    if not sign:
        return SGLangClient(url, timeout_s=600.0, token=token)
    key = capabilities.parse_key(capability_key_file().read_text())
    return RegistrySigningClient(url, timeout_s=600.0, token=token, key=key)


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


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, poll_s: float = 0.05,
    last: Callable[[], object] | None = None,
) -> float:
    """Poll until `predicate()` is true; returns the monotonic time it became true. `last()`, if given, says in
    the timeout's message what was last seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return time.monotonic()
        await asyncio.sleep(poll_s)
    seen = "" if last is None else f"; last seen: {last()!r}"
    raise TimeoutError(f"condition not reached within {timeout_s}s{seen}")


async def refcount(client: SGLangClient, name: str) -> int | None:
    entry = await client.adapter(name)
    return None if entry is None else entry["refcount"]


async def hold_scheduler(client: SGLangClient, held: bool) -> None:
    """Pause (in place) or continue one engine's scheduler through SGLang's own admin routes: a test device that
    keeps a request in flight, holding its LoRA reference, for as long as the test needs, however fast or slow
    the host decodes. The library never pauses an engine."""
    path, body = ("/pause_generation", {"mode": "in_place"}) if held else ("/continue_generation", {})
    response = await client._http.post(path, json=body)
    assert response.status_code == 200, (path, response.status_code, response.text)


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
