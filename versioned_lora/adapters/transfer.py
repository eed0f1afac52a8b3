"""Bucketed transfer of a snapshot's tensors over torch.distributed (gloo on CPU, nccl on GPU).

The publisher (rank 0) and each engine (rank 1) share a private two-rank group, so one engine's death or
stall cannot block another's transfer. Tensors travel in manifest (name) order, packed into flat uint8
buckets of at most `max_bucket_bytes`; each bucket is one `broadcast`. Both sides derive every size from
the same `BucketPlan`, so nothing but payload crosses the group.

The receiving half (`start_receive_bucket`, `received_tensors`, `bucket_views`, `split_bucket`) runs inside
SGLang's scheduler and needs nothing beyond torch and this package's pure-Python manifest module. A stash
keeps each received bucket's buffer; its tensors are views into those buffers, made only when needed.
"""

from __future__ import annotations

import collections
import datetime
import functools
import hashlib
import json
import socket
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from versioned_lora.adapters.manifest import (
    DTYPE_ITEMSIZE,
    Manifest,
    canonical_json_bytes,
    dtype_name,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore

PLAN_FORMAT = "versioned-lora/bucket-plan/v1"
# Every tensor starts at a multiple of this, so the receiver can `view` its slice as any dtype (torch
# requires the byte offset to be a multiple of the itemsize) and GPU copies stay aligned.
ALIGNMENT = 16
DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


class TransferError(Exception):
    """Base of every transfer error."""


class OversizedBucket(TransferError):
    """A single tensor larger than `max_bucket_bytes`: it cannot go in any bucket."""


class MalformedPlan(TransferError):
    """A plan (JSON or value) that breaks the format; the message says which rule."""


class PlanMismatch(TransferError):
    """Tensors, manifest or snapshot that the plan does not describe."""


class BucketTransferFailed(TransferError):
    """A broadcast that failed or missed its deadline; the group must be destroyed and recreated."""


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _slot_tuple(value: Iterable[BucketSlot]) -> tuple[BucketSlot, ...]:
    return tuple(value)


def _bucket_tuple(value: Iterable[Bucket]) -> tuple[Bucket, ...]:
    return tuple(value)


@attrs.frozen
class BucketSlot:
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "shape": list(self.shape)}  # fmt: skip


@attrs.frozen
class Bucket:
    index: int
    slots: tuple[BucketSlot, ...] = attrs.field(converter=_slot_tuple)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: up to the end of the last tensor (alignment padding included)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


@attrs.frozen
class BucketPlan:
    manifest_digest: str
    max_bucket_bytes: int
    alignment: int
    buckets: tuple[Bucket, ...] = attrs.field(converter=_bucket_tuple)

    def __attrs_post_init__(self) -> None:
        _check_plan(self)

    @classmethod
    def build(cls, manifest: Manifest, max_bucket_bytes: int, alignment: int = ALIGNMENT) -> BucketPlan:
        """Greedy packing in manifest order: a tensor joins the current bucket if it still fits, else opens one."""
        if max_bucket_bytes <= 0 or alignment <= 0:
            raise MalformedPlan(f"max_bucket_bytes ({max_bucket_bytes}) and alignment ({alignment}) must be > 0")
        buckets: list[list[BucketSlot]] = []
        current: list[BucketSlot] = []
        end = 0
        for entry in manifest.tensors:
            if entry.nbytes > max_bucket_bytes:
                raise OversizedBucket(
                    f"tensor {entry.name!r} has {entry.nbytes} bytes, more than max_bucket_bytes={max_bucket_bytes}"
                )
            offset = _align(end, alignment)
            if current and offset + entry.nbytes > max_bucket_bytes:
                buckets.append(current)
                current, offset = [], 0
            current.append(BucketSlot(entry.name, offset, entry.nbytes, entry.dtype, entry.shape))
            end = offset + entry.nbytes
        if current:
            buckets.append(current)
        return cls(
            manifest_digest=manifest.digest,
            max_bucket_bytes=max_bucket_bytes,
            alignment=alignment,
            buckets=[Bucket(i, slots) for i, slots in enumerate(buckets)],
        )

    @property
    def total_bytes(self) -> int:
        """Bytes broadcast for the whole plan (payload plus alignment padding)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for b in self.buckets for s in b.slots)

    def slots(self) -> tuple[BucketSlot, ...]:
        return tuple(s for b in self.buckets for s in b.slots)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "manifest_digest": self.manifest_digest,
            "max_bucket_bytes": self.max_bucket_bytes,
            "alignment": self.alignment,
            "buckets": [[s.to_dict() for s in b.slots] for b in self.buckets],
        }

    def to_json(self) -> str:
        return canonical_json_bytes(self.to_dict()).decode("utf-8")

    def digest(self) -> str:
        return hashlib.sha256(canonical_json_bytes(self.to_dict())).hexdigest()

    @classmethod
    def from_json(cls, data: str | bytes) -> BucketPlan:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
                raise MalformedPlan(f"not a {PLAN_FORMAT} object")
            if set(raw) != {"format", "manifest_digest", "max_bucket_bytes", "alignment", "buckets"}:
                raise MalformedPlan(f"unexpected plan fields {sorted(raw)}")
            buckets = []
            for i, slots in enumerate(raw["buckets"]):
                if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
                    raise MalformedPlan(f"bucket {i} must be a list of slot objects")
                buckets.append(Bucket(i, [BucketSlot(**s) for s in slots]))
            return cls(
                manifest_digest=raw["manifest_digest"],
                max_bucket_bytes=raw["max_bucket_bytes"],
                alignment=raw["alignment"],
                buckets=buckets,
            )
        except MalformedPlan:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise MalformedPlan(f"malformed bucket plan: {exc}") from exc

    def check_describes(self, manifest: Manifest) -> None:
        """Raise PlanMismatch unless this plan carries exactly the manifest's tensors, in its order."""
        if self.manifest_digest != manifest.digest:
            raise PlanMismatch(f"plan is for manifest {self.manifest_digest[:12]}, not {manifest.digest[:12]}")
        planned = [(s.name, s.nbytes, s.dtype, s.shape) for s in self.slots()]
        listed = [(t.name, t.nbytes, t.dtype, t.shape) for t in manifest.tensors]
        if planned != listed:
            raise PlanMismatch("plan slots differ from the manifest's tensors")


