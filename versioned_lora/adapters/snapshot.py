"""Frozen CPU snapshots of a LoRA adapter (RFC §3.1): the tensors a version is made of, fixed at one instant.

A snapshot is taken from a live PEFT model, a PEFT adapter directory, or the dict of exported tensors
that Relax's `export_local_adapter`/`gather_full_adapter` produce. Its tensors are CPU copies that share
no storage with the source, so training may keep stepping while the version is published; its manifest
and digest (adapters/manifest.py) are computed once, from those copies. Every snapshot's manifest is format
v2 (`manifest.PUBLISHED_HASH_KIND`) unless `hash_kind=` asks for another; `snapshot_for_digest` gives back the
manifest a version was published with (v1 for a v1 version) when it is staged again. A v2 manifest also records
the served digest in the pool dtype `served_dtype` (bfloat16 unless asked otherwise; adapters/served.py), which the
publisher holds every engine's read-back of its LoRA pool to.

Tensor names are PEFT's saved names (`get_peft_model_state_dict`, the keys of adapter_model.safetensors,
e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`): SGLang's LoRA loader expects them.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs

from versioned_lora.adapters.hashing import HASH_SHA256, chunk_size
from versioned_lora.adapters.manifest import (
    KNOWN_HASH_KINDS,
    PUBLISHED_HASH_KIND,
    Manifest,
    canonical_serving_config,
    manifest_from_tensors,
    verify_tensors,
)
from versioned_lora.adapters.served import DEFAULT_SERVED_DTYPE

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# Written next to the PEFT files so an engine loading the directory can verify what it loaded.
MANIFEST_FILE = "versioned_lora_manifest.json"

# The LoraConfig fields that change what the adapter computes, with PEFT's defaults for configs (e.g.
# Relax's exported dict) that leave them out. Training-only fields (dropout, init) and the local path
# of the base model are left out so they cannot change the digest.
_SERVING_DEFAULTS: Mapping[str, Any] = {
    "peft_type": "LORA",
    "task_type": None,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
}
_SERVING_REQUIRED = ("r", "lora_alpha", "target_modules")


class SnapshotError(Exception):
    """A source that cannot be snapshotted, or a copy that still shares storage with its source."""


def serving_config_from_peft(config: Mapping[str, Any] | Any, base_model: str | None = None) -> dict[str, Any]:
    """The canonical serving config from a PEFT `LoraConfig` or its dict (adapter_config.json contents).

    `base_model` is an identity string chosen by the caller (e.g. a model name and revision); the
    config's own `base_model_name_or_path` is usually a local path and is deliberately not used.
    """
    raw: dict[str, Any] = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    peft_type = _plain(raw.get("peft_type") or "LORA")
    if peft_type != "LORA":
        raise SnapshotError(f"only LoRA adapters can be published, got peft_type {peft_type!r}")
    missing = [k for k in _SERVING_REQUIRED if raw.get(k) is None]
    if missing:
        raise SnapshotError(f"adapter config lacks {missing}")
    out = {k: raw[k] for k in _SERVING_REQUIRED}
    for key, default in _SERVING_DEFAULTS.items():
        value = raw.get(key, default)
        out[key] = _plain(value)
    if base_model is not None:
        out["base_model"] = base_model
    return canonical_serving_config(out)


def _plain(value: Any) -> Any:
    # PEFT keeps peft_type/task_type as enums in memory (`str(PeftType.LORA)` is "PeftType.LORA") and
    # as plain strings on disk; hash the plain value so both sources give one digest.
    return value.value if isinstance(value, enum.Enum) else value


@attrs.frozen(eq=False)
class Snapshot:
    """Immutable by construction: nothing here hands out the stored tensors to code that could write them,
    except `tensors`, whose values callers must treat as read-only (`to_peft_state` gives writable copies)."""

    tensors: Mapping[str, torch.Tensor]
    manifest: Manifest

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def serving_config(self) -> dict[str, Any]:
        return self.manifest.serving_config

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def verify(self) -> None:
        """Re-hash the stored tensors against the manifest (raises ManifestMismatch if anyone wrote them)."""
        verify_tensors(self.manifest, self.tensors)

    def to_peft_state(self) -> dict[str, torch.Tensor]:
        """Fresh copies in PEFT's saved naming, e.g. for `set_peft_model_state_dict` or SGLang's
        `LoRAAdapter.initialize_weights_from_tensors`; writing them cannot change the snapshot."""
        return {name: t.clone() for name, t in self.tensors.items()}

    def adapter_config(self) -> dict[str, Any]:
        """adapter_config.json contents: the serving config in PEFT's field names; PEFT fills the rest."""
        return self.manifest.adapter_config()

    def save_adapter_dir(self, path: str | os.PathLike[str]) -> Path:
        """Write a PEFT-loadable directory (SGLang loads it by path). Never overwrites a non-empty directory.

        Files are written to a sibling and renamed into place, so an engine never sees a half-written
        adapter under the final path.
        """
        from safetensors.torch import save_file

        target = Path(path)
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(f"{target} exists and is not empty; adapter directories are immutable")
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(self.adapter_config(), indent=2, sort_keys=True) + "\n")
            save_file(dict(self.tensors), str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
            (tmp / MANIFEST_FILE).write_bytes(self.manifest.to_json_bytes())
            if target.exists():
                target.rmdir()  # empty, checked above
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target


# What an engine's LoRA loader takes (the managed `begin` refuses other dtypes as UNSUPPORTED_ADAPTER).
SNAPSHOT_DTYPES = ("float32", "bfloat16", "float16")


def _check_tensors(tensors: Mapping[str, torch.Tensor], serving_config: Mapping[str, Any]) -> None:
    """Refuse, naming the tensor, what no engine should be sent (issue 19): no tensors at all, a dtype the
    loader does not take, a non-finite value (NaN/Inf pass every byte hash and reach the probe), and a LoRA
    matrix whose rank is not the serving config's (`r`, or a value of its `rank_pattern`)."""
    import torch

    if not tensors:
        raise SnapshotError("the adapter holds no tensors")
    ranks = {int(serving_config["r"]), *(int(v) for v in (serving_config.get("rank_pattern") or {}).values())}
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in SNAPSHOT_DTYPES:
            raise SnapshotError(f"tensor {name!r} has dtype {dtype}; published LoRA tensors are {SNAPSHOT_DTYPES}")
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise SnapshotError(f"tensor {name!r} holds {bad} non-finite values (NaN or Inf)")
        matrix = name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")
        if matrix and tensor.dim() != 2:
            raise SnapshotError(f"tensor {name!r} has shape {tuple(tensor.shape)}; a LoRA matrix is 2-D")
        rank = tensor.shape[0] if name.endswith(".lora_A.weight") else tensor.shape[1] if matrix else None
        if rank is not None and rank not in ranks:
            raise SnapshotError(f"tensor {name!r} has shape {tuple(tensor.shape)}: rank {rank}, but the serving "
                                f"config's rank is {sorted(ranks)}")


def _storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    # Empty tensors may all report data_ptr 0; they hold no bytes to share, so they are left out.
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes() > 0}


