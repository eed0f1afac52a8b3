"""The deployment the demo and the online benchmark run on: a local Ray cluster with the registry actor,
two patched SGLang CPU engines with the fixture model, and the runtime wired over them (Publisher,
Reclaimer, SessionBinder over SGLangBackend). Nothing here is a double: every piece is the one the
library ships; this module only connects them.
"""

from __future__ import annotations

import random
import secrets
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.adapters.engine_staging import EngineStaging
from versioned_lora.adapters.probe_check import PROBE_ULPS
from versioned_lora.adapters.ray_registry import RayRegistry, RegistryActor, create_registry_actor
from versioned_lora.adapters.reference_forward import ReferenceModel, ReferenceProbeCheck
from versioned_lora.adapters.sglang_backend import SGLangBackend, sticky_by_session
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir
from versioned_lora.adapters.snapshot_store import SnapshotStore
from versioned_lora.capabilities import KEY_FILE_ENV, Action, mint, parse_key
from versioned_lora.fixtures import Fixtures, build_fixtures
from versioned_lora.lifecycle import VersionKey
from versioned_lora.lifecycle.core import DEFAULT_CAPACITY
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.dispatch_gate import DispatchGate
from versioned_lora.runtime.interfaces import BackendRequest
from versioned_lora.runtime.publisher import Publisher
from versioned_lora.runtime.reclaimer import Reclaimer
from versioned_lora.runtime.session_binder import SessionBinder
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.wire import TOKEN_ENV

ENGINE_NAMES = ("E0", "E1", "E2", "E3")  # a Stack names its first len(urls) engines by these
BUCKET_BYTES = 8 * 1024  # the fixture adapters are ~28 KB: 4 buckets, so per-bucket phases show


def start_engines(
    fixtures: Fixtures, log_dir: Path, token: str, count: int = 2, capability_key_file: Path | None = None,
    extra_args: Sequence[str] = (), cpu_threads: int | None = 1, capacity: int = DEFAULT_CAPACITY,
) -> list[EngineProcess]:
    """Start `count` engines in parallel; any failure stops them all and raises. The engines carry out cleanups
    and reclaims only under the registry's capability: `capability_key_file` is the key they and the registry
    actor share (a managed engine does not start without one). `extra_args` go to every engine's command line;
    `cpu_threads` is `EngineConfig.cpu_threads`; `capacity` the registry's K they serve (K + 1 adapter slots)."""
    configs = []
    env = {TOKEN_ENV: token, **({KEY_FILE_ENV: str(capability_key_file)} if capability_key_file else {})}
    for index in range(count):
        configs.append(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                    log_path=log_dir / f"E{index}.log", max_lora_rank=fixtures.lora_rank,
                                    lora_target_modules=fixtures.target_modules, env=env,
                                    extra_args=tuple(extra_args), cpu_threads=cpu_threads, capacity=capacity))
    return start_all(configs)


