"""Decide, before a request leaves the process, whether it may be dispatched and to which engines: the
registry's own answer (`lifecycle.queries.servable_on`, through `RegistryPort.dispatch_view`), never a
state set of this module's. A version RECLAIMING or RECLAIMED is refused; a version is sent only to
engines where it is READY in their current incarnation, so from the moment the registry adopts a
restarted engine's new incarnation no request for a version goes there before its rehydrate is READY.

Which view: a local cache of dispatch views, refreshed from the registry when older than
`max_staleness_s`, with one shared in-flight refresh (single-flight) so a burst of dispatches costs one
registry read. States only move forward, and RECLAIMING/RECLAIMED are sticky in the cache: a refresh
answered before a reclaim was claimed can never revive a version the gate has already seen go.
`claimed()` lets an in-process Reclaimer mark a version whose claim the registry answered (RECLAIMING; a
later refresh may move it on to RECLAIMED, never back). Within the staleness
window an engine may already have restarted; it then refuses the request (VERSION_UNAVAILABLE), and
the session binder sends the same binding to another engine of the view.

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
from versioned_lora.runtime.views import DispatchView

# Sticky in the cache: states only move forward, and these never come back (see the module docstring).
_GONE = frozenset({VersionState.RECLAIMING, VersionState.RECLAIMED})


class VersionUnavailable(Exception):
    """The session's bound version may not be dispatched now: RECLAIMING, RECLAIMED, unknown, or READY on
    no engine in its current incarnation (every engine that held it restarted and is being rehydrated)."""

    def __init__(self, version: VersionKey, state: VersionState | None) -> None:
        where = "" if state in _GONE or state is None else " and servable on no engine now"
        super().__init__(f"version {version} is {state or 'unknown'}{where}: not dispatched")
        self.version = version
        self.state = state


class DispatchGate:
    def __init__(self, registry: RegistryPort, max_staleness_s: float = 0.05) -> None:
        self._registry = registry
        self._max_staleness_s = max_staleness_s
        self._views: dict[VersionKey, DispatchView] = {}
        self._refreshed_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None
        self._covers: frozenset[VersionKey] = frozenset()
        self._wanted: set[VersionKey] = set()  # every version a dispatch asked about
        self.refreshes = 0

    async def check(self, version: VersionKey) -> frozenset[str]:
        """The engines a request for `version` may go to now (never empty); raise VersionUnavailable if none."""
        view = self._views.get(version)
        gone = view is not None and view.state in _GONE
        if not gone and (view is None or time.monotonic() - self._refreshed_at > self._max_staleness_s):
            await self._refreshed(version)
            view = self._views.get(version)
        if view is None or not view.engines:
            raise VersionUnavailable(version, None if view is None else view.state)
        return view.engines

    def claimed(self, version: VersionKey) -> None:
        """An in-process Reclaimer's claim of `version` was answered: refuse it from now on."""
        current = self._views.get(version)
        if current is None or current.state not in _GONE:
            self._views[version] = DispatchView(VersionState.RECLAIMING, frozenset())

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
        fresh = await self._registry.dispatch_view(wanted)
        self.refreshes += 1
        for version in wanted:
            view = fresh.get(version)
            current = self._views.get(version)
            if current is not None and current.state in _GONE and (view is None or view.state not in _GONE):
                continue  # sticky: a refresh answered before the reclaim never revives it
            if view is None:
                self._views.pop(version, None)  # unknown to the registry: asked again next time
            else:
                self._views[version] = view
        self._refreshed_at = started
