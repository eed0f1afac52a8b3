"""Where a candidate's weights come from while it is staged on this engine.

The engine-side machine is the same for every source (begin → buckets → end → load pinned, or
cleanup); a source only knows how to receive, verify, load (through SGLang's own load) and free its
weights:

- `DiskSource`: a PEFT adapter directory already on this host (bootstrap from a checkpoint, and
  the tests of the protection rules). No buckets.
- `DistributedSource`: buckets over this engine's two-rank torch.distributed group into a
  per-attempt stash in the scheduler process (`scheduler_side.StashStore`), loaded from there: the
  load request names the verified stash (`scheduler_side.STASH_LOAD_FORMAT`).

Both verify the weights *as they will be loaded* against the manifest fixed at begin (names,
shapes, dtypes, per-tensor SHA-256, digest) before anything is loaded.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import attrs

from versioned_lora.adapters.manifest import Manifest, ManifestError
from versioned_lora.sglang_patches.managed import staging_channel
from versioned_lora.sglang_patches.managed.scheduler_side import STASH_LOAD_FORMAT
from versioned_lora.spec.wire import EngineRefusal


@attrs.frozen
class Verdict:
    ok: bool
    detail: str = ""
    tail_s: float | None = None  # last bucket landed -> verified, where the source has buckets


@attrs.frozen
class StockLoads:
    """SGLang's own load entry points (TokenizerControlMixin.load_lora_adapter and
    .load_lora_adapter_from_tensors, as they were before the guards), bound to the tokenizer manager."""

    from_path: Callable[[Any], Awaitable[Any]]
    from_tensors: Callable[[Any], Awaitable[Any]]


class StagingSource(Protocol):
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str
    bucket_count: int
    manifest: Manifest

    async def allocate(self) -> None: ...

    async def stash_bucket(self, index: int) -> None: ...

    async def verify(self) -> Verdict: ...

    async def load(self, stock: StockLoads) -> Any:
        """Load exactly what `verify` accepted, pinned, under `lora_name`; SGLang's LoRAUpdateOutput."""
        ...

    async def free(self) -> None: ...


@attrs.define
class DiskSource:
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str
    manifest: Manifest
    path: Path
    bucket_count: int = 0
    # A private copy made at verify time: what was verified is exactly what gets loaded, whatever
    # happens to the original directory afterwards.
    private_copy: Path | None = None

    async def allocate(self) -> None:
        return None

    async def stash_bucket(self, index: int) -> None:
        raise AssertionError("a disk source has no buckets")

    async def verify(self) -> Verdict:
        return await asyncio.to_thread(self._verify_blocking)

    def _verify_blocking(self) -> Verdict:
        from versioned_lora.adapters.manifest import verify_tensors
        from versioned_lora.adapters.snapshot import SnapshotError, snapshot_from_adapter_dir

        copy = Path(tempfile.mkdtemp(prefix="versioned-lora-stage-"))
        self.private_copy = copy
        try:
            for item in self.path.iterdir():
                if item.is_file():
                    shutil.copy2(item, copy / item.name)
            # Hashed under the manifest's own kind (v1 or v2): the digest compared below is the manifest's.
            snapshot = snapshot_from_adapter_dir(copy, hash_kind=self.manifest.hash_kind)
            verify_tensors(self.manifest, snapshot.tensors, expected_digest=self.digest)
        except (OSError, ValueError, ManifestError, SnapshotError) as exc:
            return Verdict(False, f"adapter at {self.path} does not match the manifest: {exc}")
        if snapshot.digest != self.digest:
            return Verdict(False, f"serving config differs: digest {snapshot.digest}, expected {self.digest}")
        return Verdict(True)

    async def load(self, stock: StockLoads) -> Any:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        assert self.private_copy is not None, "load before verify"
        return await stock.from_path(LoadLoRAAdapterReqInput(lora_name=self.lora_name,
                                                             lora_path=str(self.private_copy), pinned=True))

    async def free(self) -> None:
        if self.private_copy is not None:
            shutil.rmtree(self.private_copy, ignore_errors=True)


class StagingFailed(Exception):
    """A bucket missed its deadline or its collective failed; typed for the caller."""

    def __init__(self, code: EngineRefusal, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@attrs.define
class DistributedSource:
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str
    manifest: Manifest
    plan_json: str
    bucket_count: int
    group_name: str
    bucket_deadline_s: float
    verify_deadline_s: float = 600.0

    async def allocate(self) -> None:
        await staging_channel.call(
            "allocate", attempt=self.attempt_token, plan_json=self.plan_json,
            manifest_json=self.manifest.to_json(), group=self.group_name,
        )

    async def stash_bucket(self, index: int) -> None:
        # The scheduler process posts an async receive and returns at once; we poll it here, in the
        # server, so a publisher that stalls costs the scheduler process nothing but the polls.
        await staging_channel.call("start_receive", attempt=self.attempt_token, index=index)
        answer = await staging_channel.poll(
            "poll_receive", lambda a: a["state"] != "PENDING", self.bucket_deadline_s,
            attempt=self.attempt_token, index=index,
        )
        if answer is None:
            # Dropping the group releases the pending receive (gloo) and makes the publisher's send
            # fail fast; a later attempt re-creates the group.
            await staging_channel.call("drop_group", name=self.group_name)
            raise StagingFailed(EngineRefusal.BUCKET_DEADLINE,
                                f"bucket {index} did not arrive within {self.bucket_deadline_s}s")
        if answer["state"] != "STASHED":
            raise StagingFailed(EngineRefusal.BUCKET_FAILED, f"bucket {index}: {answer}")

    async def verify(self) -> Verdict:
        await staging_channel.call("start_verify", attempt=self.attempt_token, digest=self.digest)
        answer = await staging_channel.poll(
            "poll_verify", lambda a: a["state"] == "DONE", self.verify_deadline_s, attempt=self.attempt_token,
        )
        if answer is None:
            return Verdict(False, "verification did not finish in time")
        if not answer["ok"]:
            return Verdict(False, answer["detail"])
        return Verdict(True, tail_s=answer.get("tail_s"))

    async def load(self, stock: StockLoads) -> Any:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        # The one "serialized tensors" entry names the stash; SGLang's tokenizer manager base64-decodes it
        # (normalize_serialized_named_tensor_payloads) and the scheduler side reads config and tensors from
        # the verified stash, not from this request.
        marker = base64.b64encode(self.attempt_token.encode()).decode()
        return await stock.from_tensors(LoadLoRAAdapterFromTensorsReqInput(
            lora_name=self.lora_name, config_dict={}, serialized_named_tensors=[marker], pinned=True,
            load_format=STASH_LOAD_FORMAT,
        ))

    async def free(self) -> None:
        await staging_channel.call("free", attempt=self.attempt_token)
