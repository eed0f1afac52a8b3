"""The restart supervisor: brings a restarted engine back by carrying out the registry's answer to its new
incarnation (RFC §3.4, failures; DESIGN.md §3, "Managed adapter x engine").

An engine that restarts holds nothing. Reporting its new incarnation (`EngineRestarted`, row `restart.new`)
makes the registry stop counting its old READY placements (from then on no request for a version goes there
before the version is READY there again: routing reads `lifecycle.queries.servable_on`) and answers with what
the engine is owed: a `StageOnEngine` for each version it must hold (the default and every version sessions
still use, each a rehydrate attempt; and the pending attempt of a publication in flight), a `CleanupOnEngine`
for each cleanup it had not confirmed, a `ReclaimOnEngine` for each reclaim it had not confirmed.

The supervisor decides none of this, and decides nothing by hand about it either: it runs the supervise driver
(`spec/drivers.py`, machines `supervise` and `rehydrate`), whose rows say what follows each answer, lost reply and
deadline; this module carries out its commands:

* `ReadIncarnation`: the engine port's `incarnation()`;
* `Submit`: `EngineRestarted` under one key per engine and incarnation (reconciling again is answered from the
  journal, with the same attempts);
* `ViewPlacement`: the registry's placement of a version owed (READY there already: nothing is staged twice);
* `Rehydrate`: `Publisher.stage_order` without a candidate: the stage driver, from the snapshot store by the digest
  the registry's order names, so it works in any process, whether or not the one that published the versions is
  alive.

What the answer names for other drivers is left to them, and `Reconciled.left` says so: a `StageOnEngine` of an
attempt this process's Publisher is staging itself (`Publisher.staging`, the driver's `own`: that publication's
own begin reaches the new incarnation, the link rebuilt on STALE_INCARNATION, or fails and is aborted; a second
stager of the same attempt would race it), and the cleanups and reclaims, which `Publisher.recover` (the same
abort, whose answer names the cleanup) and `Reclaimer.reclaim` (the same claim) finish under their own rows.

A rehydrate that fails (the snapshot missing or corrupt in the store, the engine refusing) leaves the placement
short of READY (as the registry has it), so the engine gets no request for that version; reconciling again stages
it again.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

import attrs

from versioned_lora.lifecycle import RegistryEffect, VersionKey, drivers
from versioned_lora.lifecycle.drivers import (
    Answer,
    DriverInput,
    Lost,
    ReadIncarnation,
    Refusal,
    Rehydrate,
    ViewPlacement,
)
from versioned_lora.runtime.driver_loop import DriverLoop
from versioned_lora.runtime.interfaces import EngineUnreachable, RegistryUnavailable
from versioned_lora.runtime.publisher import Publisher

logger = logging.getLogger(__name__)


class ReconcileStatus(StrEnum):
    RECONCILED = "RECONCILED"  # the incarnation adopted; `rehydrated` READY there, `failed` not
    REJECTED = "REJECTED"  # nothing was adopted (the engine did not answer, or restarted again): reconcile again
    UNKNOWN = "UNKNOWN"  # the adoption may have landed, its answer did not come in time: nothing was staged


@attrs.frozen
class Reconciled:
    """What one `reconcile` did for one engine."""

    engine: str
    incarnation: int  # the engine's, as read (-1: it did not answer)
    rehydrated: tuple[VersionKey, ...] = ()  # READY on the engine now (or already were)
    failed: tuple[tuple[VersionKey, str], ...] = ()  # (version, why): not READY there, no request routed
    left: tuple[RegistryEffect, ...] = ()  # for other drivers: its own Publisher's stage, cleanups, reclaims
    status: ReconcileStatus = ReconcileStatus.RECONCILED
    reason: str | None = None


class RestartSupervisor:
    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.last_loop: DriverLoop | None = None  # the last run's driver (its fired rows, for tests and logs)

    async def reconcile(self, engine: str) -> Reconciled:
        """Report `engine`'s current incarnation and rehydrate every version the registry's answer stages there."""
        details: dict[VersionKey, str] = {}  # why each failed rehydrate failed, in words (the row has its kind)

        async def perform(command: Any) -> DriverInput:
            """The supervise driver's own calls (driver_loop runs its registry calls and timers, and turns a port's
            RegistryUnavailable or EngineUnreachable into Lost)."""
            if isinstance(command, ReadIncarnation):
                return Answer(command.call, await self.publisher.engines[command.engine].incarnation())
            if isinstance(command, ViewPlacement):
                view = await self.publisher.registry.publication_view()
                return Answer(command.call, view.versions[command.version].placements[command.engine].state)
            assert isinstance(command, Rehydrate), command
            try:
                await self.publisher.stage_order(command.order)
            except Exception as exc:  # the store, the engine, the probe (a certain failure), or unreachable
                details[command.order.version] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, (RegistryUnavailable, EngineUnreachable)):
                    return Lost(command.call)
                return Refusal(command.call, type(exc).__name__)
            return Answer(command.call, True)

        deadlines = self.publisher.deadlines
        loop = DriverLoop(drivers.supervise(engine, self.publisher.staging), self.publisher.registry,
                          self.publisher.engines, lambda name: float(getattr(deadlines, name)), perform=perform)
        self.last_loop = loop
        report = await loop.finished()
        state = loop.state
        assert isinstance(state, drivers.SuperviseState)
        failed = tuple((version, details.get(version, why)) for version, why in drivers.failed_rehydrates(state))
        for version, why in failed:
            logger.warning("rehydrate of %s on %s failed: %s", version, engine, why)
        return Reconciled(engine, state.incarnation, drivers.rehydrated_versions(state), failed, state.left,
                          ReconcileStatus(report.outcome), report.reason)

    async def reconcile_all(self) -> list[Reconciled]:
        return [await self.reconcile(engine) for engine in self.publisher.engines]
