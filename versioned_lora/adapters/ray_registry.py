"""The shared single-writer registry (RFC §2): `RegistryCore` (adapters/registry_core.py, the lifecycle core behind a
durable journal) hosted in-process (`LocalRegistry`) or as a named Ray actor (`create_registry_actor`, `RayRegistry`).

The actor runs `RegistryCore` with `max_concurrency=1`, so calls are applied one at a time in arrival
order; it only steps the pure core and writes its SQLite journal. It never awaits network, NCCL,
probes or unloads: the effects the core returns go back to the caller, who carries them out.

A call is acknowledged only after its journal row is durable, and the in-memory state advances only
then. `max_restarts` brings a killed actor back; the new process replays the journal to exactly the
state after the last durable call, and a retried key is answered from the journal, not re-applied.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import pickle
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from versioned_lora import capabilities
from versioned_lora.adapters.journal import Journal
from versioned_lora.adapters.registry_core import (
    DEFAULT_CHECKPOINT_EVERY,
    OperationsView,
    RegistryCore,
)
from versioned_lora.adapters.registry_metrics import REFRESH_S, RegistryMetrics, ray_metric
from versioned_lora.lifecycle import RegistryEvent, VersionKey, VersionState
from versioned_lora.runtime.interfaces import (
    MAX_BATCH,
    BatchTooLarge,
    RegistryAnswer,
    RegistryError,
    RegistryUnavailable,
)
from versioned_lora.runtime.views import DispatchView, PublicationView

REGISTRY_ACTOR_NAME = "versioned_lora_registry"
REGISTRY_NAMESPACE = "versioned_lora"


def new_key(prefix: str = "call") -> str:
    return f"{prefix}:{uuid.uuid4().hex}"


class LocalRegistry:
    """`RegistryPort` over an in-process `RegistryCore` (tools, single-process runs, tests without
    Ray). Calls run on the event loop: a journal write blocks it for one fsync."""

    def __init__(self, core: RegistryCore) -> None:
        self.core = core

    async def submit(self, event: RegistryEvent, key: str | None = None) -> RegistryAnswer:
        return self.core.submit(key or new_key(), event)

    async def submit_batch(
        self, events: Sequence[RegistryEvent], key: str | None = None
    ) -> tuple[RegistryAnswer, ...]:
        return self.core.submit_batch(key or new_key("batch"), events)

    async def version_states(self, versions: Collection[VersionKey]) -> dict[VersionKey, VersionState]:
        return self.core.version_states(versions)

    async def dispatch_view(self, versions: Collection[VersionKey]) -> dict[VersionKey, DispatchView]:
        return self.core.dispatch_view(versions)

    async def state_digest(self) -> str:
        return self.core.state_digest()

    async def publication_view(self, all_versions: bool = False) -> PublicationView:
        return self.core.publication_view(all_versions)

    async def operations_view(self, all_versions: bool = False) -> OperationsView:
        return self.core.operations_view(all_versions)

    async def key_ids(self) -> tuple[str, ...]:
        return self.core.key_ids()

    async def engine_urls(self) -> dict[str, str]:
        return self.core.engine_urls()


# ---- Ray ---------------------------------------------------------------------------------------------------------


class RegistryActor(RegistryCore):
    """RegistryCore as the only tenant of its Ray worker process, which lets it tune that process's cyclic
    garbage collector: the state (10^5 session records and the persistent maps holding them) is long-lived
    and acyclic, yet every full collection walked all of it, stalling a call for 0.2-0.6 s (measured with
    10^5 open sessions; p99 of 256-bind calls 244 ms in-process, 58 ms with this). `gc.freeze()` after
    recovery and after each checkpoint moves what is alive then out of the collector's sight; reference
    counting still frees it when a later state drops it (nothing in it forms cycles).

    Between checkpoints (50,000 events) the new records are not frozen yet, and CPython ran a full
    collection every ~80 calls of 256 binds, 80-320 ms each over what had accumulated: in-process p99
    139 ms. A full collection now waits for `FULL_COLLECTION_AFTER` young (generation 1) collections
    instead of 10, about one per 2,000 such calls: p99 19 ms. Full collections still run, so cycles made
    elsewhere in the process (Ray's call machinery, exceptions) are still freed."""

    FULL_COLLECTION_AFTER = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import ray

        name = ray.get_runtime_context().get_actor_name() or "unnamed"
        self._metrics = RegistryMetrics(functools.partial(ray_metric, registry=name))
        self._metrics.set_gauges(self._state, self._index)
        # Records the live gauges again and again (registry_metrics.REFRESH_S): Ray's agent drops a gauge series
        # its process stopped recording, which is how a reclaimed version's series leaves; a live one must stay.
        threading.Thread(target=self._refresh_metrics, name="registry-metrics", daemon=True).start()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, self.FULL_COLLECTION_AFTER)
        gc.freeze()

    def submit_batch(self, key: str, events: Sequence[RegistryEvent]) -> tuple[RegistryAnswer, ...]:
        """RegistryCore.submit_batch, observed by the metrics (registry_metrics.py) once it answered."""
        before, started = self._state, time.perf_counter()
        answers = super().submit_batch(key, events)
        self._metrics.observe(before, self._state, tuple(events), answers, time.perf_counter() - started,
                              self._index)
        return answers

    def _refresh_metrics(self) -> None:
        while True:
            time.sleep(REFRESH_S)
            self._metrics.refresh()

    def _after_checkpoint(self) -> None:
        gc.freeze()

    def submit_batch_pickled(self, key: str, events: bytes) -> bytes:
        """`submit_batch` with its events and answers pickled by the caller and here, with the C pickler.
        Ray pickles arguments and results with cloudpickle, a pure-Python pickler: 2.0 ms for the answers
        to 256 binds, against 0.9 ms here; it passes bytes through as they are. (RayRegistry uses this.)"""
        answers = self.submit_batch(key, pickle.loads(events))
        return pickle.dumps(answers, protocol=pickle.HIGHEST_PROTOCOL)


