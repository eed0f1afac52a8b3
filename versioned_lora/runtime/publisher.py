"""Publisher: snapshot → reserve → begin on all engines → buckets → end (probe checked) → record ready
→ commit (RFC §3). Reclaimer: claim → reclaim on all engines → confirm each → RECLAIMED (RFC §5).

The registry decides; this module only carries out the effects the registry answers and reports
outcomes back, each report under an idempotency key derived from the attempt, so a retry after a
lost reply (or a registry restart) is answered from the journal. Every phase has a deadline and the
run a maximum no-progress interval; a miss goes through the protocol: abort, cleanup on every
engine, and capacity is freed only once every engine confirmed. An outcome that cannot be confirmed
(an engine that does not answer) is reported UNKNOWN and keeps the slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from versioned_lora.lifecycle import (
    Abort,
    ClaimReclaim,
    Commit,
    ConfirmReclaim,
    EngineRestarted,
    RecordCleaned,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    Rejected,
    Reserve,
    VersionKey,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine, ReclaimOnEngine, StageOnEngine
from versioned_lora.runtime.interfaces import RegistryPort, RegistryUnavailable
from versioned_lora.spec.states import PlacementState, VersionState

logger = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------- ports


class CandidatePort(Protocol):
    """One version as shipped: the adapters' `Candidate` (name, frozen snapshot, bucket plan)."""

    @property
    def lora_name(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def bucket_count(self) -> int: ...


@attrs.frozen
class ReadyReceipt:
    """What an engine's `end` answered: READY_LOCAL plus the probe."""

    lora_name: str
    digest: str
    attempt_token: str
    incarnation: int
    probe_token: int
    probe_logprob: float


class EngineUnreachable(Exception):
    """The engine did not answer (lost reply, dead process): the outcome is unknown."""


class EngineRefused(Exception):
    """The engine certainly refused (a typed error): nothing changed there."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class StagingEnginePort(Protocol):
    """One engine as the publisher sees it (implemented by `adapters.engine_staging`)."""

    name: str

    async def incarnation(self) -> int: ...

    async def begin(self, candidate: CandidatePort, attempt_token: str) -> None: ...

    async def transfer_bucket(self, candidate: CandidatePort, attempt_token: str, index: int) -> None: ...

    async def end(self, candidate: CandidatePort, attempt_token: str) -> ReadyReceipt: ...

    async def cleanup(self, lora_name: str, attempt_token: str) -> None: ...

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float) -> bool: ...


ProbeCheck = Callable[[CandidatePort, int, float], bool]


# ---------------------------------------------------------------- configuration and outcomes


@attrs.frozen
class Deadlines:
    """Seconds. Fixed before a run (RFC §7.3); `max_no_progress_s` bounds the time between two
    completed steps of one publication, whatever phase it is in."""

    reserve: float = 10.0
    begin: float = 30.0
    bucket: float = 30.0
    end: float = 120.0
    commit: float = 10.0
    cleanup: float = 60.0
    reclaim: float = 600.0
    max_no_progress: float = 120.0


class PhaseDeadlineMissed(Exception):
    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(f"phase {phase} missed its {seconds:.1f}s deadline")
        self.phase = phase


@attrs.frozen
class PublishOutcome:
    """COMMITTED, REJECTED (reason, nothing was sent), FAILED_CLEAN (aborted and cleaned everywhere)
    or UNKNOWN (aborted, some engine's cleanup not confirmed: the slot stays taken)."""

    status: str
    version: VersionKey
    reason: str | None = None
    lora_name: str | None = None
    attempt_token: str | None = None
    default_revision: int | None = None
    phases: Mapping[str, float] = attrs.field(factory=dict)
    detail: str = ""

    @property
    def committed(self) -> bool:
        return self.status == "COMMITTED"


@attrs.frozen
class ReclaimOutcome:
    status: str  # RECLAIMED | NOT_RECLAIMABLE | PENDING (some engine not confirmed yet)
    version: VersionKey
    reclaim_id: str | None = None
    confirmed: tuple[str, ...] = ()
    seconds: float = 0.0


# ---------------------------------------------------------------- publisher


class Publisher:
    def __init__(
        self,
        registry: RegistryPort,
        engines: Mapping[str, StagingEnginePort],
        probe_check: ProbeCheck,
        deadlines: Deadlines | None = None,
        on_phase: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.probe_check = probe_check
        self.deadlines = deadlines or Deadlines()
        self._on_phase = on_phase or (lambda version, phase, seconds: None)
        self._last_progress = time.monotonic()

    # ---- entry points
    async def sync_incarnations(self) -> None:
        """Tell the registry each engine's current incarnation (a restarted engine invalidates its READY
        and, for versions it must hold, yields rehydrate attempts)."""
        for name, engine in self.engines.items():
            incarnation = await engine.incarnation()
            await self.registry.submit(EngineRestarted(name, incarnation), key=f"incarnation:{name}:{incarnation}")

    async def publish(self, version: VersionKey, candidate: CandidatePort) -> PublishOutcome:
        phases: dict[str, float] = {}
        self._last_progress = time.monotonic()
        # A fresh key per publish call: the registry itself makes Reserve idempotent per (version, digest)
        # and answers a replay with where the version is *now*; the key only deduplicates retries of
        # this one call after a lost reply.
        key = f"reserve:{version.epoch}:{version.version_id}:{candidate.digest}:{uuid.uuid4().hex}"
        answer = await self._timed(phases, "reserve", submit_until_known(
            self.registry, Reserve(version, candidate.digest), key, self.deadlines.reserve
        ))
        if isinstance(answer.result, Rejected):
            return PublishOutcome("REJECTED", version, reason=str(answer.result.reason), phases=phases)
        token = answer.result.attempt_token
        if answer.result.state is not VersionState.LOADING:  # an idempotent replay of a finished publication
            return PublishOutcome(str(answer.result.state), version, lora_name=candidate.lora_name,
                                  attempt_token=token, phases=phases)
        stages = [e for e in answer.effects if isinstance(e, StageOnEngine)]
        try:
            await self._stage(version, candidate, token, stages, phases)
            revision = await self._commit(version, token, phases)
        except Exception as exc:  # any miss goes through the protocol: abort and clean up everywhere
            logger.warning("publication of %s failed: %s; aborting", version, exc)
            status = await self.abort_and_clean(version, token, phases)
            return PublishOutcome(status, version, reason=type(exc).__name__, lora_name=candidate.lora_name,
                                  attempt_token=token, phases=phases, detail=str(exc))
        return PublishOutcome("COMMITTED", version, lora_name=candidate.lora_name, attempt_token=token,
                              default_revision=revision, phases=phases)

    async def rehydrate(self, version: VersionKey, candidate: CandidatePort, engine: str) -> None:
        """Stage a version on one restarted engine under the attempt the registry issued for it;
        the default does not move."""
        view = await self.registry.publication_view()
        placement = view.versions[version].placements[engine]
        if placement.state is PlacementState.READY:
            return
        assert placement.attempt_token is not None
        stage = StageOnEngine(engine, version, candidate.lora_name, placement.attempt_token,
                              placement.incarnation, candidate.digest)
        await self._stage(version, candidate, placement.attempt_token, [stage], {})

    # ---- phases
    async def _stage(
        self, version: VersionKey, candidate: CandidatePort, token: str, stages: Sequence[StageOnEngine],
        phases: dict[str, float],
    ) -> None:
        targets = [self.engines[stage.engine] for stage in stages]

        async def begin(engine: StagingEnginePort, stage: StageOnEngine) -> None:
            await engine.begin(candidate, token)
            await self._report(RecordPrepared(version, token, engine.name, stage.incarnation, candidate.digest),
                               f"prepared:{token}:{engine.name}:{stage.incarnation}")

        await self._timed(phases, "begin", settle_all([begin(e, s) for e, s in zip(targets, stages, strict=True)]))
        for index in range(candidate.bucket_count):
            # Bucket i completes on every target before bucket i+1 starts.
            await self._timed(phases, f"bucket_{index}", settle_all(
                [engine.transfer_bucket(candidate, token, index) for engine in targets]
            ))

        async def end(engine: StagingEnginePort) -> None:
            # Each engine's READY is recorded as soon as it is known (sessions keep binding the old
            # default meanwhile: commit needs READY from every target).
            receipt = await engine.end(candidate, token)
            if not self.probe_check(candidate, receipt.probe_token, receipt.probe_logprob):
                raise EngineRefused("PROBE_MISMATCH", f"{engine.name}: probe {receipt.probe_token}/"
                                    f"{receipt.probe_logprob:.5f} differs from the reference forward")
            answer = await self._report(
                RecordReady(version, token, engine.name, receipt.incarnation, receipt.digest),
                f"ready:{token}:{engine.name}:{receipt.incarnation}",
            )
            if isinstance(answer.result, Rejected):
                raise EngineRefused(str(answer.result.reason), f"registry refused READY from {engine.name}")

        await self._timed(phases, "end", settle_all([end(engine) for engine in targets]))

    async def _commit(self, version: VersionKey, token: str, phases: dict[str, float]) -> int:
        view = await self.registry.publication_view()
        expected = view.default_revision
        # The key names the revision it expects: a retry after a lost reply is answered from the
        # journal; no new publication starts before this answer is known.
        answer = await self._timed(phases, "commit", submit_until_known(
            self.registry, Commit(version, token, expected), f"commit:{token}:{expected}", self.deadlines.commit
        ))
        if isinstance(answer.result, Rejected):
            raise EngineRefused(str(answer.result.reason), "commit refused")
        return int(answer.result.receipt.default_revision)

    async def abort_and_clean(self, version: VersionKey, token: str, phases: dict[str, float]) -> str:
        answer = await self._report(Abort(version, token), f"abort:{token}")
        cleanups = [e for e in answer.effects if isinstance(e, CleanupOnEngine)]
        if not cleanups:  # a replayed abort: ask the registry which engines still need cleaning
            view = await self.registry.publication_view()
            placements = view.versions[version].placements
            cleanups = [CleanupOnEngine(engine, version, view.versions[version].lora_name, token)
                        for engine, p in placements.items()
                        if p.state not in (PlacementState.CLEANED, PlacementState.ABSENT)]
        results = await asyncio.gather(*(self._clean_one(c) for c in cleanups), return_exceptions=True)
        phases["cleanup"] = phases.get("cleanup", 0.0)
        state = (await self.registry.version_states([version])).get(version)
        if state is VersionState.FAILED_CLEAN:
            return "FAILED_CLEAN"
        logger.warning("cleanup of %s not confirmed everywhere: %s", version, results)
        return "UNKNOWN"

    async def _clean_one(self, cleanup: CleanupOnEngine) -> None:
        engine = self.engines[cleanup.engine]
        try:
            await asyncio.wait_for(self._clean_when_idle(engine, cleanup), self.deadlines.cleanup)
        except (EngineUnreachable, TimeoutError):
            await self._report(RecordUnknown(cleanup.version, cleanup.attempt_token, cleanup.engine),
                               f"unknown:{cleanup.attempt_token}:{cleanup.engine}:{time.monotonic_ns()}")
            raise
        await self._report(RecordCleaned(cleanup.version, cleanup.attempt_token, cleanup.engine),
                           f"cleaned:{cleanup.attempt_token}:{cleanup.engine}")

    @staticmethod
    async def _clean_when_idle(engine: StagingEnginePort, cleanup: CleanupOnEngine) -> None:
        # A loaded candidate that a request still holds (its own probe, say) answers IN_USE; nothing is
        # unloaded under a request, so wait for it and ask again (bounded by the cleanup deadline).
        while True:
            try:
                await engine.cleanup(cleanup.lora_name, cleanup.attempt_token)
                return
            except EngineRefused as refused:
                if refused.reason != "IN_USE":
                    raise
                await asyncio.sleep(0.1)

    async def recover(self) -> list[PublishOutcome]:
        """A publisher that crashed mid-attempt is finished by the next one: every attempt still pending
        in the registry is aborted and cleaned (its snapshot died with the crashed publisher; committing
        it would need READY everywhere, which a half-done attempt lacks), an attempt READY everywhere
        is committed."""
        outcomes = []
        view = await self.registry.publication_view()
        for key, version in view.versions.items():
            if version.state is VersionState.LOADING:
                ready = all(p.state is PlacementState.READY for p in version.placements.values())
                if ready:
                    try:
                        revision = await self._commit(key, version.attempt_token, {})
                        outcomes.append(PublishOutcome("COMMITTED", key, lora_name=version.lora_name,
                                                       attempt_token=version.attempt_token, default_revision=revision))
                        continue
                    except EngineRefused:
                        pass
                status = await self.abort_and_clean(key, version.attempt_token, {})
                outcomes.append(PublishOutcome(status, key, lora_name=version.lora_name,
                                               attempt_token=version.attempt_token))
            elif version.state is VersionState.ABORTED:
                status = await self.abort_and_clean(key, version.attempt_token, {})
                outcomes.append(PublishOutcome(status, key, lora_name=version.lora_name,
                                               attempt_token=version.attempt_token))
        return outcomes

    # ---- plumbing
    async def _report(self, event: Any, key: str) -> Any:
        answer = await submit_until_known(self.registry, event, key, self.deadlines.commit)
        self._last_progress = time.monotonic()
        return answer

    async def _timed(self, phases: dict[str, float], phase: str, work: Awaitable[T]) -> T:
        limit = self._phase_limit(phase)
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(work, limit)
        except TimeoutError as exc:
            raise PhaseDeadlineMissed(phase, limit) from exc
        elapsed = time.monotonic() - started
        phases[phase] = elapsed
        self._on_phase("", phase, elapsed)
        self._last_progress = time.monotonic()
        return result

    def _phase_limit(self, phase: str) -> float:
        base = phase.split("_", 1)[0]
        limit = float(getattr(self.deadlines, base))
        # The no-progress bound: never wait past the last progress + max_no_progress.
        remaining = self._last_progress + self.deadlines.max_no_progress - time.monotonic()
        return max(0.0, min(limit, remaining))


async def settle_all(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """Like gather, but every call has finished (or failed) before the first error is raised: a phase
    that failed on one engine never leaves the other engine's work racing the cleanup that follows."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def submit_until_known(registry: RegistryPort, event: Any, key: str, deadline_s: float) -> Any:
    """Submit, and after a lost reply submit again under the same key until the answer is known: the
    registry answers a replayed key from its journal, so the event is applied at most once."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return await registry.submit(event, key=key)
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------- reclaimer


class Reclaimer:
    def __init__(self, registry: RegistryPort, engines: Mapping[str, StagingEnginePort],
                 deadlines: Deadlines | None = None) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.deadlines = deadlines or Deadlines()

    async def reclaim(self, version: VersionKey) -> ReclaimOutcome:
        started = time.monotonic()
        answer = await submit_until_known(self.registry, ClaimReclaim(version),
                                          f"claim:{version.epoch}:{version.version_id}", self.deadlines.commit)
        if isinstance(answer.result, Rejected):
            return ReclaimOutcome(str(answer.result.reason), version)
        reclaim_id = answer.result.reclaim_id
        orders = [e for e in answer.effects if isinstance(e, ReclaimOnEngine)]
        if not orders:  # a replayed claim: every engine not yet confirmed
            view = await self.registry.publication_view()
            lora_name = view.versions[version].lora_name
            orders = [ReclaimOnEngine(engine, version, lora_name, reclaim_id) for engine in self.engines]
        done = await asyncio.gather(*(self._reclaim_one(order) for order in orders), return_exceptions=True)
        confirmed = tuple(order.engine for order, ok in zip(orders, done, strict=True) if ok is True)
        state = (await self.registry.version_states([version])).get(version)
        status = "RECLAIMED" if state is VersionState.RECLAIMED else "PENDING"
        return ReclaimOutcome(status, version, reclaim_id, confirmed, time.monotonic() - started)

    async def _reclaim_one(self, order: ReclaimOnEngine) -> bool:
        engine = self.engines[order.engine]
        # The engine unregisters at once, waits for SGLang's native refcount, unloads once; we poll the
        # same idempotent call (same reclaim id) until it reports UNLOADED.
        deadline = time.monotonic() + self.deadlines.reclaim
        while not await engine.reclaim(order.lora_name, order.reclaim_id, wait_s=5.0):
            if time.monotonic() > deadline:
                raise PhaseDeadlineMissed("reclaim", self.deadlines.reclaim)
        await submit_until_known(self.registry, ConfirmReclaim(order.version, order.engine, order.reclaim_id),
                                 f"confirm:{order.reclaim_id}:{order.engine}", self.deadlines.commit)
        return True

