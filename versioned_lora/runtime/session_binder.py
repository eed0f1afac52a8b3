"""SessionBinder: binds each agentic session to one LoRA version at its first generation (RFC §4).

The binding lives on the session's local record (Relax's `_SessionRecord`), not on any one request:

* `bind_first` runs through one shared task per session; every waiter awaits it under
  `asyncio.shield`, so cancelling one waiter (one IR) cancels nothing else and never makes a later
  request choose again.
* every backend request carries the bound `lora_path` and the engines the registry says the version
  is servable on now (the dispatch gate); a RECLAIMING or RECLAIMED version is refused before the
  request leaves the process. An engine that refuses the version (VERSION_UNAVAILABLE: it restarted
  and the registry has not adopted its new incarnation yet) gets the same binding sent elsewhere.
* a generation whose acceptance is unknown (`OutcomeUnknown`) is never resent: it surfaces to the
  caller, and the session refuses new generations until the caller resolves it (`resolve_unknown`
  aborts that rid). Retries after known failures are the agentic layer's decision.
* a response that arrives after the session started closing is dropped; nothing is reopened.
* `finish` (Relax's `_finish_session_once`): FINALIZING locally → `begin_close` in the registry →
  wait for the bind task → abort issued requests → local cleanup → `close_and_release` once → drop
  the record. Concurrent or repeated `finish` calls share that one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from versioned_lora.lifecycle import (
    BeginClose,
    BindFirst,
    Bound,
    CloseAndRelease,
    Closed,
    Reason,
    RegistryEffect,
    Rejected,
    SessionKey,
    VersionKey,
)
from versioned_lora.runtime.dispatch_gate import DispatchGate, VersionUnavailable
from versioned_lora.runtime.interfaces import (
    BackendFailure,
    BackendRequest,
    BackendResponse,
    GenerationBackend,
    OutcomeUnknown,
    RegistryPort,
)

__all__ = [
    "Binding",
    "CloseReport",
    "LateResponseDropped",
    "LocalPhase",
    "NoPublishedVersion",
    "SessionBinder",
    "SessionClosed",
    "SessionEntry",
    "UnresolvedOutcome",
    "VersionUnavailable",
]


class SessionClosed(Exception):
    """The session is finalizing or closed (locally or in the registry): nothing is dispatched."""


class LateResponseDropped(SessionClosed):
    """A response arrived after the session began closing; it was dropped."""


class NoPublishedVersion(Exception):
    """No version is published yet (before the bootstrap commit); nothing was bound, try later."""


class UnresolvedOutcome(Exception):
    """An earlier generation of this session may have been accepted by the engine; resolve it first."""

    def __init__(self, rids: Sequence[str]) -> None:
        super().__init__(f"unresolved generation outcome for {list(rids)}; resolve_unknown() before a new attempt")
        self.rids = tuple(rids)


class LocalPhase(enum.StrEnum):
    ACTIVE = "ACTIVE"
    FINALIZING = "FINALIZING"
    CLOSED = "CLOSED"


@attrs.frozen
class Binding:
    version: VersionKey
    lora_path: str  # the immutable lora_name; every request of the session carries exactly this


@attrs.frozen
class CloseReport:
    session: SessionKey
    released: bool  # this close released the session ref (False: unbound, or released before)
    aborted: tuple[str, ...]  # rids this close asked the engine to end
    effects: tuple[RegistryEffect, ...]  # e.g. ReclaimEligible, for the Reclaimer


@attrs.define(eq=False)
class SessionEntry:
    """The local session record: its key, its binding and what it has in flight."""

    key: SessionKey
    session_id: str
    phase: LocalPhase = LocalPhase.ACTIVE
    binding: Binding | None = None
    bind_task: asyncio.Task[Binding] | None = None
    close_task: asyncio.Task[CloseReport] | None = None
    # Idempotency keys, fixed per record: a retried registry call is the same call.
    bind_key: str = attrs.field(factory=lambda: f"bind:{uuid.uuid4().hex}")
    close_keys: tuple[str, str] = attrs.field(
        factory=lambda: (f"bclose:{uuid.uuid4().hex}", f"close:{uuid.uuid4().hex}")
    )
    issued: dict[str, BackendRequest] = attrs.field(factory=dict)  # sent, no answer yet
    unknown: dict[str, BackendRequest] = attrs.field(factory=dict)  # acceptance unknown, unresolved
    generations: int = 0


Cleanup = Callable[[SessionEntry], Awaitable[None]]
EffectSink = Callable[[tuple[RegistryEffect, ...]], None]


class SessionBinder:
    def __init__(
        self,
        registry: RegistryPort,
        backend: GenerationBackend,
        *,
        epoch: int,
        shard: int,
        first_seq: int = 0,
        gate: DispatchGate | None = None,
        cleanup: Cleanup | None = None,
        on_effects: EffectSink | None = None,
    ) -> None:
        """`shard` must be unique to this binder's lifetime within the epoch (e.g. one per session-service
        incarnation), or `first_seq` above every seq it used before: the registry refuses a seq it has
        already closed, by design."""
        self._registry = registry
        self._backend = backend
        self._epoch, self._shard, self._next_seq = epoch, shard, first_seq
        self.gate = gate or DispatchGate(registry)
        self._cleanup = cleanup
        self._on_effects = on_effects
        self._records: dict[SessionKey, SessionEntry] = {}
        self.dropped_late_responses = 0
        self.redispatched = 0  # requests sent again, same binding, after an engine refused the version

    # ---- records
    def open(self, session_id: str, key: SessionKey | None = None) -> SessionKey:
        """Create the local record (RFC §4.1: no version is chosen yet). The registry learns of the
        session at its first bind (an unseen key is opened there), which saves one call per session."""
        if key is None:
            key = SessionKey(self._epoch, self._shard, self._next_seq)
            self._next_seq += 1
        if key in self._records:
            raise ValueError(f"session {key} is already open")
        self._records[key] = SessionEntry(key, session_id)
        return key

    def record(self, key: SessionKey) -> SessionEntry | None:
        return self._records.get(key)

    @property
    def open_sessions(self) -> Mapping[SessionKey, SessionEntry]:
        return self._records

    def _active(self, key: SessionKey) -> SessionEntry:
        entry = self._records.get(key)
        if entry is None or entry.phase is not LocalPhase.ACTIVE:
            raise SessionClosed(f"session {key} is {entry.phase if entry else 'not open here'}")
        return entry

    # ---- binding
    async def bind_first(self, key: SessionKey) -> Binding:
        entry = self._active(key)
        if entry.binding is not None:
            return entry.binding
        if entry.bind_task is None:
            entry.bind_task = asyncio.create_task(self._bind(entry), name=f"bind_first{tuple(key)}")
        return await asyncio.shield(entry.bind_task)

    async def _bind(self, entry: SessionEntry) -> Binding:
        try:
            answer = await self._registry.submit(BindFirst(entry.key), key=entry.bind_key)
        except BaseException:
            entry.bind_task = None  # unknown whether it bound; the next call retries the same key
            raise
        result = answer.result
        if isinstance(result, Bound):
            entry.binding = Binding(result.version, result.lora_name)
            return entry.binding
        entry.bind_task = None
        if isinstance(result, Rejected) and result.reason is Reason.NO_PUBLISHED_VERSION:
            raise NoPublishedVersion(f"session {entry.key}: no published version yet")
        if isinstance(result, Rejected) and result.reason is Reason.SESSION_CLOSED:
            raise SessionClosed(f"session {entry.key} is closed in the registry")
        raise RuntimeError(f"unexpected bind answer for {entry.key}: {result!r}")

    # ---- generation
    async def generate(
        self,
        key: SessionKey,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: Mapping[str, Any] | None = None,
        rid: str | None = None,
    ) -> BackendResponse:
        """One backend generation attempt, sent once with the session's bound lora_path."""
        entry = self._active(key)
        if entry.unknown:
            raise UnresolvedOutcome(tuple(entry.unknown))
        binding = await self.bind_first(key)
        engines = await self.gate.check(binding.version)  # raises VersionUnavailable: refused before leaving
        refused: set[str] = set()
        base_rid = rid or f"{entry.session_id}/{uuid.uuid4().hex[:16]}"
        while True:
            entry = self._active(key)  # re-check: the session may have started closing while we awaited
            request = BackendRequest(
                rid=base_rid if not refused else f"{base_rid}~{len(refused)}",
                input_ids=tuple(input_ids),
                lora_path=binding.lora_path,
                max_new_tokens=max_new_tokens,
                sampling=dict(sampling or {}),
                engines=engines - refused,
            )
            try:
                return await self._send(key, entry, request)
            except BackendFailure as failure:
                # An engine the registry still counts as serving the version refused it: it restarted and the
                # registry has not adopted its new incarnation yet. The request certainly did not run there;
                # the same binding goes to another engine of the view, never to another version.
                if failure.reason != Reason.VERSION_UNAVAILABLE or failure.engine is None:
                    raise
                refused.add(failure.engine)
                if not engines - refused:
                    raise
                self.redispatched += 1

    async def _send(self, key: SessionKey, entry: SessionEntry, request: BackendRequest) -> BackendResponse:
        entry.issued[request.rid] = request
        try:
            response = await self._backend.generate(request)
        except (OutcomeUnknown, asyncio.CancelledError):
            # Accepted or not, we cannot tell: remember it, never resend it here.
            entry.unknown[request.rid] = request
            raise
        finally:
            entry.issued.pop(request.rid, None)
        if entry.phase is not LocalPhase.ACTIVE:
            self.dropped_late_responses += 1
            raise LateResponseDropped(f"session {key} is {entry.phase}: response {request.rid} dropped")
        entry.generations += 1
        return response

    async def abort(self, key: SessionKey, rid: str) -> None:
        """Temporary abort of an in-flight generation (Relax's abort/resume): the session keeps its
        binding and its ref; the aborted call returns its partial output, and a resume is a new attempt."""
        entry = self._active(key)
        if rid in entry.issued:
            await self._backend.abort(rid)

    async def resolve_unknown(self, key: SessionKey, rid: str) -> None:
        """End an unknown-outcome attempt on the engine (abort by rid is harmless if it never arrived).
        Once the abort is acknowledged the attempt is a known failure and a new attempt may be made."""
        entry = self._active(key)
        if rid in entry.unknown:
            await self._backend.abort(rid)  # OutcomeUnknown here keeps it unresolved
            del entry.unknown[rid]

    # ---- close
    async def finish(self, key: SessionKey) -> CloseReport:
        entry = self._records.get(key)
        if entry is None:
            # Never opened here, or already closed and dropped: the registry writes (or keeps) the
            # tombstone; a duplicate close releases nothing there.
            answer = await self._registry.submit(CloseAndRelease(key))
            return self._report(key, answer.result, (), answer.effects)
        if entry.close_task is None:
            entry.close_task = asyncio.create_task(self._finish(entry), name=f"finish{tuple(key)}")
        return await asyncio.shield(entry.close_task)

    async def _finish(self, entry: SessionEntry) -> CloseReport:
        try:
            entry.phase = LocalPhase.FINALIZING  # no new dispatch from here on
            begin = await self._registry.submit(BeginClose(entry.key), key=entry.close_keys[0])
            if isinstance(begin.result, Rejected):
                raise RuntimeError(f"begin_close refused for {entry.key}: {begin.result!r}")
            if entry.bind_task is not None:
                await asyncio.wait([entry.bind_task])  # its outcome, whatever it is, before the release
            aborted = tuple([*entry.issued, *entry.unknown])
            for rid in aborted:
                # Best effort: SGLang's own request refcount decides when the adapter is really free.
                with contextlib.suppress(Exception):
                    await self._backend.abort(rid)
            if self._cleanup is not None:
                await self._cleanup(entry)
            close = await self._registry.submit(CloseAndRelease(entry.key), key=entry.close_keys[1])
        except BaseException:
            entry.close_task = None  # the same keys are reused by the next finish(): still exactly once
            raise
        entry.phase = LocalPhase.CLOSED
        self._records.pop(entry.key, None)
        return self._report(entry.key, close.result, aborted, close.effects)

    def _report(
        self, key: SessionKey, result: object, aborted: tuple[str, ...], effects: tuple[RegistryEffect, ...]
    ) -> CloseReport:
        if effects and self._on_effects is not None:
            self._on_effects(effects)
        released = isinstance(result, Closed) and result.released
        return CloseReport(key, released, aborted, effects)
