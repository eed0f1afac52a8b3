"""SessionBinder: binds each agentic session to one LoRA version at its first generation (RFC §4).

It executes the session driver of `spec/drivers.py` (machines `session` and `generation`), one `DriverLoop`
per session: the rows decide, this module carries out their commands and turns their reports into return
values and exceptions. What the rows say, in short:

* the one shared bind: every waiter's `Bind` waits for the one call, under a key derived from the session key;
  cancelling a waiter cancels nothing else. A bind whose answer does not come in time is UNKNOWN to its waiters
  (nothing is dispatched) while the same call is retried until answered.
* every generation asks the registry's dispatch view first (the gate, `dispatch_gate.DispatchGate`) and goes only
  to engines where the version is servable now, carrying the bound `lora_path`; a RECLAIMING or RECLAIMED version
  is refused before the request leaves the process. An engine that refuses the version (VERSION_UNAVAILABLE: it
  restarted and the registry has not adopted its new incarnation yet) gets the same binding sent elsewhere.
* a generation whose acceptance is unknown (`OutcomeUnknown`, or its caller gone) is never resent: it surfaces
  to the caller, and the session refuses new generations until `resolve_unknown` aborts that rid.
* `finish` (Relax's `_finish_session_once`): begin_close → abort what is in flight or unknown → the caller's
  local cleanup → close_and_release once. Concurrent or repeated `finish` calls wait for that one close; a
  response that arrives after the session began closing is dropped.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from versioned_lora.lifecycle import Closed, Reason, RegistryEffect, SessionKey, VersionKey, drivers
from versioned_lora.lifecycle.drivers import (
    AbortGeneration,
    Answer,
    Bind,
    Call,
    Cancel,
    DriverInput,
    Finish,
    Generate,
    LocalCleanup,
    Lost,
    Refusal,
    Report,
    Resolve,
    SendGeneration,
    ViewDispatch,
)
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.dispatch_gate import DispatchGate, VersionUnavailable
from versioned_lora.runtime.driver_loop import DriverLoop
from versioned_lora.runtime.interfaces import (
    BackendFailure,
    BackendRequest,
    BackendResponse,
    GenerationBackend,
    OutcomeUnknown,
    RegistryAnswer,
    RegistryPort,
    RegistryUnavailable,
)
from versioned_lora.runtime.views import DispatchView, PublicationView
from versioned_lora.spec.drivers import DriverOutcome, SessionRefusal
from versioned_lora.spec.events import RegistryEvent
from versioned_lora.spec.states import VersionState

__all__ = [
    "Binding",
    "CloseReport",
    "LateResponseDropped",
    "NoPublishedVersion",
    "RidInUse",
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


class RidInUse(ValueError):
    """A request id this session has used already (ids are unique per session, as the engine needs them)."""


class UnresolvedOutcome(Exception):
    """An earlier generation of this session may have been accepted by the engine; resolve it first."""

    def __init__(self, rids: Sequence[str]) -> None:
        super().__init__(f"unresolved generation outcome for {list(rids)}; resolve_unknown() before a new attempt")
        self.rids = tuple(rids)


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


class SessionEntry:
    """The local session record: its key, and the driver loop that holds its state (binding, generations)."""

    def __init__(self, key: SessionKey, session_id: str) -> None:
        self.key, self.session_id = key, session_id
        self.loop: DriverLoop | None = None  # started at the first call (a loop needs the running event loop)
        self.payloads: dict[str, tuple[tuple[int, ...], int, dict[str, Any]]] = {}  # rid -> what it generates
        self.errors: dict[Call, BaseException] = {}  # what a refused or lost call raised (the caller's exception)
        self.close_report: CloseReport | None = None  # the one report every finish of this record returns
        self.generations = 0

    @property
    def state(self) -> drivers.SessionState | None:
        return None if self.loop is None else self.loop.state  # type: ignore[return-value]

    @property
    def binding(self) -> Binding | None:
        state = self.state
        if state is None or state.version is None:
            return None
        return Binding(state.version, state.lora_name)

    @property
    def issued(self) -> tuple[str, ...]:
        """Request ids being dispatched or sent now."""
        return () if self.state is None else drivers.requests_in_flight(self.state)

    @property
    def unknown(self) -> tuple[str, ...]:
        """Request ids whose acceptance is unknown (unresolved)."""
        return () if self.state is None else drivers.unresolved_requests(self.state)


# The exception a caller gets for a REJECTED report, by its reason (the driver's rows decided the refusal; this only
# names it for the caller): (entry, the subject's request id) -> exception.
_REFUSALS: dict[str, Callable[[SessionEntry, str], BaseException]] = {
    Reason.NO_PUBLISHED_VERSION: lambda e, rid: NoPublishedVersion(f"session {e.key}: no published version yet"),
    SessionRefusal.UNRESOLVED_OUTCOME: lambda e, rid: UnresolvedOutcome(e.unknown),
    SessionRefusal.RID_IN_USE: lambda e, rid: RidInUse(f"session {e.key}: request id {rid!r} was used already"),
    # the gate's own error: VersionUnavailable (servable nowhere now), or why the view could not be read
    SessionRefusal.NOT_SERVABLE: lambda e, rid: e.errors[Call("view", rid)],
    SessionRefusal.VIEW_UNAVAILABLE: lambda e, rid: e.errors[Call("view", rid)],
    SessionRefusal.CLEANUP_FAILED: lambda e, rid: e.errors[Call("local_cleanup")],  # what the caller's hook raised
}


def _refused(entry: SessionEntry, report: Report, subject: str) -> BaseException:
    """A REJECTED report as the caller's exception: by its reason, else the refusing engine's own error (a
    generation), else the registry's refusal of the bind or the close."""
    named = _REFUSALS.get(report.reason or "")
    if named is not None:
        return named(entry, subject)
    failure = entry.errors.get(Call("generate", subject))
    if failure is not None:
        return failure
    if subject == "finish":
        return RuntimeError(f"the close of {entry.key} was refused: {report.reason}")
    return SessionClosed(f"session {entry.key} is closed ({report.reason})")


