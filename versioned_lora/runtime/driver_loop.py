"""The executor of one driver machine (`versioned_lora.lifecycle.drivers`): it carries out each command
and feeds its outcome back as an input. It decides nothing the driver table decides.

One task owns the driver's state; every completion (a reply, a refusal, a lost reply, a timer that
fired, the caller's cancellation) reaches it through one inbox, so `step` never runs concurrently with
itself. Commands run as tasks of their own, one I/O each:

* `Submit`: one `RegistryPort.submit` under the command's key. `RegistryUnavailable` is `Lost`. A retry
  of the same call after a `Lost` (registry or engine: the table commands it) waits a short, growing
  pause first, so a restarting registry or a dead engine is not hammered. That pause is transport
  policy, not a protocol decision.
* `StageEngine`: the engine port's `begin`, `transfer_bucket` or `end` of the loop's candidate under the driver's
  attempt; `CheckProbe`: the caller's check of an `end` receipt (what the engine serves, then its probe), answered
  True, False, or the check's typed `CheckRefused`; `DropLink`: the port's `drop_link`, at once.
* `ReadRevision`, `ReadLiveFence`, `ReadAttempt`: the registry's publication view, answered with its default
  revision, its lease fence, or the version's last attempt token ("" if unknown) (`RegistryUnavailable` is `Lost`).
* Before every engine call (`StageEngine`, `CleanupEngine`, `ReclaimEngine`) the port is told the registry's key ids
  (`StagingEnginePort.expect_registry_keys`), as the loop's latest registry answer gave them, or, if this loop has had
  none yet (a rehydrate's `begin` comes first), `RegistryPort.key_ids`: the port refuses an engine of another key
  before the call is sent (KEY_MISMATCH).
* `CleanupEngine`, `ReclaimEngine`: the engine port's call. `EngineRefused` is `Refusal` (its reason),
  `EngineUnreachable` or a timeout is `Lost`.
* `Arm`/`Disarm`: a timer (seconds from the caller's `seconds(deadline_name)`); when it fires, `Deadline`.
* `Report`: the outcome for the caller; the first one answers `reported()`, the one made when the
  driver reaches its terminal phase answers `finished()`. A session's reports name a subject ("bind", "finish", a
  request id): each answers the callers that `ask`ed about that subject since its last report.
* A session's own calls (`ViewDispatch`, `SendGeneration`, `AbortGeneration`, `LocalCleanup`) are run by the
  caller's `perform` (the SessionBinder's, which holds the backend and the requests' payloads); `HangUp` cancels
  the named call's task at once (an HTTP generation's engine sees its client go).

The loop ends when the driver is in a terminal phase; calls still in flight then are cancelled (their
outcome would land on a "late" row anyway). The loop task is not tied to the caller: a caller that stops
waiting (`Cancel`) or is cancelled itself does not end a call the table still waits for, such as a
commit being resolved.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from versioned_lora.lifecycle.drivers import (
    DRIVERS,
    Answer,
    Arm,
    Call,
    Call_,
    Cancel,
    CheckProbe,
    CheckRefused,
    CleanupEngine,
    Command,
    Deadline,
    Disarm,
    DriverInput,
    Drivers,
    DriverState,
    DropLink,
    HangUp,
    Lost,
    ReadAttempt,
    ReadLiveFence,
    ReadRevision,
    ReclaimEngine,
    Refusal,
    Reply,
    Report,
    StageEngine,
    StageState,
    Start,
    Submit,
    Timer,
    is_done,
)
from versioned_lora.runtime.interfaces import (
    EngineRefused,
    EngineUnreachable,
    RegistryPort,
    RegistryUnavailable,
    StagingEnginePort,
)

logger = logging.getLogger(__name__)

RECLAIM_POLL_S = 5.0  # one reclaim call waits at most this long for the engine's refcount to drain
RETRY_PAUSE_S = (0.05, 1.0)  # first and largest pause before a call retried after a Lost


class DriverLoop:
    def __init__(
        self,
        state: DriverState,
        registry: RegistryPort,
        engines: Mapping[str, StagingEnginePort[Any]],
        seconds: Callable[[str], float],
        drivers: Drivers = DRIVERS,
        *,
        candidate: Any = None,
        probe_check: Callable[[Any], bool | CheckRefused] | None = None,
        on_step: Callable[[Any, Any], None] | None = None,
        perform: Callable[[Any], Awaitable[DriverInput]] | None = None,
        start: bool = True,
        on_fired: Callable[[str], None] | None = None,
    ) -> None:
        self.state = state
        self.candidate = candidate  # what `StageEngine` ships (a staging driver's loop)
        # `CheckProbe`: an `end` receipt -> serves the snapshot and matches the reference (True), or why not
        self.probe_check = probe_check
        self._on_step = on_step or (lambda before, after: None)  # the caller's clock: (state before, after)
        self._perform = perform  # the calls this loop does not know (a session's): command -> its outcome
        self._on_fired = on_fired or (lambda row: None)
        self.registry = registry
        self.engines = engines
        self.seconds = seconds
        self.drivers = drivers
        self.fired: list[str] = []  # every row that fired, in order (tests and logs read it)
        self.reports: list[Report] = []
        self.answers: list[Any] = []  # every registry result the driver received (the commit's receipt...)
        self._inbox: asyncio.Queue[DriverInput] = asyncio.Queue()
        self._timers: dict[Timer, asyncio.TimerHandle] = {}
        self._calls: dict[Call, asyncio.Task[None]] = {}
        self._asked: dict[str, list[asyncio.Future[Report]]] = {}  # subject -> callers waiting for its next report
        self._retries: dict[str, int] = {}  # registry key or engine call -> times lost in a row so far
        self.failures: dict[Call, str] = {}  # what a refused or lost call said (for the caller's detail)
        self._answers: dict[Call, Any] = {}
        self._key_ids: tuple[str, ...] | None = None  # the registry's, from its latest answer (None: none yet)
        loop = asyncio.get_running_loop()
        self._reported: asyncio.Future[Report] = loop.create_future()
        self._finished: asyncio.Future[Report] = loop.create_future()
        if start:  # first in the inbox, before anything else can be (a session waits for its caller instead)
            self._inbox.put_nowait(Start())
        self._task = asyncio.ensure_future(self._run())

    # ---- the caller's side
    async def reported(self) -> Report:
        """The first outcome the driver reported (it may go on working after it)."""
        return await asyncio.shield(self._reported)

    async def finished(self) -> Report:
        """The outcome reported when the driver reached its terminal phase."""
        return await asyncio.shield(self._finished)

    @property
    def done(self) -> bool:
        return self._finished.done()

    def cancel(self) -> None:
        """The caller stops waiting: an input like any other (the table says what it ends)."""
        self._inbox.put_nowait(Cancel())

    def ask(self, inp: DriverInput, subject: str) -> asyncio.Future[Report]:
        """Feed a caller's input; the future answers with the next report to `subject` (cancelling it cancels
        nothing the driver does)."""
        future: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        if self._task.done():
            future.set_exception(RuntimeError(f"the driver has ended in {self.state.phase}"))
            return future
        self._asked.setdefault(subject, []).append(future)
        self._inbox.put_nowait(inp)
        return future

    def put(self, inp: DriverInput) -> None:
        """Feed an input no caller waits on (a caller's cancellation)."""
        self._inbox.put_nowait(inp)

    def last_report(self, subject: str) -> Report | None:
        """The last report made to `subject`, if any."""
        return next((r for r in reversed(self.reports) if r.subject == subject), None)

    def answer_of(self, call: Call, *, forget: bool = False) -> Any:
        """The last answer `call` received (a generation's response), if any; `forget`: its reader is the last."""
        return self._answers.pop(call, None) if forget else self._answers.get(call)

    # ---- the owning task
    async def _run(self) -> None:
        try:
            while not is_done(self.state):
                inp = await self._inbox.get()
                step = self.drivers.step(self.state, inp)
                before, self.state = self.state, step.state
                self._on_step(before, self.state)
                self.fired += step.fired
                for row in step.fired:
                    self._on_fired(row)
                for command in step.commands:
                    self._execute(command)
        except asyncio.CancelledError:  # the event loop is shutting down: nobody will read an outcome
            for future in (self._reported, self._finished):
                future.cancel()
            raise
        except Exception as exc:  # a ProtocolError is a bug: surface it to every waiter
            for future in (self._reported, self._finished, *(f for fs in self._asked.values() for f in fs)):
                if not future.done():
                    future.set_exception(exc)
            raise
        finally:
            for handle in self._timers.values():
                handle.cancel()
            for task in self._calls.values():
                task.cancel()
            for future in (f for fs in self._asked.values() for f in fs):  # a table bug: a subject never told
                if not future.done():
                    future.set_exception(RuntimeError(f"the driver ended in {self.state.phase} without a report"))
        if not self._finished.done():  # a terminal phase reached without a report is a table bug
            self._finished.set_exception(RuntimeError(f"driver ended in {self.state.phase} without a report"))

    def _execute(self, command: Command) -> None:
        if isinstance(command, Report):
            self.reports.append(command)
            for future in self._asked.pop(command.subject, []) if command.subject else []:
                if not future.done():  # a caller that stopped waiting cancelled its own future only
                    future.set_result(command)
            if not self._reported.done():
                self._reported.set_result(command)
            if is_done(self.state) and not self._finished.done():
                self._finished.set_result(command)
        elif isinstance(command, Arm):
            self._disarm(command.timer)
            loop = asyncio.get_running_loop()
            self._timers[command.timer] = loop.call_later(
                self.seconds(command.deadline), self._inbox.put_nowait, Deadline(command.timer)
            )
        elif isinstance(command, Disarm):
            self._disarm(command.timer)
        elif isinstance(command, DropLink):
            self.engines[command.engine].drop_link()
        elif isinstance(command, HangUp):
            task = self._calls.pop(command.call, None)
            if task is not None:
                task.cancel()
        else:
            task = asyncio.ensure_future(self._io(command))
            self._calls[command.call] = task
            task.add_done_callback(functools.partial(self._forget, command.call))

    def _forget(self, call: Call, task: asyncio.Future[None]) -> None:
        if self._calls.get(call) is task:  # not a newer call of the same name (a retry, a re-dispatch)
            del self._calls[call]

    def _disarm(self, timer: Timer) -> None:
        handle = self._timers.pop(timer, None)
        if handle is not None:
            handle.cancel()

    async def _io(self, command: Call_) -> None:
        try:
            outcome = await self._outcome(command)
            if isinstance(outcome, Answer):
                self._answers[command.call] = outcome.value
        except Exception:  # outside the port's contract: we cannot know whether it landed
            logger.exception("%s on %s raised outside the port's contract: outcome unknown", command.call.op,
                             command.call.engine or "registry")
            outcome = Lost(command.call)
        self._inbox.put_nowait(outcome)

    async def _outcome(self, command: Call_) -> DriverInput:
        call = command.call
        retry = command.key if isinstance(command, Submit) else f"{call.op}:{call.engine}"
        lost = self._retries.get(retry, 0)
        if lost:  # the same call again after a Lost: pause first, so an unreachable peer is not hammered
            await asyncio.sleep(min(RETRY_PAUSE_S[0] * 2 ** (lost - 1), RETRY_PAUSE_S[1]))
        try:
            if isinstance(command, Submit):
                answer = await self.registry.submit(command.event, key=command.key)
                self._retries.pop(retry, None)
                self._key_ids = answer.key_ids
                self.answers.append(answer.result)
                return Answer(call, Reply(answer.result, answer.effects, answer.capabilities))
            if isinstance(command, (ReadRevision, ReadLiveFence, ReadAttempt)):
                view = await self.registry.publication_view()
                self._retries.pop(retry, None)
                if isinstance(command, ReadAttempt):
                    held = view.versions.get(command.version)
                    return Answer(call, "" if held is None else str(held.attempt_token or ""))
                return Answer(call, view.default_revision if isinstance(command, ReadRevision) else view.lease_fence)
            if not isinstance(command, (CheckProbe, StageEngine, CleanupEngine, ReclaimEngine)):
                assert self._perform is not None, f"{type(command).__name__} needs the caller's perform"
                return await self._perform(command)
            if isinstance(command, CheckProbe):
                assert self.probe_check is not None, "a staging loop needs the caller's probe check"
                verdict = self.probe_check(command.receipt)
                if isinstance(verdict, CheckRefused):  # a typed refusal: its code is the table's input to read
                    self.failures[call] = verdict.detail
                    return Answer(call, verdict)
                return Answer(call, bool(verdict))
            engine = self.engines[command.engine]
            if self._key_ids is None:
                self._key_ids = await self.registry.key_ids()
            engine.expect_registry_keys(self._key_ids)
            if isinstance(command, StageEngine):
                return Answer(call, await self._stage(engine, command))
            if isinstance(command, CleanupEngine):
                await engine.cleanup(command.lora_name, command.attempt_token, command.capability)
                self._retries.pop(retry, None)
                return Answer(call)
            unloaded = await engine.reclaim(command.lora_name, command.reclaim_id, RECLAIM_POLL_S, command.capability)
            self._retries.pop(retry, None)
            return Answer(call, bool(unloaded))
        except RegistryUnavailable:
            self._retries[retry] = lost + 1
            return Lost(call)
        except EngineRefused as refused:
            self.failures[call] = refused.message
            return Refusal(call, refused.reason)
        except (EngineUnreachable, TimeoutError) as exc:
            self.failures[call] = f"{type(exc).__name__}: {exc}"
            self._retries[retry] = lost + 1
            logger.info("%s on %s: outcome unknown (%s)", call.op, call.engine or "registry", exc)
            return Lost(call)

    async def _stage(self, engine: StagingEnginePort[Any], command: StageEngine) -> Any:
        assert isinstance(self.state, StageState)
        token = self.state.attempt_token
        if command.call.op == "begin":
            return await engine.begin(self.candidate, token)
        if command.call.op == "bucket":
            return await engine.transfer_bucket(self.candidate, token, command.index)
        return await engine.end(self.candidate, token)
