"""Tensor hashes of a manifest, computed on a thread pool, and the chunked hash of manifest version 2.

Two hash kinds, each named by the string a manifest carries:

- ``"sha256"`` (manifest v1, the default): SHA-256 of the tensor's contiguous little-endian bytes.
- ``"sha256-chunked-<C>"`` (manifest v2, ``C`` a positive number of bytes): let ``B`` be those same
  ``n`` bytes. Chunk ``i`` is ``B[i*C : (i+1)*C]`` for ``i = 0 .. ceil(n/C) - 1``; the last chunk is
  short when ``C`` does not divide ``n`` and is hashed as it is (no padding beyond SHA-256's own).
  ``d_i = SHA-256(chunk_i)``, 32 raw bytes. The tensor's hash is ``SHA-256(d_0 || d_1 || ... )``, as
  64 lowercase hex digits. An empty tensor has no chunk, so its hash is ``SHA-256(b"")``
  (``e3b0c442…b855``, the same as under ``"sha256"``); a tensor of at most ``C`` bytes hashes to
  ``SHA-256(SHA-256(B))``. The chunks' digests are independent, so they can be computed in
  parallel: on a thread pool here, one GPU thread a chunk in ``gpu_hash`` — and every path gives the
  same bytes, whatever hardware it runs on (tests/adapters/test_hashing.py holds them to hashlib and
  to committed known answers).

Why a pool helps: hashlib releases the GIL while it hashes a buffer larger than 2 KiB, so threads hash
different tensors (or chunks) on different cores at once. SHA-256 itself is sequential, which is why a
v1 hash of one large tensor cannot be split and v2 exists.

Buffers are memoryviews of CPU memory (the tensor's own storage when it is contiguous on the CPU: no
copy). torch is imported only by the functions that take tensors.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

HASH_SHA256 = "sha256"
CHUNKED_PREFIX = "sha256-chunked-"
_CHUNKED = re.compile(r"sha256-chunked-([1-9][0-9]*)")
# What one pool task hashes at most (a run of whole chunks): small enough that a few large tensors still
# spread over every thread, large enough that a task's overhead (~10 µs) stays under 1% of its hashing.
TASK_BYTES = 4 * 1024 * 1024


class UnknownHashKind(ValueError):
    """A hash kind this code does not implement (not "sha256", not "sha256-chunked-<positive int>")."""


def chunked_kind(chunk_bytes: int) -> str:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise UnknownHashKind(f"chunk size must be a positive integer, got {chunk_bytes!r}")
    return f"{CHUNKED_PREFIX}{chunk_bytes}"


def chunk_size(kind: str) -> int | None:
    """None for "sha256"; the chunk size for "sha256-chunked-<C>"; UnknownHashKind otherwise."""
    if kind == HASH_SHA256:
        return None
    match = _CHUNKED.fullmatch(kind) if isinstance(kind, str) else None
    if match is None:
        raise UnknownHashKind(f"unknown hash kind {kind!r} (known: {HASH_SHA256!r}, '{CHUNKED_PREFIX}<bytes>')")
    return int(match.group(1))


def default_threads() -> int:
    """The pool's default size: every core, up to 8 (SHA-256 runs ~2 GB/s a core; 8 threads outrun the
    memory bandwidth a hash needs on any host we run on, and an engine's scheduler needs cores too)."""
    return max(1, min(8, os.cpu_count() or 1))


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pool(threads: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """One shared pool per size (created on first use, kept for the process's life: threads are idle
    between publications and a pool per call would cost its start each time)."""
    size = default_threads() if threads is None else threads
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    with _pools_lock:
        found = _pools.get(size)
        if found is None:
            found = _pools[size] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="vlora-hash")
        return found


# ---- bytes -> hash ---------------------------------------------------------------------------------------------


