"""The trainer-facing API: connect once, then publish, reclaim and run sessions, without building a protocol object.

    from versioned_lora import connect

    async with await connect(address="auto", token_file="engine.token", probe_prompt=PROBE_IDS) as deployment:
        result = await deployment.publish("step-1", peft_model, wait_for_slot_s=60)
        sessions = deployment.sessions()

`connect` finds the registry actor by name (or, given `journal=`, starts it: `start_registry`), reads the engines'
URLs the registry recorded (or takes `engines=`), and wires what the CLI used to wire by hand: one `SGLangClient`
and one staging port per engine, the probe check, the Publisher, the Reclaimer, one dispatch gate. `publish` takes
a live PEFT model, a PEFT adapter directory or a `Snapshot`, and answers a `PublishResult` whose `outcome` is one of
`Outcome`'s four; it logs each phase on the ``versioned_lora`` logger. Unless `auto_reclaim=False`, a background
task reclaims every version the registry says may go (RETIRED with no session ref left, or a reclaim not finished),
woken by the `ReclaimEligible` effects of this process's session closes and otherwise every `reclaim_interval_s`.
`Sessions` is the session side: one constructor behind which sit the SessionBinder, the dispatch gate and the
SGLang backend; a `Session` generates, takes tool turns and finishes once.

Everything the command line does (`versioned_lora/ops/commands.py`) goes through this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from versioned_lora.adapters.ray_registry import (
    REGISTRY_ACTOR_NAME,
    REGISTRY_NAMESPACE,
    RayRegistry,
    create_registry_actor,
    recorded_epoch,
)
from versioned_lora.adapters.registry_core import OperationsView
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import BackendFailure, BackendResponse, OutcomeUnknown
from versioned_lora.runtime.publisher import DEFAULT_HOLDER, DEFAULT_LEASE_TTL_S, PublishOutcome, PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimOutcome
from versioned_lora.runtime.session_binder import CloseReport
from versioned_lora.spec.states import VersionState

if TYPE_CHECKING:
    from versioned_lora.adapters.engine_staging import EngineStaging
    from versioned_lora.adapters.snapshot import Snapshot
    from versioned_lora.runtime.dispatch_gate import DispatchGate
    from versioned_lora.runtime.publisher import Publisher
    from versioned_lora.runtime.reclaimer import Reclaimer
    from versioned_lora.runtime.session_binder import SessionBinder

logger = logging.getLogger("versioned_lora")

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
DEFAULT_CLIENT_TIMEOUT_S = 600.0
ENGINE_NAMES = tuple(f"E{i}" for i in range(64))  # the registry's names of engines given as a list of URLs


class DeploymentError(Exception):
    """The deployment cannot be reached or is not what the caller says (no registry of that name, a token file
    missing, engine URLs that do not match the registry's engines, no probe to check a publication with)."""


class InvalidSource(ValueError):
    """What was given to `publish` is not a publishable adapter (no PEFT files, a version id outside the grammar).
    Its message starts with the underlying error's type (`SnapshotError: ...`, `InvalidIdentity: ...`)."""


# ---------------------------------------------------------------- outcomes


class Outcome(StrEnum):
    """How a publication ended, as a trainer acts on it."""

    COMMITTED = "COMMITTED"  # the version is published (the default for new sessions)
    REFUSED = "REFUSED"  # refused before anything was staged; `code` says why (e.g. CAPACITY_ERROR, LEASE_HELD)
    FAILED_CLEAN = "FAILED_CLEAN"  # aborted and cleaned on every engine; the slot is free, publish again
    UNKNOWN = "UNKNOWN"  # not known yet; `resolve` says how to settle it; no next publication starts before


RESOLVE = {
    "COMMIT_OUTCOME_UNKNOWN": "the same commit is being retried in the background: await deployment.resolve() "
                              "(or run `versioned-lora resolve --holder <this holder>`)",
    "RESERVE_OUTCOME_UNKNOWN": "publish the same version id with the same content again (the same reserve), "
                               "or await deployment.resolve()",
    "LEASE_OUTCOME_UNKNOWN": "nothing was reserved: publish again",
    "COMMIT_UNRESOLVED": "an earlier commit's outcome is not known yet: await deployment.resolve(), then publish",
}
DEFAULT_RESOLVE = "await deployment.resolve() (or run `versioned-lora resolve`) until it reports the version settled"


@attrs.frozen
class PublishResult:
    """The typed outcome of `Deployment.publish`. `status` is the publisher's own word (COMMITTED, REJECTED,
    FAILED_CLEAN, UNKNOWN, or REPLAYED for a version id and content reserved before); `outcome` folds it into the
    four a trainer acts on."""

    outcome: Outcome
    version_id: str
    epoch: int
    status: str
    code: str | None = None  # REFUSED: the refusal code; UNKNOWN: which call's answer is missing
    resolve: str | None = None  # UNKNOWN: how to settle it
    lora_name: str | None = None
    attempt_token: str | None = None
    default_revision: int | None = None
    version_state: str | None = None
    phases: Mapping[str, float] = attrs.field(factory=dict)
    detail: str = ""
    waited_s: float = 0.0  # time spent waiting for a free slot (`wait_for_slot_s`)
    # COMMITTED, but the probe could not tell this version from the previous default (AgreementProbeCheck.indistinct):
    # not a refusal (the manifest's digest proved the bytes); a longer or more specific probe would tell them apart.
    warning: str | None = None

    @property
    def committed(self) -> bool:
        return self.outcome is Outcome.COMMITTED

    @classmethod
    def of(cls, outcome: PublishOutcome, waited_s: float = 0.0) -> PublishResult:
        status, state = outcome.status, outcome.version_state
        code, kind = outcome.reason, Outcome.UNKNOWN
        if status is PublishStatus.COMMITTED:
            kind = Outcome.COMMITTED
        elif status is PublishStatus.REJECTED:
            kind = Outcome.REFUSED if outcome.reason not in RESOLVE else Outcome.UNKNOWN
        elif status is PublishStatus.FAILED_CLEAN:
            kind = Outcome.FAILED_CLEAN
        elif status is PublishStatus.REPLAYED:  # published before under this id and content: where is it now?
            code = "REPLAYED"
            if state is VersionState.PUBLISHED:
                kind = Outcome.COMMITTED
            elif state is VersionState.FAILED_CLEAN:
                kind = Outcome.FAILED_CLEAN
            elif state in (VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED):
                kind = Outcome.REFUSED
        resolve = RESOLVE.get(code or "", DEFAULT_RESOLVE) if kind is Outcome.UNKNOWN else None
        return cls(kind, outcome.version.version_id, outcome.version.epoch, str(status), code, resolve,
                   outcome.lora_name, outcome.attempt_token, outcome.default_revision,
                   None if state is None else str(state), dict(outcome.phases), outcome.detail, waited_s)


@attrs.frozen
class ReclaimResult:
    version_id: str
    status: str  # RECLAIMED, REJECTED (e.g. NOT_RECLAIMABLE), PENDING (reclaim again), UNKNOWN (reclaim again)
    reason: str | None
    reclaim_id: str | None
    confirmed: tuple[str, ...]
    seconds: float

    @classmethod
    def of(cls, outcome: ReclaimOutcome) -> ReclaimResult:
        return cls(outcome.version.version_id, str(outcome.status), outcome.reason, outcome.reclaim_id,
                   tuple(outcome.confirmed), outcome.seconds)


@attrs.frozen
class Resolved:
    """One line of `Deployment.resolve`: what was settled (or is still not) and how."""

    version_id: str  # "*" for an engine-wide line
    action: str
    status: str
    reason: str | None

    @property
    def settled(self) -> bool:
        return self.status in ("COMMITTED", "FAILED_CLEAN", "RECLAIMED", "REHYDRATED")


# ---------------------------------------------------------------- the registry


@attrs.frozen
class RegistryInfo:
    """Where a registry runs and what it was started with."""

    address: str  # the Ray cluster's GCS address: what every other process passes as `address`
    name: str
    namespace: str
    epoch: int
    engines: Mapping[str, str]  # engine name -> URL, as the registry recorded them
    journal: str
    detached: bool


def ensure_ray(address: str | None = "auto") -> str:
    """Join the Ray cluster at `address` ("auto": the one on this host; None: start a small local one) unless this
    process joined one already; the cluster's GCS address."""
    import ray

    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    return str(ray.get_runtime_context().gcs_address)


def engine_map(engines: Mapping[str, str] | Sequence[str] | str | None) -> dict[str, str]:
    """Engine name -> URL from a mapping, a list of URLs (named E0, E1, ...), or "NAME=URL,..." / "URL,..."."""
    if engines is None:
        return {}
    if isinstance(engines, Mapping):
        return {str(k): str(v) for k, v in engines.items()}
    items = [e for e in (engines.split(",") if isinstance(engines, str) else engines) if e]
    named = [item.partition("=") if "=" in item.split("://", 1)[0] else ("", "", item) for item in items]
    if any(name for name, _, _ in named) and not all(name for name, _, _ in named):
        raise ValueError(f"name every engine or none: {items}")
    return {name or ENGINE_NAMES[index]: url for index, (name, _, url) in enumerate(named)}


def _positional(engines: Mapping[str, str] | Sequence[str] | str) -> bool:
    """Whether `engines` lists URLs without names (in the registry's engine order)."""
    if isinstance(engines, Mapping):
        return False
    items = engines.split(",") if isinstance(engines, str) else list(engines)
    return not any("=" in item.split("://", 1)[0] for item in items)


def start_registry(
    journal: str | os.PathLike[str],
    engines: Mapping[str, str] | Sequence[str] | str,
    *,
    key_file: str | os.PathLike[str] | None = None,
    capacity: int = 2,
    epoch: int | None = None,
    address: str | None = "auto",
    name: str = REGISTRY_ACTOR_NAME,
    namespace: str = REGISTRY_NAMESPACE,
    detached: bool = True,
    options: dict[str, Any] | None = None,
) -> RegistryInfo:
    """Start the registry actor (or find it, if one of that name runs) over `journal`, recording the engines' URLs.

    `detached=True` (the default): the actor outlives this process and every handle; it runs until
    `stop_registry` (or the cluster ends). With `detached=False` the actor lives only as long as this process's
    driver holds the cluster connection: the caller must keep this process alive (the CLI's foreground mode).

    `epoch`: the deployment epoch every version id and session key of this journal carries. Default: the journal's
    own if it exists (a journal keeps its epoch), else the current Unix time in microseconds: a fresh epoch per
    fresh journal, so a managed name is never reused on an engine that served an older deployment.
    `key_file`: the capability key file the engines were started with (`versioned-lora engine
    --capability-key-file`); the actor reads it in its own process."""
    urls = engine_map(engines)
    if not urls:
        raise ValueError("a registry needs at least one engine")
    gcs = ensure_ray(address)
    path = Path(journal).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    chosen = epoch if epoch is not None else (recorded_epoch(path) or time.time_ns() // 1000)
    handle = create_registry_actor(path, engines=tuple(urls), capacity=capacity, epoch=chosen, name=name,
                          namespace=namespace, detached=detached,
                          capability_key_file=None if key_file is None else Path(key_file).resolve(),
                          engine_urls=urls, options=options)
    if not detached:  # Ray collects a non-detached actor with its last handle: this process keeps one
        _HELD[(namespace, name)] = handle
    return RegistryInfo(gcs, name, namespace, chosen, urls, str(path), detached)


def stop_registry(name: str = REGISTRY_ACTOR_NAME, namespace: str = REGISTRY_NAMESPACE,
                  address: str | None = "auto") -> None:
    """End the registry actor (its journal stays: starting it again recovers every call)."""
    import ray

    ensure_ray(address)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    _HELD.pop((namespace, name), None)


_HELD: dict[tuple[str, str], Any] = {}  # the handles of the non-detached registries this process started


# ---------------------------------------------------------------- sources


def to_snapshot(source: Any, *, adapter_name: str = "default") -> Snapshot:
    """A frozen snapshot of `source`: a `Snapshot` as it is, a PEFT adapter directory (a path), or a live PEFT
    model (its adapter `adapter_name`, copied now: training on afterwards does not change it)."""
    from versioned_lora.adapters.snapshot import (
        Snapshot,
        SnapshotError,
        snapshot_from_adapter_dir,
        snapshot_from_peft_model,
    )

    try:
        if isinstance(source, Snapshot):
            return source
        if isinstance(source, (str, os.PathLike)):
            return snapshot_from_adapter_dir(source)
        if hasattr(source, "peft_config"):
            return snapshot_from_peft_model(source, adapter_name=adapter_name)
    except SnapshotError as exc:
        raise InvalidSource(f"SnapshotError: {exc}") from exc
    raise InvalidSource(f"cannot publish a {type(source).__name__}: give a PEFT model, a PEFT adapter directory "
                        "or a Snapshot")


# ---------------------------------------------------------------- the deployment


PhaseCallback = Callable[[str, str, float], None]  # (version id, phase, seconds)


class Deployment:
    """One connection to a running deployment: the registry actor and its engines. Build it with `connect`."""

    def __init__(
        self,
        registry: RayRegistry,
        epoch: int,
        engines: Mapping[str, str],
        *,
        token: str | None,
        probe: Any,
        probe_prompt: Sequence[int],
        holder: str,
        lease_ttl_s: float,
        snapshots: str | os.PathLike[str] | None,
        bucket_bytes: int,
        deadlines: Deadlines | None,
        on_phase: PhaseCallback | None,
        client_timeout_s: float,
        bucket_deadline_s: float,
    ) -> None:
        from versioned_lora.adapters.engine_staging import EngineStaging
        from versioned_lora.adapters.snapshot_store import SnapshotStore
        from versioned_lora.runtime.dispatch_gate import DispatchGate
        from versioned_lora.runtime.publisher import Publisher
        from versioned_lora.runtime.reclaimer import Reclaimer

        self.registry, self.epoch, self.engines = registry, epoch, dict(engines)
        self.bucket_bytes = bucket_bytes
        self.deadlines = deadlines or Deadlines()
        self.clients = {name: SGLangClient(url, timeout_s=client_timeout_s, token=token)
                        for name, url in self.engines.items()}
        self.ports: dict[str, EngineStaging] = {
            name: EngineStaging(name, client, list(probe_prompt), bucket_deadline_s=bucket_deadline_s)
            for name, client in self.clients.items()}
        self.probe = probe
        self._on_phase = on_phase
        self._publishing: str = ""  # the version id `publish` runs now (the publisher's callback names none)
        self._synced = False
        self._hold_lease = False  # the last publication's outcome is unknown: its holder keeps the lease to finish
        self.snapshots = SnapshotStore(Path(snapshots), bucket_bytes) if snapshots is not None else None
        self.publisher: Publisher = Publisher(registry, self.ports, probe, self.deadlines, on_phase=self._phase,
                                              holder=holder, lease_ttl_s=lease_ttl_s, snapshots=self.snapshots)
        self.gate: DispatchGate = DispatchGate(registry)
        self.reclaimer: Reclaimer = Reclaimer(registry, self.ports, self.deadlines, gate=self.gate)
        self.reclaimed: list[ReclaimResult] = []  # what the reclaim loop did, oldest first
        self._reclaim_task: asyncio.Task[None] | None = None
        self._reclaim_wake = asyncio.Event()
        self._reclaim_lock = asyncio.Lock()
        self._reclaim_interval_s = 0.5

    # ---- lifecycle
    def start_reclaim_loop(self, interval_s: float = 0.5) -> None:
        """Reclaim, in the background, every version the registry lets go (see the module's docstring)."""
        if self._reclaim_task is None:
            self._reclaim_interval_s = interval_s
            self._reclaim_task = asyncio.get_running_loop().create_task(self._reclaim_loop())

    async def close(self) -> None:
        """Stop the reclaim loop, give the publisher lease back (unless a commit's outcome is still unknown: the
        same holder finishes it), close every engine connection."""
        if self._reclaim_task is not None:
            self._reclaim_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reclaim_task
            self._reclaim_task = None
        try:
            if self.publisher.fence is not None and not (self._hold_lease or self.publisher.commit_unresolved):
                await self.publisher.release_lease()
        finally:
            for port in self.ports.values():
                port.close()
            for client in self.clients.values():
                await client.aclose()

    async def __aenter__(self) -> Deployment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- publication
    def _phase(self, _version: str, phase: str, seconds: float) -> None:
        logger.info("publish %s: %s done in %.3f s", self._publishing, phase, seconds)
        if self._on_phase is not None:
            self._on_phase(self._publishing, phase, seconds)

    async def sync_incarnations(self) -> None:
        """Tell the registry each engine's current incarnation (done before the first publication)."""
        await self.publisher.sync_incarnations()
        self._synced = True

    async def take_over_lease(self) -> Any:
        """End whatever publisher lease is live and take it (its holder is known to be gone)."""
        return await self.publisher.acquire_lease(take_over=True)

    def prepare(self, version_id: str, source: Any) -> Any:
        """The candidate `publish` would stage for `source` under `version_id` (a snapshot, its immutable name, its
        buckets), with the probe's reference computed. Raises InvalidSource."""
        from versioned_lora.adapters.engine_link import Candidate
        from versioned_lora.lifecycle import VersionKey
        from versioned_lora.spec.identities import InvalidIdentity, check_version_identity, lora_name

        snapshot = to_snapshot(source)
        version = VersionKey(self.epoch, version_id)
        try:
            check_version_identity(version, snapshot.digest)
        except InvalidIdentity as exc:
            raise InvalidSource(f"InvalidIdentity: {exc}") from exc
        candidate = Candidate.build(lora_name(version, snapshot.digest), snapshot, self.bucket_bytes)
        reference = getattr(self.probe, "reference", None)
        if reference is not None:  # known once the snapshot is frozen: no forward inside the publication's `end`
            reference(candidate)
        return candidate

    async def publish(self, version_id: str, source: Any, *, wait_for_slot_s: float | None = None,
                      candidate: Any = None) -> PublishResult:
        """Publish `source` (a PEFT model, a PEFT adapter directory, or a Snapshot) as version `version_id` of this
        deployment's epoch. With `wait_for_slot_s`, a publication refused for capacity (every slot holds a version
        that sessions still use, or one being reclaimed) waits up to that long for a slot to free (the reclaim loop
        frees them as sessions close) and tries again. Raises InvalidSource for what cannot be published."""
        candidate = candidate if candidate is not None else await asyncio.to_thread(self.prepare, version_id,
                                                                                    source)
        version = candidate_version(self.epoch, version_id)
        if not self._synced:
            await self.sync_incarnations()
        started = time.monotonic()
        deadline = None if wait_for_slot_s is None else started + wait_for_slot_s
        self._publishing = version_id
        logger.info("publish %s: %s, %d bucket(s)", version_id, candidate.lora_name, candidate.bucket_count)
        try:
            while True:
                outcome = await self.publisher.publish(version, candidate)
                if not (outcome.status is PublishStatus.REJECTED and outcome.reason == "CAPACITY_ERROR"
                        and deadline is not None and time.monotonic() < deadline):
                    break
                logger.info("publish %s: no free slot; waiting (%.0f s left)", version_id,
                            deadline - time.monotonic())
                await self._wait_for_slot(deadline)
        finally:
            self._publishing = ""
        result = PublishResult.of(outcome, waited_s=time.monotonic() - started - sum(outcome.phases.values()))
        if result.outcome is Outcome.COMMITTED:
            result = attrs.evolve(result, warning=self._probe_committed(candidate))
            if result.warning:
                logger.warning("publish %s: %s", version_id, result.warning)
        self._hold_lease = result.outcome is Outcome.UNKNOWN
        log = logger.info if result.outcome is Outcome.COMMITTED else logger.warning
        log("publish %s: %s%s%s", version_id, result.outcome, f" {result.code}" if result.code else "",
            f"; to resolve: {result.resolve}" if result.resolve else "")
        return result

    def _probe_committed(self, candidate: Any) -> str | None:
        """Tell the probe check the candidate is the default now; its warning if it could not tell it from the
        previous default (checks that keep no history, like a caller's own callable, have neither)."""
        indistinct = getattr(self.probe, "indistinct", None)
        warning = indistinct(candidate) if indistinct is not None else None
        committed = getattr(self.probe, "committed", None)
        if committed is not None:
            committed(candidate)
        return warning

    async def _wait_for_slot(self, deadline: float) -> None:
        """Until a slot is free or `deadline`: reclaim what is eligible, then wait a little."""
        while time.monotonic() < deadline:
            await self.reclaim_eligible()
            ops: OperationsView = await self.registry.operations_view()
            if ops.occupied < ops.capacity:
                return
            self._reclaim_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reclaim_wake.wait(), min(self._reclaim_interval_s,
                                                                      max(0.0, deadline - time.monotonic())))

    # ---- reclaims
    async def eligible(self) -> list[str]:
        """The version ids the registry lets go now: RETIRED with no session ref, or RECLAIMING (unfinished)."""
        view = await self.registry.publication_view()
        return [key.version_id for key, v in sorted(view.versions.items())
                if key.epoch == self.epoch and (v.state is VersionState.RECLAIMING
                                                or (v.state is VersionState.RETIRED and v.session_refs == 0))]

    async def reclaim(self, version_id: str) -> ReclaimResult:
        """Claim and reclaim one version (again, to finish a PENDING or UNKNOWN one: the same claim key)."""

        async with self._reclaim_lock:
            return await self._reclaim(version_id)

    async def _reclaim(self, version_id: str) -> ReclaimResult:
        from versioned_lora.lifecycle import VersionKey

        result = ReclaimResult.of(await self.reclaimer.reclaim(VersionKey(self.epoch, version_id)))
        logger.info("reclaim %s: %s%s (confirmed by %s, %.2f s)", version_id, result.status,
                    f" {result.reason}" if result.reason else "", ", ".join(result.confirmed) or "none",
                    result.seconds)
        return result

    async def reclaim_eligible(self) -> list[ReclaimResult]:
        """Reclaim every version the registry lets go now (read under the same lock as the reclaims: the loop and a
        wait for a slot never claim one version twice on the strength of one stale read)."""
        async with self._reclaim_lock:
            results = [await self._reclaim(version_id) for version_id in await self.eligible()]
        self.reclaimed.extend(results)
        return results

    def reclaim_soon(self) -> None:
        """Wake the reclaim loop (a session close reported ReclaimEligible)."""
        self._reclaim_wake.set()

    async def _reclaim_loop(self) -> None:
        while True:
            try:
                await self.reclaim_eligible()
            except asyncio.CancelledError:
                raise
            except Exception:  # a registry or an engine unreachable for now: the next round tries again
                logger.warning("reclaim loop: round failed; trying again", exc_info=True)
            self._reclaim_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reclaim_wake.wait(), self._reclaim_interval_s)

    async def wait_reclaimed(self, version_ids: Sequence[str], timeout_s: float) -> bool:
        """Until every one of `version_ids` is RECLAIMED (True), or `timeout_s` passed (False)."""
        from versioned_lora.lifecycle import VersionKey

        deadline = time.monotonic() + timeout_s
        keys = [VersionKey(self.epoch, v) for v in version_ids]
        while True:
            states = await self.registry.version_states(keys)
            if all(states.get(k) is VersionState.RECLAIMED for k in keys):
                return True
            if time.monotonic() >= deadline:
                return False
            if self._reclaim_task is None:
                await self.reclaim_eligible()
            await asyncio.sleep(0.1)

    # ---- settling unknown outcomes
    async def resolve(self) -> list[Resolved]:
        """Settle what unknown outcomes left, under the same keys: each engine's incarnation reported (with a
        snapshot store, restarted engines rehydrated from it), pending publication attempts recovered (committed if
        READY everywhere, else aborted and cleaned), every unfinished reclaim claimed again."""
        from versioned_lora.runtime.supervisor import ReconcileStatus, RestartSupervisor

        lines: list[Resolved] = []
        self._hold_lease = False
        if self.snapshots is None:
            await self.sync_incarnations()
        else:
            for reconciled in await RestartSupervisor(self.publisher).reconcile_all():
                action = f"rehydrate {reconciled.engine}"
                if reconciled.status is not ReconcileStatus.RECONCILED:
                    lines.append(Resolved("*", action, str(reconciled.status), reconciled.reason))
                lines.extend(Resolved(key.version_id, action, "REHYDRATED", None) for key in reconciled.rehydrated)
                lines.extend(Resolved(key.version_id, action, "REHYDRATE_FAILED", why)
                             for key, why in reconciled.failed)
            self._synced = True
        for outcome in await self.publisher.recover():
            lines.append(Resolved(outcome.version.version_id, "publication", str(outcome.status), outcome.reason))
        view = await self.registry.publication_view()
        for key, version in sorted(view.versions.items()):
            if version.state is VersionState.RECLAIMING:
                reclaimed = await self.reclaim(key.version_id)
                lines.append(Resolved(key.version_id, "reclaim", reclaimed.status, reclaimed.reason))
        return lines

    @property
    def commit_unresolved(self) -> bool:
        return self.publisher.commit_unresolved

    # ---- reading
    async def status(self, all_versions: bool = False) -> dict[str, Any]:
        """The rows `versioned-lora status` shows: versions, placements, reclaims, engines, what blocks (live
        versions and the last few ended ones; `all_versions`: every version the registry still records)."""
        from versioned_lora.ops.status_view import gather_status

        return await gather_status(self.registry, self.clients, all_versions)

    async def default_version(self) -> str | None:
        view = await self.registry.publication_view()
        return None if view.default is None else view.default.version_id

    # ---- sessions
    def sessions(self, *, shard: int | None = None, route: Callable[[Any], int] | None = None,
                 cleanup: Any = None) -> Sessions:
        """A session service over this deployment (its registry, engines and dispatch gate); each call a new
        shard, unless named (a shard must be unique within the epoch: see `Sessions`)."""
        return Sessions(self, shard=shard, route=route, cleanup=cleanup)


