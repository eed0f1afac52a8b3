"""Reclaimer: claim → reclaim on every engine the claim names → confirm each → RECLAIMED (RFC §5).

The registry decides which version may be reclaimed and which engines must unload it; the reclaim
driver (`spec/drivers.py`, machines `reclaim` and `reclaim_engine`) decides what to do with every answer,
lost reply and deadline; this module only runs that driver (`runtime.driver_loop`) and turns its report
into a `ReclaimOutcome`. Given the process's `DispatchGate`, it tells the gate when a claim landed, so the
sessions of this process stop dispatching the version at once, not within the gate's staleness window. A
claim whose reply is lost past its deadline may have landed: nothing is sent to any engine on the strength
of it, and calling `reclaim` again retries the same claim key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import attrs

from versioned_lora.lifecycle import VersionKey, drivers
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.dispatch_gate import DispatchGate
from versioned_lora.runtime.driver_loop import DriverLoop
from versioned_lora.runtime.interfaces import RegistryPort, StagingEnginePort


class ReclaimStatus(StrEnum):
    RECLAIMED = "RECLAIMED"  # every engine confirmed: the slot is free
    REJECTED = "REJECTED"  # the registry refused the claim (`reason`, e.g. NOT_RECLAIMABLE): nothing was unloaded
    PENDING = "PENDING"  # claimed; some engine has not confirmed yet (reclaim again to finish)
    UNKNOWN = "UNKNOWN"  # the claim's reply was lost past its deadline: nothing was sent to any engine


CLAIM_OUTCOME_UNKNOWN = "CLAIM_OUTCOME_UNKNOWN"  # ReclaimOutcome.reason of UNKNOWN: reclaim again to resolve


@attrs.frozen
class ReclaimOutcome:
    status: ReclaimStatus
    version: VersionKey
    reclaim_id: str | None = None
    confirmed: tuple[str, ...] = ()
    seconds: float = 0.0
    reason: str | None = None


class Reclaimer:
    def __init__(self, registry: RegistryPort, engines: Mapping[str, StagingEnginePort[Any]],
                 deadlines: Deadlines | None = None, gate: DispatchGate | None = None) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.deadlines = deadlines or Deadlines()
        self.gate = gate
        self.last_loop: DriverLoop | None = None  # the last run's driver (its fired rows, for tests and logs)

    async def reclaim(self, version: VersionKey) -> ReclaimOutcome:
        """Claim, then reclaim on exactly the engines the claim's answer names, confirming each. Calling it
        again for the same version retries the same claim key: answered from the journal, it names the
        same engines and reclaim id (engine unloads are idempotent per reclaim id)."""
        started = time.monotonic()
        loop = DriverLoop(drivers.reclaim(version), self.registry, self.engines,
                          lambda name: float(getattr(self.deadlines, name)))
        self.last_loop = loop
        report = await loop.finished()
        state = loop.state
        assert isinstance(state, drivers.ReclaimState)
        status = ReclaimStatus(report.outcome)
        reason = report.reason if status is not ReclaimStatus.UNKNOWN else CLAIM_OUTCOME_UNKNOWN
        if self.gate is not None and status in (ReclaimStatus.RECLAIMED, ReclaimStatus.PENDING):  # the claim landed
            self.gate.claimed(version)
        return ReclaimOutcome(status, version, state.reclaim_id, drivers.confirmed_engines(state),
                              time.monotonic() - started, reason)
