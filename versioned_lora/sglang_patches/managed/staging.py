"""Where a candidate's weights come from while it is staged on this engine.

The engine-side machine is the same for every source (begin → buckets → end → load pinned, or
cleanup); a source only knows how to receive, verify, materialise and free its weights:

- `DiskSource`: a PEFT adapter directory already on this host (bootstrap from a checkpoint, and
  the tests of the protection rules). No buckets.
- the distributed source (buckets over the engine's torch.distributed group into a per-attempt
  stash in the scheduler) lives in `distributed_staging.py`.

Both verify the weights *as they will be loaded* against the manifest fixed at begin (names,
shapes, dtypes, per-tensor SHA-256, digest) before anything is loaded.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import attrs

from versioned_lora.adapters.manifest import Manifest, ManifestError


@attrs.frozen
class Verdict:
    ok: bool
    detail: str = ""


class StagingSource(Protocol):
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str
    bucket_count: int
    manifest: Manifest

    def allocate(self) -> None: ...

    async def stash_bucket(self, tokenizer_manager: Any, index: int) -> None: ...

    async def verify(self, tokenizer_manager: Any) -> Verdict: ...

    async def materialise(self, tokenizer_manager: Any) -> str: ...

    async def free(self, tokenizer_manager: Any) -> None: ...


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

    def allocate(self) -> None:
        return None

    async def stash_bucket(self, tokenizer_manager: Any, index: int) -> None:
        raise AssertionError("a disk source has no buckets")

    async def verify(self, tokenizer_manager: Any) -> Verdict:
        return await asyncio.to_thread(self._verify_blocking)

    def _verify_blocking(self) -> Verdict:
        from versioned_lora.adapters.manifest import verify_tensors
        from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir

        copy = Path(tempfile.mkdtemp(prefix="versioned-lora-stage-"))
        self.private_copy = copy
        try:
            for item in self.path.iterdir():
                if item.is_file():
                    shutil.copy2(item, copy / item.name)
            snapshot = snapshot_from_adapter_dir(copy)
            verify_tensors(self.manifest, snapshot.tensors, expected_digest=self.digest)
        except (OSError, ValueError, ManifestError) as exc:
            return Verdict(False, f"adapter at {self.path} does not match the manifest: {exc}")
        if snapshot.digest != self.digest:
            return Verdict(False, f"serving config differs: digest {snapshot.digest}, expected {self.digest}")
        return Verdict(True)

    async def materialise(self, tokenizer_manager: Any) -> str:
        assert self.private_copy is not None, "materialise before verify"
        return str(self.private_copy)

    async def free(self, tokenizer_manager: Any) -> None:
        if self.private_copy is not None:
            shutil.rmtree(self.private_copy, ignore_errors=True)
