"""The canonical manifest and digest (DESIGN.md §2): exact bytes, stability across processes, strict parsing,
and verification that names every kind of difference."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from versioned_lora.adapters.manifest import (
    MalformedManifest,
    Manifest,
    ManifestError,
    ManifestMismatch,
    MismatchKind,
    TensorEntry,
    manifest_from_tensors,
    tensor_sha256,
    verify_tensors,
)
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.fixtures import Fixtures

CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "layers.1.v_proj.lora_B.weight": torch.randn(64, 8, generator=gen),
        "layers.0.q_proj.lora_A.weight": torch.randn(8, 128, generator=gen).to(torch.bfloat16),
        "layers.0.q_proj.lora_B.weight": torch.randn(128, 8, generator=gen).to(torch.float16),
        "layers.0.scale": torch.tensor(3, dtype=torch.int64),
    }


def test_canonical_json_is_exactly_the_documented_bytes() -> None:
    """Hashes computed here from struct-packed little-endian bytes, independently of torch's storage."""
    f32 = struct.pack("<6f", *range(6))
    bf16 = bytes([0x80, 0x3F, 0x00, 0xC0])  # bf16 1.0 = 0x3F80, -2.0 = 0xC000, little-endian
    tensors = {
        "b.weight": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }
    manifest = manifest_from_tensors(tensors, CONFIG)
    expected = (
        '{"format":"versioned-lora/manifest/v1",'
        '"serving_config":{"lora_alpha":16,"r":8,"target_modules":["q_proj","v_proj"]},'
        '"tensors":['
        f'{{"dtype":"float32","name":"a.weight","nbytes":24,"sha256":"{hashlib.sha256(f32).hexdigest()}",'
        '"shape":[2,3]},'
        f'{{"dtype":"bfloat16","name":"b.weight","nbytes":4,"sha256":"{hashlib.sha256(bf16).hexdigest()}",'
        '"shape":[2]}]}'
    )
    assert manifest.to_json() == expected
    assert manifest.to_json_bytes() == expected.encode("utf-8")
    assert manifest.digest == hashlib.sha256(expected.encode()).hexdigest()


def test_hash_is_of_row_major_bytes_whatever_the_layout() -> None:
    base = torch.randn(16, 8).to(torch.bfloat16)
    transposed = base.t().contiguous().t()  # same values, column-major storage
    assert not transposed.is_contiguous()
    assert tensor_sha256(transposed) == tensor_sha256(base)
    assert tensor_sha256(base[:, :4]) == tensor_sha256(base[:, :4].contiguous())


def test_json_round_trip_is_byte_stable() -> None:
    manifest = manifest_from_tensors(sample_tensors(), CONFIG)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.to_json_bytes() == manifest.to_json_bytes()
    assert again.digest == manifest.digest
    # Whitespace and key order in the input do not change the canonical form or the digest.
    pretty = json.dumps(json.loads(manifest.to_json()), indent=3)
    assert Manifest.from_json(pretty).digest == manifest.digest


def test_insertion_order_and_config_list_order_do_not_change_the_digest() -> None:
    tensors = sample_tensors()
    reversed_tensors = dict(reversed(list(tensors.items())))
    config = {**CONFIG, "target_modules": {"q_proj", "v_proj"}}
    assert manifest_from_tensors(reversed_tensors, config).digest == manifest_from_tensors(tensors, CONFIG).digest


def test_digest_changes_with_any_byte_or_config_field() -> None:
    tensors = sample_tensors()
    digest = manifest_from_tensors(tensors, CONFIG).digest
    flipped = dict(tensors)
    flipped["layers.0.q_proj.lora_A.weight"] = tensors["layers.0.q_proj.lora_A.weight"].clone()
    flipped["layers.0.q_proj.lora_A.weight"].view(torch.int16)[0, 0] ^= 1  # one bit
    assert manifest_from_tensors(flipped, CONFIG).digest != digest
    assert manifest_from_tensors(tensors, {**CONFIG, "lora_alpha": 32}).digest != digest
    assert manifest_from_tensors(tensors, {**CONFIG, "base_model": "qwen3-tiny@1"}).digest != digest


