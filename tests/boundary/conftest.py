"""The bad-input suite's context: the session's two real engines (tests/conftest.py), one managed version READY on
E0, a real Ray registry actor holding one reserved version, and the figures every case is checked against (one
context per module)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import PROMPT, TEST_TOKEN, Staged, capability_key_file, client_for, lora_ids, publish_from_disk
from lease_helpers import fence_of

from versioned_lora.adapters.ray_registry import RayRegistry, create_registry_actor
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir
from versioned_lora.lifecycle import Reserve, Reserved, VersionKey
from versioned_lora.spec.wire import TOKEN_HEADER

# Fields of the engine status that move on their own: `managed_begin` counts every begin that reached the engine
# (refused or not, by design), `abort_request` every per-request abort.
VOLATILE_AUDIT = ("managed_begin", "abort_request")
SERVE_TOKENS = 4
REGISTRY_EPOCH = 7


@dataclasses.dataclass
class Boundary:
    url: str
    engine: Any
    m: Staged
    m_lora_id: str
    candidate: Snapshot  # of fixture adapter C: what a valid begin of a new name would stage
    candidate_dir: Path
    fill_dir: Path  # fixture adapter B: what fills the engine's other managed slots for NO_FREE_SLOT
    root: Path
    registry: RayRegistry
    baseline: dict[str, list[float]]
    log_offsets: dict[Path, int]
    results: dict[str, dict[str, bool]] = dataclasses.field(default_factory=dict)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, headers={TOKEN_HEADER: TEST_TOKEN})

    def status(self) -> dict[str, Any]:
        """E0's status with what moves by itself left out."""
        with self.http() as client:
            status = client.get("/versioned_lora/status").json()
        for key in VOLATILE_AUDIT:
            status["audit"].pop(key, None)
        return status

    def serving(self) -> dict[str, list[float]]:
        """Greedy logprobs of the managed version and of the base model on the same prompt."""
        out = {}
        with self.http() as client:
            for label, lora_path in (("managed", self.m.name), ("base", None)):
                body = {"input_ids": PROMPT, "return_logprob": True,
                        "sampling_params": {"max_new_tokens": SERVE_TOKENS, "temperature": 0.0}}
                if lora_path is not None:
                    body["lora_path"] = lora_path
                answer = client.post("/generate", json=body)
                assert answer.status_code == 200, answer.text
                out[label] = [entry[0] for entry in answer.json()["meta_info"]["output_token_logprobs"]]
        return out

    def registry_state(self) -> tuple[str, Any]:
        async def read() -> tuple[str, Any]:
            return await self.registry.state_digest(), await self.registry.publication_view()

        return asyncio.run(read())


@pytest.fixture(scope="session")
def suite_log_offsets(engines: Any) -> dict[Path, int]:
    """Where the engines' logs stood when the first test of this suite that asks for it started."""
    return {e.config.log_path: e.config.log_path.stat().st_size for e in engines}


def log_text_since(offsets: dict[Path, int]) -> str:
    text = []
    for path, offset in offsets.items():
        with path.open("rb") as log:
            log.seek(offset)
            text.append(log.read().decode("utf-8", "replace"))
    return "".join(text)


# Per module: a module's managed version is reclaimed when it ends, so the session's engines get their slots
# back for the tests after this package (K managed slots an engine, K its `EngineConfig.capacity`).
@pytest.fixture(scope="module")
def boundary(engines: Any, fixtures: Any, ray_cluster: None, tmp_path_factory: pytest.TempPathFactory,
             suite_log_offsets: dict[Path, int]) -> Iterator[Boundary]:
    engine = engines.e0
    log_offsets = suite_log_offsets

    async def publish() -> tuple[Staged, str]:
        async with client_for(engine) as client:
            staged = await publish_from_disk(client, fixtures.adapters["A"], label="bnd")
            return staged, lora_ids(await client.status())[staged.name]

    m, m_lora_id = asyncio.run(publish())
    handle = create_registry_actor(tmp_path_factory.mktemp("boundary-registry") / "registry.sqlite",
                                   name=f"boundary-{uuid.uuid4().hex[:8]}", epoch=REGISTRY_EPOCH,
                                   capability_key_file=capability_key_file())
    registry = RayRegistry(handle, retry_deadline_s=60.0)

    async def reserve_one() -> None:
        answer = await registry.submit(Reserve(VersionKey(REGISTRY_EPOCH, "A"), "a" * 64, await fence_of(registry)))
        assert isinstance(answer.result, Reserved), answer

    asyncio.run(reserve_one())
    context = Boundary(
        url=engine.url, engine=engine, m=m, m_lora_id=m_lora_id,
        candidate=snapshot_from_adapter_dir(fixtures.adapters["C"]), candidate_dir=fixtures.adapters["C"],
        fill_dir=fixtures.adapters["B"],
        root=fixtures.root, registry=registry, baseline={}, log_offsets=log_offsets,
    )
    context.baseline = context.serving()
    try:
        yield context
    finally:
        async def reclaim() -> None:
            async with client_for(engine) as client:
                await client.managed("reclaim", lora_name=m.name, reclaim_id=f"bnd-{uuid.uuid4().hex[:6]}", wait_s=60)

        asyncio.run(reclaim())
        import ray

        ray.kill(handle)


@pytest.fixture
def scratch_dir(boundary: Boundary) -> Iterator[Path]:
    """A directory inside the engines' source root (the fixture cache), removed afterwards."""
    path = boundary.root / f"boundary-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
