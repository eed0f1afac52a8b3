"""Tensor hashes (adapters/hashing.py), manifest v2 and the pipelined stash verifier, bit for bit.

Every path is held to hashlib applied straight from the definition and to committed known answers
(hashing_vectors.json, computed from the definition by a script independent of the code under test). The
GPU kernel (adapters/gpu_hash.py) runs here, on the CPU, under Triton's interpreter: the same source that
the GPU compiles.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import random
from pathlib import Path

import pytest
import torch

from versioned_lora.adapters import hashing
from versioned_lora.adapters.manifest import (
    DTYPE_ITEMSIZE,
    MANIFEST_FORMAT,
    MANIFEST_FORMAT_V2,
    V2_CHUNK_BYTES,
    V2_HASH,
    MalformedManifest,
    Manifest,
    ManifestMismatch,
    MismatchKind,
    UnsupportedManifest,
    manifest_from_tensors,
    verify_tensors,
)
from versioned_lora.adapters.stash_verifier import StashVerifier
from versioned_lora.adapters.transfer import BucketPlan, pack_all

VECTORS = json.loads((Path(__file__).parent / "hashing_vectors.json").read_text())["vectors"]
CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def pattern(n: int, a: int, b: int) -> bytes:
    return bytes((a * i + b) % 256 for i in range(n))


def reference(data: bytes, kind: str) -> str:
    """The definition, written out with hashlib."""
    if kind == "sha256":
        return hashlib.sha256(data).hexdigest()
    chunk = int(kind.removeprefix("sha256-chunked-"))
    digests = b"".join(hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    return hashlib.sha256(digests).hexdigest()


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype_name: str, shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=rng).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=rng).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=rng, dtype=torch.int64).to(dtype)


# ---- the definition --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"n{v['n']}")
def test_known_answers(vector: dict) -> None:
    data = pattern(vector["n"], vector["a"], vector["b"])
    for kind, expected in vector["hashes"].items():
        assert hashing.hash_bytes(data, kind) == expected, kind
        assert hashing.hash_buffers({"x": memoryview(data)}, kind, threads=2)["x"] == expected, kind


def test_known_answers_anchor_on_fips_abc_and_the_empty_string() -> None:
    abc = next(v for v in VECTORS if v["n"] == 3)
    assert abc["hashes"]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert abc["hashes"][V2_HASH] == hashlib.sha256(bytes.fromhex(abc["hashes"]["sha256"])).hexdigest()
    empty = next(v for v in VECTORS if v["n"] == 0)
    assert set(empty["hashes"].values()) == {EMPTY_SHA256}  # no chunks: SHA-256 of nothing


@pytest.mark.parametrize("chunk", [1, 64, 100, 4096, V2_CHUNK_BYTES])
def test_chunked_hash_equals_hashlib_at_sizes_around_the_chunk(chunk: int) -> None:
    rnd = random.Random(chunk)
    kind = hashing.chunked_kind(chunk)
    for n in {0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk, 3 * chunk + 7, rnd.randrange(1, 5 * chunk)} - {-1}:
        data = rnd.randbytes(max(n, 0))
        assert hashing.hash_bytes(data, kind) == reference(data, kind), n


def test_hash_kinds_parse_strictly() -> None:
    assert hashing.chunk_size("sha256") is None
    assert hashing.chunk_size(V2_HASH) == V2_CHUNK_BYTES == 65536
    for bad in ("sha512", "sha256-chunked-", "sha256-chunked-0", "sha256-chunked-064", "sha256-chunked--1", "", 7):
        with pytest.raises(hashing.UnknownHashKind):
            hashing.chunk_size(bad)  # type: ignore[arg-type]
    with pytest.raises(hashing.UnknownHashKind):
        hashing.chunked_kind(0)


# ---- tensors on the pool --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sha256", V2_HASH, "sha256-chunked-100"])
def test_random_tensors_of_every_supported_dtype(kind: str) -> None:
    rng = torch.Generator().manual_seed(7)
    tensors = {}
    for i, dtype in enumerate(sorted(DTYPE_ITEMSIZE)):
        # Sizes on both sides of the chunk, and one over several pool tasks (hashing.TASK_BYTES).
        shape = [(3, 5), (257, 129), (1, V2_CHUNK_BYTES // DTYPE_ITEMSIZE[dtype] + 3)][i % 3]
        tensors[dtype] = random_tensor(dtype, shape, rng)
    tensors["large"] = random_tensor("float32", (1300, 1024), rng)  # 5.3 MB: more than one task
    expected = {name: reference(raw_bytes(t), kind) for name, t in tensors.items()}
    for threads in (1, 2, 3):
        assert hashing.hash_tensors(tensors, kind, threads) == expected, threads
    assert {name: hashing.tensor_hash(t, kind) for name, t in tensors.items()} == expected


@pytest.mark.parametrize("kind", ["sha256", V2_HASH])
def test_empty_and_non_contiguous_tensors(kind: str) -> None:
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tensors = {
        "empty": torch.empty(0, 16, dtype=torch.bfloat16),
        "transposed": base.T,
        "strided": base[::3, 1::2],
        "expanded": torch.ones(1, 8).expand(100, 8),
        "negative": torch.tensor([1.0, -2.0]).neg(),  # a lazily negated view: its values are hashed
    }
    hashes = hashing.hash_tensors(tensors, kind, threads=2)
    assert hashes["empty"] == EMPTY_SHA256
    for name, t in tensors.items():
        assert not (name != "empty" and t.is_contiguous() and name != "negative")
        assert hashes[name] == reference(raw_bytes(t.contiguous()), kind), name
    assert hashes["transposed"] != hashing.hash_tensors({"x": base}, kind)["x"]  # the row-major bytes count


def test_a_flipped_bit_in_any_chunk_changes_the_hash() -> None:
    chunk = 256
    kind = hashing.chunked_kind(chunk)
    data = bytearray(random.Random(1).randbytes(5 * chunk + 17))
    original = hashing.hash_bytes(bytes(data), kind)
    seen = {original}
    for index in range(6):  # every chunk, the short last one too
        position = index * chunk + random.Random(index).randrange(min(chunk, len(data) - index * chunk))
        flipped = bytearray(data)
        flipped[position] ^= 1 << (position % 8)
        changed = hashing.hash_bytes(bytes(flipped), kind)
        assert changed == reference(bytes(flipped), kind)
        seen.add(changed)
    assert len(seen) == 7


def test_pool_size_is_a_parameter_with_a_sane_default() -> None:
    assert 1 <= hashing.default_threads() <= 8
    assert hashing.pool(3)._max_workers == 3  # type: ignore[attr-defined]
    assert hashing.pool(3) is hashing.pool(3)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            hashing.pool(bad)  # type: ignore[arg-type]


# ---- manifest v2 -------------------------------------------------------------------------------------------


def small_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.lora_{ab}.weight": torch.randn(8 + i, 96, generator=rng).to(torch.bfloat16)
            for i in range(6) for ab in "AB"}  # fmt: skip


def test_v1_stays_the_default_and_byte_identical() -> None:
    tensors = small_tensors()
    v1 = manifest_from_tensors(tensors, CONFIG)
    assert v1.hash_kind == "sha256" and v1.format == MANIFEST_FORMAT
    raw = json.loads(v1.to_json())
    assert set(raw) == {"format", "serving_config", "tensors"}  # no "hash" key in v1
    assert all(t["sha256"] == hashlib.sha256(raw_bytes(tensors[t["name"]])).hexdigest() for t in raw["tensors"])
    again = Manifest.from_json(v1.to_json())
    assert again.to_json_bytes() == v1.to_json_bytes() and again.digest == v1.digest and again.hash_kind == "sha256"


def test_v2_carries_its_hash_kind_in_the_digest_and_round_trips() -> None:
    tensors = small_tensors()
    v1 = manifest_from_tensors(tensors, CONFIG)
    v2 = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH)
    raw = json.loads(v2.to_json())
    assert raw["format"] == MANIFEST_FORMAT_V2 and raw["hash"] == V2_HASH
    assert all(t["sha256"] == reference(raw_bytes(tensors[t["name"]]), V2_HASH) for t in raw["tensors"])
    assert v2.digest == hashlib.sha256(v2.to_json_bytes()).hexdigest() != v1.digest
    again = Manifest.from_json(v2.to_json())
    assert again == v2 and again.digest == v2.digest
    verify_tensors(v2, tensors, expected_digest=v2.digest)
    altered = dict(tensors)
    name = sorted(tensors)[3]
    altered[name] = tensors[name].clone()
    altered[name].view(torch.int16).view(-1)[-1] ^= 1
    with pytest.raises(ManifestMismatch) as info:
        verify_tensors(v2, altered)
    assert [(m.kind, m.name) for m in info.value.mismatches] == [(MismatchKind.SHA256, name)]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"format": "versioned-lora/manifest/v3"}, UnsupportedManifest, "not known here"),
        ({"format": MANIFEST_FORMAT_V2, "hash": "sha256-chunked-4096"}, UnsupportedManifest, "hash kind"),
        ({"format": MANIFEST_FORMAT_V2, "hash": "blake3"}, UnsupportedManifest, "hash kind"),
        ({"format": MANIFEST_FORMAT_V2}, MalformedManifest, "missing fields ['hash']"),
        ({"hash": V2_HASH}, MalformedManifest, "unknown fields ['hash']"),  # v1 has no hash field
        ({"format": "v0"}, MalformedManifest, "format"),
    ],
)
def test_unknown_versions_and_hash_kinds_are_refused_with_a_typed_error(
    change: dict, error: type, message: str
) -> None:
    raw = json.loads(manifest_from_tensors(small_tensors(), CONFIG).to_json())
    raw.update(change)
    with pytest.raises(error) as info:
        Manifest.from_json(json.dumps(raw))
    assert message in str(info.value)
    assert error is MalformedManifest or isinstance(info.value, MalformedManifest)  # one family for callers
    with pytest.raises(UnsupportedManifest):
        Manifest.create([], CONFIG, hash_kind="sha256-chunked-4096")


# ---- the pipelined verifier ------------------------------------------------------------------------------------


def staged(kind: str, max_bucket_bytes: int = 3000) -> tuple[Manifest, BucketPlan, list[torch.Tensor]]:
    tensors = small_tensors(1)
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=kind)
    plan = BucketPlan.build(manifest, max_bucket_bytes)
    assert len(plan.buckets) >= 4
    return manifest, plan, pack_all(tensors, plan)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "after-last-bucket"])
@pytest.mark.parametrize("kind", ["sha256", V2_HASH])
def test_pipelined_verifier_accepts_buckets_in_any_order(kind: str, pipelined: bool) -> None:
    manifest, plan, flats = staged(kind)
    verifier = StashVerifier(manifest, plan, threads=2, pipelined=pipelined)
    order = list(range(len(flats)))
    random.Random(5).shuffle(order)
    for index in order:
        verifier.bucket_landed(index, flats[index])
        verifier.bucket_landed(index, flats[index])  # a duplicate landing is ignored
    verifier.finish(manifest.digest)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "after-last-bucket"])
@pytest.mark.parametrize("kind", ["sha256", V2_HASH])
def test_pipelined_verifier_refuses_a_corrupted_bucket_with_the_typed_mismatch(kind: str, pipelined: bool) -> None:
    manifest, plan, flats = staged(kind)
    for index, bucket in enumerate(plan.buckets):  # a flipped bit in each bucket in turn
        slot = bucket.slots[-1]
        corrupted = [f.clone() for f in flats]
        corrupted[index][slot.offset + slot.nbytes // 2] ^= 0x10
        verifier = StashVerifier(manifest, plan, pipelined=pipelined)
        for i, flat in enumerate(corrupted):
            verifier.bucket_landed(i, flat)
        with pytest.raises(ManifestMismatch) as info:
            verifier.finish(manifest.digest)
        assert [(m.kind, m.name) for m in info.value.mismatches] == [(MismatchKind.SHA256, slot.name)]
        # ... the same typed difference that verify_tensors reports for the same tensors
        from versioned_lora.adapters.transfer import received_tensors

        with pytest.raises(ManifestMismatch) as same:
            verify_tensors(manifest, received_tensors(plan, dict(enumerate(corrupted))), manifest.digest)
        assert same.value.mismatches == info.value.mismatches


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "after-last-bucket"])
def test_pipelined_verifier_reports_missing_buckets_and_a_wrong_digest(pipelined: bool) -> None:
    manifest, plan, flats = staged(V2_HASH)
    verifier = StashVerifier(manifest, plan, pipelined=pipelined)
    for index in range(len(flats) - 1):
        verifier.bucket_landed(index, flats[index])
    with pytest.raises(ManifestMismatch) as info:
        verifier.finish("0" * 64)
    kinds = [m.kind for m in info.value.mismatches]
    assert kinds[0] is MismatchKind.DIGEST
    assert {m.name for m in info.value.mismatches[1:]} == set(plan.buckets[-1].names)
    assert set(kinds[1:]) == {MismatchKind.MISSING}


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "after-last-bucket"])
def test_pipelined_verifier_turns_a_hashing_failure_into_a_refusal_not_a_crash(pipelined: bool) -> None:
    manifest, plan, flats = staged("sha256")
    verifier = StashVerifier(manifest, plan, pipelined=pipelined)
    verifier.bucket_landed(0, flats[0][:-1])  # a buffer of the wrong size: the receive path never raises
    for index in range(1, len(flats)):
        verifier.bucket_landed(index, flats[index])
    with pytest.raises(RuntimeError, match="hashing bucket 0 failed: PlanMismatch"):
        verifier.finish(manifest.digest)


def test_the_after_last_bucket_baseline_hashes_nothing_until_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    # The baseline benchmarks/end_phase.py measures the pipelined verifier against: today's verification,
    # every hash after the last bucket. (The pipelined one starts a bucket's hashes as it lands.)
    from versioned_lora.adapters import stash_verifier

    submitted: list[int] = []
    real = stash_verifier.submit_buffers

    def counting(buffers, *args, **kwargs):  # type: ignore[no-untyped-def]
        submitted.append(len(buffers))
        return real(buffers, *args, **kwargs)

    monkeypatch.setattr(stash_verifier, "submit_buffers", counting)
    manifest, plan, flats = staged(V2_HASH)
    for pipelined, before_finish in ((False, 0), (True, len(flats))):
        submitted.clear()
        verifier = StashVerifier(manifest, plan, threads=1, pipelined=pipelined)
        for index, flat in enumerate(flats):
            verifier.bucket_landed(index, flat)
        assert len(submitted) == before_finish
        verifier.finish(manifest.digest)
        assert len(submitted) == len(flats) and sum(submitted) == len(manifest.tensors)


# ---- the GPU kernel's source, under Triton's interpreter ----------------------------------------------------


@pytest.fixture(scope="module")
def gpu_hash():  # type: ignore[no-untyped-def]
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is defined: (re)import the module under it
    from versioned_lora.adapters import gpu_hash as module

    module = importlib.reload(module)
    assert type(module.sha256_chunks).__name__ == "InterpretedFunction"
    yield module
    if previous is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = previous
    importlib.reload(module)


@pytest.mark.parametrize("layout_kind", ["words", "bytes"])
def test_gpu_kernel_equals_hashlib_on_every_padding_case(gpu_hash, layout_kind: str) -> None:  # type: ignore[no-untyped-def]
    # chunk 128: lanes of 1, 2 and 3 SHA-256 blocks; lengths on each side of the 55/56-byte padding edge and
    # of every residue mod 4. "words": packed_bytes puts every tensor on a 4-byte boundary and the kernel reads
    # whole words; "bytes": the same bytes back to back (unaligned starts), read byte by byte.
    chunk = 128
    kind = hashing.chunked_kind(chunk)
    rnd = random.Random(11)
    buffers = [pattern(v["n"], v["a"], v["b"]) for v in VECTORS if v["n"] <= 1000]
    buffers += [rnd.randbytes(n) for n in (55, 56, 57, 58, 63, 119, 120, 121, 127, 200, 383)]
    flipped = bytearray(buffers[-1])
    flipped[300] ^= 0x04
    buffers.append(bytes(flipped))
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
               for b in buffers]  # fmt: skip
    if layout_kind == "words":
        flat, spans = gpu_hash.packed_bytes(tensors)
    else:
        flat = torch.cat(tensors)
        ends = list(itertools.accumulate(len(b) for b in buffers))
        spans = [(end - len(b), len(b)) for end, b in zip(ends, buffers, strict=True)]
    layout = gpu_hash.ChunkLayout(spans, chunk, "cpu")
    assert layout.aligned == (layout_kind == "words")
    got = layout.fold(layout.launch(flat))
    assert got == [reference(b, kind) for b in buffers]
    assert got[-1] != got[-2]
    known = [v["hashes"][kind] for v in VECTORS if v["n"] <= 1000]
    assert got[: len(known)] == known


def test_chunk_table_lists_every_chunk_of_every_buffer() -> None:
    rnd = random.Random(0)
    for _ in range(100):
        spans, offset = [], 0
        for _ in range(rnd.randrange(0, 6)):
            nbytes = rnd.choice([0, 1, rnd.randrange(0, 1000)])
            spans.append((offset, nbytes))
            offset += nbytes + rnd.randrange(0, 20)
        chunk = rnd.choice([1, 7, 64, 128])
        starts, lengths, firsts = hashing.chunk_table(spans, chunk)
        expected = [(o + b, min(chunk, n - b)) for o, n in spans for b in range(0, n, chunk)]
        assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == expected
        counts = [-(-n // chunk) for _, n in spans]
        assert firsts == [sum(counts[:i]) for i in range(len(spans) + 1)]


def test_a_snapshot_is_manifest_v2_by_default_and_v1_when_asked() -> None:
    from versioned_lora.adapters.manifest import PUBLISHED_HASH_KIND
    from versioned_lora.adapters.snapshot import snapshot_from_tensors

    rng = torch.Generator().manual_seed(2)
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(shape, generator=rng)
               for i in range(3) for ab, shape in (("A", (8, 96)), ("B", (96, 8)))}  # fmt: skip
    v2 = snapshot_from_tensors(tensors, CONFIG)
    v1 = snapshot_from_tensors(tensors, CONFIG, hash_kind="sha256")
    assert PUBLISHED_HASH_KIND == V2_HASH
    assert (v2.manifest.hash_kind, v2.manifest.format) == (V2_HASH, MANIFEST_FORMAT_V2)
    assert (v1.manifest.hash_kind, v1.manifest.format) == ("sha256", MANIFEST_FORMAT)
    # ... recording the served digest in the pool dtype bf16 (adapters/served.py); a v1 manifest has none.
    assert v2.manifest == manifest_from_tensors(v2.tensors, v2.serving_config, hash_kind=V2_HASH,
                                                served_dtype="bfloat16")
    assert v2.manifest.served is not None and v1.manifest.served is None
    # v1 asked for is exactly the manifest v1 has always been: no "hash" key, the same bytes as a Manifest's default.
    assert v1.manifest.to_json_bytes() == manifest_from_tensors(tensors, v1.serving_config).to_json_bytes()
    assert "hash" not in json.loads(v1.manifest.to_json())
    assert v2.digest != v1.digest
    v2.verify()
    v1.verify()
    with pytest.raises(UnsupportedManifest):
        snapshot_from_tensors(tensors, CONFIG, hash_kind="sha256-chunked-4096")


def test_snapshot_for_digest_gives_back_the_manifest_a_version_was_published_with() -> None:
    from versioned_lora.adapters.snapshot import SnapshotError, snapshot_for_digest, snapshot_from_tensors

    rng = torch.Generator().manual_seed(5)
    tensors = {f"base_model.model.layers.{i}.v_proj.lora_{ab}.weight": torch.randn(shape, generator=rng)
               for i in range(2) for ab, shape in (("A", (8, 96)), ("B", (96, 8)))}  # fmt: skip
    published_v1 = snapshot_from_tensors(tensors, CONFIG, hash_kind="sha256")
    rebuilt = snapshot_from_tensors(tensors, CONFIG)  # the same source, snapshotted again under today's default
    assert rebuilt.manifest.hash_kind == V2_HASH and rebuilt.digest != published_v1.digest
    again = snapshot_for_digest(rebuilt, published_v1.digest)
    assert again.manifest.to_json_bytes() == published_v1.manifest.to_json_bytes()
    assert again.tensors is rebuilt.tensors  # the same frozen copies: only the manifest is computed again
    assert snapshot_for_digest(rebuilt, rebuilt.digest) is rebuilt
    assert snapshot_for_digest(published_v1, rebuilt.digest).manifest == rebuilt.manifest
    with pytest.raises(SnapshotError, match="hash kinds tried"):
        snapshot_for_digest(rebuilt, "0" * 64)