DIGEST_SCRIPT = """
import sys, torch
from versioned_lora.adapters.manifest import manifest_from_tensors
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
gen = torch.Generator().manual_seed(5)
tensors = {f"t{i}": torch.randn(33, 7, generator=gen).to(dt) for i, dt in
           enumerate([torch.float32, torch.bfloat16, torch.float16])}
print(manifest_from_tensors(tensors, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}).digest)
print(snapshot_from_adapter_dir(sys.argv[1]).digest)
"""


def test_digest_is_stable_across_processes(fixtures: Fixtures) -> None:
    """Two fresh interpreters (different hash seeds, so no dict/set order can leak in) and this one agree."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", DIGEST_SCRIPT, str(fixtures.adapters["A"])],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 2 and all(len(d) == 64 for d in runs[0])
    assert snapshot_from_adapter_dir(fixtures.adapters["A"]).digest == runs[0][1]


# ---- strict parsing -----------------------------------------------------------------------------------------


def valid_raw() -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(manifest_from_tensors(sample_tensors(), CONFIG).to_json())
    return raw


def set_in(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def swap_first_two(raw: dict[str, Any]) -> None:
    raw["tensors"][0], raw["tensors"][1] = raw["tensors"][1], raw["tensors"][0]


def duplicate_first(raw: dict[str, Any]) -> None:
    raw["tensors"].insert(1, copy.deepcopy(raw["tensors"][0]))


MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing sha256": (delete(("tensors", 0, "sha256")), "missing fields ['sha256']"),
    "missing serving_config": (delete(("serving_config",)), "missing fields ['serving_config']"),
    "unknown top-level field": (set_in(("extra",), 1), "unknown fields ['extra']"),
    "unknown tensor field": (set_in(("tensors", 0, "stride"), [1]), "unknown fields ['stride']"),
    "wrong format": (set_in(("format",), "v0"), "format"),
    "tensors not a list": (set_in(("tensors",), {}), "tensors must be a list"),
    "shape not a list": (set_in(("tensors", 0, "shape"), "8x128"), "shape must be a list"),
    "shape of floats": (set_in(("tensors", 0, "shape"), [8.0, 128]), "shape must be a list of integers"),
    "nbytes as string": (set_in(("tensors", 0, "nbytes"), "2048"), "nbytes must be an integer"),
    "nbytes as bool": (set_in(("tensors", 0, "nbytes"), True), "nbytes must be an integer"),
    "name not a string": (set_in(("tensors", 0, "name"), 7), "name must be a non-empty string"),
    "negative dimension": (set_in(("tensors", 0, "shape"), [-8, 128]), "negative dimension"),
    "negative nbytes": (set_in(("tensors", 0, "nbytes"), -1), "negative nbytes"),
    "nbytes inconsistent": (set_in(("tensors", 0, "nbytes"), 4), "nbytes 4 != prod(shape"),
    "unknown dtype": (set_in(("tensors", 0, "dtype"), "float128"), "unknown dtype 'float128'"),
    "sha256 uppercase": (set_in(("tensors", 0, "sha256"), "A" * 64), "sha256 must be 64 lowercase hex"),
    "sha256 short": (set_in(("tensors", 0, "sha256"), "ab"), "sha256 must be 64 lowercase hex"),
    "unsorted names": (swap_first_two, "not sorted by name"),
    "duplicate names": (duplicate_first, "duplicate tensor name"),
    "config lacks r": (delete(("serving_config", "r")), "lacks ['r']"),
    "config r zero": (set_in(("serving_config", "r"), 0), "positive integer"),
    "config alpha string": (set_in(("serving_config", "lora_alpha"), "16"), "finite number"),
    "config modules unsorted": (set_in(("serving_config", "target_modules"), ["v_proj", "q_proj"]), "sorted"),
    "config base_model not str": (set_in(("serving_config", "base_model"), 3), "base_model must be a string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_rejected_with_one_typed_error(case: str) -> None:
    mutate, message = MALFORMED[case]
    raw = valid_raw()
    mutate(raw)
    with pytest.raises(MalformedManifest) as info:
        Manifest.from_json(json.dumps(raw))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        b"\xff\xfe",
        '{"format": "versioned-lora/manifest/v1", "format": "x", "serving_config": {}, "tensors": []}',
        '{"format": "versioned-lora/manifest/v1", "serving_config": {"r": NaN}, "tensors": []}',
    ],
    ids=["garbage", "top-level list", "bad utf-8", "duplicate key", "NaN"],
)
def test_unparseable_manifest_is_malformed(text: str | bytes) -> None:
    with pytest.raises(MalformedManifest):
        Manifest.from_json(text)


def test_constructing_an_invalid_entry_directly_is_also_malformed() -> None:
    with pytest.raises(MalformedManifest, match="nbytes"):
        TensorEntry(name="x", dtype="float32", shape=(2,), nbytes=4, sha256="0" * 64)
    entry = TensorEntry(name="x", dtype="float32", shape=(2,), nbytes=8, sha256="0" * 64)
    with pytest.raises(MalformedManifest, match="duplicate"):
        Manifest(tensors=(entry, entry), serving_config_json=Manifest.create([], CONFIG).serving_config_json)
    assert issubclass(MalformedManifest, ManifestError) and issubclass(ManifestMismatch, ManifestError)


def test_pure_json_part_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "from versioned_lora.adapters.manifest import Manifest\n"
        f"m = Manifest.from_json({manifest_from_tensors(sample_tensors(), CONFIG).to_json()!r})\n"
        "print(m.digest, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    digest, torch_loaded = out.stdout.split()
    assert digest == manifest_from_tensors(sample_tensors(), CONFIG).digest
    assert torch_loaded == "False"


# ---- verification --------------------------------------------------------------------------------------------

A = "layers.0.q_proj.lora_A.weight"
B = "layers.0.q_proj.lora_B.weight"


def mismatch_of(manifest: Manifest, tensors: dict[str, torch.Tensor], **kwargs: Any) -> ManifestMismatch:
    with pytest.raises(ManifestMismatch) as info:
        verify_tensors(manifest, tensors, **kwargs)
    return info.value


def test_verify_passes_for_the_same_tensors() -> None:
    tensors = sample_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    verify_tensors(manifest, tensors, expected_digest=manifest.digest)
    verify_tensors(manifest, {k: v.clone() for k, v in tensors.items()})


def test_verify_detects_a_tensor_altered_after_the_manifest_was_fixed() -> None:
    tensors = sample_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    tensors[A].view(torch.int16)[3, 3] ^= 1  # in place, one bit, same dtype and shape
    error = mismatch_of(manifest, tensors)
    assert [(m.kind, m.name) for m in error.mismatches] == [(MismatchKind.SHA256, A)]
    assert manifest.entry(A).sha256 in str(error)


@pytest.mark.parametrize(
    ("change", "kind"),
    [
        (lambda t: t.__setitem__(A, t[A].reshape(128, 8)), MismatchKind.SHAPE),
        (lambda t: t.__setitem__(A, t[A].to(torch.float16)), MismatchKind.DTYPE),
        (lambda t: t.pop(A), MismatchKind.MISSING),
        (lambda t: t.__setitem__("layers.9.extra", torch.zeros(2)), MismatchKind.EXTRA),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_verify_detects_each_kind(change: Callable[[dict[str, torch.Tensor]], Any], kind: MismatchKind) -> None:
    tensors = sample_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    change(tensors)
    assert mismatch_of(manifest, tensors).kinds() == {kind}


def test_verify_detects_a_digest_other_than_the_reserved_one() -> None:
    tensors = sample_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    error = mismatch_of(manifest, tensors, expected_digest="0" * 64)
    assert error.kinds() == {MismatchKind.DIGEST}


def test_verify_lists_every_difference_at_once() -> None:
    tensors = sample_tensors()
    manifest = manifest_from_tensors(tensors, CONFIG)
    tensors[A] = tensors[A].to(torch.float32)
    tensors[B] = tensors[B].clone()
    tensors[B][0, 0] += 1
    tensors.pop("layers.0.scale")
    tensors["zz.extra"] = torch.ones(1)
    error = mismatch_of(manifest, tensors, expected_digest="f" * 64)
    assert error.kinds() == {
        MismatchKind.DTYPE,
        MismatchKind.SHA256,
        MismatchKind.MISSING,
        MismatchKind.EXTRA,
        MismatchKind.DIGEST,
    }
    assert len(error.mismatches) == 5