def _check_plan(plan: BucketPlan) -> None:
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(plan.manifest_digest, str) or len(plan.manifest_digest) != 64:
        raise MalformedPlan(f"manifest_digest must be a sha256 hex string, got {plan.manifest_digest!r}")
    if not is_int(plan.max_bucket_bytes) or plan.max_bucket_bytes <= 0:
        raise MalformedPlan(f"max_bucket_bytes must be a positive integer, got {plan.max_bucket_bytes!r}")
    if not is_int(plan.alignment) or plan.alignment <= 0:
        raise MalformedPlan(f"alignment must be a positive integer, got {plan.alignment!r}")
    previous_name: str | None = None
    for i, bucket in enumerate(plan.buckets):
        if bucket.index != i or not bucket.slots:
            raise MalformedPlan(f"bucket {i}: wrong index {bucket.index} or no tensors")
        end = 0
        for slot in bucket.slots:
            where = f"bucket {i}, tensor {slot.name!r}"
            if not isinstance(slot.name, str) or (previous_name is not None and slot.name <= previous_name):
                raise MalformedPlan(f"{where}: names must be strings in strictly increasing order")
            previous_name = slot.name
            if slot.dtype not in DTYPE_ITEMSIZE or not all(is_int(d) and d >= 0 for d in slot.shape):
                raise MalformedPlan(f"{where}: unknown dtype {slot.dtype!r} or bad shape {list(slot.shape)}")
            expected = DTYPE_ITEMSIZE[slot.dtype]
            for d in slot.shape:
                expected *= d
            if not is_int(slot.nbytes) or slot.nbytes != expected:
                raise MalformedPlan(f"{where}: nbytes {slot.nbytes!r} != {expected} from dtype and shape")
            if not is_int(slot.offset) or slot.offset < end or slot.offset % plan.alignment:
                raise MalformedPlan(f"{where}: offset {slot.offset!r} overlaps or is not aligned")
            end = slot.end
        if end > plan.max_bucket_bytes:
            raise MalformedPlan(f"bucket {i} has {end} bytes, over max_bucket_bytes={plan.max_bucket_bytes}")


# ---- packing and splitting -----------------------------------------------------------------------------------
#
# The cost of a transfer is per tensor, not per byte: an adapter has hundreds of small tensors and the wire moves
# a bucket in well under a millisecond. So nothing here issues one device operation per tensor on the hot path:
# a bucket is packed with one `torch.cat` over byte views, a snapshot's packed buckets are kept (`packed_buckets`)
# so that sending it again costs no packing at all, and a received bucket stays one buffer until its tensors
# are needed (then views into it, no per-tensor copy). Measured on two H200s (gpu_validation/transfer_breakdown):
# making the 504 views of a Qwen3-8B LoRA costs ~1.8 ms of host time, four times the wire time of all its bytes.