def create_registry_actor(
    journal_path: str | Path,
    *,
    engines: Sequence[str] = ("E0", "E1"),
    capacity: int = 2,
    epoch: int = 0,
    name: str = REGISTRY_ACTOR_NAME,
    namespace: str = REGISTRY_NAMESPACE,
    detached: bool = False,
    max_restarts: int = -1,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    capability_key_file: str | Path | None = None,
    options: dict[str, Any] | None = None,
    insecure: bool = False,
    previous_key_file: str | Path | None = None,
    previous_key_until: float | None = None,
    engine_urls: Mapping[str, str] | None = None,
    actor_class: type[RegistryActor] | None = None,
) -> Any:
    """Create (or get, if it already exists) the named registry actor and wait until it has recovered.

    KEEP THE HANDLE, or pass `detached=True`: a non-detached actor is Ray's to collect once the last handle to it
    is gone (or the process that created it leaves the cluster), and every later lookup by name then fails with
    Ray's "Failed to look up actor". A deployment that other processes join (the CLI, a trainer, a session
    service) wants `detached=True`, as `versioned_lora.start_registry` and `versioned-lora registry` do; it runs
    until killed (`versioned_lora.stop_registry`).

    `journal_path` must survive the actor's process: on a multi-node cluster pin the actor to one node
    (`options={"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}`) or put the
    journal on a shared filesystem. `max_task_retries=0`: a call in flight when the actor dies fails to
    its caller, who retries it with the same key (RayRegistry does), so nothing is applied twice.

    `capability_key_file`: the key file the engines also read (`versioned_lora.capabilities`); the actor
    reads it in its own process, so the caller passes a path, never the key. Required, unless `insecure=True` (tests
    that say so: the actor then runs without a key, `RegistryCore`): refused here, before any actor exists.
    `previous_key_file`/`previous_key_until` (a rotation, `capabilities.KeyRing`) go the same way. `actor_class`: a
    subclass of `RegistryActor` to host instead (tests hold the process at a point of a call:
    tests/registry_faults.py)."""
    import ray

    if capability_key_file is None and not insecure:
        raise capabilities.KeyRequired(
            "create_registry_actor needs capability_key_file: the deployment's key file, the one the engines read "
            "(`versioned-lora keygen PATH` makes one); only tests run a registry without one (insecure=True)")
    if (previous_key_file is None) != (previous_key_until is None):
        raise ValueError("a previous key file and the time until which it is accepted go together")
    key_env = {} if capability_key_file is None else {capabilities.KEY_FILE_ENV: str(capability_key_file)}
    if previous_key_file is not None:
        key_env |= {capabilities.PREVIOUS_KEY_FILE_ENV: str(previous_key_file),
                    capabilities.PREVIOUS_KEY_UNTIL_ENV: str(previous_key_until)}

    actor_options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "max_concurrency": 1,  # the single writer: calls are applied one at a time
        "max_restarts": max_restarts,
        "max_task_retries": 0,
        "num_cpus": 0,  # it is I/O-light bookkeeping; never let it wait for a CPU slot
        "get_if_exists": True,
        **({"lifetime": "detached"} if detached else {}),
        **({"runtime_env": {"env_vars": key_env}} if key_env else {}),
        **(options or {}),
    }
    remote: Any = ray.remote(actor_class or RegistryActor)
    handle = remote.options(**actor_options).remote(
        str(journal_path), tuple(engines), capacity, epoch, checkpoint_every, insecure=insecure,
        **({"engine_urls": dict(engine_urls)} if engine_urls is not None else {}),
    )
    ray.get(handle.pid.remote())  # returns once the actor has recovered its journal
    return handle


