"""Refuse dispatch for a version that is RECLAIMING or RECLAIMED before a request leaves the process.

Which view: a local cache of version states, refreshed from the registry (`RegistryPort.version_states`)
when older than `max_staleness_s`, with one shared in-flight refresh (single-flight) so a burst of
dispatches costs one registry read. States only move forward, and RECLAIMING/RECLAIMED are sticky in
the cache: a refresh answered before a reclaim was claimed can never revive a version the gate has
already seen go. `note()` lets an in-process Reclaimer mark a version the moment it claims it.

Why a slightly stale view is safe: the registry lets `claim_reclaim` through only with session_refs
== 0, and a session holds its ref from `bind_first` until `close_and_release`, which the SessionBinder
sends only after it has stopped dispatching for that session. The gate therefore only matters for a
session closed behind this process's back (another finisher, an operator), and `max_staleness_s=0`
makes it exact (one registry read per dispatch).
"""

from __future__ import annotations

import asyncio
import time

from versioned_lora.lifecycle import VersionKey, VersionState
from versioned_lora.runtime.interfaces import RegistryPort

DISPATCHABLE = frozenset({VersionState.PUBLISHED, VersionState.RETIRED})
_GONE = frozenset({VersionState.RECLAIMING, VersionState.RECLAIMED})


class VersionUnavailable(Exception):
    """The session's bound version may not be dispatched (RECLAIMING, RECLAIMED or unknown)."""

    def __init__(self, version: VersionKey, state: VersionState | None) -> None:
        super().__init__(f"version {version} is {state or 'unknown'}: not dispatched")
        self.version = version
        self.state = state


class DispatchGate:
    def __init__(self, registry: RegistryPort, max_staleness_s: float = 0.05) -> None:
        self._registry = registry
        self._max_staleness_s = max_staleness_s
        self._states: dict[VersionKey, VersionState] = {}
        self._refreshed_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None
        self._covers: frozenset[VersionKey] = frozenset()
        self._wanted: set[VersionKey] = set()  # every version a dispatch asked about
        self.refreshes = 0

    async def check(self, version: VersionKey) -> None:
        """Return if `version` may be dispatched now; raise VersionUnavailable otherwise."""
        state = self._states.get(version)
        if state not in _GONE and (state is None or time.monotonic() - self._refreshed_at > self._max_staleness_s):
            await self._refreshed(version)
            state = self._states.get(version)
        if state not in DISPATCHABLE:
            raise VersionUnavailable(version, state)

    def note(self, version: VersionKey, state: VersionState) -> None:
        if self._states.get(version) not in _GONE:
            self._states[version] = state

    async def _refreshed(self, version: VersionKey) -> None:
        self._wanted.add(version)
        while True:
            task, covers = self._refresh, self._covers
            if task is None or task.done():
                covers = self._covers = frozenset(self._wanted)
                task = self._refresh = asyncio.create_task(self._run_refresh(tuple(covers)))
            # shield: a cancelled dispatch must not cancel the refresh other dispatches are waiting for.
            await asyncio.shield(task)
            if version in covers:
                return

    async def _run_refresh(self, wanted: tuple[VersionKey, ...]) -> None:
        started = time.monotonic()
        fresh = await self._registry.version_states(wanted)
        self.refreshes += 1
        for version in wanted:
            state = fresh.get(version)
            if state is None:
                if self._states.get(version) not in _GONE:
                    self._states.pop(version, None)  # unknown to the registry: asked again next time
            else:
                self.note(version, state)
        self._refreshed_at = started
