"""The restart supervisor: brings a restarted engine back by carrying out the registry's answer to its new
incarnation (RFC §3.4, failures; DESIGN.md §3, "Managed adapter x engine").

An engine that restarts holds nothing. Reporting its new incarnation (`EngineRestarted`, row `restart.new`)
makes the registry stop counting its old READY placements (from then on no request for a version goes there
before the version is READY there again: routing reads `lifecycle.queries.servable_on`) and answers with what
the engine is owed: a `StageOnEngine` for each version it must hold (the default and every version sessions
still use, each a rehydrate attempt; and the pending attempt of a publication in flight), a `CleanupOnEngine`
for each cleanup it had not confirmed, a `ReclaimOnEngine` for each reclaim it had not confirmed.

The supervisor decides none of this: it reports the incarnation and stages exactly the versions the answer
names, each from the snapshot store by the digest the registry holds (`Publisher.rehydrate` without a
candidate), so it works in any process, whether or not the one that published the versions is alive. Two
kinds of work it leaves where they belong, and says so in its report:

* a `StageOnEngine` of the attempt this process's Publisher is staging itself (`Publisher.is_staging`): that
  publication's own begin reaches the new incarnation (the link is rebuilt on STALE_INCARNATION) or fails and
  is aborted; a second stager of the same attempt would race it;
* cleanups and reclaims: `Publisher.recover` (the same abort, whose answer names the cleanup) and
  `Reclaimer.reclaim` (the same claim) finish them under their own drivers' rows.

A rehydrate that fails (the snapshot missing or corrupt in the store, the engine refusing) leaves the
placement short of READY (as the registry has it), so the engine gets no request for that version; reconciling again
stages it again (the answer is journaled under one key per incarnation).
"""

from __future__ import annotations

import logging

import attrs

from versioned_lora.lifecycle import RegistryEffect, VersionKey
from versioned_lora.lifecycle.effects import StageOnEngine
from versioned_lora.runtime.publisher import Publisher

logger = logging.getLogger(__name__)


@attrs.frozen
class Reconciled:
    """What one `reconcile` did for one engine."""

    engine: str
    incarnation: int
    rehydrated: tuple[VersionKey, ...] = ()  # READY on the engine now (or already were)
    failed: tuple[tuple[VersionKey, str], ...] = ()  # (version, why): not READY there, no request routed
    left: tuple[RegistryEffect, ...] = ()  # for other drivers: its own Publisher's stage, cleanups, reclaims


class RestartSupervisor:
    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def reconcile(self, engine: str) -> Reconciled:
        """Report `engine`'s current incarnation and rehydrate every version the registry's answer stages there."""
        incarnation, effects = await self.publisher.adopt_incarnation(engine)
        rehydrated: list[VersionKey] = []
        failed: list[tuple[VersionKey, str]] = []
        left: list[RegistryEffect] = []
        for effect in effects:
            if not isinstance(effect, StageOnEngine) or self.publisher.is_staging(effect.attempt_token):
                left.append(effect)
                continue
            try:
                await self.publisher.rehydrate(effect.version, None, engine)
            except Exception as exc:  # reported; the placement stays short of READY (nothing routed)
                logger.warning("rehydrate of %s on %s failed: %s", effect.version, engine, exc)
                failed.append((effect.version, f"{type(exc).__name__}: {exc}"))
            else:
                rehydrated.append(effect.version)
        return Reconciled(engine, incarnation, tuple(rehydrated), tuple(failed), tuple(left))

    async def reconcile_all(self) -> list[Reconciled]:
        return [await self.reconcile(engine) for engine in self.publisher.engines]
