"""Bucket plans (properties over generated manifests) and pack/split without a process group."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import math
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from versioned_lora.adapters import transfer
from versioned_lora.adapters.manifest import (
    DTYPE_ITEMSIZE,
    Manifest,
    TensorEntry,
    manifest_from_tensors,
    verify_tensors,
)
from versioned_lora.adapters.snapshot import Snapshot
from versioned_lora.adapters.transfer import (
    ALIGNMENT,
    BucketPlan,
    MalformedPlan,
    OversizedBucket,
    PlanMismatch,
    bucket_views,
    clear_packed_cache,
    pack_all,
    pack_bucket,
    packed_buckets,
    split_bucket,
)

CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}

entries = st.dictionaries(
    keys=st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12),
    values=st.tuples(
        st.sampled_from(sorted(DTYPE_ITEMSIZE)), st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
    ),
    max_size=25,
)


def manifest_of(spec: dict[str, tuple[str, tuple[int, ...]]]) -> Manifest:
    return Manifest.create(
        [
            TensorEntry(name, dtype, shape, math.prod(shape) * DTYPE_ITEMSIZE[dtype], "0" * 64)
            for name, (dtype, shape) in spec.items()
        ],
        CONFIG,
    )


@settings(max_examples=300, deadline=None)
@given(spec=entries, max_bytes=st.integers(1, 4000))
def test_plan_properties(spec: dict[str, tuple[str, tuple[int, ...]]], max_bytes: int) -> None:
    manifest = manifest_of(spec)
    largest = max((t.nbytes for t in manifest.tensors), default=0)
    if largest > max_bytes:
        with pytest.raises(OversizedBucket):
            BucketPlan.build(manifest, max_bytes)
        return
    plan = BucketPlan.build(manifest, max_bytes)

    # Every tensor in exactly one bucket, in manifest order, with its dtype/shape/size.
    assert [(s.name, s.dtype, s.shape, s.nbytes) for s in plan.slots()] == [
        (t.name, t.dtype, t.shape, t.nbytes) for t in manifest.tensors
    ]
    plan.check_describes(manifest)
    for bucket in plan.buckets:
        assert bucket.slots, "no empty buckets"
        assert bucket.nbytes <= max_bytes
        end = 0
        for slot in bucket.slots:
            assert slot.offset >= end and slot.offset % ALIGNMENT == 0
            end = slot.end
    # Greedy: a bucket was closed only because the next tensor did not fit.
    for before, after in zip(plan.buckets, plan.buckets[1:], strict=False):
        first = after.slots[0]
        assert -(-before.nbytes // ALIGNMENT) * ALIGNMENT + first.nbytes > max_bytes
    assert plan.payload_bytes == manifest.total_bytes
    assert plan.total_bytes == sum(b.nbytes for b in plan.buckets) >= plan.payload_bytes

    again = BucketPlan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest() and again.to_json() == plan.to_json()


def test_oversized_tensor_names_the_tensor() -> None:
    manifest = manifest_of({"a": ("float32", (10,)), "big": ("float32", (100,))})
    with pytest.raises(OversizedBucket, match="'big' has 400 bytes"):
        BucketPlan.build(manifest, 399)
    assert len(BucketPlan.build(manifest, 400).buckets) == 2


def test_plan_is_tied_to_its_manifest() -> None:
    one = manifest_of({"a": ("float32", (10,))})
    other = manifest_of({"a": ("float32", (11,))})
    with pytest.raises(PlanMismatch):
        BucketPlan.build(one, 1024).check_describes(other)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda raw: raw["buckets"][0][0].update(offset=3),  # misaligned
        lambda raw: raw["buckets"][0][0].update(nbytes=1),  # inconsistent with dtype x shape
        lambda raw: raw["buckets"].append([]),  # empty bucket
        lambda raw: raw.update(max_bucket_bytes=8),  # bucket over the max
        lambda raw: raw["buckets"][0].reverse(),  # names out of order
        lambda raw: raw["buckets"][0][0].update(dtype="complex32"),
        lambda raw: raw.pop("alignment"),
        lambda raw: raw.update(format="v0"),
        lambda raw: raw["buckets"][0][0].pop("shape"),
    ],
    ids=["misaligned", "nbytes", "empty", "over-max", "order", "dtype", "missing-field", "format", "slot-field"],
)
def test_malformed_plan_is_rejected(mutate) -> None:  # type: ignore[no-untyped-def]
    plan = BucketPlan.build(manifest_of({"a": ("float32", (4,)), "b": ("int8", (3,)), "c": ("bfloat16", (2,))}), 64)
    raw = json.loads(plan.to_json())
    mutate(raw)
    with pytest.raises(MalformedPlan):
        BucketPlan.from_json(json.dumps(raw))


def odd_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 10, generator=gen)
    return {
        "a.bf16": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "b.int8": torch.randint(-100, 100, (7,), generator=gen, dtype=torch.int8),
        "c.f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "d.scalar": torch.tensor(2.5, dtype=torch.float16),
        "e.empty": torch.empty(0, 4),
        "f.noncontig": wide[:, ::3],
        "g.bool": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("max_bytes", [96, 130, 4096])
def test_pack_then_split_is_bit_exact(max_bytes: int) -> None:
    tensors = odd_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    plan = BucketPlan.build(manifest, max_bytes)
    flats = pack_all(tensors, plan)
    assert [f.numel() for f in flats] == [b.nbytes for b in plan.buckets]
    received: dict[str, torch.Tensor] = {}
    for i, flat in enumerate(flats):
        part = split_bucket(flat, plan, i)
        for tensor in part.values():
            # Clones: the stash must not pin (or alias) the flat receive buffer.
            assert tensor.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        received.update(part)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name
    # Same input, same bytes (padding is zeroed).
    assert all(torch.equal(a, b) for a, b in zip(flats, pack_all(tensors, plan), strict=True))


def test_pack_rejects_tensors_the_plan_does_not_describe() -> None:
    tensors = odd_tensors()
    plan = BucketPlan.build(manifest_from_tensors(tensors, CONFIG), 4096)
    with pytest.raises(PlanMismatch, match="missing"):
        pack_bucket({k: v for k, v in tensors.items() if k != "a.bf16"}, plan, 0)
    with pytest.raises(PlanMismatch, match="plan says"):
        pack_bucket({**tensors, "a.bf16": tensors["a.bf16"].to(torch.float16)}, plan, 0)
    with pytest.raises(PlanMismatch, match="plan says"):
        pack_bucket({**tensors, "a.bf16": tensors["a.bf16"].reshape(3, 5)}, plan, 0)
    # Fault injection for engine tests: the raw bytes of a same-sized tensor can be forced through.
    pack_bucket({**tensors, "a.bf16": tensors["a.bf16"].to(torch.float16)}, plan, 0, check=False)


def test_receiver_half_imports_only_torch() -> None:
    code = (
        "import sys\n"
        "import versioned_lora.adapters.transfer\n"
        "heavy = [m for m in ('sglang', 'peft', 'transformers', 'safetensors', 'ray') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("max_bytes", [96, 130, 4096])
def test_views_are_bit_exact_and_live_in_the_bucket_buffer(max_bytes: int) -> None:
    # What the receiver hands out: no copy per tensor; the stash keeps the bucket's buffer alive.
    tensors = odd_tensors()
    plan = BucketPlan.build(manifest_from_tensors(tensors, CONFIG), max_bytes)
    received: dict[str, torch.Tensor] = {}
    for i, flat in enumerate(pack_all(tensors, plan)):
        part = bucket_views(flat, plan, i)
        assert list(part) == list(plan.buckets[i].names)
        for tensor in part.values():
            if tensor.numel():
                assert tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert tensor.is_contiguous()
        received.update(part)
    assert sorted(received) == sorted(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name
    verify_tensors(manifest_from_tensors(tensors, CONFIG), received)


def test_a_plan_with_small_alignment_still_round_trips() -> None:
    # alignment 1 puts f64/f16 tensors at odd offsets, where no dtype view exists: those are copied.
    tensors = odd_tensors()
    plan = BucketPlan.build(manifest_from_tensors(tensors, CONFIG), 4096, alignment=1)
    flat = pack_bucket(tensors, plan, 0)
    assert flat.numel() == sum(t.numel() * t.element_size() for t in tensors.values())
    received = bucket_views(flat, plan, 0)
    assert sorted(received) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(received[name], tensor), name
    with pytest.raises(PlanMismatch):
        bucket_views(flat[1:], plan, 0)


def test_pack_bucket_never_aliases_its_input() -> None:
    tensors = {"only": torch.arange(64, dtype=torch.float32)}
    plan = BucketPlan.build(manifest_from_tensors(tensors, CONFIG), 4096)
    flat = pack_bucket(tensors, plan, 0)
    assert flat.untyped_storage().data_ptr() != tensors["only"].untyped_storage().data_ptr()
    flat.zero_()
    assert tensors["only"][1] == 1


def frozen(tensors: dict[str, torch.Tensor]) -> Snapshot:
    return Snapshot(tensors=types.MappingProxyType(tensors), manifest=manifest_from_tensors(tensors, CONFIG))


def test_packed_buckets_are_cached_per_snapshot_plan_and_device() -> None:
    clear_packed_cache()
    snapshot = frozen(odd_tensors())
    plan = BucketPlan.build(snapshot.manifest, 130)
    first = packed_buckets(snapshot, plan)
    assert all(torch.equal(a, b) for a, b in zip(first, pack_all(snapshot.tensors, plan), strict=True))
    again = packed_buckets(snapshot, plan, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again, strict=True))  # not packed twice
    equal_plan = BucketPlan.from_json(plan.to_json())
    assert all(a is b for a, b in zip(first, packed_buckets(snapshot, equal_plan), strict=True))
    other_plan = BucketPlan.build(snapshot.manifest, 4096)
    other = packed_buckets(snapshot, other_plan)
    assert len(other) == 1 and other[0].numel() == other_plan.buckets[0].nbytes
    # An equal but distinct snapshot object is packed anew (the cache goes by object, held weakly).
    twin = frozen(dict(snapshot.tensors))
    assert all(a is not b for a, b in zip(first, packed_buckets(twin, plan), strict=True))
    with pytest.raises(PlanMismatch):
        packed_buckets(snapshot, BucketPlan.build(frozen({"x": torch.ones(3)}).manifest, 4096))


def test_links_asking_at_once_get_one_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' links ask for a snapshot's buckets at once, each from a thread (EngineLink.transfer_bucket):
    the first packs, the others wait for it and take the same tensors. (Each bucket's packing is slowed here, so
    without the lock every thread would find the cache empty and pack all of them.)"""
    clear_packed_cache()
    snapshot = frozen(odd_tensors())
    plan = BucketPlan.build(snapshot.manifest, 130)
    packs: list[int] = []
    today = transfer.pack_bucket

    def slow_pack(*args: object, **kwargs: object) -> torch.Tensor:
        packs.append(int(args[2]))  # type: ignore[call-overload]
        time.sleep(0.02)
        return today(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(transfer, "pack_bucket", slow_pack)
    start = threading.Barrier(4)

    def ask() -> tuple[torch.Tensor, ...]:
        start.wait()
        return packed_buckets(snapshot, plan)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: ask(), range(4)))
    assert sorted(packs) == list(range(len(plan.buckets)))  # each bucket packed once
    assert all(a is answers[0] for a in answers)
    assert all(torch.equal(a, b) for a, b in zip(answers[0], pack_all(snapshot.tensors, plan), strict=True))


