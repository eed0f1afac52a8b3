"""Closed-loop agentic traffic and what is recorded about it.

- `RecordingBackend` wraps the real `GenerationBackend` (SGLangBackend): every backend attempt is
  recorded (start, end, engine, lora_path, prompt and cached tokens, outcome). An attempt that comes
  back with finish_reason "abort" counts as aborted even though the agentic driver resumes it.
- `ClosedLoopTraffic` runs `concurrency` workers; each runs one agentic session after another through
  `AgenticDriver` (first generation binds the version, tool turns in between, finish closes it).
- `OpenLoopTraffic` starts the same sessions on a fixed `ArrivalSchedule` instead, period after period,
  whether or not earlier ones have finished.
- `ProgressMonitor` keeps one streamed greedy generation in flight per engine and records when each
  chunk arrives: the longest interval without a new token is the engine's no-progress gap.
- `RegistrySampler` records the registry's view (default, versions held, session refs) over time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from versioned_lora.adapters.sglang_client import SGLangClient, UnknownOutcome
from versioned_lora.ops.status_view import held_per_engine, read_engine, status_rows
from versioned_lora.runtime.agentic_driver import AgenticDriver, SessionScript, SessionTranscript
from versioned_lora.runtime.interfaces import (
    BackendFailure,
    BackendRequest,
    BackendResponse,
    GenerationBackend,
    OutcomeUnknown,
    RegistryPort,
)

SHARED_PREFIX = tuple(range(40, 56))  # every session's prompt starts with the same 16 "system" tokens


@attrs.frozen
class RequestRecord:
    start: float
    end: float
    engine: int
    session_id: str
    turn: int
    lora_path: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    outcome: str  # ok | aborted | failed | unknown
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


class RecordingBackend:
    def __init__(self, inner: GenerationBackend, route: Callable[[BackendRequest], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.route = route
        self.clock = clock
        self.records: list[RequestRecord] = []
        self.in_flight = 0

    def _record(self, request: BackendRequest, start: float, outcome: str, response: BackendResponse | None = None,
                detail: str = "") -> None:
        session_id, _, rest = request.rid.partition("/")
        turn = int(rest.split("/")[0][1:]) if rest.startswith("t") else 0
        self.records.append(RequestRecord(
            start, self.clock(), self.route(request), session_id, turn, request.lora_path, len(request.input_ids),
            len(response.output_ids) if response else 0, response.cached_tokens if response else 0, outcome, detail,
        ))

    async def generate(self, request: BackendRequest) -> BackendResponse:
        start = self.clock()
        self.in_flight += 1
        try:
            response = await self.inner.generate(request)
        except BackendFailure as exc:
            self._record(request, start, "failed", detail=str(exc)[:300])
            raise
        except (OutcomeUnknown, asyncio.CancelledError) as exc:
            self._record(request, start, "unknown", detail=type(exc).__name__)
            raise
        finally:
            self.in_flight -= 1
        self._record(request, start, "aborted" if response.finish_reason == "abort" else "ok", response)
        return response

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)


@attrs.frozen
class TrafficShape:
    concurrency: int = 4  # closed-loop sessions in flight at any time
    turns: int = 3  # generations per session; a tool turn sits between consecutive ones
    max_new_tokens: int = 12
    tool_latency_s: float = 0.05  # the tool's own time between turns
    prompt_tokens: int = 8  # per-session tokens after the shared prefix


class ClosedLoopTraffic:
    """`concurrency` workers, each running agentic sessions back to back until `stop()`; a stopping worker
    finishes its current session first (sessions are never cut: they close through `finish`)."""

    def __init__(self, driver: AgenticDriver, shape: TrafficShape, name: str = "s", seed: int = 0) -> None:
        self.driver = driver
        self.shape = shape
        self.name = name
        self.rng = random.Random(seed)
        self.transcripts: list[SessionTranscript] = []
        self.sessions_started = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i), name=f"traffic-{self.name}-{i}")
                       for i in range(self.shape.concurrency)]

    def stop(self) -> None:
        self._stop.set()

    async def join(self) -> None:
        await asyncio.gather(*self._tasks)

    async def _worker(self, index: int) -> None:
        while not self._stop.is_set():
            self.sessions_started += 1
            session_id = f"{self.name}{index}-{self.sessions_started}"
            prompt = SHARED_PREFIX + tuple(self.rng.randrange(1, 500) for _ in range(self.shape.prompt_tokens))
            script = SessionScript(session_id, prompt, turns=self.shape.turns,
                                   max_new_tokens=self.shape.max_new_tokens)
            transcript = await self.driver.run_session(script)
            self.transcripts.append(transcript)


@attrs.frozen
class ArrivalSchedule:
    """When sessions start within one period: the same offsets in every period, so two windows of one
    period each see the same offered load, and what differs between them is what the engines did with it."""

    period_s: float
    offsets: tuple[float, ...]

    @classmethod
    def seeded(cls, period_s: float, rate_per_s: float, seed: int) -> ArrivalSchedule:
        """round(rate_per_s * period_s) arrivals at seeded uniform offsets in one period: Poisson arrivals
        conditioned on their count. The count is the rate's, not drawn: one period's Poisson count is as
        likely to be far from its mean as near it (seed 7 drew 12 arrivals in 3 s at 1.5/s, where the mean is
        4.5, and the run offered 2.7 times the load its rate said, saturating the engines)."""
        rng = random.Random(seed)
        count = max(1, round(rate_per_s * period_s))
        return cls(period_s, tuple(sorted(rng.uniform(0.0, period_s) for _ in range(count))))


class OpenLoopTraffic:
    """Agentic sessions that arrive on a fixed schedule, period after period from `start(t0)`, whether or not
    earlier ones have finished (open loop: a slow engine cannot lower the offered load, as closed-loop workers
    would). Each session's prompt is drawn from its arrival's index within the period, so every period offers
    the same requests."""

    def __init__(self, driver: AgenticDriver, shape: TrafficShape, schedule: ArrivalSchedule, name: str = "o",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.shape = shape
        self.schedule = schedule
        self.name = name
        self.clock = clock
        self.transcripts: list[SessionTranscript] = []
        self.sessions_started = 0
        self._stop = asyncio.Event()
        self._arrivals: asyncio.Task[None] | None = None
        self._sessions: set[asyncio.Task[None]] = set()
        self._prompts = [SHARED_PREFIX + tuple(random.Random(i).randrange(1, 500) for _ in range(shape.prompt_tokens))
                         for i in range(len(schedule.offsets))]

    def start(self, t0: float) -> None:
        self._arrivals = asyncio.create_task(self._arrive(t0), name=f"arrivals-{self.name}")

    def stop(self) -> None:
        self._stop.set()

    async def join(self) -> None:
        """After `stop()`: every session that arrived has finished (sessions are never cut)."""
        if self._arrivals is not None:
            await self._arrivals
        await asyncio.gather(*self._sessions)

    async def _arrive(self, t0: float) -> None:
        for period in itertools.count():
            for index, offset in enumerate(self.schedule.offsets):
                delay = t0 + period * self.schedule.period_s + offset - self.clock()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    return
                task = asyncio.create_task(self._session(period, index))
                self._sessions.add(task)
                task.add_done_callback(self._sessions.discard)

    async def _session(self, period: int, index: int) -> None:
        self.sessions_started += 1
        script = SessionScript(f"{self.name}{period}-{index}", self._prompts[index], turns=self.shape.turns,
                               max_new_tokens=self.shape.max_new_tokens)
        self.transcripts.append(await self.driver.run_session(script))


def tool_with_latency(seconds: float) -> Any:
    """The driver's deterministic echo tool, taking `seconds` like a real tool call would."""
    from versioned_lora.runtime.agentic_driver import echo_tool

    async def tool(session_id: str, turn: int, context: tuple[int, ...]) -> tuple[int, ...]:
        await asyncio.sleep(seconds)
        return await echo_tool(session_id, turn, context)

    return tool