def chunk_digests(data: memoryview, chunk: int, first: int = 0, count: int | None = None) -> bytes:
    """The concatenated 32-byte digests of chunks `first .. first+count-1` of `data` (all from `first` by
    default)."""
    n = len(data)
    last = -(-n // chunk) if count is None else first + count
    sha = hashlib.sha256
    return b"".join(sha(data[i * chunk : (i + 1) * chunk]).digest() for i in range(first, last))


def combine(digests: bytes) -> str:
    """The tensor hash from its chunks' concatenated digests."""
    return hashlib.sha256(digests).hexdigest()


def hash_bytes(data: memoryview | bytes, kind: str) -> str:
    """The hash of one tensor's bytes under `kind`, on the calling thread."""
    view = memoryview(data).cast("B")
    chunk = chunk_size(kind)
    if chunk is None:
        return hashlib.sha256(view).hexdigest()
    return combine(chunk_digests(view, chunk))


def _tasks(data: memoryview, chunk: int | None) -> list[tuple[int, int | None]]:
    """How one buffer's hash is split into pool tasks: (first chunk, count) runs of at most TASK_BYTES
    (one task, (0, None), for a v1 hash, which cannot be split)."""
    if chunk is None:
        return [(0, None)]
    chunks = -(-len(data) // chunk)
    step = max(1, TASK_BYTES // chunk)
    return [(first, min(step, chunks - first)) for first in range(0, chunks, step)] or [(0, 0)]


# One piece of work: (name, buffer, first chunk, chunk count) -- count None for a v1 hash of the whole buffer.
_Piece = tuple[str, memoryview, int, int | None]
_Results = list[tuple[str, int, "str | bytes"]]  # (name, first chunk, hex hash or chunk digests)


class PendingHashes:
    """Hashes being computed on a pool: `result()` waits for them and returns name -> hex hash."""

    def __init__(
        self, names: Sequence[str], futures: list[concurrent.futures.Future[_Results]], chunked: bool
    ) -> None:
        self._names = names
        self._futures = futures
        self._chunked = chunked

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> dict[str, str]:
        parts: dict[str, list[tuple[int, str | bytes]]] = {name: [] for name in self._names}
        for future in self._futures:
            for name, first, value in future.result():
                parts[name].append((first, value))
        out: dict[str, str] = {}
        for name in self._names:
            values = [v for _, v in sorted(parts[name], key=lambda p: p[0])]
            if self._chunked:
                out[name] = combine(b"".join(v for v in values if isinstance(v, bytes)))
            else:
                (value,) = values
                assert isinstance(value, str)
                out[name] = value
        return out


def _run(pieces: list[_Piece], kind: str, event: Any) -> _Results:
    if event is not None:
        event.synchronize()  # e.g. a CUDA event: the copy into the buffers being hashed has finished
    chunk = chunk_size(kind)
    out: list[tuple[str, int, str | bytes]] = []
    for name, data, first, count in pieces:
        if count is None or chunk is None:
            out.append((name, first, hash_bytes(data, kind)))
        else:
            out.append((name, first, chunk_digests(data, chunk, first, count)))
    return out


def submit_buffers(
    buffers: Mapping[str, memoryview], kind: str, threads: int | None = None, *, before: Any = None,
) -> PendingHashes:  # fmt: skip
    """Start hashing every buffer on the pool and return at once. With `before`, the hashing waits for its
    `synchronize()` first (the event of the copy that fills the buffers). (A memoryview keeps the memory it
    views alive: a tensor's numpy array holds the tensor, the view holds the array.)

    Work goes to the pool in tasks of about TASK_BYTES: a large tensor's chunks split over several, small
    tensors grouped into one (a task per tensor cost ~5% more CPU than hashing on one thread, for an
    adapter's hundreds of sub-megabyte tensors)."""
    chunk = chunk_size(kind)
    executor = pool(threads)
    pieces: list[_Piece] = []
    # Largest first: the pool then ends with the small ones, which fill the last gaps.
    for name in sorted(buffers, key=lambda n: -len(buffers[n])):
        data = buffers[name]
        if chunk is None:
            pieces.append((name, data, 0, None))
        else:
            pieces += [(name, data, first, count) for first, count in _tasks(data, chunk)]
    futures: list[concurrent.futures.Future[_Results]] = []
    group: list[_Piece] = []
    size = 0
    for piece in pieces:
        group.append(piece)
        size += len(piece[1]) if piece[3] is None or chunk is None else min(piece[3] * chunk, len(piece[1]))
        if size >= TASK_BYTES:
            futures.append(executor.submit(_run, group, kind, before))
            group, size = [], 0
    if group:
        futures.append(executor.submit(_run, group, kind, before))
    return PendingHashes(list(buffers), futures, chunk is not None)


def hash_buffers(buffers: Mapping[str, memoryview], kind: str, threads: int | None = None) -> dict[str, str]:
    return submit_buffers(buffers, kind, threads).result()


# ---- tensors -> hash ------------------------------------------------------------------------------------------


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise ValueError("tensor hashing assumes a little-endian host")


def cpu_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major bytes as a flat CPU uint8 tensor (no copy when already contiguous on CPU).

    Viewing as uint8 reads the raw storage, which is how bf16 (no numpy dtype) is hashed exactly. The
    in-memory order is the host's; every supported host is little-endian, and we refuse others rather
    than silently hash big-endian bytes."""
    import torch

    _check_little_endian()
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _memoryview(flat_u8: torch.Tensor) -> memoryview:
    # numpy hands hashlib the tensor's own buffer: no copy of a large tensor.
    return memoryview(flat_u8.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; stubs lag


def host_buffers(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, memoryview], object]:
    """Every tensor's bytes in CPU memory, as memoryviews, and the object that owns that memory.

    CPU tensors are viewed in place (a non-contiguous one is made contiguous first). Tensors on a GPU
    come to the host in one copy of all their bytes (one device-side concatenation, then one transfer
    into pinned memory), not one small copy per tensor: per-tensor copies cost more than the bytes."""
    import torch

    _check_little_endian()
    on_device = [name for name, t in tensors.items() if t.device.type != "cpu"]
    views: dict[str, memoryview] = {}
    owners: list[object] = []
    for name, t in tensors.items():
        if t.device.type == "cpu":
            flat = cpu_bytes(t)
            owners.append(flat)
            views[name] = _memoryview(flat)
    if on_device:
        parts = [tensors[n].detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
                 for n in on_device]  # fmt: skip
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.copy_(packed, non_blocking=True)
        if packed.is_cuda:
            torch.cuda.current_stream(packed.device).synchronize()
        owners.append(host)
        whole = _memoryview(host)
        offset = 0
        for name, part in zip(on_device, parts, strict=True):
            views[name] = whole[offset : offset + part.numel()]
            offset += part.numel()
    return {name: views[name] for name in tensors}, owners


class _Pending(Protocol):
    def result(self) -> dict[str, str]: ...


def submit_tensors(tensors: Mapping[str, torch.Tensor], kind: str, threads: int | None = None) -> _Pending:
    """Start hashing every tensor under `kind` and return at once (`result()` waits): on the pool, or for a
    chunked hash of CUDA tensors in the GPU kernel (`gpu_hash`), so the caller's own work overlaps it."""
    chunk = chunk_size(kind)
    if chunk is not None and tensors and all(t.is_cuda for t in tensors.values()):
        from versioned_lora.adapters import gpu_hash

        return gpu_hash.start_cuda_hashes(tensors, chunk)
    buffers, _owner = host_buffers(tensors)  # the views keep their memory alive
    return submit_buffers(buffers, kind, threads)


def hash_tensors(tensors: Mapping[str, torch.Tensor], kind: str, threads: int | None = None) -> dict[str, str]:
    """name -> hash of every tensor under `kind` (see submit_tensors)."""
    return submit_tensors(tensors, kind, threads).result()


def tensor_hash(tensor: torch.Tensor, kind: str) -> str:
    """One tensor's hash under `kind`, on the calling thread."""
    return hash_bytes(_memoryview(cpu_bytes(tensor)), kind)


def slices(view: memoryview, spans: Iterable[tuple[str, int, int]]) -> dict[str, memoryview]:
    """name -> view[offset:offset+nbytes] for each (name, offset, nbytes)."""
    return {name: view[offset : offset + nbytes] for name, offset, nbytes in spans}


def chunk_table(spans: Sequence[tuple[int, int]], chunk: int) -> tuple[Any, Any, list[int]]:
    """For buffers at (offset, nbytes) in one flat buffer: every chunk's start and length in that buffer (two
    int64 numpy arrays), and for each buffer the index of its first chunk (plus a final entry: the total).
    This is the layout `gpu_hash` hashes in one launch and `combine` folds back per buffer. (Vectorised: a
    349 MB adapter has ~5,000 chunks of 64 KiB, and a Python loop over them costs milliseconds.)"""
    import numpy as np

    offsets = np.array([offset for offset, _ in spans], dtype=np.int64)
    sizes = np.array([nbytes for _, nbytes in spans], dtype=np.int64)
    counts = -(-sizes // chunk)
    firsts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(firsts[-1])
    owner = np.repeat(np.arange(len(spans), dtype=np.int64), counts)
    within = (np.arange(total, dtype=np.int64) - firsts[:-1][owner]) * chunk
    starts = offsets[owner] + within
    lengths = np.minimum(chunk, sizes[owner] - within)
    return starts, lengths, [int(f) for f in firsts]
