"""The shared single-writer registry (RFC §2): the lifecycle core behind a durable journal, in-process
(`RegistryCore`, `LocalRegistry`) or as a named Ray actor (`create_registry_actor`, `RayRegistry`).

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
import os
import pickle
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from versioned_lora import capabilities
from versioned_lora.adapters.journal import CheckpointWriter, Journal, state_digest
from versioned_lora.adapters.registry_metrics import REFRESH_S, RegistryMetrics, ray_metric
from versioned_lora.lifecycle import (
    ArmLeaseTimer,
    ExpireLease,
    RegistryEffect,
    RegistryEvent,
    RegistryState,
    Reserve,
    VersionKey,
    VersionState,
    initial_state,
    step,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine, ReclaimOnEngine
from versioned_lora.runtime.interfaces import (
    MAX_BATCH,
    BatchTooLarge,
    IdempotencyKeyReused,
    RegistryAnswer,
    RegistryError,
    RegistryUnavailable,
)
from versioned_lora.runtime.views import DispatchView, PublicationView, ViewIndex, dispatch_view
from versioned_lora.spec.identities import check_version_identity

REGISTRY_ACTOR_NAME = "versioned_lora_registry"
REGISTRY_NAMESPACE = "versioned_lora"
DEFAULT_CHECKPOINT_EVERY = 50_000  # events between checkpoints: bounds replay time after a restart
# Pickling time a checkpoint may add to one call (it is written over as many later calls as it needs).
CHECKPOINT_BUDGET_S = 0.001
DEFAULT_ANSWER_CACHE = 4096  # recent calls answered from memory; older retried keys hit the journal index


def new_key(prefix: str = "call") -> str:
    return f"{prefix}:{uuid.uuid4().hex}"


@attrs.frozen
class OperationsView:
    """What an operator needs beside `PublicationView` (which the runtime's view module defines): the
    capacity, the slots held, each claimed version's engines that confirmed their unload (of the versions the
    publication view of the same `all_versions` holds), open sessions. Answered from `ViewIndex`: its cost does
    not grow with sessions or with the versions that ended."""

    epoch: int
    capacity: int
    occupied: int
    reclaim_confirmed: dict[VersionKey, tuple[str, ...]]
    open_sessions: int
    # The publisher lease: its holder (None: free), the last fence granted, and the seconds until the registry
    # expires it without a renewal (None: free, or this registry process has armed no timer for it).
    lease_holder: str | None = None
    lease_fence: int = 0
    lease_expires_in_s: float | None = None


@attrs.frozen
class RecoveryReport:
    replayed_calls: int
    seconds: float
    last_seq: int


# Where an armed fault holds the actor (test-only fault injection: a real process cannot be made to
# stop at an exact point of a call on demand, so the actor pauses there and the test kill -9s it).
FAULT_POINTS = ("mid_batch", "before_commit", "after_commit")


@attrs.define
class _Fault:
    point: str
    after_events: int
    hold_s: float
    marker: str | None

    def hit(self) -> None:
        if self.marker:
            # Written aside and renamed: a reader polling for the file never sees it empty.
            staged = Path(f"{self.marker}.tmp")
            staged.write_text(str(os.getpid()))
            staged.replace(self.marker)
        time.sleep(self.hold_s)


class RegistryCore:
    """The registry as a plain class: the core's state, its journal, idempotent calls."""

    def __init__(
        self,
        journal_path: str | Path,
        engines: Sequence[str] = ("E0", "E1"),
        capacity: int = 2,
        epoch: int = 0,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        answer_cache: int = DEFAULT_ANSWER_CACHE,
        capability_key: bytes | capabilities.KeyRing | None = None,
        id_salt: str | None = None,
        publisher_lease: bool = True,
        insecure: bool = False,
        engine_urls: Mapping[str, str] | None = None,
    ) -> None:
        """`capability_key`: the key engines check cleanups and reclaims with (`versioned_lora.capabilities`), or a
        `KeyRing` (a rotation); default: the key ring of this process's environment (`keyring_from_env`). Without
        one the registry does not start (`KeyRequired`, before its journal is opened): it could sign nothing, and
        engines refuse every cleanup and reclaim it orders (issue 41). `insecure=True` lets it run keyless (tests
        that say so): its answers then carry no capabilities and no key id, and every engine port refuses it
        (`KEY_MISMATCH`).
        `id_salt`: the reclaim-id salt of a new journal (default: a random one; `Journal.id_salt`).
        `publisher_lease`: whether a new journal requires the publisher lease's fence on every Reserve and
        Commit (`RegistryConfig.publisher_lease`); a journal keeps what it was begun with (one begun before
        leases existed replays unfenced, as it ran).
        `engine_urls`: where each engine is reached (name -> URL), recorded in the journal beside its configuration
        so that every other process needs only the registry's name (None: keep what the journal recorded)."""
        started = time.perf_counter()
        key = capability_key if capability_key is not None else capabilities.keyring_from_env()
        if key is None and not insecure:
            raise capabilities.KeyRequired(
                f"the registry needs the deployment's capability key: ${capabilities.KEY_FILE_ENV} (or "
                f"create_registry_actor(capability_key_file=...)), the file the engines read; make one with "
                f"`versioned-lora keygen PATH`. Only tests run a registry without one (insecure=True)")
        self._keys = capabilities.KeyRing(key) if isinstance(key, bytes) else key
        self._journal = Journal(journal_path)
        recorded = self._journal.recorded_config()
        initial = initial_state(engines=engines, capacity=capacity, epoch=epoch,
                                id_salt=self._journal.id_salt(id_salt),
                                publisher_lease=publisher_lease if recorded is None else recorded.publisher_lease)
        self._journal.bind_config(initial.config)
        self._engine_urls = self._journal.engine_urls(engine_urls)
        self._state, replayed = self._journal.recover(initial, step)
        self._index = ViewIndex(self._state)  # the one walk of every session and version: at start, not per read
        self._next_seq = self._journal.next_seq()
        self._checkpoint_every = checkpoint_every
        self._events_since_checkpoint = 0
        self._checkpointing: CheckpointWriter | None = None  # a checkpoint written a slice per call
        self._recent: OrderedDict[str, tuple[tuple[RegistryEvent, ...], tuple[RegistryAnswer, ...]]] = OrderedDict()
        self._answer_cache = answer_cache
        self._fault: _Fault | None = None
        # The publisher lease's timer (ArmLeaseTimer): (fence, monotonic deadline). A recovered registry grants a
        # held lease a whole ttl from now: it never expires a lease sooner than its holder could have renewed it.
        lease = self._state.lease
        self._lease_timer = None if lease.holder is None else (lease.fence, time.monotonic() + lease.ttl_s)
        self.recovery = RecoveryReport(replayed, time.perf_counter() - started, self._next_seq - 1)

    def _after_checkpoint(self) -> None:
        """A hook for the process that hosts the registry (see RegistryActor)."""

    # ---- calls
    def submit(self, key: str, event: RegistryEvent) -> RegistryAnswer:
        return self.submit_batch(key, (event,))[0]

    def submit_batch(self, key: str, events: Sequence[RegistryEvent]) -> tuple[RegistryAnswer, ...]:
        """Apply `events` in order as one call. Atomic: a ProtocolError on any event (a bug) leaves the
        state and the journal untouched. A call that changes nothing is answered without a journal row."""
        events = tuple(events)
        if len(events) > MAX_BATCH:
            raise BatchTooLarge(len(events))
        _check_identities(events)
        self._expire_lease_when_due()
        answered = self._answered(key, events)
        if answered is not None:
            return self._signed(answered)
        state = self._state
        steps = []
        for index, event in enumerate(events):
            state, result, effects = step(state, event)
            steps.append((result, tuple(effects)))
            self._maybe_fault("mid_batch", index + 1)
        if state is self._state:  # every row was a keep row: no effect to protect, no fsync
            self._arm_lease_timer(steps)
            return self._signed(tuple(RegistryAnswer(result, effects, None) for result, effects in steps))
        seq = self._next_seq
        answers = tuple(RegistryAnswer(result, effects, seq) for result, effects in steps)
        try:
            checkpoint_stored = self._journal.append(
                seq,
                key,
                events,
                answers,
                before_commit=lambda: self._maybe_fault("before_commit"),
                checkpoint=self._checkpointing,
                checkpoint_budget_s=CHECKPOINT_BUDGET_S,
            )
        except BaseException:
            self._checkpointing = None  # it moved past slices the rolled-back transaction held: start afresh
            self._events_since_checkpoint = self._checkpoint_every
            raise
        # Only now, with the row durable, does the state move and the call become answerable.
        self._next_seq = seq + 1
        self._index.advance(self._state, state, events)
        self._state = state
        self._arm_lease_timer(steps)
        self._remember(key, events, answers)
        if checkpoint_stored:
            self._checkpointing = None
            self._after_checkpoint()
        self._events_since_checkpoint += len(events)
        if self._checkpointing is None and self._events_since_checkpoint >= self._checkpoint_every:
            self._checkpointing = CheckpointWriter(seq, state)  # written a slice per call from the next one on
            self._events_since_checkpoint = 0
        self._maybe_fault("after_commit")
        return self._signed(answers)

    def _arm_lease_timer(self, steps: Sequence[tuple[Any, tuple[RegistryEffect, ...]]]) -> None:
        for _, effects in steps:
            for effect in effects:
                if isinstance(effect, ArmLeaseTimer):
                    self._lease_timer = (effect.fence, time.monotonic() + effect.ttl_s)

    def _expire_lease_when_due(self) -> None:
        """The lease timer fires here, at the start of the first call after its deadline, rather than on a
        thread of its own: a lease is only ever observed through a call, so one that expired with no call in
        between is the same as one that expires now. The expiry is a row (lease.expire), journaled under a key
        of its fence; a timer of a fence no longer live changes nothing (lease.expire_late)."""
        timer = self._lease_timer
        if timer is None or time.monotonic() < timer[1]:
            return
        self._lease_timer = None
        if self._state.lease.holder is not None and self._state.lease.fence == timer[0]:
            self.submit_batch(f"lease-expired:{timer[0]}", (ExpireLease(timer[0]),))

    def _signed(self, answers: tuple[RegistryAnswer, ...]) -> tuple[RegistryAnswer, ...]:
        """The answers with this registry's key ids (where the engine ports read them) and a capability for each
        cleanup of an ABORTED version (an abort row's effect) and each reclaim of a RECLAIMING one (a claim row's),
        minted now: the journal holds them unsigned."""
        keys = self._keys
        if keys is None:
            return answers
        now = time.time()
        ids = keys.ids(now)
        return tuple(
            RegistryAnswer(answer.result, answer.effects, answer.journal_seq, answer.from_journal,
                           tuple(self._capability(keys, effect, now) for effect in answer.effects)
                           if answer.effects else answer.capabilities, ids)
            for answer in answers
        )

    def _capability(self, keys: capabilities.KeyRing, effect: RegistryEffect, now: float) -> str | None:
        version = self._state.versions.get(getattr(effect, "version", None))  # type: ignore[arg-type]
        state = None if version is None else version.state
        if isinstance(effect, CleanupOnEngine) and state in (VersionState.ABORTED, VersionState.FAILED_CLEAN):
            return capabilities.mint_all(keys, capabilities.Action.CLEANUP, effect.lora_name, effect.attempt_token,
                                         now)
        if isinstance(effect, ReclaimOnEngine) and state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            return capabilities.mint_all(keys, capabilities.Action.RECLAIM, effect.lora_name, effect.reclaim_id, now)
        return None

    def key_ids(self) -> tuple[str, ...]:
        """The ids of the keys this registry signs under now, the current first (empty: insecure)."""
        return () if self._keys is None else self._keys.ids()

    def _answered(self, key: str, events: tuple[RegistryEvent, ...]) -> tuple[RegistryAnswer, ...] | None:
        hit = self._recent.get(key)
        if hit is None:
            stored = self._journal.lookup(key)
            if stored is None:
                return None
            hit = (stored.events, stored.answers)
        if hit[0] != events:
            raise IdempotencyKeyReused(f"key {key!r} was used for other events")
        return tuple(attrs.evolve(answer, from_journal=True) for answer in hit[1])

    def _remember(self, key: str, events: tuple[RegistryEvent, ...], answers: tuple[RegistryAnswer, ...]) -> None:
        self._recent[key] = (events, answers)
        if len(self._recent) > self._answer_cache:
            self._recent.popitem(last=False)

    # ---- read-only queries
    def version_states(self, versions: Collection[VersionKey]) -> dict[VersionKey, VersionState]:
        known = self._state.versions
        return {v: known[v].state for v in versions if v in known}

    def state(self) -> RegistryState:
        return self._state

    def dispatch_view(self, versions: Collection[VersionKey]) -> dict[VersionKey, DispatchView]:
        return dispatch_view(self._state, versions)

    def publication_view(self, all_versions: bool = False) -> PublicationView:
        """Every live version and the last few ended ones (`views.RECENT_ENDED`); `all_versions`: every one."""
        return self._index.view(self._state, all_versions)

    def view_index(self) -> ViewIndex:
        return self._index

    def state_digest(self) -> str:
        return state_digest(self._state)

    def operations_view(self, all_versions: bool = False) -> OperationsView:
        state, timer = self._state, self._lease_timer  # a read expires nothing: an overdue lease shows 0 s left
        held = state.lease.holder is not None and timer is not None and timer[0] == state.lease.fence
        index = self._index
        shown = state.versions.keys() if all_versions else index.shown()
        return OperationsView(
            state.config.epoch, state.config.capacity, len(index.live),  # every live version holds one slot
            {key: tuple(sorted(v.reclaim_confirmed)) for key in shown
             if (v := state.versions[key]).reclaim_id is not None},
            index.open_sessions,
            state.lease.holder, state.lease.fence,
            max(0.0, timer[1] - time.monotonic()) if held and timer is not None else None,
        )

    def engine_urls(self) -> dict[str, str]:
        """The engines' URLs this registry recorded (name -> URL; empty: none recorded)."""
        return dict(self._engine_urls)

    @property
    def journal_format(self) -> int:
        return self._journal.format

    def journal_has(self, key: str) -> bool:
        """Read-only: whether a call under `key` is durable in the journal (tests show a lost reply's
        request landed)."""
        return self._journal.lookup(key) is not None

    def journal_stats(self) -> dict[str, int]:
        return {**self._journal.stats(), "replayed_calls": self.recovery.replayed_calls}

    def recovery_report(self) -> RecoveryReport:
        return self.recovery

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._journal.close()

    # ---- test-only fault injection
    def arm_fault(self, point: str, after_events: int = 1, hold_s: float = 30.0, marker: str | None = None) -> None:
        """Hold the next call at `point` (after `after_events` events for mid_batch) for `hold_s`
        seconds, writing this process's pid to `marker` first. Not persisted: a restart disarms it."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; one of {FAULT_POINTS}")
        self._fault = _Fault(point, after_events, hold_s, marker)

    def _maybe_fault(self, point: str, events_done: int = 0) -> None:
        fault = self._fault
        if fault is None or fault.point != point or (point == "mid_batch" and events_done != fault.after_events):
            return
        self._fault = None
        fault.hit()


def _check_identities(events: Sequence[RegistryEvent]) -> None:
    """Where a version's identity enters the registry, it must be inside the name grammar
    (spec/identities.py): a `Reserve` mints the version's managed name and takes a slot, so one outside it
    is refused here with InvalidIdentity, before any event of the call is stepped — nothing is taken,
    nothing journaled. The pure core stays total over any key (the model checker's digests are not hex)."""
    for event in events:
        if isinstance(event, Reserve):
            check_version_identity(event.version, event.digest)


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
    `previous_key_file`/`previous_key_until` (a rotation, `capabilities.KeyRing`) go the same way."""
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
    actor_class: Any = ray.remote(RegistryActor)
    handle = actor_class.options(**actor_options).remote(
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
    "FAULT_POINTS",
    "REGISTRY_ACTOR_NAME",
    "REGISTRY_NAMESPACE",
    "LocalRegistry",
    "OperationsView",
    "RayRegistry",
    "RecoveryReport",
    "RegistryCore",
    "RegistryError",
    "create_registry_actor",
    "find_registry_actor",
    "new_key",
    "recorded_epoch",
]