class ProgressMonitor:
    """One streamed greedy generation in flight per engine at all times; `chunks[engine]` holds the arrival
    time of every chunk (one chunk per decoded token), so decode stalls show as gaps."""

    def __init__(self, clients: Sequence[SGLangClient], lora_path: str | None = None, tokens: int = 16) -> None:
        self.clients = list(clients)
        self.lora_path = lora_path
        self.tokens = tokens
        self.chunks: list[list[float]] = [[] for _ in self.clients]
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(len(self.clients))]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _run(self, index: int) -> None:
        client = self.clients[index]
        prompt = list(range(200, 224))
        while not self._stop.is_set():
            try:
                progress = await client.stream_progress(prompt, self.lora_path, self.tokens)
            except Exception as exc:
                self.errors.append(f"E{index}: {type(exc).__name__}: {str(exc)[:200]}")
                await asyncio.sleep(0.05)
                continue
            self.chunks[index].extend(t for t, _ in progress)


def longest_gap(times: Sequence[float], start: float, end: float) -> float:
    """Longest interval in [start, end] without an event (the window's edges count as events)."""
    inside = sorted(t for t in times if start <= t <= end)
    points = [start, *inside, end]
    return max((b - a for a, b in itertools.pairwise(points)), default=end - start)


@attrs.frozen
class RegistrySample:
    t: float
    default: str | None
    managed: int  # versions holding capacity in the registry
    states: dict[str, str]  # label -> version state
    refs: dict[str, int]  # label -> session refs
    engine_managed: tuple[int, ...]  # per engine, managed adapters READY or STAGING


class RegistrySampler:
    def __init__(self, registry: RegistryPort, clients: Sequence[SGLangClient], label_of: Callable[[str], str],
                 period_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.clients = list(clients)
        self.label_of = label_of
        self.period_s = period_s
        self.clock = clock
        self.samples: list[RegistrySample] = []
        self.rows: dict[str, Any] | None = None  # the last sample's status rows
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.sample()

    async def sample(self) -> RegistrySample:
        # The rows `versioned-lora status` shows (ops/status_view.py): one place turns registry and engine
        # state into what is displayed; the live view renders the same rows.
        view = await self.registry.publication_view()  # type: ignore[attr-defined]
        ops = await self.registry.operations_view()  # type: ignore[attr-defined]
        readings = [await read_engine(name, client) for name, client in zip(view.engines, self.clients, strict=False)]
        unreachable = [r.error for r in readings if r.status is None]
        if unreachable:
            raise UnknownOutcome(f"engine status unreadable: {unreachable}")
        rows = status_rows(view, ops, readings)
        self.rows = rows
        default = rows["registry"]["default"]
        sample = RegistrySample(
            self.clock(),
            self.label_of(default["lora_name"]) if default else None,
            rows["registry"]["capacity"]["used"],
            {self.label_of(v["lora_name"]): v["state"] for v in rows["versions"]},
            {self.label_of(v["lora_name"]): v["session_refs"] for v in rows["versions"]},
            held_per_engine(rows),
        )
        self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.sample()
            await asyncio.sleep(self.period_s)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[rank]
