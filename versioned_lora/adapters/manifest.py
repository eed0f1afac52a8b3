"""The canonical manifest of a LoRA version and its digest (DESIGN.md §2).

The manifest lists every tensor (name, dtype, shape, nbytes, hash of its contiguous little-endian
bytes) sorted by name, plus the serving config. Its canonical form is JSON with sorted keys, no
whitespace, UTF-8; `digest = sha256(canonical bytes)`. The digest is the version's identity: the same
`version_key` with another digest is a conflict, and an engine's READY must name the reserved digest.

Two versions of the format, both accepted everywhere:

- v1 (``"format": "versioned-lora/manifest/v1"``, a `Manifest`'s default): each tensor's ``sha256`` field is the
  SHA-256 of its bytes. Its canonical bytes are exactly what they were before v2 existed, so every v1
  digest, name and journal entry stays valid, and a manifest read as v1 is written back as v1.
- v2 (``"format": "versioned-lora/manifest/v2"`` plus ``"hash": "sha256-chunked-<C>"``): the ``sha256``
  field is the chunked hash of `hashing` (SHA-256 over the SHA-256 digests of fixed ``C``-byte
  chunks), which threads and GPUs compute in parallel. The ``hash`` field is part of the canonical
  manifest, so the chunk size is frozen into the digest. Only ``C = V2_CHUNK_BYTES`` is known. New
  publications are v2 (`PUBLISHED_HASH_KIND`, the default of every snapshot).

A v2 manifest may also record its *served digest* (``"served": {"dtype", "digest"}``, `served.ServedRecord`): the
tensors as an engine's LoRA memory pool holds them, in the pool's dtype (adapters/served.py). It is part of the
canonical manifest, so the digest covers it; a v2 manifest without it keeps its bytes and digest. Every new snapshot
records it (`snapshot.py`); the publisher requires the served digest an engine reads back from its own pool to
equal it.

A manifest of another format, or a v2 manifest of another hash kind, is refused with
`UnsupportedManifest` (an engine answers it with a typed refusal, ``UNSUPPORTED_MANIFEST``).

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

from versioned_lora.adapters.hashing import HASH_SHA256, chunked_kind, hash_tensors, submit_tensors, tensor_hash
from versioned_lora.adapters.served import ServedError, ServedRecord, served_record

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = "versioned-lora/manifest/v1"
MANIFEST_FORMAT_V2 = "versioned-lora/manifest/v2"
# The one chunk size of v2 (64 KiB). Measured before it was frozen (gpu_validation/results/
# 2026-12-01-verify-*.txt): on a 2-core host its hashing costs the same CPU time as v1's (16 KiB costs
# ~7% more: hashlib's per-call overhead), and on an H200 it still gives thousands of independent chunks for
# a 349 MB adapter, where 1 MiB chunks leave the GPU a few hundred long serial hashes.
V2_CHUNK_BYTES = 64 * 1024
V2_HASH = chunked_kind(V2_CHUNK_BYTES)
KNOWN_HASH_KINDS: Mapping[str, str] = {MANIFEST_FORMAT: HASH_SHA256, MANIFEST_FORMAT_V2: V2_HASH}
# The hash kind of every new publication: a snapshot's manifest is v2 unless its caller asks for another kind
# (adapters/snapshot.py). A `Manifest` built or parsed without a kind stays v1, so every v1 manifest, digest,
# name and journal keeps its bytes, and a version published as v1 is re-staged as v1 (`snapshot_for_digest`).
PUBLISHED_HASH_KIND = V2_HASH

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
_MANIFEST_KEYS_V2 = _MANIFEST_KEYS | {"hash"}
_MANIFEST_KEYS_V2_SERVED = _MANIFEST_KEYS_V2 | {"served"}


class ManifestError(Exception):
    """Base of every manifest error."""


class MalformedManifest(ManifestError):
    """A manifest (JSON or value) that breaks the canonical format; the message says which rule."""


class UnsupportedManifest(MalformedManifest):
    """A well-formed manifest of a format version or hash kind this code does not know (a newer publisher):
    refused rather than guessed at, since its digest covers rules we cannot check."""


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
    # How each entry's `sha256` was computed: "sha256" (format v1) or V2_HASH (format v2).
    hash_kind: str = HASH_SHA256
    # The served digest (v2 only): the tensors as an engine's LoRA pool holds them (adapters/served.py).
    served: ServedRecord | None = None

    def __attrs_post_init__(self) -> None:
        if self.hash_kind not in KNOWN_HASH_KINDS.values():
            raise UnsupportedManifest(
                f"hash kind {self.hash_kind!r} is not known here (known: {sorted(KNOWN_HASH_KINDS.values())})"
            )
        if self.served is not None and (self.hash_kind == HASH_SHA256 or not isinstance(self.served, ServedRecord)):
            # v1's canonical bytes never change, so it has no place for one.
            raise _malformed(f"a served record needs a v2 manifest and a ServedRecord, got {self.served!r} "
                             f"under hash kind {self.hash_kind!r}")
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
    def create(
        cls, tensors: Iterable[TensorEntry], serving_config: Mapping[str, Any], hash_kind: str = HASH_SHA256,
        served: ServedRecord | None = None,
    ) -> Manifest:  # fmt: skip
        """Sorts the entries and canonicalises the config; use this rather than the raw constructor."""
        config = canonical_serving_config(serving_config)
        return cls(
            tensors=sorted(tensors, key=lambda t: t.name),
            serving_config_json=canonical_json_bytes(config).decode("utf-8"),
            hash_kind=hash_kind,
            served=served,
        )

    @property
    def format(self) -> str:
        return MANIFEST_FORMAT if self.hash_kind == HASH_SHA256 else MANIFEST_FORMAT_V2

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
        out: dict[str, Any] = {
            "format": self.format,
            "serving_config": self.serving_config,
            "tensors": [t.to_dict() for t in self.tensors],
        }
        if self.hash_kind != HASH_SHA256:  # v1 has no "hash" key: its canonical bytes never change
            out["hash"] = self.hash_kind
        if self.served is not None:  # absent, a v2 manifest keeps the bytes it had before served records existed
            out["served"] = self.served.to_dict()
        return out

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
        fmt = raw.get("format")
        if not isinstance(fmt, str) or fmt not in KNOWN_HASH_KINDS:
            known = sorted(KNOWN_HASH_KINDS)
            if isinstance(fmt, str) and fmt.startswith("versioned-lora/manifest/"):
                raise UnsupportedManifest(f"manifest format {fmt!r} is not known here (known: {known})")
            raise _malformed(f"manifest format {fmt!r} is not one of {known}")
        expected_keys = _MANIFEST_KEYS if fmt == MANIFEST_FORMAT else _MANIFEST_KEYS_V2
        keys = set(raw)
        if fmt == MANIFEST_FORMAT_V2 and keys == _MANIFEST_KEYS_V2_SERVED:
            expected_keys = _MANIFEST_KEYS_V2_SERVED
        if keys != expected_keys:
            raise _malformed(
                f"manifest: missing fields {sorted(expected_keys - keys)}, "
                f"unknown fields {sorted(keys - expected_keys)}"
            )
        hash_kind = raw.get("hash", HASH_SHA256)
        if hash_kind != KNOWN_HASH_KINDS[fmt]:
            raise UnsupportedManifest(
                f"manifest {fmt!r}: hash kind {hash_kind!r} is not known here (known: {KNOWN_HASH_KINDS[fmt]!r})"
            )
        if not isinstance(raw["tensors"], list):
            raise _malformed(f"manifest tensors must be a list, got {type(raw['tensors']).__name__}")
        _check_serving_config(raw["serving_config"])
        try:
            served = ServedRecord.from_dict(raw["served"]) if "served" in raw else None
        except ServedError as exc:
            raise _malformed(f"manifest served: {exc}") from exc
        return cls(
            tensors=[TensorEntry.from_dict(t) for t in raw["tensors"]],
            serving_config_json=canonical_json_bytes(raw["serving_config"]).decode("utf-8"),
            hash_kind=hash_kind,
            served=served,
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
    """The tensor's row-major bytes as a flat CPU uint8 tensor (see `hashing.cpu_bytes`)."""
    from versioned_lora.adapters.hashing import cpu_bytes

    try:
        return cpu_bytes(tensor)
    except ValueError as exc:  # a big-endian host
        raise UnsupportedTensor(str(exc)) from exc


