"""The harness's view of an engine: an authorized client, a way to publish one managed version to it, and
scored generations. Publication uses the project's own engine link (begin, buckets over torch.distributed,
verified end) or, where the harness host cannot join the engine's transfer group (a CUDA engine expects
NCCL), the managed disk source (begin with ``source_path``, then end). Nothing here reaches `runtime/`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot
from versioned_lora.capabilities import KEY_FILE_ENV, Action, mint
from versioned_lora.spec.wire import SOURCE_ROOT_ENV

# The managed endpoints read their shared secret from this variable (spec/wire.TOKEN_ENV);
# spelled out here so the harness does not import SGLang just to name it.
TOKEN_ENV = "VERSIONED_LORA_TOKEN"

# The fixture adapters are ~28 KB: 8 KiB buckets give several buckets, so the bucket path really runs.
DEFAULT_BUCKET_BYTES = 8 * 1024


@attrs.frozen
class Observation:
    """One scored generation, exactly as the engine answered it."""

    engine: str
    lora_name: str
    prefix_id: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int
    prompt_tokens: int
    phase: str

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


class Engine:
    """One engine under test: a label (E0, E1, baseline-A, ...), a client, and, with the link transport, the
    transfer group this harness formed with its current incarnation."""

    def __init__(
        self, label: str, url: str, token: str | None, transport: str, bucket_bytes: int, device: str = "cpu",
        *, capability_key: bytes,
    ) -> None:
        self.label = label
        # The harness is its own registry (it decides its default switch and its reclaims): it signs the
        # cleanups and reclaims it sends with the key the engines were started with.
        self._key = capability_key
        self.device = device  # the harness's side of the link: "cuda" (NCCL) for engines that serve on a GPU
        self.url = url
        self.client = SGLangClient(url, timeout_s=600.0, token=token)
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self._link: EngineLink | None = None
        # What this harness staged or published here and has not reclaimed: released on close, so a failed
        # run does not leave managed versions holding the engine's two slots.
        self._staged: dict[str, str] = {}
        self._ready: set[str] = set()

    async def link(self) -> EngineLink:
        if self._link is None:
            self._link = await EngineLink.connect(self.client, device=self.device)
        return self._link

    async def begin(self, snapshot: Snapshot, name: str, adapter_dir: Path) -> tuple[Any, str]:
        """Stage `snapshot` under `name` up to its last bucket; `end` makes it READY. Returns (handle, attempt)."""
        attempt = f"gv-{uuid.uuid4().hex[:12]}"
        self._staged[name] = attempt
        if self.transport == "disk":
            incarnation = int((await self.client.status())["incarnation"])
            await self.client.managed("begin", lora_name=name, attempt_token=attempt, incarnation=incarnation,
                                      digest=snapshot.digest, manifest=snapshot.manifest.to_json(),
                                      source_path=str(adapter_dir))  # fmt: skip
            return incarnation, attempt
        link = await self.link()
        candidate = Candidate.build(name, snapshot, self.bucket_bytes)
        await link.begin(candidate, attempt)
        for index in range(candidate.bucket_count):
            await link.transfer_bucket(candidate, attempt, index)
        return candidate, attempt

    async def end(self, handle: Any, name: str, attempt: str, probe: Sequence[int]) -> dict[str, Any]:
        if self.transport == "disk":
            answer = await self.client.managed("end", lora_name=name, attempt_token=attempt, incarnation=handle,
                                               probe_input_ids=list(probe), http_timeout_s=600)  # fmt: skip
        else:
            answer = await (await self.link()).end(handle, attempt, probe)
        self._ready.add(name)
        return answer

    async def publish(self, snapshot: Snapshot, name: str, adapter_dir: Path, probe: Sequence[int]) -> dict[str, Any]:
        handle, attempt = await self.begin(snapshot, name, adapter_dir)
        return await self.end(handle, name, attempt, probe)

    async def reclaim(self, name: str) -> dict[str, Any]:
        reclaim_id = f"gv-reclaim-{name}"
        answer = await self.client.managed("reclaim", lora_name=name, reclaim_id=reclaim_id, wait_s=60.0,
                                           http_timeout_s=120.0,
                                           capability=mint(self._key, Action.RECLAIM, name, reclaim_id))  # fmt: skip
        self._ready.discard(name)
        self._staged.pop(name, None)
        return answer

    async def release_leftovers(self) -> list[str]:
        """Best effort after a failed run: reclaim what became READY, clean up what was only staged."""
        errors = []
        for name in sorted(self._ready):
            try:
                await self.reclaim(name)
            except Exception as exc:  # report, keep releasing the rest
                errors.append(f"reclaim {name}: {exc}")
        for name, attempt in sorted(self._staged.items()):
            try:
                await self.client.managed("cleanup", lora_name=name, attempt_token=attempt,
                                          capability=mint(self._key, Action.CLEANUP, name, attempt))
            except Exception as exc:
                errors.append(f"cleanup {name}: {exc}")
        self._staged.clear()
        return errors

    async def score(
        self, name: str, prefix_id: str, token_ids: Sequence[int], new_tokens: int, phase: str
    ) -> Observation:
        generation = await self.client.generate(token_ids, name, new_tokens, ignore_eos=True)
        return Observation(
            engine=self.label, lora_name=name, prefix_id=prefix_id, output_ids=tuple(generation.output_ids),
            logprobs=tuple(generation.logprobs), cached_tokens=generation.cached_tokens,
            prompt_tokens=len(token_ids), phase=phase,
        )  # fmt: skip

    async def managed_names(self) -> list[str]:
        status = await self.client.status()
        return [a["name"] for a in status.get("managed", []) if a.get("state") not in ("CLEANED", "UNLOADED")]

    async def stock_adapters(self) -> list[str]:
        return [a["name"] for a in (await self.client.status()).get("adapters", [])]

    async def close(self) -> None:
        await self.release_leftovers()
        if self._link is not None:
            self._link.close()
            self._link = None
        await self.client.aclose()


@attrs.frozen
class LaunchSpec:
    """How the harness starts engines of its own (the fresh baseline processes, and E0/E1 with --launch)."""

    model_dir: Path
    token: str
    log_dir: Path
    key_file: Path  # the capability key the engines and this harness share
    gpu: bool = False
    max_lora_rank: int = 8
    lora_target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    # The trees the engines' disk-sourced begins may read (the adapters' directories): an engine is given its
    # source root explicitly, it has no default (issue 46).
    source_roots: tuple[Path, ...] = ()

    def config(self, label: str) -> EngineConfig:
        patches = ("introspection", "managed") if self.gpu else ("cpu", "introspection", "managed")
        return EngineConfig(
            model_dir=self.model_dir, port=free_port_block(), max_lora_rank=self.max_lora_rank,
            lora_target_modules=self.lora_target_modules, patches=patches, cpu=not self.gpu,
            log_path=self.log_dir / f"{label}.log",
            env={TOKEN_ENV: self.token, KEY_FILE_ENV: str(self.key_file),
                 SOURCE_ROOT_ENV: os.pathsep.join(map(str, self.source_roots))},
        )  # fmt: skip


async def start_engine(spec: LaunchSpec, label: str) -> EngineProcess:
    process = EngineProcess(spec.config(label))
    await asyncio.to_thread(process.start)
    return process


async def stop_engine(process: EngineProcess) -> None:
    await asyncio.to_thread(process.stop)
