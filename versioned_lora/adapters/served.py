"""The served digest (issue 46, item 1): a version's tensors as an engine serves them, and the config it serves.

A manifest's tensor hashes name the bytes the publisher sent. What an engine's LoRA kernels read is something else:
SGLang copies each tensor into its LoRA memory pool in the pool's dtype (the base model's), stacks q/k/v and
gate/up into one buffer per layer and pads every adapter to the pool's max rank. The served digest is the hash of
that served form with the stacking and the padding undone, so both sides can compute it:

- the publisher, from its snapshot: each tensor converted to the pool's dtype (``Tensor.to``: round-to-nearest-even
  from float32, as SGLang's own copy into the pool does), hashed with the manifest's hash kind;
- the engine, after the load, from the pool's A and B buffers at the adapter's buffer id
  (`sglang_patches/managed/served_readback.py`), hashed the same way.

``served digest = SHA-256(canonical JSON {"dtype", "hash", "tensors": [{"name", "shape", "sha256"}, ...]})``, the
tensors sorted by name, `canonical_json_bytes` as for the manifest. A tensor already in the pool's dtype hashes to
its manifest entry, so that hash is reused, never computed twice. The hashing is `hashing`'s (threads on the CPU,
the chunk kernel for CUDA tensors): there is no second hasher.

The served config is what decides how the pool's weights are applied: rank, alpha, the scaling SGLang derives from
them (``lora_alpha / r``, always: SGLang 0.5.23's `LoRAAdapter.scaling` ignores ``use_rslora``, so an rsLoRA
manifest can never match) and the target modules.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from versioned_lora.adapters.hashing import hash_tensors

if TYPE_CHECKING:
    import torch

# The pool dtype a snapshot records its served digest for unless told otherwise: the dtype SGLang serves a bf16
# checkpoint in (`LoRAMemoryPool.dtype` is the base model's dtype), the one every fixture and Qwen3 release uses.
DEFAULT_SERVED_DTYPE = "bfloat16"
# The dtypes an engine's pool can have (a served record of another is malformed).
SERVED_DTYPES = ("bfloat16", "float16", "float32")


class ServedError(ValueError):
    """A served record or read-back that breaks the format (a dtype no pool has, a malformed digest)."""


@attrs.frozen
class ServedRecord:
    """The served digest of a version in one pool dtype, as a manifest records it."""

    dtype: str
    digest: str

    def __attrs_post_init__(self) -> None:
        if self.dtype not in SERVED_DTYPES:
            raise ServedError(f"served dtype {self.dtype!r} is not a pool dtype ({SERVED_DTYPES})")
        if not isinstance(self.digest, str) or len(self.digest) != 64 or not all(
                c in "0123456789abcdef" for c in self.digest):
            raise ServedError(f"served digest must be 64 lowercase hex digits, got {self.digest!r}")

    def to_dict(self) -> dict[str, str]:
        return {"dtype": self.dtype, "digest": self.digest}

    @classmethod
    def from_dict(cls, raw: object) -> ServedRecord:
        if not isinstance(raw, dict) or set(raw) != {"dtype", "digest"}:
            raise ServedError(f"served must be an object with exactly 'dtype' and 'digest', got {raw!r}")
        return cls(dtype=raw["dtype"], digest=raw["digest"])


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def served_digest(hashes: Mapping[str, tuple[tuple[int, ...], str]], dtype: str, hash_kind: str) -> str:
    """The served digest from each tensor's (shape, hash) in the pool's `dtype`, hashed under `hash_kind`."""
    tensors = [{"name": name, "shape": list(shape), "sha256": digest}
               for name, (shape, digest) in sorted(hashes.items())]
    return hashlib.sha256(_canonical({"dtype": dtype, "hash": hash_kind, "tensors": tensors})).hexdigest()


def served_record(
    tensors: Mapping[str, torch.Tensor], dtype: str, hash_kind: str, known: Mapping[str, str] | None = None,
    threads: int | None = None,
) -> ServedRecord:  # fmt: skip
    """The snapshot's served record in the pool `dtype`: each tensor converted to it (round-to-nearest-even) and
    hashed under `hash_kind`; `known` gives hashes under that kind already computed (a manifest's), reused for
    tensors already in `dtype`."""
    import torch

    if dtype not in SERVED_DTYPES:
        raise ServedError(f"served dtype {dtype!r} is not a pool dtype ({SERVED_DTYPES})")
    pool_dtype: torch.dtype = getattr(torch, dtype)
    known = known or {}
    reused = {name: known[name] for name, t in tensors.items() if t.dtype == pool_dtype and name in known}
    converted = {name: t.to(pool_dtype) for name, t in tensors.items() if name not in reused}
    hashes = {**reused, **hash_tensors(converted, hash_kind, threads)}
    shapes = {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}
    return ServedRecord(dtype, served_digest({n: (shapes[n], hashes[n]) for n in tensors}, dtype, hash_kind))


def expected_scaling(config: Mapping[str, Any]) -> float:
    """The scaling a serving config means: alpha / r, or alpha / sqrt(r) for rsLoRA (PEFT's rule)."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def served_config(r: int, lora_alpha: float, target_modules: Iterable[str] | str, scaling: float) -> str:
    """The served config as canonical JSON: the same spelling for what a manifest means and what an engine loaded,
    so the two compare as strings."""
    modules: Any = target_modules if isinstance(target_modules, str) else sorted(set(target_modules))
    return _canonical({"r": int(r), "lora_alpha": float(lora_alpha), "target_modules": modules,
                       "scaling": float(scaling)}).decode()


def expected_served_config(serving_config: Mapping[str, Any]) -> str:
    """The served config a manifest's serving config means (see `served_config`)."""
    return served_config(serving_config["r"], serving_config["lora_alpha"], serving_config["target_modules"],
                         expected_scaling(serving_config))