def candidate_version(epoch: int, version_id: str) -> Any:
    from versioned_lora.lifecycle import VersionKey

    return VersionKey(epoch, version_id)


def read_token(token_file: str | os.PathLike[str] | None) -> str | None:
    if token_file is None:
        return None
    path = Path(token_file)
    if not path.is_file():
        raise DeploymentError(f"token file {path} does not exist")
    return path.read_text().strip()


def probe_check(probe_prompt: Sequence[int], *, reference_model: str | os.PathLike[str] | None = None,
                top_logit: float | None = None, ulps: float | None = None, dtype: str = "bfloat16") -> Any:
    """The check every engine's loaded candidate must pass before its READY counts (adapters/probe_check.py): by
    default the engines' teacher-forced scores of `probe_prompt` must agree with each other within `ulps` units in
    the last place of `dtype` at the top-logit magnitude `top_logit` (no model needed anywhere); with
    `reference_model` (a base model directory, for small models and tests) they must agree with a transformers +
    PEFT forward of the same snapshot, at the top logit that forward measures."""
    from versioned_lora.adapters.probe_check import DEFAULT_TOP_LOGIT, PROBE_ULPS, AgreementProbeCheck

    if len(probe_prompt) < 2:
        raise DeploymentError("a probe needs at least two token ids: each is scored after the ones before it")
    ulps = PROBE_ULPS if ulps is None else ulps
    if reference_model is None:
        try:
            return AgreementProbeCheck(DEFAULT_TOP_LOGIT if top_logit is None else top_logit, dtype, ulps)
        except ValueError as exc:
            raise DeploymentError(str(exc)) from exc
    from versioned_lora.adapters.reference_forward import ReferenceModel, ReferenceProbeCheck

    return ReferenceProbeCheck(ReferenceModel(Path(reference_model)), probe_prompt, ulps, dtype)