def tensor_sha256(tensor: torch.Tensor, hash_kind: str = HASH_SHA256) -> str:
    """One tensor's hash under `hash_kind` (plain SHA-256 of its bytes by default), on this thread."""
    tensor_bytes(tensor)  # refuses a big-endian host with UnsupportedTensor
    return tensor_hash(tensor, hash_kind)


def _describe(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    if not isinstance(name, str):
        raise UnsupportedTensor(f"tensor name must be a string, got {name!r}")
    dtype = dtype_name(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    return dtype, shape, math.prod(shape) * DTYPE_ITEMSIZE[dtype]


def tensor_entry(name: str, tensor: torch.Tensor, hash_kind: str = HASH_SHA256) -> TensorEntry:
    dtype, shape, nbytes = _describe(name, tensor)
    return TensorEntry(name=name, dtype=dtype, shape=shape, nbytes=nbytes, sha256=tensor_sha256(tensor, hash_kind))


def manifest_from_tensors(
    tensors: Mapping[str, torch.Tensor], serving_config: Mapping[str, Any], *, hash_kind: str = HASH_SHA256,
    threads: int | None = None, served_dtype: str | None = None,
) -> Manifest:  # fmt: skip
    """The manifest of `tensors`, their hashes computed on a pool of `threads` (hashing.default_threads()
    by default); a v2 manifest of CUDA tensors is hashed on their GPU. With `served_dtype` (a v2 kind), it also
    records the served digest in that pool dtype (adapters/served.py)."""
    if sys.byteorder != "little":
        raise UnsupportedTensor("tensor hashing assumes a little-endian host")
    for name in tensors:
        if not isinstance(name, str):
            raise UnsupportedTensor(f"tensor name must be a string, got {name!r}")
    for dtype in {t.dtype for t in tensors.values()}:
        dtype_name(dtype)  # an unsupported dtype is refused before any hashing starts
    pending = submit_tensors(tensors, hash_kind, threads)
    described = {name: _describe(name, t) for name, t in tensors.items()}  # while the hashes are computed
    hashes = pending.result()
    entries = (TensorEntry(name=n, dtype=d, shape=s, nbytes=b, sha256=hashes[n]) for n, (d, s, b) in described.items())
    served = None
    if served_dtype is not None:
        if hash_kind == HASH_SHA256:
            raise MalformedManifest("a served digest is recorded in v2 manifests only (hash kind 'sha256' is v1)")
        served = served_record(tensors, served_dtype, hash_kind, known=hashes, threads=threads)
    return Manifest.create(entries, serving_config, hash_kind, served)


def verify_tensors(
    manifest: Manifest, tensors: Mapping[str, torch.Tensor], expected_digest: str | None = None, *,
    threads: int | None = None,
) -> None:  # fmt: skip
    """Raise ManifestMismatch listing every difference between `tensors` and `manifest`.

    Checks names (missing/extra), then dtype and shape, and the hash (the manifest's kind, on a pool of
    `threads`) only where dtype and shape agree (a different shape necessarily hashes differently; reporting
    both would only add noise). With `expected_digest`, also checks the manifest's digest, i.e. that it is
    the version that was reserved.
    """
    described = {
        name: (str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape)) for name, t in tensors.items()
    }
    comparable = {name: tensors[name] for name in _comparable(manifest, described)}
    hashes = hash_tensors(comparable, manifest.hash_kind, threads)
    raise_mismatches(manifest, described, hashes, expected_digest)


def _comparable(manifest: Manifest, described: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The names present on both sides whose dtype and shape agree: the ones whose hash is compared."""
    expected = {t.name: t for t in manifest.tensors}
    both = sorted(set(expected) & set(described))
    return [n for n in both if described[n] == (expected[n].dtype, expected[n].shape)]


def raise_mismatches(
    manifest: Manifest, described: Mapping[str, tuple[str, tuple[int, ...]]], hashes: Mapping[str, str],
    expected_digest: str | None = None,
) -> None:  # fmt: skip
    """The one comparison of received tensors with a manifest: `described` gives each tensor's (dtype name,
    shape), `hashes` the hash of each whose dtype and shape agree. Raises ManifestMismatch listing every
    difference (see verify_tensors)."""
    mismatches: list[Mismatch] = []
    if expected_digest is not None and manifest.digest != expected_digest:
        mismatches.append(Mismatch(MismatchKind.DIGEST, None, expected_digest, manifest.digest))
    expected = {t.name: t for t in manifest.tensors}
    for name in sorted(set(expected) - set(described)):
        mismatches.append(Mismatch(MismatchKind.MISSING, name, "present", "absent"))
    for name in sorted(set(described) - set(expected), key=str):
        mismatches.append(Mismatch(MismatchKind.EXTRA, str(name), "absent", "present"))
    for name in sorted(set(expected) & set(described)):
        entry = expected[name]
        actual_dtype, actual_shape = described[name]
        if actual_dtype != entry.dtype:
            mismatches.append(Mismatch(MismatchKind.DTYPE, name, entry.dtype, actual_dtype))
        if actual_shape != entry.shape:
            mismatches.append(Mismatch(MismatchKind.SHAPE, name, str(list(entry.shape)), str(list(actual_shape))))
        if actual_dtype == entry.dtype and actual_shape == entry.shape and hashes[name] != entry.sha256:
            mismatches.append(Mismatch(MismatchKind.SHA256, name, entry.sha256, hashes[name]))
    if mismatches:
        raise ManifestMismatch(mismatches)
