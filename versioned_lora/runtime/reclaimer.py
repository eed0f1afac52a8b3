"""Reclaimer: claim → reclaim on every engine the claim names → confirm each → RECLAIMED (RFC §5).

The registry decides which version may be reclaimed and which engines must unload it; this module carries
out exactly the effects of the registry's claim answer and reports each engine's receipt under a key
derived from the reclaim id, so a retry after a lost reply is answered from the journal. A claim whose
reply is lost past its deadline may have landed: nothing is sent to any engine on the strength of it, and
calling `reclaim` again retries the same claim key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import attrs

from versioned_lora.lifecycle import ClaimReclaim, ConfirmReclaim, Rejected, VersionKey
from versioned_lora.lifecycle.effects import ReclaimOnEngine
from versioned_lora.runtime.deadlines import Deadlines, PhaseDeadlineMissed, submit_until_known
from versioned_lora.runtime.interfaces import RegistryPort, RegistryUnavailable, StagingEnginePort
from versioned_lora.spec.states import VersionState


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
                 deadlines: Deadlines | None = None) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.deadlines = deadlines or Deadlines()

    async def reclaim(self, version: VersionKey) -> ReclaimOutcome:
        """Claim, then reclaim on exactly the engines the claim's answer names, confirming each. Calling it
        again for the same version retries the same claim key: answered from the journal, it names the
        same engines and reclaim id (engine unloads are idempotent per reclaim id)."""
        started = time.monotonic()
        key = f"claim:{version.epoch}:{version.version_id}"
        try:
            answer = await submit_until_known(self.registry, ClaimReclaim(version), key, self.deadlines.commit)
        except RegistryUnavailable:
            # The claim may have landed: nothing is sent to any engine on the strength of it.
            return ReclaimOutcome(ReclaimStatus.UNKNOWN, version, seconds=time.monotonic() - started,
                                  reason=CLAIM_OUTCOME_UNKNOWN)
        if isinstance(answer.result, Rejected):
            return ReclaimOutcome(ReclaimStatus.REJECTED, version, reason=str(answer.result.reason),
                                  seconds=time.monotonic() - started)
        reclaim_id = answer.result.reclaim_id
        orders = [(effect, answer.capability_of(index)) for index, effect in enumerate(answer.effects)
                  if isinstance(effect, ReclaimOnEngine)]
        done = await asyncio.gather(*(self._reclaim_one(order, capability) for order, capability in orders),
                                    return_exceptions=True)
        confirmed = tuple(order.engine for (order, _), ok in zip(orders, done, strict=True) if ok is True)
        try:
            state = (await self.registry.version_states([version])).get(version)
        except RegistryUnavailable:
            state = None
        status = ReclaimStatus.RECLAIMED if state is VersionState.RECLAIMED else ReclaimStatus.PENDING
        return ReclaimOutcome(status, version, reclaim_id, confirmed, time.monotonic() - started)

    async def _reclaim_one(self, order: ReclaimOnEngine, capability: str | None) -> bool:
        engine = self.engines[order.engine]
        # The engine unregisters at once, waits for SGLang's native refcount, unloads once; we poll the
        # same idempotent call (same reclaim id) until it reports UNLOADED.
        # The deadline bounds the whole phase on this engine, calls in flight included: a call cut off by it
        # may still have unloaded (its effect is idempotent per reclaim id), so the engine simply stays
        # unconfirmed, the slot stays taken, and the next `reclaim` asks again.
        deadline = time.monotonic() + self.deadlines.reclaim
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PhaseDeadlineMissed("reclaim", self.deadlines.reclaim)
            try:
                unloaded = await asyncio.wait_for(
                    engine.reclaim(order.lora_name, order.reclaim_id, min(5.0, remaining), capability), remaining
                )
            except TimeoutError as exc:
                raise PhaseDeadlineMissed("reclaim", self.deadlines.reclaim) from exc
            if unloaded:
                break
        await submit_until_known(self.registry, ConfirmReclaim(order.version, order.engine, order.reclaim_id),
                                 f"confirm:{order.reclaim_id}:{order.engine}", self.deadlines.commit)
        return True