DEFAULT_PROBE_PROMPT = tuple(range(10, 30))  # 20 ids, inside any vocabulary


async def connect(
    *,
    address: str | None = "auto",
    registry: str = REGISTRY_ACTOR_NAME,
    namespace: str = REGISTRY_NAMESPACE,
    engines: Mapping[str, str] | Sequence[str] | str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    token: str | None = None,
    journal: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
    capacity: int = 2,
    epoch: int | None = None,
    probe: Any = None,
    probe_prompt: Sequence[int] = DEFAULT_PROBE_PROMPT,
    probe_top_logit: float | None = None,
    probe_ulps: float | None = None,
    reference_model: str | os.PathLike[str] | None = None,
    holder: str = DEFAULT_HOLDER,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    snapshots: str | os.PathLike[str] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    auto_reclaim: bool = True,
    reclaim_interval_s: float = 0.5,
    deadlines: Deadlines | None = None,
    on_phase: PhaseCallback | None = None,
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
    bucket_deadline_s: float = 60.0,
) -> Deployment:
    """Connect to a deployment: join Ray at `address`, find the registry actor `registry` in `namespace` (given a
    `journal`, start it first: `start_registry(journal, engines, key_file=, capacity=, epoch=)`), and reach the
    engines at the URLs the registry recorded (or `engines`: a list in the registry's engine order, or
    name -> URL). `token_file` (or `token`): the engines' managed-endpoint token; needed to publish and reclaim.

    The probe check that every engine's loaded candidate must pass (`probe_check`): by default the engines' scores
    of `probe_prompt` (token ids in the served model's vocabulary: choose them for a real model) must agree with
    each other within `probe_ulps` at the top-logit magnitude `probe_top_logit`; with `reference_model` (a base
    model directory) they must agree with a forward of it; or `probe`, a callable `(candidate, receipt) -> bool`.
    `holder`: this publisher's name for the publisher lease (one publisher at a time). `snapshots`: a
    snapshot-store directory (every committed version written there, what rehydrates read). `auto_reclaim`:
    start the reclaim loop now."""
    ensure_ray(address)
    if journal is not None:
        if engines is None:
            raise ValueError("starting a registry (journal=...) needs the engines' URLs")
        start_registry(journal, engines, key_file=key_file, capacity=capacity, epoch=epoch, address=address,
                       name=registry, namespace=namespace)
    try:
        found = RayRegistry.find(registry, namespace, retry_deadline_s=10.0)
    except ValueError as exc:  # ray.get_actor: no actor of that name in that namespace
        raise DeploymentError(f"no registry actor {registry!r} in namespace {namespace!r}: {exc}") from exc
    view = await found.publication_view()
    ops = await found.operations_view()
    urls = engine_map(engines) if engines is not None else await found.engine_urls()
    if not urls:
        raise DeploymentError(f"registry {registry!r} recorded no engine URLs: pass engines=[URL, ...] (in its "
                              f"engine order: {', '.join(view.engines)})")
    if engines is not None and _positional(engines):
        if len(urls) != len(view.engines):
            raise DeploymentError(f"engines gives {len(urls)} URL(s); the registry has {len(view.engines)} engines "
                                  f"({', '.join(view.engines)})")
        urls = dict(zip(view.engines, urls.values(), strict=True))
    if set(urls) != set(view.engines):
        raise DeploymentError(f"engines {sorted(urls)} are not the registry's ({', '.join(view.engines)})")
    if probe is None:
        probe = probe_check(probe_prompt, reference_model=reference_model, top_logit=probe_top_logit, ulps=probe_ulps)
    deployment = Deployment(
        found, ops.epoch, {name: urls[name] for name in view.engines},
        token=token if token is not None else read_token(token_file), probe=probe, probe_prompt=probe_prompt,
        holder=holder, lease_ttl_s=lease_ttl_s, snapshots=snapshots, bucket_bytes=bucket_bytes,
        deadlines=deadlines, on_phase=on_phase, client_timeout_s=client_timeout_s,
        bucket_deadline_s=bucket_deadline_s)
    if auto_reclaim:
        deployment.start_reclaim_loop(reclaim_interval_s)
    return deployment