def _byte_parts(tensors: Mapping[str, torch.Tensor], bucket: Bucket, device: torch.device) -> list[torch.Tensor]:
    """The uint8 pieces whose concatenation is the bucket's bytes (zero padding included), all on one device:
    `device` when every source is there (or on no common device), else the sources' common device (the caller
    then moves the one packed bucket instead of every tensor)."""
    import torch

    sources = [tensors[slot.name].detach() for slot in bucket.slots]
    source_devices = {t.device for t in sources}
    on = next(iter(source_devices)) if len(source_devices) == 1 else device
    ends = [0, *(s.end for s in bucket.slots[:-1])]
    gaps = [slot.offset - end for slot, end in zip(bucket.slots, ends, strict=True)]
    zeros = torch.zeros(max(gaps, default=0), dtype=torch.uint8, device=on)
    parts: list[torch.Tensor] = []
    for gap, source in zip(gaps, sources, strict=True):
        if gap:
            parts.append(zeros[:gap])
        raw = source.contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw if raw.device == on else raw.to(on))
    return parts


def pack_bucket(
    tensors: Mapping[str, torch.Tensor], plan: BucketPlan, index: int, device: str | torch.device = "cpu",
    *, check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Bucket `index` as one flat uint8 tensor on `device` (padding zeroed, so identical input gives identical
    bytes). With `check`, each tensor's dtype and shape must match the plan; its byte count always must.

    One concatenation per bucket (plus one copy to `device` when the tensors live elsewhere), not one copy per
    tensor. The result is fresh memory: it never aliases the inputs.

    On the CPU the concatenation is numpy's, on the calling thread, not `torch.cat`: torch runs a copy this size
    as an OpenMP parallel region over every intra-op thread, and a region ends only when its slowest thread
    does, which beside busy engines is late. benchmarks/pack_under_load.py (inside publications of an 80 MB
    adapter beside two engines under traffic), medians of three runs: 0.270, 0.176 and 0.183 s with torch.cat,
    0.132, 0.013 and 0.139 s with numpy (benchmarks/results/2026-12-04-pack-under-load*.txt)."""
    import torch

    check_bucket_tensors(tensors, plan, index, check_dtype_and_shape=check)
    bucket = plan.buckets[index]
    target = torch.device(device)
    parts = _byte_parts(tensors, bucket, target)
    if not parts:
        flat = torch.empty(0, dtype=torch.uint8, device=target)
    elif parts[0].device.type == "cpu":
        import numpy as np

        flat = torch.from_numpy(np.concatenate([part.numpy() for part in parts])).to(target)
    elif len(parts) == 1:
        flat = parts[0].to(target, copy=True)
    else:
        flat = torch.cat(parts)
        if flat.device != target:
            flat = flat.to(target)
    if flat.numel() != bucket.nbytes:  # unreachable after check_bucket_tensors; guards the layout arithmetic
        raise PlanMismatch(f"bucket {index} packed to {flat.numel()} bytes, plan says {bucket.nbytes}")
    return flat


def check_bucket_tensors(
    tensors: Mapping[str, torch.Tensor], plan: BucketPlan, index: int, *, check_dtype_and_shape: bool = True
) -> None:
    """Raise PlanMismatch if a tensor of bucket `index` is missing or does not fit its slot."""
    for slot in plan.buckets[index].slots:
        if slot.name not in tensors:
            raise PlanMismatch(f"tensor {slot.name!r} of bucket {index} is missing")
        tensor = tensors[slot.name]
        actual = (dtype_name(tensor.dtype), tuple(tensor.shape))
        if check_dtype_and_shape and actual != (slot.dtype, slot.shape):
            raise PlanMismatch(
                f"tensor {slot.name!r} is {actual[0]}{list(actual[1])}, plan says {slot.dtype}{list(slot.shape)}"
            )
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != slot.nbytes:
            raise PlanMismatch(f"tensor {slot.name!r} has {nbytes} bytes, plan says {slot.nbytes}")


def pack_all(
    tensors: Mapping[str, torch.Tensor], plan: BucketPlan, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    return [pack_bucket(tensors, plan, i, device) for i in range(len(plan.buckets))]


# Packed buckets of recently sent snapshots, so a snapshot sent again (to another engine, a retry, a late
# joiner) costs no packing. Keyed by the snapshot object (held weakly: an entry goes when its snapshot does);
# at most PACKED_CACHE_ENTRIES entries, least recently used first out. Each entry holds one extra copy of the
# adapter on its device. Only objects with `tensors` and `digest` (a Snapshot) are cached, never a plain
# mapping: a Snapshot is immutable by contract, and the receiver's digest check would catch a violation.
PACKED_CACHE_ENTRIES = 2


@attrs.define(eq=False)
class _PackedEntry:
    owner: weakref.ref[Any]
    plan: BucketPlan
    device: torch.device
    flats: tuple[torch.Tensor, ...]


_packed_cache: collections.OrderedDict[int, _PackedEntry] = collections.OrderedDict()
_packed_lock = threading.Lock()
_packing_lock = threading.Lock()  # held while packing a snapshot's buckets (packed_buckets)


def _normalised_device(device: str | torch.device) -> torch.device:
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _cached_flats(snapshot: object, plan: BucketPlan, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    with _packed_lock:
        entry = _packed_cache.get(id(snapshot))
        if entry is None or entry.owner() is not snapshot:
            return None
        if entry.device != device or not (entry.plan is plan or entry.plan == plan):
            return None
        _packed_cache.move_to_end(id(snapshot))
        return entry.flats


def _remember_flats(snapshot: object, plan: BucketPlan, device: torch.device, flats: Sequence[torch.Tensor]) -> None:
    key = id(snapshot)

    def forget(ref: weakref.ref[Any], lock: Any = _packed_lock, cache: Any = _packed_cache) -> None:
        # Module globals may already be gone when this runs at interpreter exit: hold them here.
        with lock:
            entry = cache.get(key)
            if entry is not None and entry.owner is ref:
                del cache[key]

    try:
        owner = weakref.ref(snapshot, forget)
    except TypeError:  # an object that takes no weak references is simply not cached
        return
    with _packed_lock:
        _packed_cache[key] = _PackedEntry(owner, plan, device, tuple(flats))
        _packed_cache.move_to_end(key)
        while len(_packed_cache) > max(PACKED_CACHE_ENTRIES, 0):
            _packed_cache.popitem(last=False)


def clear_packed_cache() -> None:
    """Drop every snapshot's packed buckets (frees their memory once no send is using them)."""
    with _packed_lock:
        _packed_cache.clear()


def _snapshot_tensors(snapshot: _HasTensors, plan: BucketPlan) -> Mapping[str, torch.Tensor]:
    if snapshot.digest != plan.manifest_digest:
        raise PlanMismatch(f"plan is for {plan.manifest_digest[:12]}, snapshot is {snapshot.digest[:12]}")
    return snapshot.tensors


def packed_buckets(
    snapshot: _HasTensors, plan: BucketPlan, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Every bucket of `snapshot` packed on `device`, from the cache or packed (and cached) now.

    A publisher may call this when a candidate is prepared, so the transfer itself starts with packed
    buckets; `send_all` uses the same cache. The tensors are shared: treat them as read-only."""
    target = _normalised_device(device)
    # One packer at a time: the engines' links ask for the same buckets at once (each from a thread of its own),
    # and the first packs while the others wait for its result instead of packing it again.
    with _packing_lock:
        cached = _cached_flats(snapshot, plan, target)
        if cached is not None:
            return cached
        tensors = _snapshot_tensors(snapshot, plan)
        for i in range(len(plan.buckets)):
            check_bucket_tensors(tensors, plan, i)
        flats = tuple(pack_bucket(tensors, plan, i, target, check=False) for i in range(len(plan.buckets)))
        if flats:
            _sync_device(flats[-1])  # cached buffers must be complete before another stream or thread sends them
        _remember_flats(snapshot, plan, target, flats)
        return flats


def allocate_buckets(plan: BucketPlan, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Empty receive buffers for every bucket (the raw baseline's receiver side)."""
    import torch

    return [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in plan.buckets]


@attrs.frozen
class _BucketLayout:
    """What `bucket_views` needs, derived once per bucket: one typed view of the buffer per dtype, then per
    tensor (name, which typed view, shape, contiguous stride, offset in elements)."""

    dtypes: tuple[tuple[Any, int], ...]  # (torch dtype, itemsize)
    entries: tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], int], ...]
    misaligned: tuple[BucketSlot, ...]  # offset not a multiple of the itemsize (only with a small alignment)


