"""The canonical manifest of a LoRA version and its digest (DESIGN.md §2).

The manifest lists every tensor (name, dtype, shape, nbytes, SHA-256 of its contiguous little-endian
bytes) sorted by name, plus the serving config. Its canonical form is JSON with sorted keys, no
whitespace, UTF-8; `digest = sha256(canonical bytes)`. The digest is the version's identity: the same
`version_key` with another digest is a conflict, and an engine's READY must name the reserved digest.

The JSON part imports without torch (the registry and the lifecycle core handle manifests and
digests without ever touching tensors); torch is imported only by the functions that hash tensors.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = "versioned-lora/manifest/v1"

# Element sizes by the dtype's torch name (`str(torch.float32)` without "torch."). Kept as plain data so
# a manifest can be checked (nbytes == prod(shape) * itemsize) without importing torch.
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Keys of the serving config every manifest must carry: what SGLang's LoRAConfig reads to size and
# scale the adapter. Other keys (use_rslora, bias, ...) may be present and are hashed like these.
REQUIRED_SERVING_KEYS = ("lora_alpha", "r", "target_modules")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "nbytes", "sha256"})
_MANIFEST_KEYS = frozenset({"format", "serving_config", "tensors"})


class ManifestError(Exception):
    """Base of every manifest error."""


class MalformedManifest(ManifestError):
    """A manifest (JSON or value) that breaks the canonical format; the message says which rule."""


class UnsupportedTensor(ManifestError):
    """A tensor the manifest cannot describe (dtype outside DTYPE_ITEMSIZE, non-string name)."""


class MismatchKind(enum.StrEnum):
    MISSING = "missing"
    EXTRA = "extra"
    DTYPE = "dtype"
    SHAPE = "shape"
    SHA256 = "sha256"
    DIGEST = "digest"


@attrs.frozen
class Mismatch:
    """One difference between a manifest and the tensors (or digest) checked against it."""

    kind: MismatchKind
    name: str | None  # the tensor, None for the digest
    expected: str | None
    actual: str | None

    def describe(self) -> str:
        subject = f"tensor {self.name!r}" if self.name is not None else "manifest"
        return f"{subject}: {self.kind.value} (expected {self.expected}, got {self.actual})"


class ManifestMismatch(ManifestError):
    """Tensors (or a digest) that differ from the manifest; `mismatches` lists every difference."""

    def __init__(self, mismatches: Iterable[Mismatch]) -> None:
        self.mismatches: tuple[Mismatch, ...] = tuple(mismatches)
        lines = "\n  ".join(m.describe() for m in self.mismatches)
        super().__init__(f"{len(self.mismatches)} difference(s) from the manifest:\n  {lines}")

    def kinds(self) -> set[MismatchKind]:
        return {m.kind for m in self.mismatches}


def canonical_json_bytes(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN/Infinity (they have no JSON spelling)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _is_int(value: object) -> bool:
    # bool is an int subclass; `True` as a size is a type error, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _malformed(message: str) -> MalformedManifest:
    return MalformedManifest(message)


def _to_shape(value: object) -> tuple[Any, ...]:
    # A converter, so a non-sequence shape is reported as a malformed manifest instead of a TypeError.
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _malformed(f"shape must be a list of integers, got {value!r}")
    return tuple(value)


def _to_entries(value: object) -> tuple[TensorEntry, ...]:
    if not isinstance(value, Iterable):
        raise _malformed(f"tensors must be a list of entries, got {value!r}")
    entries = tuple(value)
    for entry in entries:
        if not isinstance(entry, TensorEntry):
            raise _malformed(f"tensors must be TensorEntry values, got {type(entry).__name__}")
    return entries


@attrs.frozen
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)
    nbytes: int
    sha256: str

    def __attrs_post_init__(self) -> None:
        where = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise _malformed(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_ITEMSIZE:
            raise _malformed(f"{where}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_ITEMSIZE)})")
        if not all(_is_int(d) for d in self.shape):
            raise _malformed(f"{where}: shape must be a list of integers, got {list(self.shape)!r}")
        if any(d < 0 for d in self.shape):
            raise _malformed(f"{where}: negative dimension in shape {list(self.shape)}")
        if not _is_int(self.nbytes):
            raise _malformed(f"{where}: nbytes must be an integer, got {self.nbytes!r}")
        if self.nbytes < 0:
            raise _malformed(f"{where}: negative nbytes {self.nbytes}")
        expected = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            raise _malformed(
                f"{where}: nbytes {self.nbytes} != prod(shape {list(self.shape)}) * itemsize({self.dtype})"
                f" = {expected}"
            )
        if not isinstance(self.sha256, str) or not _SHA256_HEX.fullmatch(self.sha256):
            raise _malformed(f"{where}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "sha256": self.sha256,
        }

    @classmethod
    def from_dict(cls, raw: object) -> TensorEntry:
        if not isinstance(raw, dict):
            raise _malformed(f"tensor entry must be an object, got {type(raw).__name__}")
        keys = set(raw)
        if keys != _TENSOR_KEYS:
            raise _malformed(
                f"tensor entry {raw.get('name')!r}: missing fields {sorted(_TENSOR_KEYS - keys)}, "
                f"unknown fields {sorted(keys - _TENSOR_KEYS)}"
            )
        if not isinstance(raw["shape"], list):
            raise _malformed(f"tensor {raw['name']!r}: shape must be a list, got {type(raw['shape']).__name__}")
        return cls(
            name=raw["name"], dtype=raw["dtype"], shape=raw["shape"], nbytes=raw["nbytes"], sha256=raw["sha256"]
        )


def canonical_serving_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The serving config in canonical form: target_modules sorted, tuples/sets as lists.

    Raises MalformedManifest when a required key is missing or has the wrong type.
    """
    if not isinstance(config, Mapping):
        raise _malformed(f"serving config must be a mapping, got {type(config).__name__}")
    try:
        out: dict[str, Any] = json.loads(canonical_json_bytes(_jsonable(dict(config))))
    except (TypeError, ValueError) as exc:
        raise _malformed(f"serving config is not JSON-serialisable: {exc}") from exc
    modules = config.get("target_modules")
    # PEFT keeps target_modules as a set in memory and a list on disk; sort so both hash alike.
    if isinstance(modules, (list, tuple, set, frozenset)):
        out["target_modules"] = sorted(modules)
    _check_serving_config(out)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _check_serving_config(config: object) -> None:
    if not isinstance(config, dict):
        raise _malformed(f"serving_config must be an object, got {type(config).__name__}")
    if not all(isinstance(k, str) for k in config):
        raise _malformed("serving_config keys must be strings")
    missing = [k for k in REQUIRED_SERVING_KEYS if k not in config]
    if missing:
        raise _malformed(f"serving_config lacks {missing}")
    r = config["r"]
    if not _is_int(r) or r <= 0:
        raise _malformed(f"serving_config.r must be a positive integer, got {r!r}")
    alpha = config["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _malformed(f"serving_config.lora_alpha must be a finite number, got {alpha!r}")
    modules = config["target_modules"]
    # PEFT also accepts a regex string for target_modules; a list must be sorted and unique to be canonical.
    if isinstance(modules, list):
        if not modules or not all(isinstance(m, str) for m in modules):
            raise _malformed(f"serving_config.target_modules must be non-empty strings, got {modules!r}")
        if modules != sorted(set(modules)):
            raise _malformed(f"serving_config.target_modules must be sorted and unique, got {modules!r}")
    elif not isinstance(modules, str) or not modules:
        raise _malformed(f"serving_config.target_modules must be a list or a regex string, got {modules!r}")
    if "base_model" in config and not isinstance(config["base_model"], str):
        raise _malformed(f"serving_config.base_model must be a string, got {config['base_model']!r}")


@attrs.frozen
class Manifest:
    """Tensors sorted by name plus the serving config (kept as canonical JSON, so the value is immutable)."""

    tensors: tuple[TensorEntry, ...] = attrs.field(converter=_to_entries)
    serving_config_json: str

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        for before, after in itertools.pairwise(names):
            if before == after:
                raise _malformed(f"duplicate tensor name {after!r}")
            if before > after:
                raise _malformed(f"tensors not sorted by name: {before!r} before {after!r}")
        try:
            config = json.loads(self.serving_config_json)
        except (TypeError, ValueError) as exc:
            raise _malformed(f"serving_config_json is not JSON: {exc}") from exc
        _check_serving_config(config)
        if canonical_json_bytes(config).decode("utf-8") != self.serving_config_json:
            raise _malformed("serving_config_json is not in canonical form")

    @classmethod
    def create(cls, tensors: Iterable[TensorEntry], serving_config: Mapping[str, Any]) -> Manifest:
        """Sorts the entries and canonicalises the config; use this rather than the raw constructor."""
        config = canonical_serving_config(serving_config)
        return cls(
            tensors=sorted(tensors, key=lambda t: t.name),
            serving_config_json=canonical_json_bytes(config).decode("utf-8"),
        )

    @property
    def serving_config(self) -> dict[str, Any]:
        """A fresh copy each call, so callers cannot change the manifest through it."""
        config: dict[str, Any] = json.loads(self.serving_config_json)
        return config

    def adapter_config(self) -> dict[str, Any]:
        """adapter_config.json contents (what SGLang's `LoRAConfig` reads): the serving config in PEFT's
        field names; PEFT fills the rest."""
        config = self.serving_config
        config["base_model_name_or_path"] = config.pop("base_model", None)
        config["inference_mode"] = True
        return config

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def entry(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "serving_config": self.serving_config,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def to_json_bytes(self) -> bytes:
        return _canonical_bytes(self)

    def to_json(self) -> str:
        return self.to_json_bytes().decode("utf-8")

    @property
    def digest(self) -> str:
        return _digest(self)

    @classmethod
    def from_json(cls, data: str | bytes) -> Manifest:
        """Strict parse: any deviation from the format raises MalformedManifest (never KeyError/TypeError)."""
        try:
            raw = json.loads(data, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
        except MalformedManifest:
            raise
        except (TypeError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise _malformed(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise _malformed(f"manifest must be a JSON object, got {type(raw).__name__}")
        keys = set(raw)
        if keys != _MANIFEST_KEYS:
            raise _malformed(
                f"manifest: missing fields {sorted(_MANIFEST_KEYS - keys)}, "
                f"unknown fields {sorted(keys - _MANIFEST_KEYS)}"
            )
        if raw["format"] != MANIFEST_FORMAT:
            raise _malformed(f"manifest format {raw['format']!r} is not {MANIFEST_FORMAT!r}")
        if not isinstance(raw["tensors"], list):
            raise _malformed(f"manifest tensors must be a list, got {type(raw['tensors']).__name__}")
        _check_serving_config(raw["serving_config"])
        return cls(
            tensors=[TensorEntry.from_dict(t) for t in raw["tensors"]],
            serving_config_json=canonical_json_bytes(raw["serving_config"]).decode("utf-8"),
        )


# Cached per value: a manifest for a large adapter has hundreds of entries and its digest is asked often.
@functools.lru_cache(maxsize=64)
def _canonical_bytes(manifest: Manifest) -> bytes:
    return canonical_json_bytes(manifest.to_dict())


@functools.lru_cache(maxsize=64)
def _digest(manifest: Manifest) -> str:
    return hashlib.sha256(_canonical_bytes(manifest)).hexdigest()


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _malformed(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _malformed(f"{name} is not allowed in a manifest")


# ---- tensors (torch imported lazily) -------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedTensor(f"dtype {dtype} is not supported in a manifest (known: {sorted(DTYPE_ITEMSIZE)})")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedTensor(f"unknown dtype {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major bytes as a flat CPU uint8 tensor (no copy when already contiguous on CPU).

    Viewing as uint8 reads the raw storage, which is how bf16 (no numpy dtype) is hashed exactly. The
    in-memory order is the host's; every supported host is little-endian, and we refuse others rather
    than silently hash big-endian bytes.
    """
    import torch

    if sys.byteorder != "little":
        raise UnsupportedTensor("tensor hashing assumes a little-endian host")
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def tensor_sha256(tensor: torch.Tensor) -> str:
    # memoryview hands the tensor's own buffer to hashlib: no copy of a large tensor.
    return hashlib.sha256(tensor_bytes(tensor).numpy().data).hexdigest()


def tensor_entry(name: str, tensor: torch.Tensor) -> TensorEntry:
    if not isinstance(name, str):
        raise UnsupportedTensor(f"tensor name must be a string, got {name!r}")
    dtype = dtype_name(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    return TensorEntry(
        name=name,
        dtype=dtype,
        shape=shape,
        nbytes=math.prod(shape) * DTYPE_ITEMSIZE[dtype],
        sha256=tensor_sha256(tensor),
    )


def manifest_from_tensors(tensors: Mapping[str, torch.Tensor], serving_config: Mapping[str, Any]) -> Manifest:
    return Manifest.create((tensor_entry(n, t) for n, t in tensors.items()), serving_config)


def verify_tensors(
    manifest: Manifest, tensors: Mapping[str, torch.Tensor], expected_digest: str | None = None
) -> None:
    """Raise ManifestMismatch listing every difference between `tensors` and `manifest`.

    Checks names (missing/extra), then dtype and shape, and the SHA-256 only where dtype and shape agree
    (a different shape necessarily hashes differently; reporting both would only add noise). With
    `expected_digest`, also checks the manifest's digest, i.e. that it is the version that was reserved.
    """
    mismatches: list[Mismatch] = []
    if expected_digest is not None and manifest.digest != expected_digest:
        mismatches.append(Mismatch(MismatchKind.DIGEST, None, expected_digest, manifest.digest))
    expected = {t.name: t for t in manifest.tensors}
    for name in sorted(set(expected) - set(tensors)):
        mismatches.append(Mismatch(MismatchKind.MISSING, name, "present", "absent"))
    for name in sorted(set(tensors) - set(expected), key=str):
        mismatches.append(Mismatch(MismatchKind.EXTRA, str(name), "absent", "present"))
    for name in sorted(set(expected) & set(tensors)):
        entry, tensor = expected[name], tensors[name]
        actual_dtype = str(tensor.dtype).removeprefix("torch.")
        actual_shape = tuple(int(d) for d in tensor.shape)
        if actual_dtype != entry.dtype:
            mismatches.append(Mismatch(MismatchKind.DTYPE, name, entry.dtype, actual_dtype))
        if actual_shape != entry.shape:
            mismatches.append(Mismatch(MismatchKind.SHAPE, name, str(list(entry.shape)), str(list(actual_shape))))
        if actual_dtype == entry.dtype and actual_shape == entry.shape:
            actual_sha = tensor_sha256(tensor)
            if actual_sha != entry.sha256:
                mismatches.append(Mismatch(MismatchKind.SHA256, name, entry.sha256, actual_sha))
    if mismatches:
        raise ManifestMismatch(mismatches)
