"""A directory of frozen snapshots, addressed by digest: the bytes of every version, after its publisher is gone.

A rehydrate (an engine restarted and must hold a version again, DESIGN.md §3) stages the version's exact bytes
under the digest the registry holds. The process that published the version may be long gone by then, so
its snapshot cannot live only in that process's memory: a publisher given a store writes each candidate
here before its commit is sent (`Publisher`), so every version a publisher of this store committed is here,
and any publisher later reads it back by digest (`Publisher.rehydrate` without a candidate, and the restart
supervisor, `runtime/supervisor.py`).

Layout: `<root>/<digest>/` is a PEFT adapter directory (`Snapshot.save_adapter_dir`: adapter_config.json,
adapter_model.safetensors) plus the manifest exactly as published (v1 or v2, whichever the digest names).
Entries are immutable: written to a sibling and renamed into place, never rewritten. Reading verifies:
the manifest's digest must be the one asked for, and every tensor's dtype, shape and hash the manifest's
(so a file altered or truncated on disk is refused, typed, and never staged).

What this does not do: decide what to keep. Entries stay until `retain` is called with the digests still
needed (an operator's or deployment's garbage collection; several versions may share one digest).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.manifest import Manifest, ManifestError, verify_tensors
from versioned_lora.adapters.snapshot import ADAPTER_WEIGHTS_FILE, MANIFEST_FILE, Snapshot

_DIGEST = re.compile(r"[0-9a-f]{64}")
DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024


class SnapshotStoreError(Exception):
    """Base of the store's refusals."""


class SnapshotMissing(SnapshotStoreError):
    """No entry for this digest: it was never written here (or was removed by `retain`)."""


class SnapshotCorrupt(SnapshotStoreError):
    """The entry for this digest is not the snapshot the digest names (altered, truncated, half-removed)."""


class SnapshotStore:
    def __init__(self, root: str | Path, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.root = Path(root)
        self.max_bucket_bytes = max_bucket_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ValueError(f"not a snapshot digest (64 lowercase hex digits): {digest!r}")
        return self.root / digest

    def holds(self, digest: str) -> bool:
        return (self.path(digest) / MANIFEST_FILE).is_file()

    def digests(self) -> frozenset[str]:
        return frozenset(p.name for p in self.root.iterdir() if _DIGEST.fullmatch(p.name) and self.holds(p.name))

    def put(self, snapshot: Snapshot) -> Path:
        """Write `snapshot` under its digest, once: an entry already there is the same bytes by construction
        (content addressing) and is left as it is (reading it verifies it)."""
        target = self.path(snapshot.digest)
        if self.holds(snapshot.digest):
            return target
        try:
            return snapshot.save_adapter_dir(target)
        except FileExistsError:  # another writer renamed the same entry into place first
            if self.holds(snapshot.digest):
                return target
            raise

    def put_candidate(self, candidate: Candidate) -> None:
        """`put` for the Publisher, which holds candidates (runtime.interfaces.SnapshotStorePort)."""
        self.put(candidate.snapshot)

    def get(self, digest: str) -> Snapshot:
        """The snapshot whose digest is `digest`, verified tensor by tensor against its manifest."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        entry = self.path(digest)
        if not self.holds(digest):
            raise SnapshotMissing(f"no snapshot {digest} in {self.root}")
        try:
            manifest = Manifest.from_json((entry / MANIFEST_FILE).read_bytes())
            if manifest.digest != digest:
                raise SnapshotCorrupt(f"{entry}: its manifest's digest is {manifest.digest}")
            tensors = load_file(str(entry / ADAPTER_WEIGHTS_FILE), device="cpu")
            verify_tensors(manifest, tensors)
        except SnapshotCorrupt:
            raise
        except (ManifestError, SafetensorError, OSError, ValueError) as exc:
            raise SnapshotCorrupt(f"{entry}: {type(exc).__name__}: {exc}") from exc
        # load_file's tensors are this call's own: nothing else holds them, as a snapshot requires.
        return Snapshot(tensors=MappingProxyType({name: tensors[name] for name in manifest.names}), manifest=manifest)

    def candidate(self, digest: str, lora_name: str) -> Candidate:
        """The version as a publisher ships it, from its stored snapshot (runtime.interfaces.SnapshotStorePort)."""
        return Candidate.build(lora_name, self.get(digest), self.max_bucket_bytes)

    def retain(self, digests: Iterable[str]) -> list[str]:
        """Remove every entry whose digest is not in `digests`; returns the removed digests."""
        keep = {self.path(d).name for d in digests}
        removed = sorted(self.digests() - keep)
        for digest in removed:
            shutil.rmtree(self.path(digest))
        return removed