def _freeze(
    tensors: Mapping[str, torch.Tensor],
    serving_config: dict[str, Any],
    live: Iterable[torch.Tensor],
    dtype: torch.dtype | None,
    hash_kind: str = PUBLISHED_HASH_KIND,
    served_dtype: str = DEFAULT_SERVED_DTYPE,
) -> Snapshot:
    """Copy to CPU, prove the copies share no storage with `live` or each other, hash them.

    A v2 snapshot (`hash_kind` chunked) of tensors that are all on one GPU is hashed there instead, by the
    chunk kernel, on the current stream, and the CPU copies are taken after it on that same stream: nothing
    can change between the hash and the copy, because both read the tensors in stream order with no kernel
    between them, and the host waits for the hashes before the copies are enqueued (a trainer writes its
    parameters only from its own step, which does not run while this call holds the thread that drives it;
    a writer on another stream would break the snapshot contract itself, hash or not). The snapshot stays a
    CPU copy (RFC §3.1); the digest is the same bytes either way (adapters/hashing.py)."""
    import torch

    on_gpu = (
        chunk_size(hash_kind) is not None and dtype is None and len(tensors) > 0
        and all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors.values())
        and len({t.device for t in tensors.values()}) == 1
    )  # fmt: skip
    served = None if hash_kind == HASH_SHA256 else served_dtype  # a v1 manifest has no served record
    gpu_manifest = (manifest_from_tensors(tensors, serving_config, hash_kind=hash_kind, served_dtype=served)
                    if on_gpu else None)
    copies: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise SnapshotError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        # copy=True forces fresh storage even for a CPU tensor already of the right dtype.
        copies[name] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype, copy=True).contiguous()
    _check_tensors(copies, serving_config)
    live_ptrs = _storage_ptrs(live) | _storage_ptrs(tensors.values())
    copy_ptrs = [c.untyped_storage().data_ptr() for c in copies.values() if c.untyped_storage().nbytes() > 0]
    if live_ptrs & set(copy_ptrs) or len(set(copy_ptrs)) != len(copy_ptrs):
        raise SnapshotError("snapshot tensors share storage with the live parameters or each other")
    manifest = gpu_manifest or manifest_from_tensors(copies, serving_config, hash_kind=hash_kind, served_dtype=served)
    ordered = {name: copies[name] for name in manifest.names}
    return Snapshot(tensors=MappingProxyType(ordered), manifest=manifest)


