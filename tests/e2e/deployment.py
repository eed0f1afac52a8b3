"""One deployment as the e2e tests drive it: a registry actor on real Ray, the Publisher and
Reclaimer over the two real engines, and a SessionBinder whose backend routes by session."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

from engine_helpers import PROMPT, client_for

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_staging import EngineStaging
from versioned_lora.adapters.ray_registry import RayRegistry, create_registry_actor
from versioned_lora.adapters.reference_forward import ReferenceModel, ReferenceProbeCheck
from versioned_lora.adapters.sglang_backend import SGLangBackend
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.interfaces import BackendRequest
from versioned_lora.runtime.publisher import Deadlines, Publisher, Reclaimer
from versioned_lora.runtime.session_binder import SessionBinder
from versioned_lora.spec.identities import lora_name

SMALL_BUCKETS = 8 * 1024  # the fixture adapters are ~28 KB: 4 buckets
ENGINE_NAMES = ("E0", "E1")

_reference: ReferenceModel | None = None


def reference_model(model_dir: Path) -> ReferenceModel:
    global _reference
    if _reference is None:
        _reference = ReferenceModel(model_dir)
    return _reference


def route_by_session_name(request: BackendRequest) -> int:
    """Sessions named '...@E1' go to E1, others to E0: the tests choose where each session runs."""
    return 1 if request.rid.split("/", 1)[0].endswith("@E1") else 0


class Deployment:
    def __init__(self, engines: Any, fixtures: Any, tmp_path: Path, deadlines: Deadlines | None = None) -> None:
        deadlines = deadlines or Deadlines()
        # A fresh epoch per deployment: managed names are never reused on an engine.
        self.epoch = random.randrange(1, 2**31)
        self.engines = engines
        self.fixtures = fixtures
        self.registry_name = f"registry-{uuid.uuid4().hex[:8]}"
        self.handle = create_registry_actor(tmp_path / "registry.sqlite", name=self.registry_name,
                                            engines=ENGINE_NAMES, epoch=self.epoch)
        self.registry = RayRegistry(self.handle)
        self.clients = {"E0": client_for(engines.e0), "E1": client_for(engines.e1)}
        self.ports = {name: EngineStaging(name, client, PROMPT, bucket_deadline_s=20.0)
                      for name, client in self.clients.items()}
        self.reference = reference_model(fixtures.model_dir)
        self.publisher = Publisher(self.registry, self.ports, ReferenceProbeCheck(self.reference, PROMPT), deadlines)
        self.reclaimer = Reclaimer(self.registry, self.ports, deadlines)
        self.backend = SGLangBackend([self.clients["E0"], self.clients["E1"]], route=route_by_session_name)
        self.binder = SessionBinder(self.registry, self.backend, epoch=self.epoch, shard=0)
        self.candidates: dict[VersionKey, Candidate] = {}

    def candidate(self, label: str, snapshot: Snapshot | None = None) -> tuple[VersionKey, Candidate]:
        snapshot = snapshot or snapshot_from_adapter_dir(self.fixtures.adapters[label])
        version = VersionKey(self.epoch, label)
        candidate = Candidate.build(lora_name(version, snapshot.digest), snapshot, SMALL_BUCKETS)
        self.candidates[version] = candidate
        return version, candidate

    async def audit(self) -> dict[str, dict[str, int]]:
        return {name: (await client.status())["audit"] for name, client in self.clients.items()}

    async def close(self) -> None:
        for port in self.ports.values():
            port.close()
        for client in self.clients.values():
            await client.aclose()
        import ray

        ray.kill(self.handle, no_restart=True)


ENGINE_WIDE = ("pause_generation", "flush_cache", "abort_all", "base_weight_update", "continue_generation")


def engine_wide_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{engine}.{key}": after[engine][key] - before[engine][key] for engine in before for key in ENGINE_WIDE}