def recorded_epoch(journal_path: str | Path) -> int | None:
    """The deployment epoch a journal was begun with (None: no journal there yet, or an empty one)."""
    if not Path(journal_path).exists():
        return None
    journal = Journal(journal_path)
    try:
        config = journal.recorded_config()
    finally:
        journal.close()
    return None if config is None else config.epoch


def find_registry_actor(name: str = REGISTRY_ACTOR_NAME, namespace: str = REGISTRY_NAMESPACE) -> Any:
    import ray

    return ray.get_actor(name, namespace=namespace)


class RayRegistry:
    """`RegistryPort` over the registry actor. A call whose actor died or is restarting is retried
    with the same idempotency key until `retry_deadline_s`; then `RegistryUnavailable` (unknown whether
    it was applied; the caller may retry the same key later)."""

    def __init__(self, handle: Any, retry_deadline_s: float = 60.0, backoff_s: float = 0.05) -> None:
        self.handle = handle
        self._deadline_s = retry_deadline_s
        self._backoff_s = backoff_s

    @classmethod
    def find(cls, name: str = REGISTRY_ACTOR_NAME, namespace: str = REGISTRY_NAMESPACE, **kwargs: Any) -> RayRegistry:
        return cls(find_registry_actor(name, namespace), **kwargs)

    async def submit(self, event: RegistryEvent, key: str | None = None) -> RegistryAnswer:
        key = key or new_key()
        answer: RegistryAnswer = await self._call(lambda: self.handle.submit.remote(key, event))
        return answer

    async def submit_batch(
        self, events: Sequence[RegistryEvent], key: str | None = None
    ) -> tuple[RegistryAnswer, ...]:
        events = tuple(events)
        if len(events) > MAX_BATCH:
            raise BatchTooLarge(len(events))  # refused here: no round trip for a call the actor refuses
        key = key or new_key("batch")
        blob = pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)
        answers: tuple[RegistryAnswer, ...] = pickle.loads(
            await self._call(lambda: self.handle.submit_batch_pickled.remote(key, blob))
        )
        return answers

    async def version_states(self, versions: Collection[VersionKey]) -> dict[VersionKey, VersionState]:
        wanted = tuple(versions)
        states: dict[VersionKey, VersionState] = await self._call(lambda: self.handle.version_states.remote(wanted))
        return states

    async def dispatch_view(self, versions: Collection[VersionKey]) -> dict[VersionKey, DispatchView]:
        wanted = tuple(versions)
        view: dict[VersionKey, DispatchView] = await self._call(lambda: self.handle.dispatch_view.remote(wanted))
        return view

    async def state_digest(self) -> str:
        digest: str = await self._call(lambda: self.handle.state_digest.remote())
        return digest

    async def publication_view(self, all_versions: bool = False) -> PublicationView:
        view: PublicationView = await self._call(lambda: self.handle.publication_view.remote(all_versions))
        return view

    async def operations_view(self, all_versions: bool = False) -> OperationsView:
        view: OperationsView = await self._call(lambda: self.handle.operations_view.remote(all_versions))
        return view

    async def key_ids(self) -> tuple[str, ...]:
        ids: tuple[str, ...] = await self._call(lambda: self.handle.key_ids.remote())
        return ids

    async def engine_urls(self) -> dict[str, str]:
        urls: dict[str, str] = await self._call(lambda: self.handle.engine_urls.remote())
        return urls

    async def _call(self, make_ref: Any) -> Any:
        import ray

        deadline = time.monotonic() + self._deadline_s
        while True:
            try:
                return await make_ref()
            except ray.exceptions.RayTaskError as exc:
                # An exception raised by the core (ProtocolError, BatchTooLarge, ...): surface it as itself.
                cause = exc.cause
                if isinstance(cause, BaseException):
                    raise cause from None
                raise
            except ray.exceptions.RayActorError as exc:
                # The actor died (kill -9, node loss) or is restarting: the call may or may not be in the
                # journal. Retrying the same key is answered from the journal if it was, applied if not.
                if time.monotonic() >= deadline:
                    raise RegistryUnavailable(f"registry actor unavailable for {self._deadline_s}s: {exc}") from exc
                await asyncio.sleep(self._backoff_s)


__all__ = [
    "REGISTRY_ACTOR_NAME",
    "REGISTRY_NAMESPACE",
    "LocalRegistry",
    "RayRegistry",
    "RegistryError",
    "create_registry_actor",
    "find_registry_actor",
    "new_key",
    "recorded_epoch",
]