class _PortOf:
    """The registry port as the binder has it now (callers may swap `SessionBinder._registry`, e.g. tests)."""

    def __init__(self, binder: SessionBinder) -> None:
        self._binder = binder

    async def submit(self, event: RegistryEvent, key: str | None = None) -> RegistryAnswer:
        return await self._binder._registry.submit(event, key=key)

    async def submit_batch(
        self, events: Sequence[RegistryEvent], key: str | None = None
    ) -> tuple[RegistryAnswer, ...]:
        return await self._binder._registry.submit_batch(events, key=key)

    async def version_states(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, VersionState]:
        return await self._binder._registry.version_states(versions)

    async def dispatch_view(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, DispatchView]:
        return await self._binder._registry.dispatch_view(versions)

    async def state_digest(self) -> str:
        return await self._binder._registry.state_digest()

    async def publication_view(self, all_versions: bool = False) -> PublicationView:
        return await self._binder._registry.publication_view(all_versions)

    async def key_ids(self) -> tuple[str, ...]:
        return await self._binder._registry.key_ids()


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
        deadlines: Deadlines | None = None,
    ) -> None:
        """`shard` must be unique to this binder's lifetime within the epoch (e.g. one per session-service
        incarnation), or `first_seq` above every seq it used before: the registry refuses a seq it has
        already closed, by design. `deadlines.report` bounds how long a caller waits for the bind's or the
        close's answer before it is told the outcome is unknown (the call itself goes on until answered)."""
        self._registry = registry
        self._port = _PortOf(self)
        self._backend = backend
        self._epoch, self._shard, self._next_seq = epoch, shard, first_seq
        self.gate = gate or DispatchGate(registry)
        self._cleanup = cleanup
        self._on_effects = on_effects
        self.deadlines = deadlines or Deadlines()
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

    def _entry(self, key: SessionKey) -> SessionEntry:
        entry = self._records.get(key)
        if entry is None:
            raise SessionClosed(f"session {key} is not open here")
        return entry

    def _loop(self, entry: SessionEntry, *, close_only: bool = False) -> DriverLoop:
        if entry.loop is None:
            entry.loop = DriverLoop(
                drivers.session(entry.key, cleanup=self._cleanup is not None, close_only=close_only),
                self._port, {}, lambda name: float(getattr(self.deadlines, name)), start=False,
                perform=lambda command: self._perform(entry, command), on_fired=self._count)
        return entry.loop

    def _count(self, row: str) -> None:
        if row == "generate.redispatch":
            self.redispatched += 1

    # ---- binding
    async def bind_first(self, key: SessionKey) -> Binding:
        entry = self._entry(key)
        report = await self._loop(entry).ask(Bind(), "bind")
        if report.outcome is DriverOutcome.BOUND:
            binding = entry.binding
            assert binding is not None
            return binding
        if report.outcome is DriverOutcome.UNKNOWN:
            raise RegistryUnavailable(f"session {key}: the bind's outcome is unknown past its deadline; nothing is "
                                      "dispatched, and the same bind is retried until answered")
        raise _refused(entry, report, "bind")

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
        entry = self._entry(key)
        await self.bind_first(key)
        rid = rid or f"{entry.session_id}/{uuid.uuid4().hex[:16]}"  # the caller's request id (not a driver key)
        payload = (tuple(input_ids), max_new_tokens, dict(sampling or {}))
        owned = entry.payloads.setdefault(rid, payload) is payload  # (a reused rid keeps the first one's)
        loop = self._loop(entry)
        asked = loop.ask(Generate(rid), rid)
        try:
            report = await asked
        except asyncio.CancelledError:
            loop.put(Cancel(rid))  # the caller went away: the table says what that ends
            raise
        finally:
            if owned:  # reported: nothing sends it again (a long session keeps no prompt it is done with)
                del entry.payloads[rid]
        call = Call("generate", rid)
        if report.outcome is DriverOutcome.GENERATED:
            entry.generations += 1
            response: BackendResponse = loop.answer_of(call, forget=True)
            return response
        if report.outcome is DriverOutcome.DROPPED:
            self.dropped_late_responses += 1
            raise LateResponseDropped(f"session {key} is closing: response {rid} dropped")
        if report.outcome is DriverOutcome.UNKNOWN:
            raise entry.errors.get(call) or OutcomeUnknown(f"{rid}: outcome unknown")
        raise _refused(entry, report, rid)

    async def _perform(self, entry: SessionEntry, command: Any) -> DriverInput:
        """Carry out one of the session driver's calls and say how it ended."""
        call = command.call
        try:
            if isinstance(command, ViewDispatch):
                try:
                    return Answer(call, await self.gate.check(command.version))
                except VersionUnavailable as unavailable:
                    entry.errors[call] = unavailable
                    return Answer(call, frozenset())
            if isinstance(command, SendGeneration):
                input_ids, max_new_tokens, sampling = entry.payloads[call.engine]
                request = BackendRequest(rid=command.rid, input_ids=input_ids, lora_path=command.lora_name,
                                         max_new_tokens=max_new_tokens, sampling=sampling, engines=command.engines)
                try:
                    return Answer(call, await self._backend.generate(request))
                except BackendFailure as failure:
                    entry.errors[call] = failure
                    return Refusal(call, str(failure.reason or "BACKEND_FAILURE"), origin=failure.engine or "")
            if isinstance(command, AbortGeneration):
                await self._backend.abort(command.rid)
                return Answer(call)
            assert isinstance(command, LocalCleanup) and self._cleanup is not None
            await self._cleanup(entry)
            return Answer(call)
        except Exception as exc:  # the call's outcome is not known (an OutcomeUnknown, a registry read, a hook)
            entry.errors[call] = exc
            return Lost(call)

    async def abort(self, key: SessionKey, rid: str) -> None:
        """Temporary abort of an in-flight generation (Relax's abort/resume): the session keeps its
        binding and its ref; the aborted call returns its partial output, and a resume is a new attempt.
        It changes nothing the session driver holds, so it is passed straight to the engine."""
        entry = self._entry(key)
        target = None if entry.state is None else drivers.in_flight_rid(entry.state, rid)
        if target is not None:
            await self._backend.abort(target)

    async def resolve_unknown(self, key: SessionKey, rid: str) -> None:
        """End an unknown-outcome attempt on the engine (abort by rid is harmless if it never arrived).
        Once the abort is acknowledged the attempt is a known failure and a new attempt may be made."""
        entry = self._entry(key)
        report = await self._loop(entry).ask(Resolve(rid), rid)
        if report.outcome is DriverOutcome.UNKNOWN:
            raise entry.errors.get(Call("abort", rid)) or OutcomeUnknown(f"abort of {rid}: outcome unknown")
        if report.outcome is not DriverOutcome.RESOLVED:
            raise SessionClosed(f"session {key} is closing: {rid} was aborted by the close")

    # ---- close
    async def finish(self, key: SessionKey) -> CloseReport:
        entry = self._records.get(key)
        if entry is None:
            # Not held here (never opened, or closed and forgotten): the registry closes it or answers its
            # tombstone; a duplicate close releases nothing there.
            entry = SessionEntry(key, "")
            self._loop(entry, close_only=True)
        if entry.loop is not None and entry.state is not None and drivers.is_done(entry.state):
            # Closed already (its close was resolved after the finish that sent it gave up): row finish.closed's
            # answer is the close's last report, read here because a finished driver's loop steps no more.
            report = entry.loop.last_report("finish")
        else:
            report = await self._loop(entry).ask(Finish(), "finish")
        assert report is not None  # a closed session's last report to its finish is CLOSED or REJECTED
        if report.outcome is DriverOutcome.CLOSED:
            return self._closed(entry)
        if report.outcome is DriverOutcome.UNKNOWN:
            raise RegistryUnavailable(f"session {key}: the close's outcome is unknown past its deadline; the same "
                                      "calls are retried until answered, and finish() again returns their report")
        raise _refused(entry, report, "finish")

    def _closed(self, entry: SessionEntry) -> CloseReport:
        """The record's one close report (every finish of it gets the same), and the record forgotten."""
        if entry.close_report is None:
            entry.close_report = self._close_report(entry)
        self._records.pop(entry.key, None)
        return entry.close_report

    def _close_report(self, entry: SessionEntry) -> CloseReport:
        assert entry.loop is not None and entry.state is not None
        answer = entry.loop.answer_of(Call("close"))
        result, effects = answer.result, tuple(answer.effects)
        if effects and self._on_effects is not None:
            self._on_effects(effects)
        released = isinstance(result, Closed) and result.released
        return CloseReport(entry.key, released, drivers.aborted_requests(entry.state), effects)
