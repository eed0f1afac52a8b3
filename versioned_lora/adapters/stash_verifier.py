"""Verifying a staged candidate while its buckets arrive: the engine's check of what it received.

A stash is checked against the manifest fixed at `begin` (names, dtypes, shapes, each tensor's hash, and
the manifest's digest against the reserved one). The hashes are what costs: hundreds of milliseconds for
a 349 MB adapter on one CPU thread, where the wire takes about a millisecond on a GPU. So the hashing of a
bucket starts as soon as that bucket lands (`bucket_landed`, which returns at once), on the hashing pool
(`hashing.pool`) or, for a v2 manifest of a stash on a GPU, in a GPU kernel (`gpu_hash`); when the last
bucket lands only its own tensors are left to hash, and `finish` waits for them and compares.

The comparison is `manifest.raise_mismatches`, the same one `verify_tensors` makes, so a corrupted bucket
is refused with the same typed `ManifestMismatch` (the engine answers MANIFEST_MISMATCH). Each tensor's
dtype and shape are the plan's (the receiver views the bytes by the plan), so a plan that does not
describe the manifest shows as those mismatches too; a bucket that never landed leaves its tensors missing.

`StashVerifier(..., pipelined=False)` is the verification as it was before: nothing is hashed until
`finish`, then everything at once (with `threads=1`, on one thread). It is kept as the baseline a
benchmark measures the pipelined verifier against in the same run (`benchmarks/end_phase.py`; an engine
runs it when started with `VERIFY_MODE_ENV` set to `after-last-bucket`), never as the engine's default.

Nothing here imports SGLang: the engine's scheduler uses this class (`scheduler_side.StashStore`), and so
does the GPU benchmark (`gpu_validation.verify_bench`) on machines without SGLang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from versioned_lora.adapters.hashing import PendingHashes, chunk_size, slices, submit_buffers
from versioned_lora.adapters.manifest import Manifest, raise_mismatches
from versioned_lora.adapters.transfer import BucketPlan, PlanMismatch

if TYPE_CHECKING:
    import torch


class _GpuBucket:
    """A bucket on a GPU hashed by the chunk kernel, launched on a stream of its own (so the buckets'
    kernels, each of a few thousand GPU threads, run side by side instead of one after the other)."""

    def __init__(self, layout: Any, flat: torch.Tensor, stream: Any) -> None:
        import torch

        self.layout = layout
        stream.wait_stream(torch.cuda.current_stream(flat.device))  # the bucket's bytes are complete there
        with torch.cuda.stream(stream):
            self.words = layout.launch(flat)
            flat.record_stream(stream)
            self.words.record_stream(stream)
        self.stream = stream

    def hashes(self, names: tuple[str, ...]) -> dict[str, str]:
        self.stream.synchronize()
        return dict(zip(names, self.layout.fold(self.words), strict=True))


class _HostCopy:
    """A bucket on a GPU under a v1 manifest: one asynchronous copy into pinned host memory, then the pool
    hashes its tensors there (each task first waits for the copy)."""

    def __init__(self, flat: torch.Tensor, stream: Any) -> None:
        import torch

        self.host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(stream):
            self.host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)
            self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda's stubs are untyped
            self.copied.record(stream)


class StashVerifier:
    """Hash each bucket of one stash as it lands; `finish` compares everything with the manifest."""

    def __init__(
        self, manifest: Manifest, plan: BucketPlan, threads: int | None = None, *, pipelined: bool = True
    ) -> None:
        self.manifest = manifest
        self.plan = plan
        self.threads = threads
        self.pipelined = pipelined
        self._deferred: dict[int, torch.Tensor] = {}  # not pipelined: landed buckets, hashed at finish
        self.chunk = chunk_size(manifest.hash_kind)
        self._lock = threading.Lock()
        self._landed: dict[int, Callable[[], dict[str, str]]] = {}
        self._failures: dict[int, str] = {}
        self._layouts: dict[int, Any] = {}  # bucket index -> gpu_hash.ChunkLayout, built before the bytes come
        self._streams: list[Any] = []

    def prepare(self, device: str | torch.device) -> None:
        """Build what hashing a bucket on `device` needs before any bucket lands (a v2 stash on a GPU: every
        bucket's chunk table, on the device), so none of it falls on the path from a landing to a verdict."""
        import torch

        target = torch.device(device)
        if target.type != "cuda" or self._streams:
            return
        self._streams = [torch.cuda.Stream(target)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                         for _ in range(min(8, max(1, len(self.plan.buckets))))]
        if self.chunk is not None:
            from versioned_lora.adapters.gpu_hash import ChunkLayout

            for bucket in self.plan.buckets:
                spans = [(slot.offset, slot.nbytes) for slot in bucket.slots]
                self._layouts[bucket.index] = ChunkLayout(spans, self.chunk, target)

    def bucket_landed(self, index: int, flat: torch.Tensor) -> None:
        """Start hashing bucket `index` (its received buffer, complete on the current stream) and return at
        once. A second call for the same bucket is ignored (a stashed bucket is never received twice)."""
        with self._lock:
            if index in self._landed or index in self._failures or index in self._deferred:
                return
            if not self.pipelined:
                self._deferred[index] = flat
                return
            try:
                self._landed[index] = self._start(index, flat)
            except Exception as exc:  # reported by finish as a refusal, never raised into the receive path
                self._failures[index] = f"hashing bucket {index} failed: {type(exc).__name__}: {exc}"

    def _start(self, index: int, flat: torch.Tensor) -> Callable[[], dict[str, str]]:
        bucket = self.plan.buckets[index]
        if flat.numel() != bucket.nbytes or flat.dtype != torch_uint8():
            raise PlanMismatch(f"buffer of {flat.numel()} {flat.dtype} is not bucket {index} ({bucket.nbytes} bytes)")
        names = bucket.names
        if flat.is_cuda:
            self.prepare(flat.device)
            stream = self._streams[index % len(self._streams)]
            if self.chunk is not None:
                gpu = _GpuBucket(self._layouts[index], flat, stream)
                return lambda: gpu.hashes(names)
            copy = _HostCopy(flat, stream)
            view = _view(copy.host)
            pending = submit_buffers(slices(view, ((s.name, s.offset, s.nbytes) for s in bucket.slots)),
                                     self.manifest.hash_kind, self.threads, before=copy.copied)  # fmt: skip
            return pending.result
        view = _view(flat)
        pending_host: PendingHashes = submit_buffers(
            slices(view, ((s.name, s.offset, s.nbytes) for s in bucket.slots)), self.manifest.hash_kind, self.threads
        )
        return pending_host.result

    def finish(self, expected_digest: str | None = None) -> None:
        """Wait for every landed bucket's hashes and compare with the manifest; raises ManifestMismatch
        listing every difference (or RuntimeError if hashing itself failed)."""
        with self._lock:
            deferred, self._deferred = self._deferred, {}
            for index in sorted(deferred):
                try:
                    self._landed[index] = self._start(index, deferred[index])
                except Exception as exc:  # as in bucket_landed: a refusal, never an escape
                    self._failures[index] = f"hashing bucket {index} failed: {type(exc).__name__}: {exc}"
            landed = dict(self._landed)
            failures = dict(self._failures)
        if failures:
            raise RuntimeError("; ".join(failures[i] for i in sorted(failures)))
        hashes: dict[str, str] = {}
        for index in sorted(landed):
            hashes.update(landed[index]())
        described = {
            slot.name: (slot.dtype, slot.shape)
            for index in landed
            for slot in self.plan.buckets[index].slots
        }
        raise_mismatches(self.manifest, described, hashes, expected_digest)


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _view(flat: torch.Tensor) -> memoryview:
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; stubs lag