# ---------------------------------------------------------------- sessions


class Session:
    """One agentic session: its first generation binds it to the default version, and every later one (after tool
    turns) carries the same version. `finish` closes it once (releasing its ref: a retired version becomes
    reclaimable when its last session finishes)."""

    def __init__(self, sessions: Sessions, session_id: str, prompt: Sequence[int]) -> None:
        self._sessions, self.session_id = sessions, session_id
        self.key = sessions.binder.open(session_id)
        self.tokens: list[int] = list(prompt)  # prompt, every generation, every tool result
        self.version_id: str | None = None
        self.lora_name: str | None = None
        self.lora_names: set[str] = set()  # every name this session's requests carried (exactly one)
        self._turn = 0

    async def generate(self, max_new_tokens: int = 16, *, sampling: Mapping[str, Any] | None = None,
                       max_retries: int = 2) -> list[int]:
        """Generate from the session's tokens so far; the output is appended and returned. A known failure is
        retried as a new attempt; an attempt whose outcome is unknown is first ended on the engine (never sent
        twice), then retried."""
        binder = self._sessions.binder
        turn, self._turn = self._turn, self._turn + 1
        for attempt in range(max_retries + 1):
            rid = f"{self.session_id}/t{turn}/a{attempt}"
            binding = await binder.bind_first(self.key)
            self.version_id, self.lora_name = binding.version.version_id, binding.lora_path
            self.lora_names.add(binding.lora_path)
            try:
                response: BackendResponse = await binder.generate(self.key, self.tokens, max_new_tokens,
                                                                  sampling=sampling, rid=rid)
            except BackendFailure:
                if attempt == max_retries:
                    raise
                continue
            except OutcomeUnknown:
                await binder.resolve_unknown(self.key, rid)
                if attempt == max_retries:
                    raise
                continue
            self.tokens.extend(response.output_ids)
            return list(response.output_ids)
        raise AssertionError("unreachable")

    def tool_result(self, tokens: Sequence[int]) -> None:
        """A tool turn: the tool's output joins the session's tokens (the next generation reads it)."""
        self.tokens.extend(tokens)

    async def finish(self) -> CloseReport:
        """Close the session once (concurrent or repeated calls share that close)."""
        return await self._sessions.binder.finish(self.key)