def ensure_ray() -> bool:
    """A small local Ray cluster unless one is already up; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
    return True


class Stack:
    """Registry actor + engines' clients + Publisher/Reclaimer + SessionBinder, for one deployment epoch."""

    registry_actor: type[RegistryActor] = RegistryActor  # the class hosting the registry (a test's may hold it)

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        workdir: Path,
        fixtures: Fixtures,
        on_phase: Callable[[str, str, float], None] | None = None,
        deadlines: Deadlines | None = None,
        *,
        probe_prompt: Sequence[int] | None = None,
        probe_ulps: float = PROBE_ULPS,
        reference: ReferenceModel | None = None,
        route: Callable[[BackendRequest], int] | None = None,
        bucket_deadline_s: float = 60.0,
        client_timeout_s: float = 300.0,
        bucket_bytes: int = BUCKET_BYTES,
        capability_key_file: Path | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        # A fresh epoch per deployment: managed names are never reused on an engine.
        self.epoch = random.randrange(1, 2**31)
        self.fixtures = fixtures
        self.token = token
        journal = workdir / f"registry-{self.epoch}.sqlite"
        self.registry_name = f"registry-{uuid.uuid4().hex[:8]}"
        self.handle = create_registry_actor(journal, name=self.registry_name,
                                            engines=ENGINE_NAMES[: len(urls)], epoch=self.epoch,
                                            capability_key_file=capability_key_file, capacity=capacity,
                                            actor_class=self.registry_actor)
        # The registry's capacity K gates how many versions are held; the engines must have been started with at
        # least K + 1 slots (`start_engines(capacity=K)`, `EngineConfig.capacity`), else a begin is NO_FREE_SLOT.
        self.capacity = capacity
        self.registry = RayRegistry(self.handle)
        self.clients = {name: SGLangClient(url, token=token, timeout_s=client_timeout_s)
                        for name, url in zip(ENGINE_NAMES, urls, strict=False)}
        # The probe is the fixture's (fixtures.Fixtures), unless the caller picks its own; its scores are checked
        # against a forward of the fixture's base model (the stack runs on fixtures, whose models are small).
        probe_prompt = list(fixtures.probe_prompt if probe_prompt is None else probe_prompt)
        self.ports: dict[str, EngineStaging] = {
            name: EngineStaging(name, client, probe_prompt, bucket_deadline_s=bucket_deadline_s)
            for name, client in self.clients.items()
        }
        self.reference = reference or ReferenceModel(fixtures.model_dir)
        self.probe_check = ReferenceProbeCheck(self.reference, probe_prompt, probe_ulps)
        self.deadlines = deadlines or Deadlines()
        # Every committed version's bytes, by digest, in the deployment's work directory: what a rehydrate reads
        # when the publisher that published the version is gone.
        self.snapshots = SnapshotStore(workdir / "snapshots", bucket_bytes)
        self.publisher = Publisher(self.registry, self.ports, self.probe_check, self.deadlines, on_phase=on_phase,
                                   snapshots=self.snapshots)
        # One dispatch gate for every session binder of this process; the in-process reclaimer tells it what
        # it claimed, so a reclaimed version is refused at once, not within the gate's staleness window.
        self.gate = DispatchGate(self.registry)
        self.reclaimer = Reclaimer(self.registry, self.ports, self.deadlines, gate=self.gate)
        self.route = route or sticky_by_session(len(self.clients))
        self.backend = SGLangBackend(list(self.clients.values()), route=self.route, names=list(self.clients))
        self.capability_key_file = capability_key_file
        self.candidates: dict[VersionKey, Candidate] = {}
        self.labels: dict[str, str] = {}  # lora_name -> label, for reports
        self.bucket_bytes = bucket_bytes

    def new_binder(self, backend: Any, shard: int) -> SessionBinder:
        return SessionBinder(self.registry, backend, epoch=self.epoch, shard=shard, deadlines=self.deadlines,
                             gate=self.gate)

    def candidate(
        self, label: str, adapter: str | None = None, *, snapshot: Snapshot | None = None
    ) -> tuple[VersionKey, Candidate]:
        """Version `label` of this epoch, from fixture adapter `adapter` (default: `label`) or `snapshot`."""
        snapshot = snapshot or snapshot_from_adapter_dir(self.fixtures.adapters[adapter or label])
        version = VersionKey(self.epoch, label)
        candidate = Candidate.build(lora_name(version, snapshot.digest), snapshot, self.bucket_bytes)
        # What the probe must answer is known once the snapshot is frozen: computed here, with the candidate,
        # so no publication spends a reference forward (on the publisher's event loop) inside its `end`.
        self.probe_check.reference(candidate)
        self.candidates[version] = candidate
        self.labels[candidate.lora_name] = label
        return version, candidate

    async def audit(self) -> dict[str, dict[str, int]]:
        return {name: dict((await client.status())["audit"]) for name, client in self.clients.items()}

    async def unload_leftovers(self) -> None:
        """Attach mode only (engines shared with tests): unload this epoch's managed adapters so later
        users find free managed slots. Not part of the protocol: a teardown, which the engines carry out only
        under the registry's capability; the deployment that owns the key file signs it here."""
        if self.capability_key_file is None:
            raise ValueError("unload_leftovers needs the deployment's capability key file (engines require it)")
        key = parse_key(self.capability_key_file.read_text())
        for client in self.clients.values():
            status = await client.status()
            for adapter in status["managed"]:
                if adapter["state"] in ("READY", "STAGING") and f"@{self.epoch}-" in adapter["name"]:
                    name, reclaim_id = adapter["name"], "demo-teardown"
                    await client.managed("reclaim", lora_name=name, reclaim_id=reclaim_id, wait_s=60,
                                         capability=mint(key, Action.RECLAIM, name, reclaim_id))

    async def close(self) -> None:
        import ray

        for port in self.ports.values():
            port.close()
        for client in self.clients.values():
            await client.aclose()
        ray.kill(self.handle, no_restart=True)


def new_token() -> str:
    return secrets.token_hex(16)


def load_fixtures() -> Fixtures:
    return build_fixtures()