# Layouts by bucket identity (hashing a frozen plan by value costs more than a layout saves).
_layouts: dict[int, tuple[weakref.ref[Bucket], _BucketLayout]] = {}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return tuple(reversed(stride))


def _drop_key(table: dict[int, Any], key: int, _ref: object) -> None:
    # A weakref callback; bound to its table so it still works while the module is torn down at exit.
    table.pop(key, None)


def _layout(bucket: Bucket) -> _BucketLayout:
    key = id(bucket)
    found = _layouts.get(key)
    if found is not None and found[0]() is bucket:
        return found[1]
    dtypes: list[tuple[Any, int]] = []
    entries = []
    misaligned = []
    for slot in bucket.slots:
        itemsize = DTYPE_ITEMSIZE[slot.dtype]
        if slot.offset % itemsize:
            misaligned.append(slot)
            continue
        dtype = torch_dtype(slot.dtype)
        if (dtype, itemsize) not in dtypes:
            dtypes.append((dtype, itemsize))
        entries.append((slot.name, dtypes.index((dtype, itemsize)), slot.shape, _contiguous_stride(slot.shape),
                        slot.offset // itemsize))  # fmt: skip
    layout = _BucketLayout(tuple(dtypes), tuple(entries), tuple(misaligned))
    _layouts[key] = (weakref.ref(bucket, functools.partial(_drop_key, _layouts, key)), layout)
    return layout


def _aligned_views(flat: torch.Tensor, layout: _BucketLayout) -> dict[str, torch.Tensor]:
    n = flat.numel()
    makers = [flat[: n - n % itemsize].view(dtype).as_strided for dtype, itemsize in layout.dtypes]
    return {name: makers[k](shape, stride, offset) for name, k, shape, stride, offset in layout.entries}


def _misaligned_copies(flat: torch.Tensor, layout: _BucketLayout) -> dict[str, torch.Tensor]:
    return {
        s.name: flat[s.offset : s.end].clone().view(torch_dtype(s.dtype)).reshape(s.shape) for s in layout.misaligned
    }


def bucket_views(flat: torch.Tensor, plan: BucketPlan, index: int) -> dict[str, torch.Tensor]:
    """The tensors of bucket `index` as views into `flat` (no copy): they share `flat`'s memory, which stays
    alive as long as any of them does. (A tensor whose offset is not a multiple of its itemsize, possible only
    with a plan alignment below 8, cannot be viewed and is copied.)"""
    if flat.numel() != plan.buckets[index].nbytes or flat.storage_offset() != 0:
        raise PlanMismatch(f"buffer of {flat.numel()} bytes is not bucket {index} ({plan.buckets[index].nbytes})")
    layout = _layout(plan.buckets[index])
    out = _aligned_views(flat, layout)
    if layout.misaligned:
        out.update(_misaligned_copies(flat, layout))
    return out


def split_bucket(flat: torch.Tensor, plan: BucketPlan, index: int) -> dict[str, torch.Tensor]:
    """The tensors of bucket `index`, each a clone (they share nothing with `flat`). The receive path uses
    `bucket_views` instead; this is for callers that must free or reuse `flat`."""
    return {name: view.clone() for name, view in bucket_views(flat, plan, index).items()}


# ---- the collective -------------------------------------------------------------------------------------------


def _wait(work: Any, timeout: datetime.timedelta | None, what: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
    except RuntimeError as exc:  # gloo/nccl report timeouts and closed peers as RuntimeError
        raise BucketTransferFailed(f"{what}: {exc}") from exc


def _sync_device(tensor: torch.Tensor) -> None:
    # NCCL's wait() only orders the current stream; callers of send/receive expect the bytes to be there.
    if tensor.is_cuda:
        import torch

        torch.cuda.current_stream(tensor.device).synchronize()


def send_bucket(
    group: dist.ProcessGroup, flat: torch.Tensor, src_rank: int = 0, timeout: datetime.timedelta | None = None
) -> None:
    """Broadcast one packed bucket from `src_rank`; returns once it completed (or raises BucketTransferFailed).

    A timed-out broadcast stays pending inside the backend: the group is unusable afterwards.
    """
    import torch.distributed as dist

    if flat.numel() == 0:
        return  # both sides know the size from the plan; a 0-byte collective is skipped on both
    try:
        if flat.is_cuda:  # in stream order (see send_all); NCCL's own timeout bounds it, the host waits below
            dist.broadcast(flat, src=src_rank, group=group)
        else:
            _wait(dist.broadcast(flat, src=src_rank, group=group, async_op=True), timeout, "send")
    except RuntimeError as exc:
        raise BucketTransferFailed(f"send: {exc}") from exc
    _sync_device(flat)


@attrs.define
class PendingBucket:
    """A posted receive. `done()` polls without blocking, so a scheduler can keep decoding while it waits;
    `result()` waits (up to a deadline) and returns the bucket's buffer, complete (on a GPU: in stream order).

    The buffer was allocated for this receive and is referenced by nothing else: whoever keeps it owns the
    bucket. Nothing per tensor happens here: `received_tensors` makes the tensors (views into the buffers)
    when they are needed, at verification, because on a fast wire even making hundreds of views costs more
    than the bytes' transfer."""

    plan: BucketPlan
    index: int
    flat: torch.Tensor
    work: Any  # torch.distributed Work, or None for a 0-byte bucket

    def done(self) -> bool:
        # Also true once the backend's own timeout fired; result() then raises.
        return self.work is None or bool(self.work.is_completed())

    def result(self, timeout: datetime.timedelta | None = None) -> torch.Tensor:
        # On a GPU the buffer is complete in stream order: wait() makes the current stream wait for the
        # broadcast, so every later use (verification's copy to the host, SGLang's load) reads the bucket.
        # The host does not wait here: `done()` already said the bytes arrived, and a host sync per bucket
        # costs as much as a small bucket's wire time.
        if self.work is not None:
            _wait(self.work, timeout, f"receive bucket {self.index}")
        return self.flat


def start_receive_bucket(
    group: dist.ProcessGroup, plan: BucketPlan, index: int, device: str | torch.device = "cpu", src_rank: int = 0
) -> PendingBucket:
    """Post the receive of bucket `index` into a fresh buffer of its size and return at once (see
    PendingBucket)."""
    import torch
    import torch.distributed as dist

    flat = torch.empty(plan.buckets[index].nbytes, dtype=torch.uint8, device=device)
    if flat.numel() == 0:
        return PendingBucket(plan, index, flat, None)
    try:
        work = dist.broadcast(flat, src=src_rank, group=group, async_op=True)
    except RuntimeError as exc:
        raise BucketTransferFailed(f"receive bucket {index}: {exc}") from exc
    return PendingBucket(plan, index, flat, work)


def received_tensors(plan: BucketPlan, buffers: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the received buckets (bucket index -> buffer), dtype and shape from the plan: views into
    the buffers (see `bucket_views`), which stay alive as long as any view does."""
    out: dict[str, torch.Tensor] = {}
    for index in sorted(buffers):
        out.update(bucket_views(buffers[index], plan, index))
    return out


class _HasTensors(Protocol):
    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def digest(self) -> str: ...


@attrs.frozen
class SendReport:
    """Per group (by position in `groups`): how many buckets completed on the sender, and the error that
    stopped it. A completed send is not proof of receipt (gloo completes a send once its bytes are in the
    socket buffer): the engine's own reply for bucket i is what confirms it was stashed."""

    buckets_total: int
    buckets_done: tuple[int, ...]
    failures: Mapping[int, BaseException]

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_for_failures(self) -> None:
        if self.failures:
            detail = "; ".join(f"group {g}: {exc}" for g, exc in sorted(self.failures.items()))
            raise BucketTransferFailed(f"transfer failed for {len(self.failures)} group(s): {detail}")


def send_all(
    groups: Sequence[dist.ProcessGroup],
    snapshot: _HasTensors | Mapping[str, torch.Tensor],
    plan: BucketPlan,
    on_bucket_done: Callable[[int], None] | None = None,
    *,
    device: str | torch.device = "cpu",
    src_rank: int = 0,
    timeout: datetime.timedelta | None = None,
    cache: bool = True,
) -> SendReport:
    """Send every bucket to every group, in bucket order on each group.

    The broadcasts of one bucket to all groups run concurrently. A snapshot (an object with `tensors` and
    `digest`) is packed once and its packed buckets are kept (`packed_buckets`; `cache=False` neither reads
    nor fills the cache): sending it again sends them as they are. Otherwise bucket i+1 is packed (one
    `torch.cat`) while bucket i is on the wire. Without `on_bucket_done`, bucket i+1 is posted before
    bucket i is waited for (two in flight per group), so the wire never idles on a host round trip.

    A group that fails is dropped and the others continue (its engine's attempt is then cleaned up by the
    protocol). `on_bucket_done(i)` runs after the sends of bucket i completed on every live group and before
    bucket i+1 is posted: tests use it to hold the sender mid-transfer. (A completed send means the bytes
    left this process; see SendReport.)
    """
    import torch.distributed as dist

    target = _normalised_device(device)
    cacheable = cache and not isinstance(snapshot, Mapping)
    count = len(plan.buckets)
    # A hit was checked against this very snapshot object and an equal plan when it was packed; computing the
    # digest again (hundreds of microseconds for hundreds of tensors) would cost as much as the wire.
    cached = _cached_flats(snapshot, plan, target) if cacheable else None
    tensors = (
        snapshot if isinstance(snapshot, Mapping) else _snapshot_tensors(snapshot, plan) if cached is None else {}
    )
    if cached is None:
        # Check every tensor before the first byte leaves, so a bad input never strands a receiver mid-attempt.
        for i in range(count):
            check_bucket_tensors(tensors, plan, i)
    packed: list[torch.Tensor] = []

    def pack(i: int) -> torch.Tensor:
        flat = cached[i] if cached is not None else pack_bucket(tensors, plan, i, target, check=False)
        packed.append(flat)
        return flat

    failures: dict[int, BaseException] = {}
    done = [0] * len(groups)
    depth = 1 if on_bucket_done is not None else 2
    in_flight: collections.deque[tuple[int, torch.Tensor, list[tuple[int, Any]]]] = collections.deque()
    # On a GPU, async_op=True runs a broadcast on NCCL's internal stream, fenced by CUDA events on both sides
    # (15-20 µs a call on an H200 host, 5% of an 87 MB transfer); async_op=False enqueues it on the current
    # stream and returns at once. In stream order is only right with one group (a group's stall must not
    # hold another's buckets back, and every group's broadcasts would queue behind the first's) and packed
    # buckets (packing the next bucket on the same stream would wait for the wire instead of overlapping it).
    in_stream_order = target.type == "cuda" and len(groups) == 1 and cached is not None

    def post(group: dist.ProcessGroup, flat: torch.Tensor) -> Any:
        """Start one bucket on one group: its Work, or None when enqueued in stream order."""
        if in_stream_order:
            dist.broadcast(flat, src=src_rank, group=group)
            return None
        return dist.broadcast(flat, src=src_rank, group=group, async_op=True)

    def complete_oldest() -> None:
        i, flat, works = in_flight.popleft()
        for g, work in works:
            if g in failures or work is None:  # failed on an earlier bucket (abandoned with its group), or in order
                continue
            try:
                _wait(work, timeout, f"bucket {i}")
            except BucketTransferFailed as exc:
                failures[g] = exc
        if on_bucket_done is not None or i == count - 1:
            # On a GPU, wait() only orders this stream after the broadcast; the host waits here only where it
            # must see the bucket done (a hook, the return). Buckets finish in order on each group's stream.
            _sync_device(flat)
        for g in range(len(groups)):
            if g not in failures:
                done[g] = i + 1
        if on_bucket_done is not None and len(failures) < len(groups):
            on_bucket_done(i)

    next_flat = pack(0) if count else None
    for i in range(count):
        flat, next_flat = next_flat, None
        if flat is None:  # unreachable: bucket i was packed in the previous round
            raise TransferError(f"bucket {i} was not packed")
        works: list[tuple[int, Any]] = []
        for g, group in enumerate(groups):
            if g in failures or flat.numel() == 0:
                continue
            try:
                works.append((g, post(group, flat)))
            except RuntimeError as exc:
                failures[g] = BucketTransferFailed(f"bucket {i}: {exc}")
        in_flight.append((i, flat, works))
        # Pack the next bucket while this one is on the wire.
        next_flat = pack(i + 1) if i + 1 < count else None
        while len(in_flight) >= depth:
            complete_oldest()
        if len(failures) == len(groups):
            break
    while in_flight and len(failures) < len(groups):
        complete_oldest()
    if cacheable and cached is None and len(packed) == count and count:
        _sync_device(packed[-1])
        _remember_flats(snapshot, plan, target, packed)
    return SendReport(buckets_total=count, buckets_done=tuple(done), failures=failures)


def raw_broadcast(group: dist.ProcessGroup, flat_tensors: Sequence[torch.Tensor], src_rank: int = 0) -> None:
    """Benchmark baseline: plain broadcasts of pre-packed (or pre-allocated) buckets, nothing else. Both the
    sender (`pack_all`) and the receiver (`allocate_buckets`) call it with the same plan."""
    import torch.distributed as dist

    for flat in flat_tensors:
        if flat.numel():
            dist.broadcast(flat, src=src_rank, group=group)
    if flat_tensors:
        _sync_device(flat_tensors[-1])


# ---- groups ---------------------------------------------------------------------------------------------------


def transfer_backend(device: str | torch.device) -> str:
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def tcp_init_method(host: str, port: int) -> str:
    # Same spelling as SGLang's NetworkAddress.to_tcp (IPv6 literals in brackets).
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port for a group's rendezvous (rank 0 listens on it). Racy by nature: another
    socket (an outgoing connection's local port) may take it before rank 0 listens. Tests and benchmarks
    that start both ranks themselves use it; a publisher uses `listen_for_transfer_group`, which has no race."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _custom_process_group_factory() -> Callable[..., Any]:
    """SGLang's `init_custom_process_group` when SGLang is installed (the engine side always uses it, via
    `/init_weights_update_group` or the managed-LoRA handler); otherwise the same steps inline, for
    publisher hosts and GPU benchmark machines that have torch but no SGLang."""
    try:
        from sglang.srt.utils.common import init_custom_process_group
    except ImportError:
        return _init_custom_process_group_without_sglang
    return init_custom_process_group  # type: ignore[no-any-return]


def _init_custom_process_group_without_sglang(
    *,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: datetime.timedelta,
    init_method: str | None = None,
    store: Any = None,
) -> Any:
    """The steps of sglang.srt.utils.common.init_custom_process_group (0.5.23): a group outside the default
    world, rendezvous over `init_method` with keys under a `group_name` prefix (or over a `store` given as it
    is, as SGLang's does), ranks mapped 1:1."""
    from torch.distributed.distributed_c10d import (  # type: ignore[attr-defined]
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if store is None:
        assert init_method is not None
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    options: dict[str, Any] = {"group_name": group_name, "backend_options": None, "timeout": timeout}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, **options)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def init_transfer_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    group_name: str,
    device: str | torch.device = "cpu",
    world_size: int = 2,
    timeout: datetime.timedelta = DEFAULT_GROUP_TIMEOUT,
    backend: str | None = None,
    store: TCPStore | None = None,
) -> dist.ProcessGroup:
    """Join the two-rank group of one engine: rank 0 the publisher, rank 1 the engine.

    Blocks until every rank joined (rank 0 hosts the TCP store on `master_port`), so the publisher must
    issue the engine's join request concurrently (another thread or task). `group_name` must be unique
    among live groups in each process (torch refuses a duplicate): use one per engine incarnation.
    `timeout` bounds every later collective on the group: a bucket that has not arrived by then fails and
    leaves the group unusable. `store`: rank 0's store from `listen_for_transfer_group`, already listening
    on `master_port` (the other ranks reach it through `master_address:master_port` as before).
    """
    from torch._C._distributed_c10d import PrefixStore

    init = _custom_process_group_factory()
    where: dict[str, Any] = (
        {"init_method": tcp_init_method(master_address, master_port)} if store is None
        # Under the group's prefix, as rendezvous over init_method puts the other ranks' keys.
        else {"store": PrefixStore(group_name, store)}
    )
    group: dist.ProcessGroup = init(
        backend=backend or transfer_backend(device),
        world_size=world_size,
        rank=rank,
        group_name=group_name,
        timeout=timeout,
        **where,
    )
    return group


def listen_for_transfer_group(
    master_address: str = "127.0.0.1", world_size: int = 2, timeout: datetime.timedelta = DEFAULT_GROUP_TIMEOUT
) -> TCPStore:
    """Rank 0's rendezvous store, listening before any other rank is asked to join, on a port the kernel
    picks as it binds (port 0; `.port` says which). A port chosen first and bound later (`free_port`) can
    be taken in between by any outgoing connection's local port; the other rank then waits out its whole
    timeout for a rank 0 that never listened."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(master_address, 0, world_size, True, timeout, wait_for_workers=False)


def destroy_transfer_group(group: dist.ProcessGroup) -> None:
    """Tear a group down; also how a receiver abandons a pending receive (gloo releases it at once)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)