def snapshot_from_peft_model(
    model: Any, adapter_name: str = "default", base_model: str | None = None, dtype: torch.dtype | None = None,
    hash_kind: str = PUBLISHED_HASH_KIND, served_dtype: str = DEFAULT_SERVED_DTYPE,
) -> Snapshot:  # fmt: skip
    """Snapshot adapter `adapter_name` of a live `PeftModel`, as `save_pretrained` would name and save it.
    `hash_kind`: the manifest's (manifest v2's by default, or "sha256" for manifest v1)."""
    from peft import get_peft_model_state_dict

    if adapter_name not in model.peft_config:
        raise SnapshotError(f"model has no adapter {adapter_name!r} (has {sorted(model.peft_config)})")
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    live = [*model.parameters(), *model.buffers()]
    config = serving_config_from_peft(model.peft_config[adapter_name], base_model)
    return _freeze(state, config, live, dtype, hash_kind, served_dtype)


def snapshot_from_adapter_dir(
    path: str | os.PathLike[str], base_model: str | None = None, hash_kind: str = PUBLISHED_HASH_KIND,
    served_dtype: str = DEFAULT_SERVED_DTYPE,
) -> Snapshot:
    """Snapshot a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import load_file

    root = Path(path)
    config_path, weights_path = root / ADAPTER_CONFIG_FILE, root / ADAPTER_WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise SnapshotError(f"{root} needs {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}")
    config = serving_config_from_peft(json.loads(config_path.read_text()), base_model)
    loaded = load_file(str(weights_path), device="cpu")
    return _freeze(loaded, config, (), None, hash_kind, served_dtype)


def snapshot_from_tensors(
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | Any,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
    hash_kind: str = PUBLISHED_HASH_KIND,
    served_dtype: str = DEFAULT_SERVED_DTYPE,
) -> Snapshot:
    """Snapshot exported tensors (PEFT saved naming) plus their PEFT config (a LoraConfig or its dict)."""
    return _freeze(tensors, serving_config_from_peft(config, base_model), (), dtype, hash_kind, served_dtype)


def snapshot_for_digest(snapshot: Snapshot, digest: str) -> Snapshot:
    """These tensors under the manifest whose digest is `digest`: the same snapshot when it already has it,
    else the same tensors with their manifest computed under another known hash kind (no tensor is copied).

    For staging a version again (a rehydrate after an engine restart, a publisher rebuilt from its source):
    the registry holds the digest it was published with, and a snapshot rebuilt today is v2 by default, so
    a version published as v1 must be re-staged under its v1 manifest, byte for byte, or it would be another
    version. A v2 version published before manifests recorded a served digest is found the same way (its
    manifest without the record). Raises SnapshotError when no known kind gives `digest` (other tensors or another
    config)."""
    if snapshot.digest == digest:
        return snapshot
    mine = snapshot.manifest
    tried = [mine.hash_kind]
    if mine.served is not None:
        bare = attrs.evolve(mine, served=None)
        if bare.digest == digest:
            return Snapshot(tensors=snapshot.tensors, manifest=bare)
    for kind in KNOWN_HASH_KINDS.values():
        if kind in tried:
            continue
        tried.append(kind)
        manifest = manifest_from_tensors(snapshot.tensors, snapshot.serving_config, hash_kind=kind,
                                         served_dtype=None if kind == HASH_SHA256 else DEFAULT_SERVED_DTYPE)
        for found in (manifest, attrs.evolve(manifest, served=None)):
            if found.digest == digest:
                return Snapshot(tensors=snapshot.tensors, manifest=found)
    raise SnapshotError(f"no manifest of these tensors and serving config has digest {digest} "
                        f"(hash kinds tried: {tried})")