class Sessions:
    """The session side of a deployment behind one constructor: a SessionBinder over the engines (SGLang
    backend, requests sticky per session), sharing the deployment's dispatch gate; every close that makes a
    version reclaimable wakes the deployment's reclaim loop.

    `shard`: unique to this object's lifetime within the epoch (the registry refuses a session key it closed
    before); default: a random one of 2**31."""

    def __init__(self, deployment: Deployment, *, shard: int | None = None, route: Callable[[Any], int] | None = None,
                 cleanup: Any = None) -> None:
        from versioned_lora.adapters.sglang_backend import SGLangBackend, sticky_by_session
        from versioned_lora.runtime.session_binder import SessionBinder

        self.deployment = deployment
        self.shard = shard if shard is not None else random.randrange(2**31)
        self.backend = SGLangBackend(list(deployment.clients.values()),
                                     route=route or sticky_by_session(len(deployment.clients)),
                                     names=list(deployment.clients))
        self.binder: SessionBinder = SessionBinder(
            deployment.registry, self.backend, epoch=deployment.epoch, shard=self.shard, gate=deployment.gate,
            cleanup=cleanup, on_effects=self._effects, deadlines=deployment.deadlines)
        self._count = 0

    def _effects(self, effects: tuple[Any, ...]) -> None:
        from versioned_lora.lifecycle.effects import ReclaimEligible

        if any(isinstance(effect, ReclaimEligible) for effect in effects):
            self.deployment.reclaim_soon()

    def open(self, prompt: Sequence[int] = (), session_id: str | None = None) -> Session:
        """A new session (no version chosen until its first generation)."""
        self._count += 1
        return Session(self, session_id or f"s{self.shard}-{self._count}", prompt)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "REGISTRY_ACTOR_NAME",
    "REGISTRY_NAMESPACE",
    "Deployment",
    "DeploymentError",
    "InvalidSource",
    "Outcome",
    "PublishResult",
    "ReclaimResult",
    "RegistryInfo",
    "Resolved",
    "Session",
    "Sessions",
    "connect",
    "engine_map",
    "ensure_ray",
    "start_registry",
    "stop_registry",
    "to_snapshot",
]