def test_the_packed_cache_is_bounded_and_forgets_dead_snapshots() -> None:
    clear_packed_cache()
    snapshots = [frozen({"x": torch.full((5,), float(i))}) for i in range(transfer.PACKED_CACHE_ENTRIES + 2)]
    plans = [BucketPlan.build(s.manifest, 4096) for s in snapshots]
    for snapshot, plan in zip(snapshots, plans, strict=True):
        packed_buckets(snapshot, plan)
    assert len(transfer._packed_cache) == transfer.PACKED_CACHE_ENTRIES
    # The most recent entries stay; the oldest went first.
    assert packed_buckets(snapshots[-1], plans[-1]) is packed_buckets(snapshots[-1], plans[-1])
    del snapshots[-1], snapshot
    gc.collect()
    assert len(transfer._packed_cache) == transfer.PACKED_CACHE_ENTRIES - 1
    clear_packed_cache()
    assert not transfer._packed_cache


def test_received_tensors_are_the_stashed_buckets_views() -> None:
    # A stash keeps bucket buffers; its tensors are views made on demand, only of the buckets it holds.
    tensors = odd_tensors()
    plan = BucketPlan.build(manifest_from_tensors(tensors, CONFIG), 96)
    buffers = dict(enumerate(pack_all(tensors, plan)))
    assert len(buffers) == 3 and buffers[1].numel() != buffers[2].numel()
    received = transfer.received_tensors(plan, buffers)
    assert sorted(received) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(received[name], tensor), name
    partial = transfer.received_tensors(plan, {1: buffers[1]})
    assert sorted(partial) == sorted(plan.buckets[1].names)
    with pytest.raises(PlanMismatch):
        transfer.received_tensors(plan, {1: buffers[2]})  # a buffer under the wrong index is refused
