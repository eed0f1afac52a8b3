"""Publisher: snapshot → reserve → begin on all engines → buckets → end (probe checked) → record ready
→ commit (RFC §3). The Reclaimer is `runtime.reclaimer`; the ports both drive are in `runtime.interfaces`.

The registry decides, and the driver machines of `spec/drivers.py` decide what follows each answer: the stage
driver (reserve, begin, buckets, end, probe, READY) and the settle driver (commit, or abort and cleanup) run
in `runtime.driver_loop`, and this module only starts them and turns their reports into a `PublishOutcome`.
Every report to the registry goes under an idempotency key derived from the attempt, so a retry after a
lost reply (or a registry restart) is answered from the journal. Every phase has a deadline and the
run a maximum no-progress interval. What follows a miss depends on whether the missed call may have
landed (DESIGN.md §1, RFC §3.4):

* a staging call (begin, bucket, end) or a report before commit that failed or missed its deadline:
  the version is certainly not committed, so the attempt is aborted, and the registry's abort answer
  names the engines to clean; capacity is freed only once every engine confirmed;
* a commit whose reply was lost or whose deadline fired: the commit may have landed. That is an
  unknown outcome. Nothing is aborted or cleaned; the same commit (same idempotency key) is retried in
  the background until the registry answers, and no next publication starts before it has;
* an abort, claim or confirm whose reply is lost past its deadline: unknown too; nothing is cleaned
  or reclaimed on the strength of it. Retrying the same call (`recover`, `reclaim`) resolves it.

Cleanups and reclaims are only ever the effects of the registry's own answer (an abort row, a claim
row), never derived from a read of the registry's view.

A publisher given a snapshot store (`snapshots`, `interfaces.SnapshotStorePort`) writes each candidate there
while the engines stage it and sends the commit only once it is written (a store that cannot take it fails the
attempt before the commit), so every version the registry may serve can be rehydrated from the store by any
publisher later, the one that published it alive or not (`rehydrate` without a candidate); `recover` commits a
crashed publisher's attempt only if the store holds it.

One publisher at a time (RFC §3): every publication runs under the registry's publisher lease. `publish`
acquires it (the holder asking again renews it) before it reserves, renews it while the publication runs,
and its Reserve and Commit carry the lease's fence; a publisher refused the lease is refused before reserve
(REJECTED, LEASE_HELD), and one whose lease expired or was taken over meanwhile has its Reserve or Commit
refused by the registry (NOT_LEASE_HOLDER; an attempt whose commit is refused so is aborted and cleaned).
The lease is not released after a publication (the next one reuses it); it expires `lease_ttl_s` after the
last renewal, or `release_lease` ends it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Any, TypeVar

import attrs

from versioned_lora.lifecycle import (
    EngineRestarted,
    LeaseGranted,
    Rejected,
    ReleaseLease,
    VersionKey,
    drivers,
)
from versioned_lora.lifecycle.effects import StageOnEngine
from versioned_lora.lifecycle.results import Committed, Reserved
from versioned_lora.runtime.deadlines import Deadlines, PhaseDeadlineMissed, submit_until_known
from versioned_lora.runtime.driver_loop import DriverLoop
from versioned_lora.runtime.interfaces import (
    CandidatePort,
    EngineRefused,
    EngineUnreachable,
    ProbeCheck,
    ReadyReceipt,
    RegistryPort,
    RegistryUnavailable,
    SnapshotStorePort,
    StagingEnginePort,
)
from versioned_lora.runtime.served_check import served_refusal
from versioned_lora.spec.drivers import DriverOutcome, Input
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import VersionState

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The publisher lease's holder name when the caller names none: one logical publisher per deployment, so a
# restarted trainer's publisher takes its own lease back at once (lease.acquire_replay). A second publisher
# (the CLI, another job) names itself otherwise and is refused while this one holds the lease.
DEFAULT_HOLDER = "publisher"
DEFAULT_LEASE_TTL_S = 60.0


# ---------------------------------------------------------------- outcomes


class NameMismatch(Exception):
    """The registry reserved another lora_name than the candidate carries: nothing is staged under it."""


# How one `publish` (or `recover`) ended, as the caller sees it: the publish driver's own outcome, one type (no
# conversion), of the values COMMITTED (the version is the default); REJECTED (refused before anything was staged,
# `reason` says why: nothing to clean); FAILED_CLEAN (aborted, and every engine confirmed its cleanup: the slot is
# free); UNKNOWN (not known yet: a commit that may have landed, being resolved by retrying the same commit, an abort or
# reserve whose reply was lost, or a cleanup some engine has not confirmed: the slot stays taken and no next
# publication starts until the outcome is known); REPLAYED (the same version and content was reserved before:
# `version_state` says where it is).
PublishStatus = DriverOutcome


class UnknownReason(StrEnum):
    """Why an outcome is UNKNOWN: which call may have landed without its answer reaching the publisher."""

    RESERVE_OUTCOME_UNKNOWN = "RESERVE_OUTCOME_UNKNOWN"  # publish the same content again: the same reserve
    LEASE_OUTCOME_UNKNOWN = "LEASE_OUTCOME_UNKNOWN"  # the lease's acquire got no answer: nothing was reserved
    COMMIT_OUTCOME_UNKNOWN = "COMMIT_OUTCOME_UNKNOWN"  # being retried in the background: see Publisher.resolve


class PublisherRefusal(StrEnum):
    """Refusals decided by the publisher itself, before any call reaches the registry."""

    COMMIT_UNRESOLVED = "COMMIT_UNRESOLVED"  # a previous commit's outcome is not known yet (RFC §3.4)
    # The candidate's lora_name is not the one its version and digest name (spec.identities.lora_name),
    # or not the one the registry reserved: requests would carry a name the registry does not serve.
    NAME_MISMATCH = "NAME_MISMATCH"
    # The probe check refused an engine's loaded candidate (adapters/probe_check.py): the attempt is aborted.
    PROBE_MISMATCH = "PROBE_MISMATCH"
    # An engine's read-back of its own LoRA pool differs from the snapshot (runtime/served_check.py): the digest
    # (SERVED_DIGEST_MISMATCH) or the config it loaded (SERVED_CONFIG_MISMATCH); those codes are `ServedRefusal`'s.


def failure_reason(why: BaseException) -> str:
    """A failed publication's `reason`: the refusal's code where an engine or the publisher refused, typed
    (`EngineRefused.reason`: PROBE_MISMATCH, MANIFEST_MISMATCH, PROTOCOL_MISMATCH, ...), else what went wrong
    (PhaseDeadlineMissed, EngineUnreachable, an exception of the snapshot store): a caller acts on the code."""
    return why.reason if isinstance(why, EngineRefused) else type(why).__name__


@attrs.frozen
class PublishOutcome:
    status: PublishStatus
    version: VersionKey
    reason: str | None = None
    lora_name: str | None = None
    attempt_token: str | None = None
    default_revision: int | None = None
    phases: Mapping[str, float] = attrs.field(factory=dict)
    detail: str = ""
    version_state: VersionState | None = None  # REPLAYED: the version's state in the registry

    @property
    def committed(self) -> bool:
        return self.status is PublishStatus.COMMITTED


# ---------------------------------------------------------------- publisher


class Publisher:
    def __init__(
        self,
        registry: RegistryPort,
        engines: Mapping[str, StagingEnginePort[Any]],
        probe_check: ProbeCheck,
        deadlines: Deadlines | None = None,
        on_phase: Callable[[str, str, float], None] | None = None,
        *,
        holder: str = DEFAULT_HOLDER,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        snapshots: SnapshotStorePort | None = None,
        state: drivers.PublisherState | None = None,
    ) -> None:
        self.registry = registry
        # What this publisher carries from one publication to the next (the reserves left unknown, by content): a
        # driver state, so every key is derived from it and from what the rows read (two publishers given the same
        # state send the same calls).
        self.state = state or drivers.PublisherState()
        # Where every version this publisher commits is written first, so that any publisher can rehydrate it
        # after this one is gone (None: rehydrates need the caller's candidate).
        self.snapshots = snapshots
        self.holder, self.lease_ttl_s = holder, lease_ttl_s
        self.fence: int | None = None  # the publisher lease's fence this publisher was granted last (None: none)
        self.engines = dict(engines)
        self.probe_check = probe_check
        self.deadlines = deadlines or Deadlines()
        self._on_phase = on_phase or (lambda version, phase, seconds: None)
        self._last_progress = time.monotonic()
        # The last commit, run as a task of its own so that neither a deadline nor the caller's
        # cancellation ends it before the registry answered (RFC §3.4: resolved by the same commit).
        self._commit_task: asyncio.Future[PublishOutcome] | None = None
        # The last settle drivers this publisher ran, newest last (their fired rows say what decided an
        # outcome); bounded: a long job publishes thousands of versions.
        self.settle_loops: deque[DriverLoop] = deque(maxlen=16)
        self._staging: set[str] = set()  # attempt tokens `publish` is staging now
        self._armed: dict[str, tuple[float, str]] = {}  # deadline name -> (seconds, bound) last armed

    # ---- entry points
    async def sync_incarnations(self) -> None:
        """Tell the registry each engine's current incarnation, and stage nothing: a restarted engine's READY stops
        counting (no request goes there) until `supervisor.RestartSupervisor` (or `rehydrate`) stages what the
        registry's answer names. The same key as the supervisor's report, so its answer is the journal's."""
        for name in self.engines:
            incarnation = await self.engines[name].incarnation()
            await submit_until_known(self.registry, EngineRestarted(name, incarnation),
                                     drivers.restarted_key(name, incarnation), self.deadlines.report)

    @property
    def staging(self) -> frozenset[str]:
        """The attempt tokens this publisher stages itself now (in `publish`): nobody else should stage them."""
        return frozenset(self._staging)

    @property
    def commit_unresolved(self) -> bool:
        """True while a commit whose reply was lost is still being resolved (no publication may start)."""
        return self._commit_task is not None and not self._commit_task.done()

    async def resolve(self) -> PublishOutcome | None:
        """The outcome of this publisher's last commit, once known (None if it never committed): an unresolved
        commit is retried under its own key until the registry answers; it is never aborted."""
        if self._commit_task is None:
            return None
        return await asyncio.shield(self._commit_task)

    async def publish(self, version: VersionKey, candidate: CandidatePort) -> PublishOutcome:
        if self.commit_unresolved:
            return PublishOutcome(PublishStatus.REJECTED, version, reason=PublisherRefusal.COMMIT_UNRESOLVED,
                                  detail="a previous commit's outcome is not known yet; see Publisher.resolve")
        if candidate.lora_name != lora_name(version, candidate.digest):
            return PublishOutcome(PublishStatus.REJECTED, version, reason=PublisherRefusal.NAME_MISMATCH,
                                  detail=f"{candidate.lora_name!r} != {lora_name(version, candidate.digest)!r}")
        phases: dict[str, float] = {}
        self._last_progress = time.monotonic()
        keeper = self._keeper()  # renews the lease while this publication runs
        try:
            lease = await self._lease(version, keeper, phases)
            if isinstance(lease, PublishOutcome):
                return lease
            return await self._publish(version, candidate, lease, phases)
        finally:  # (a keeper that already ended has no task left to read the Cancel: nothing happens)
            if self.commit_unresolved and self._commit_task is not None:
                # The commit is still being resolved under this fence: keep the lease until it is answered.
                self._commit_task.add_done_callback(lambda _: keeper.cancel())
            else:
                keeper.cancel()

    async def _publish(self, version: VersionKey, candidate: CandidatePort, fence: int,
                       phases: dict[str, float]) -> PublishOutcome:
        """Run the publish driver (spec/drivers.py, machine `publish`): the stage driver, the snapshot store's
        write, then the settle driver's commit, or its abort and cleanup, as the rows decide. Here its three calls
        are carried out, and its outcome is told as a PublishOutcome with what each call saw."""
        # Written while the engines stage (a file write of the whole adapter), finished before the commit is sent:
        # a version the registry may serve is always in the store. Content-addressed, so a retry rewrites nothing.
        stored: list[asyncio.Future[None]] = []

        def reserved(state: drivers.StageState) -> None:
            if self.snapshots is not None and not stored:
                stored.append(asyncio.ensure_future(asyncio.to_thread(self.snapshots.put_candidate, candidate)))

        stage_loops: list[DriverLoop] = []
        errors: list[Exception] = []  # the stage driver raised (a bug): re-raised to the caller as it was
        failures: list[Exception] = []  # why the bytes could not be stored (the abort's reason)
        settled: list[PublishOutcome] = []

        async def perform(command: Any) -> drivers.DriverInput:
            if isinstance(command, drivers.RunStage):
                start = drivers.publication(command.version, command.digest, command.lora_name,
                                            candidate.bucket_count, command.reserve_key, command.fence)
                try:
                    loop, report = await self._run_stage(start, candidate, phases, on_staging=reserved)
                except Exception as exc:
                    errors.append(exc)
                    raise
                stage_loops.append(loop)
                state = loop.state
                assert isinstance(state, drivers.StageState)
                return drivers.Answer(command.call, drivers.StageResult(report.outcome, state.attempt_token,
                                                                        state.reserve_key))
            if isinstance(command, drivers.WaitStored):
                try:
                    if stored:
                        await self._timed(phases, "store", stored[0])
                except PhaseDeadlineMissed as exc:
                    failures.append(exc)
                    return drivers.Lost(command.call)
                except Exception as exc:  # the write itself failed
                    failures.append(exc)
                    return drivers.Refusal(command.call, type(exc).__name__)
                return drivers.Answer(command.call)
            assert isinstance(command, drivers.SettleAttempt), command
            token = command.attempt.attempt_token
            if command.commit:
                outcome = await self._commit_and_resolve(version, candidate.lora_name, token, phases, fence)
            else:  # rows publish.stage_failed, publish.store_failed, publish.store_lost: certainly not committed
                loop = stage_loops[0]
                state = loop.state
                assert isinstance(state, drivers.StageState)
                why = failures[0] if failures else self._stage_failure(
                    state, loop, loop.answers[0] if loop.answers else None, candidate)
                logger.warning("publication of %s failed before commit: %s; aborting", version, why)
                if stored:
                    await asyncio.gather(stored[0], return_exceptions=True)  # its thread cannot be stopped; let it end
                status = await self.abort_and_clean(version, token, phases)
                outcome = PublishOutcome(status, version, reason=failure_reason(why), lora_name=candidate.lora_name,
                                         attempt_token=token, phases=phases, detail=str(why))
            settled.append(outcome)
            return drivers.Answer(command.call, outcome.status)

        loop = DriverLoop(self.state.publication(version, candidate.digest, candidate.lora_name, fence),
                          self.registry, self.engines, self.seconds, perform=perform)
        try:
            await loop.finished()
        except asyncio.CancelledError:
            loop.cancel()  # row publish.cancel: a staging in flight is cancelled, a commit goes on
            raise
        finally:  # a reserve left unknown is sent again for the same content (rows reserve.deadline, stage_unknown)
            assert isinstance(loop.state, drivers.PublishState)
            self.state = self.state.after(loop.state)
        if settled:
            return settled[0]
        state = loop.state
        assert isinstance(state, drivers.PublishState)
        if errors:  # row publish.stage_lost: the stage driver raised outside its rows (a bug)
            raise errors[0]
        assert stage_loops, loop.fired  # (the stage driver answered: publish.rejected, .replayed or .stage_unknown)
        result = stage_loops[0].answers[0] if stage_loops[0].answers else None  # the reserve's answer, if any
        if state.stage is DriverOutcome.REJECTED:  # row publish.rejected
            assert isinstance(result, Rejected)
            if result.reason is Reason.NOT_LEASE_HOLDER:
                self.fence = None  # expired or taken over since it was granted: the next publish acquires again
            return PublishOutcome(PublishStatus.REJECTED, version, reason=str(result.reason), phases=phases)
        if state.stage is DriverOutcome.REPLAYED:  # row publish.replayed: a finished publication
            assert isinstance(result, Reserved)
            return PublishOutcome(PublishStatus.REPLAYED, version, lora_name=candidate.lora_name,
                                  attempt_token=state.attempt_token, phases=phases, version_state=result.state)
        # Row publish.stage_unknown (the stage driver's reserve.deadline): the reserve may have taken a slot;
        # publishing the same version again retries it under its key (self.state.after kept it).
        assert state.stage is DriverOutcome.UNKNOWN, loop.fired
        phases.pop("reserve", None)  # not completed
        limit, bound = self._armed.get("reserve", (self.deadlines.reserve, "deadline"))
        return PublishOutcome(PublishStatus.UNKNOWN, version, reason=UnknownReason.RESERVE_OUTCOME_UNKNOWN,
                              lora_name=candidate.lora_name, phases=phases,
                              detail=str(PhaseDeadlineMissed("reserve", limit, bound)))

    # ---- the publisher lease: a lease keeper (spec/drivers.py, machine `lease`) acquires and renews it
    async def acquire_lease(self, *, take_over: bool = False) -> LeaseGranted | Rejected:
        """Take the publisher lease, or keep it (the holder asking again renews it: lease.acquire_replay).
        `take_over`: end the live lease at once, whoever holds it (lease.take_over), for an operator who knows its
        holder is gone; the fence taken over is the one the keeper reads from the registry's view first
        (keeper.start), so a lease that moved on meanwhile is not ended (lease.take_over_moved). Nothing renews it
        afterwards (a publication keeps its own keeper). Raises PhaseDeadlineMissed when the answer did not come within
        its deadline (`Deadlines.acquire`, however long this publisher was idle)."""
        keeper = self._keeper(take_over)
        try:
            return await self._lease_answer(keeper)
        finally:
            keeper.cancel()

    async def release_lease(self) -> None:
        """End this publisher's lease now (another publisher may acquire it at once). Nothing if it holds none."""
        if self.fence is not None:
            fence, self.fence = self.fence, None
            await self.registry.submit(ReleaseLease(self.holder, fence))

    def _keeper(self, take_over: bool = False) -> DriverLoop:
        # The acquire's key is derived from the fence the keeper reads first (drivers.acquire_key).
        state = drivers.keep_lease(self.holder, self.lease_ttl_s, take_over)
        return DriverLoop(state, self.registry, {}, self._lease_seconds, on_step=self._lease_step)

    def _lease_seconds(self, deadline: str) -> float:
        """A keeper's timers: its renewal period, a third of the lease's ttl; the acquire's, its own deadline."""
        return self.lease_ttl_s / 3 if deadline == drivers.RENEW_PERIOD else self.seconds(deadline)

    def _lease_step(self, before: Any, after: Any) -> None:
        if isinstance(after, drivers.LeaseState) and drivers.lease_lost(after) and not drivers.lease_lost(before):
            logger.warning("publisher lease (fence %d) lost: expired or taken over", after.fence)
            if self.fence == after.fence:
                self.fence = None  # the next publish acquires again

    async def _lease_answer(self, keeper: DriverLoop) -> LeaseGranted | Rejected:
        """The acquire's answer, once the keeper reported it (LEASED or REJECTED); PhaseDeadlineMissed if unknown."""
        report = await keeper.reported()
        reply = keeper.answer_of(drivers.Call("acquire"))
        if report.outcome is DriverOutcome.UNKNOWN or reply is None:  # acquire.deadline / acquire.cancel
            raise PhaseDeadlineMissed("lease", self.deadlines.acquire)
        result = reply.result
        assert isinstance(result, (LeaseGranted, Rejected)), result
        if isinstance(result, LeaseGranted):
            self.fence = result.fence
        return result

    async def _lease(self, version: VersionKey, keeper: DriverLoop, phases: dict[str, float]) -> int | PublishOutcome:
        """The fence this publication runs under, or the outcome that ends it before any reserve."""
        try:
            result = await self._lease_answer(keeper)
        except PhaseDeadlineMissed as exc:
            return PublishOutcome(PublishStatus.UNKNOWN, version, reason=UnknownReason.LEASE_OUTCOME_UNKNOWN,
                                  phases=phases, detail=str(exc))
        if isinstance(result, Rejected):
            return PublishOutcome(PublishStatus.REJECTED, version, reason=str(result.reason), phases=phases,
                                  detail=f"the publisher lease is held by another publisher ({result.row})")
        return result.fence

    async def rehydrate(self, version: VersionKey, candidate: CandidatePort | None, engine: str) -> None:
        """Stage a version on one restarted engine under the attempt the registry issued for it (its placement
        there, read from the view: the caller names the version); the default does not move. Without a candidate,
        the bytes are read from the snapshot store. `supervisor.RestartSupervisor` is the way to bring an engine
        back: it stages exactly what the registry's answer to the new incarnation names, and nothing READY there
        already (rows `placement.*`); this is the same staging for a caller that holds the candidate."""
        view = await self.registry.publication_view()
        held = view.versions[version]
        placement = held.placements[engine]
        if placement.attempt_token is None:
            raise ValueError(f"{version} has no attempt on {engine} to stage (placement {placement.state})")
        await self.stage_order(StageOnEngine(engine, version, held.lora_name, placement.attempt_token,
                                             placement.incarnation, held.digest), candidate)

    async def stage_order(self, order: StageOnEngine, candidate: CandidatePort | None = None) -> None:
        """Run the stage driver for one attempt the registry issued (a rehydrate: `begin` at once, row
        stage.start) on `order.engine`. Without a candidate, the version's bytes are read from the snapshot store
        by the order's digest (verified on read): a publisher that never saw the version can rehydrate it. Raises
        why it failed."""
        if candidate is None:
            candidate = await self._stored_candidate(order.digest, order.lora_name)
        self._last_progress = time.monotonic()  # a staging is a run of its own: its calls get their deadlines
        loop, report = await self._run_stage(drivers.stage(order.version, order.attempt_token,
                                                           candidate.bucket_count, (order,)), candidate, {})
        if report.outcome is not DriverOutcome.STAGED:
            state = loop.state
            assert isinstance(state, drivers.StageState)
            raise self._stage_failure(state, loop, candidate=candidate)

    async def _stored_candidate(self, digest: str, lora_name: str) -> CandidatePort:
        if self.snapshots is None:
            raise ValueError("rehydrate without a candidate needs a snapshot store (Publisher(snapshots=...))")
        candidate: CandidatePort = await asyncio.to_thread(self.snapshots.candidate, digest, lora_name)
        return candidate

    # ---- phases
    async def _run_stage(
        self, start: drivers.StageState, candidate: CandidatePort, phases: dict[str, float],
        on_staging: Callable[[drivers.StageState], None] | None = None,
    ) -> tuple[DriverLoop, drivers.Report]:
        """Run the stage driver (spec/drivers.py, rows `reserve.*`, `stage.*` and the per-engine rows): a
        publication's reserve, then `begin` and PREPARED on every engine, each bucket on every engine before the
        next goes to any (RFC §3.2), then `end`, the probe check and READY per engine. Each engine's READY is
        recorded as soon as it is known (sessions keep binding the old default meanwhile: commit needs READY from
        every target). The phases that completed are timed into `phases`; `on_staging` is told once the attempt
        is known and staging starts."""
        marks = {"at": time.monotonic()}

        def on_step(before: drivers.StageState, after: drivers.StageState) -> None:
            now = time.monotonic()
            if after != before:
                self._last_progress = now
            if drivers.staging_started(before, after):
                self._staging.add(after.attempt_token)
                if on_staging is not None:
                    on_staging(after)
            label = drivers.stage_phase_completed(before, after)
            if label is not None:
                phases[label] = now - marks["at"]
                self._on_phase("", label, phases[label])
            if drivers.stage_phase_moved(before, after):
                marks["at"] = now

        def probe(receipt: ReadyReceipt) -> bool | drivers.CheckRefused:
            # What the engine serves first (its read-back of its own LoRA pool), then the probe: a candidate the
            # engine does not serve exactly is refused for that, whatever its probe says.
            return served_refusal(candidate.served_identity(), receipt) or self.probe_check(candidate, receipt)

        loop = DriverLoop(start, self.registry, self.engines, self.seconds, candidate=candidate, probe_check=probe,
                          on_step=on_step)
        try:
            report = await loop.finished()
        except asyncio.CancelledError:
            loop.cancel()  # rows reserve.cancel / stage.cancel: calls in flight end; `recover` settles the attempt
            raise
        finally:
            state = loop.state
            assert isinstance(state, drivers.StageState)
            self._staging.discard(state.attempt_token)
        return loop, report

    def _stage_failure(self, state: drivers.StageState, loop: DriverLoop, reserved: Any = None,
                       candidate: CandidatePort | None = None) -> Exception:
        """The exception that tells the caller why staging failed: the first failed engine's (by name), or the
        reserve's answer that could not be staged (row reserve.unstageable)."""
        failed_engines = drivers.failed_engines(state)
        if not failed_engines:
            name = getattr(reserved, "lora_name", None)
            return NameMismatch(f"registry reserved {name!r} on {len(state.engines)} engines, candidate is "
                                f"{getattr(candidate, 'lora_name', None)!r}")
        name = failed_engines[0]
        failed = state.engines[name]
        failure = failed.failure
        assert failure is not None
        said = loop.failures.get(drivers.Call(failure.op, name), "")
        if failure.kind is Input.DEADLINE:
            limit, bound = self._armed.get(STAGE_DEADLINE[failure.op], (0.0, "deadline"))
            seconds = self.deadlines.max_no_progress if bound == "max_no_progress" else limit
            return PhaseDeadlineMissed(drivers.stage_phase(state, failure.op), seconds, bound)
        if failure.kind is Input.LOST:
            return EngineUnreachable(f"{name}: {failure.op}: {said or 'no answer'}")
        if failure.op == "probe" and failure.reason is not None:
            # The served check's typed refusal (runtime/served_check.py): its message names both sides.
            return EngineRefused(failure.reason, f"{name}: {said}")
        if failure.op == "probe":
            # Where the scores differ and the rule they broke, where the check can say it (adapters/probe_check.py).
            explain = getattr(self.probe_check, "explain", None)
            said = explain(candidate, failed.receipt) if explain is not None and candidate is not None else ""
            return EngineRefused(PublisherRefusal.PROBE_MISMATCH, f"{name}: the probe check refused the loaded "
                                 f"candidate: {said or 'its probe differs'}")
        assert failure.reason is not None
        if failure.op in ("prepared", "ready"):
            said = f"registry refused {failure.op.upper()} from {name}: {failure.reason}"
        return EngineRefused(failure.reason, said or f"{name}: {failure.op} refused: {failure.reason}")

    async def _commit_and_resolve(
        self, version: VersionKey, lora_name: str | None, token: str, phases: dict[str, float], fence: int
    ) -> PublishOutcome:
        """Commit under a key derived from the attempt and the revision it expects, through the settle driver
        (spec/drivers.py): it reads the revision the commit expects, then commits; a commit whose deadline fires (or
        whose caller is cancelled) is reported UNKNOWN and retried under the same key until the registry answers; it
        is never aborted. A read that never came back aborts (row revision.deadline: no commit was sent)."""
        started = time.monotonic()
        loop = self._settle(drivers.settle(version, token, commit=True, fence=fence))

        async def final() -> PublishOutcome:
            report = await loop.finished()
            self._last_progress = time.monotonic()
            return self._outcome(report, version, lora_name, token, phases, loop)

        self._commit_task = asyncio.ensure_future(final())
        try:
            await loop.reported()
        except asyncio.CancelledError:
            loop.cancel()  # the caller gave up: row commit.cancel (the commit itself goes on)
            raise
        state = loop.state
        assert isinstance(state, drivers.SettleState)
        if not loop.done:  # reported before its terminal phase: rows commit.deadline / commit.cancel (UNKNOWN)
            limit, key = self.seconds("commit"), drivers.commit_key(state)
            logger.warning("commit of %s missed its %.1fs deadline: outcome unknown, resolving by retrying %s",
                           version, limit, key)
            return PublishOutcome(PublishStatus.UNKNOWN, version, reason=UnknownReason.COMMIT_OUTCOME_UNKNOWN,
                                  lora_name=lora_name, attempt_token=token, phases=phases,
                                  detail=f"commit missed its {limit:.1f}s deadline; retrying {key!r} until answered")
        phases["commit"] = time.monotonic() - started
        self._on_phase("", "commit", phases["commit"])
        return await asyncio.shield(self._commit_task)

    async def abort_and_clean(self, version: VersionKey, token: str, phases: dict[str, float]) -> PublishStatus:
        """Abort the attempt and clean exactly what the registry's answer names, through the settle driver. A
        refused abort (the version was committed, or another attempt is live) cleans nothing; so does an abort
        whose reply is lost past its deadline (it may have landed: `recover` retries the same key)."""
        loop = self._settle(drivers.settle(version, token, commit=False))
        report = await loop.finished()
        phases["cleanup"] = phases.get("cleanup", 0.0)
        if report.outcome is not DriverOutcome.FAILED_CLEAN:
            logger.warning("abort of %s: %s (%s); rows %s", version, report.outcome, report.reason, loop.fired)
        return report.outcome

    def _settle(self, state: drivers.SettleState) -> DriverLoop:
        loop = DriverLoop(state, self.registry, self.engines, self.seconds)
        self.settle_loops.append(loop)
        return loop

    def seconds(self, deadline: str) -> float:
        """A driver timer's seconds: the named deadline; staging's and the commit's are capped by the run's
        no-progress bound (the bound covers staging and the commit, not the abort and cleanup that follow a
        missed phase). The last bound armed per deadline is kept, to say which one fired."""
        if deadline in ("reserve", "begin", "bucket", "end", "commit"):
            self._armed[deadline] = self._phase_limit(deadline)
            return self._armed[deadline][0]
        self._armed[deadline] = (float(getattr(self.deadlines, deadline)), "deadline")
        return self._armed[deadline][0]

    @staticmethod
    def _outcome(report: drivers.Report, version: VersionKey, lora_name: str | None, token: str,
                 phases: dict[str, float], loop: DriverLoop) -> PublishOutcome:
        receipt = next((r for r in loop.answers if isinstance(r, Committed)), None)
        return PublishOutcome(report.outcome, version, reason=report.reason, lora_name=lora_name,
                              attempt_token=token, phases=phases,
                              default_revision=None if receipt is None else int(receipt.receipt.default_revision),
                              detail="commit refused" if report.reason else "")

    async def recover(self) -> list[PublishOutcome]:
        """A publisher that crashed mid-attempt is finished by the next one: the recover driver (spec/drivers.py,
        machine `recover`) reads the registry's versions, and for the attempt pending there (at most one) takes the
        publisher lease (only its holder finishes it) and settles it by the settle driver: a LOADING attempt whose
        bytes the snapshot store holds (every one, without a store) is committed (the commit lands if it is READY
        everywhere; otherwise the registry refuses it and the settle driver aborts it and cleans what the answer
        names); an ABORTED one, or a LOADING one the store lacks, is aborted (again) under its abort key. An
        unresolved commit of this publisher is resolved first."""
        self._last_progress = time.monotonic()  # a recovery is a run of its own: its commit gets its deadline
        outcomes = []
        if self.commit_unresolved:
            resolved = await self.resolve()
            assert resolved is not None
            outcomes.append(resolved)
        settled: list[PublishOutcome] = []

        async def perform(command: Any) -> drivers.DriverInput:
            if isinstance(command, drivers.ViewPending):
                view = await self.registry.publication_view()
                return drivers.Answer(command.call, tuple(
                    drivers.PendingAttempt(key, v.state, v.attempt_token, v.lora_name,
                                           self.snapshots is None or self.snapshots.holds(v.digest))
                    for key, v in sorted(view.versions.items())))
            if isinstance(command, drivers.TakeLease):
                try:
                    lease = await self.acquire_lease()
                except PhaseDeadlineMissed:
                    return drivers.Lost(command.call)
                if isinstance(lease, Rejected):
                    return drivers.Refusal(command.call, str(lease.reason))
                return drivers.Answer(command.call, lease)
            assert isinstance(command, drivers.SettleAttempt), command
            a = command.attempt
            if command.commit:
                outcome = await self._commit_and_resolve(a.version, a.lora_name, a.attempt_token, {}, command.fence)
            else:
                outcome = PublishOutcome(await self.abort_and_clean(a.version, a.attempt_token, {}), a.version,
                                         lora_name=a.lora_name, attempt_token=a.attempt_token)
            settled.append(outcome)
            return drivers.Answer(command.call, outcome.status)

        loop = DriverLoop(drivers.recover(), self.registry, self.engines, self.seconds, perform=perform)
        report = await loop.finished()
        state = loop.state
        assert isinstance(state, drivers.RecoverState)
        a = state.attempt
        if a is None and report.outcome is not DriverOutcome.RECOVERED:
            raise RegistryUnavailable("recover: the registry's versions could not be read; nothing was done")
        if a is not None and report.outcome is DriverOutcome.REJECTED:  # the lease is another publisher's
            return [*outcomes, PublishOutcome(PublishStatus.REJECTED, a.version, reason=report.reason,
                                              lora_name=a.lora_name, attempt_token=a.attempt_token,
                                              detail="left as it is: another publisher holds the lease")]
        if a is not None and not settled:
            raise RegistryUnavailable(f"recover: {report.outcome} before {a.version} was settled (the lease's "
                                      "answer lost, or the caller gone); nothing was settled")
        return [*outcomes, *settled]

    # ---- plumbing
    async def _timed(self, phases: dict[str, float], phase: str, work: Awaitable[T]) -> T:
        limit, bound = self._phase_limit(phase)
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(work, limit)
        except TimeoutError as exc:
            if bound == "max_no_progress":
                raise PhaseDeadlineMissed(phase, self.deadlines.max_no_progress, bound) from exc
            raise PhaseDeadlineMissed(phase, limit) from exc
        elapsed = time.monotonic() - started
        phases[phase] = elapsed
        self._on_phase("", phase, elapsed)
        self._last_progress = time.monotonic()
        return result

    def _phase_limit(self, phase: str) -> tuple[float, str]:
        """Seconds to wait for `phase`, and which bound that is: its own deadline or the no-progress bound
        (never wait past the last progress + max_no_progress)."""
        base = phase.split("_", 1)[0]
        limit = float(getattr(self.deadlines, base))
        remaining = max(0.0, self._last_progress + self.deadlines.max_no_progress - time.monotonic())
        return (limit, "deadline") if limit <= remaining else (remaining, "max_no_progress")


# A staging call's deadline (a `Deadlines` field).
STAGE_DEADLINE = {"begin": "begin", "prepared": "report", "bucket": "bucket", "end": "end", "probe": "end",
                  "ready": "report"}
