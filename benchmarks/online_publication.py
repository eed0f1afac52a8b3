"""Online publication benchmark (issue 9, RFC §7.3): managed publication vs today's pause-and-overwrite.

Same engines, the same agentic sessions (the demo's: tool turns between generations), no fault injection,
two modes:

- managed: `Publisher.publish` of a new immutable version while sessions keep running; sessions bound to
  the old version finish on it, then it is reclaimed (outside the measured windows, traffic running);
- baseline (what Relax does today): POST /pause_generation {"mode": "abort"} -> /flush_cache ->
  /unload_lora_adapter + /load_lora_adapter of the same unmanaged name -> /continue_generation, on both
  engines; every request carries that one fixed name.

Two methods (`--method`); the design of each is fixed before the run and printed first.

- open-loop (the default, and the figures; issue 22 part 6): sessions arrive on one seeded arrival schedule
  (round(`--rate` x `--window`) arrivals at uniform offsets drawn once from `--seed`: the rate's count, not a
  Poisson draw of it, which for one short period is often far off), repeated period
  after period: every window is offered the same requests at the same offsets, so the steady window of a
  pair is a like-for-like baseline for its publication window. A closed-loop run cannot resolve a 1% effect:
  its workers slow down with the engine, and its windows moved between 25 and 57 tokens/s on a quiet host
  (tput_ratio 0.749 [0.554, 1.309]). Many short pairs (default 30 per mode, 3 s windows); per pair and mode,
  `--settle` periods of that mode's traffic are discarded (the ramp-up of traffic started afresh, the cold
  cache after a baseline flush), then a control window, the steady window, and the publication window with
  the publication at the pair's seeded offset (the same for both modes of a pair). Steady over control
  (`null_ratio`) is what the method reads when nothing happens: near 1 with an interval as narrow as the
  goal's, or the tput_ratio beside it cannot be read. Reclaim, floor and candidate preparation run between
  pairs, without traffic. Under a load the engines keep up with, every request offered in a window is served
  inside it, so `tput_ratio` reads 1 unless the publication delays or loses work past the window's end: it is
  the delivered share of the offered work. What the engines could still do is read beside it (below).
- closed-loop (descriptive): triples of (control, steady, publication) windows of `--window` seconds each,
  the publication starting `--offset` seconds into its window; `--pairs` per mode, and before every triple
  the traffic of that mode runs a `--warmup` that is discarded.

Both: modes alternate pair by pair (M, B, M, B, ...). Per window: throughput (output tokens generated in the
window, `generated_tokens`, and completed requests per second), latency p50/p95/p99, longest
no-progress interval per engine (chunk arrival times of one streamed generation kept in flight per
engine), failed/aborted requests, cached-token rate of continuing turns, managed versions held, and the
engine-wide audit counters (pause/flush/abort_all), and the engines' own counts (`demo.engine_counters`,
engines started with `--enable-metrics`): decode tokens and forward passes, exact at the window's edges.
The engines' decode tokens include the progress monitor's stream, which runs flat out on every engine: so
`engine_tput_ratio` reads the engines' decode rate with the publication against without it, whatever the
offered load. (A 1024-token monitor stream instead of 16 tokens, tried at 7e6a8d8, did not narrow it:
benchmarks/results/RESULTS.md.) Ratios are publication window over steady window per pair; medians over pairs
with 95% bootstrap intervals (resampling pairs).

The publication floor is measured in the same run, under managed traffic, between windows: a raw gloo
transfer of the same buckets + one stock native load from the same tensors + the probe (see
`versioned_lora.demo.floor`).

Not a test: nothing is asserted. Last line (tput_ci: the 95% interval of tput_ratio):
    tput_ratio=… p95_ratio=… gap_ratio=… failed=… aborted=… pauses=… publish_s=… floor_ratio=… tput_ci=lo,hi

    python benchmarks/online_publication.py [--method open-loop|closed-loop] [--quick] [--out runs/bench]
        [--engines URL0,URL1 --token T --capability-key-file K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.intervals import bootstrap_median, fmt_interval
from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.engine_counters import Counts, EngineCounters, MetricsUnavailable, total, window_counts
from versioned_lora.demo.floor import RawTransferFloor, native_load_and_probe
from versioned_lora.demo.report import jsonable
from versioned_lora.demo.stack import Stack, ensure_ray, new_token, start_engines
from versioned_lora.demo.traffic import (
    ArrivalSchedule,
    ClosedLoopTraffic,
    OpenLoopTraffic,
    ProgressMonitor,
    RecordingBackend,
    RegistrySampler,
    TrafficShape,
    longest_gap,
    percentile,
    tool_with_latency,
)
from versioned_lora.fixtures import FIXTURE_NAMES, TINY, build_fixtures
from versioned_lora.lifecycle import SessionKey, VersionKey
from versioned_lora.runtime.agentic_driver import AgenticDriver
from versioned_lora.runtime.interfaces import BackendRequest, BackendResponse
from versioned_lora.runtime.session_binder import Binding, CloseReport

FIXED_NAME = "policy-fixed"  # the one unmanaged name the baseline overwrites (Relax's fixed adapter name)
DESIGN_KEYS = ("method", "window", "offset", "warmup", "settle", "pairs", "concurrency", "rate", "seed")
AUDITED = ("pause_generation", "flush_cache", "abort_all", "continue_generation", "base_weight_update")


# ------------------------------------------------------------------------------------------ baseline binder


class FixedNameBinder:
    """What the agentic layer does today: every request carries the one fixed adapter name; nothing is bound
    and nothing is released. Implements the part of `SessionBinder` that `AgenticDriver` uses."""

    def __init__(self, backend: Any, epoch: int) -> None:
        self.backend = backend
        self.epoch = epoch
        self.seq = 0
        self.binding = Binding(VersionKey(epoch, "fixed"), FIXED_NAME)
        self.ids: dict[SessionKey, str] = {}

    def open(self, session_id: str) -> SessionKey:
        key = SessionKey(self.epoch, 99, self.seq)
        self.seq += 1
        self.ids[key] = session_id
        return key

    async def bind_first(self, key: SessionKey) -> Binding:
        return self.binding

    async def generate(self, key: SessionKey, input_ids: Sequence[int], max_new_tokens: int, *,
                       sampling: Any = None, rid: str | None = None) -> BackendResponse:
        request = BackendRequest(rid or f"{self.ids[key]}/x", tuple(input_ids), FIXED_NAME, max_new_tokens,
                                 dict(sampling or {}))
        response: BackendResponse = await self.backend.generate(request)
        return response

    async def abort(self, key: SessionKey, rid: str) -> None:
        await self.backend.abort(rid)

    async def resolve_unknown(self, key: SessionKey, rid: str) -> None:
        await self.backend.abort(rid)

    async def finish(self, key: SessionKey) -> CloseReport:
        self.ids.pop(key, None)
        return CloseReport(key, False, (), ())


async def overwrite_publication(clients: Sequence[SGLangClient], adapter_dir: Path) -> dict[str, float]:
    """Relax today, on every engine at once: pause (abort) -> flush -> unload + load the same name -> continue."""
    http = [c._http for c in clients]  # the stock control endpoints; the client has no wrapper for these
    phases: dict[str, float] = {}

    async def each(label: str, call: Callable[[Any], Any]) -> None:
        started = time.monotonic()
        answers = await asyncio.gather(*(call(h) for h in http))
        for answer in answers:
            if answer.status_code != 200:
                raise RuntimeError(f"{label}: HTTP {answer.status_code} {answer.text[:200]}")
        phases[label] = time.monotonic() - started

    await each("pause", lambda h: h.post("/pause_generation", json={"mode": "abort"}))
    await each("flush", lambda h: h.post("/flush_cache"))
    await each("unload", lambda h: h.post("/unload_lora_adapter", json={"lora_name": FIXED_NAME}))
    await each("load", lambda h: h.post("/load_lora_adapter", json={"lora_name": FIXED_NAME,
                                                                    "lora_path": str(adapter_dir)}))
    await each("continue", lambda h: h.post("/continue_generation", json={"torch_empty_cache": False}))
    return phases


# ------------------------------------------------------------------------------------------ measurement


@attrs.define
class Window:
    mode: str
    kind: str  # control | steady | publication (control: open-loop only, a second steady window just before)
    pair: int
    start: float
    end: float
    audit: dict[str, int] = attrs.field(factory=dict)
    managed_max: int = 0
    engine: dict[str, Counts] | None = None  # each engine's counters over the window (None: not exported)
    figures: dict[str, Any] = attrs.field(factory=dict)


def engine_figures(window: Window) -> dict[str, Any]:
    """What the engines counted over the window (`demo.engine_counters`): decode tokens and forward passes."""
    if window.engine is None:
        return {"engine_tokens_per_s": None}
    seconds = window.end - window.start
    summed = total(list(window.engine.values()))
    return {
        "engine_tokens_per_s": summed.decode_tokens / seconds,
        "engine_decode_passes_per_s": summed.decode_passes / seconds,
        "engine_prefill_passes": summed.prefill_passes,
        "engine_tokens_per_s_by_engine": {k: c.decode_tokens / seconds for k, c in window.engine.items()},
    }


def window_figures(window: Window, recorder: RecordingBackend, monitor: ProgressMonitor) -> dict[str, Any]:
    inside = [r for r in recorder.records if window.start <= r.end < window.end]
    ok = [r for r in inside if r.outcome == "ok"]
    latencies = [r.latency for r in ok]
    seconds = window.end - window.start
    continuing = [r for r in ok if r.turn > 0]
    gaps = [longest_gap(chunks, window.start, window.end) for chunks in monitor.chunks]
    return {
        "requests_ok": len(ok),
        "throughput_rps": len(ok) / seconds,
        "tokens_per_s": generated_tokens(recorder.records, window.start, window.end) / seconds,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "latency_p99_s": percentile(latencies, 0.99),
        "no_progress_s": {f"E{i}": g for i, g in enumerate(gaps)},
        "no_progress_max_s": max(gaps),
        "failed": sum(1 for r in inside if r.outcome == "failed"),
        "aborted": sum(1 for r in inside if r.outcome == "aborted"),
        "unknown": sum(1 for r in inside if r.outcome == "unknown"),
        "cached_token_rate_continuing": (sum(r.cached_tokens for r in continuing)
                                         / max(1, sum(r.prompt_tokens for r in continuing))),
        **engine_figures(window),
    }


def generated_tokens(records: Sequence[Any], start: float, end: float) -> float:
    """Output tokens generated inside [start, end): each successful request's tokens spread evenly over its
    lifetime and counted by overlap. The throughput the ratios use: a window holds only 20-30 completed
    requests, so counting whole requests by their end time moves a window's rate by a request's share
    (3-5%) on where one request happens to end; this estimate counts what was generated in the window."""
    total = 0.0
    for r in records:
        if r.outcome != "ok" or r.end <= start or r.start >= end:
            continue
        lifetime = max(r.end - r.start, 1e-9)
        total += r.output_tokens * (min(r.end, end) - max(r.start, start)) / lifetime
    return total


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def engine_ratio(a: dict[str, Any], b: dict[str, Any] | None) -> float | None:
    """Two windows' engine-counted decode tokens/s, a over b (None where the engines did not count them)."""
    if b is None or a.get("engine_tokens_per_s") is None or b.get("engine_tokens_per_s") is None:
        return None
    return ratio(a["engine_tokens_per_s"], b["engine_tokens_per_s"])


# ------------------------------------------------------------------------------------------ the run


class Bench:
    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack = stack
        self.args = args
        self.shape = TrafficShape(concurrency=args.concurrency)
        self.recorder = RecordingBackend(stack.backend, stack.route)
        self.monitor = ProgressMonitor(list(stack.clients.values()))
        self.sampler = RegistrySampler(stack.registry, list(stack.clients.values()), stack.labels.get)
        self.counters: EngineCounters | None = EngineCounters({k: c.base_url for k, c in stack.clients.items()})
        self.windows: list[Window] = []
        self.publications: list[dict[str, Any]] = []
        self.floors: list[dict[str, float]] = []
        self.reclaims: list[dict[str, Any]] = []
        self.floor_errors: list[str] = []
        self.current: tuple[VersionKey, str] | None = None  # managed default (version, label)
        self.serial = 0
        self.shard = 0

    async def audit_total(self) -> dict[str, int]:
        audit = await self.stack.audit()
        return {k: sum(a[k] for a in audit.values()) for k in AUDITED}

    def traffic(self, mode: str) -> ClosedLoopTraffic:
        if mode == "managed":
            self.shard += 1
            binder: Any = self.stack.new_binder(self.recorder, shard=self.shard)
        else:
            binder = FixedNameBinder(self.recorder, self.stack.epoch)
        driver = AgenticDriver(binder, tool=tool_with_latency(self.shape.tool_latency_s))
        return ClosedLoopTraffic(driver, self.shape, name=f"{mode[0]}{len(self.windows)}-", seed=len(self.windows))

    def open_traffic(self, mode: str, schedule: ArrivalSchedule) -> OpenLoopTraffic:
        if mode == "managed":
            self.shard += 1
            binder: Any = self.stack.new_binder(self.recorder, shard=self.shard)
        else:
            binder = FixedNameBinder(self.recorder, self.stack.epoch)
        driver = AgenticDriver(binder, tool=tool_with_latency(self.shape.tool_latency_s))
        return OpenLoopTraffic(driver, self.shape, schedule, name=f"{mode[0]}{len(self.windows)}-")

    def next_candidate(self) -> tuple[VersionKey, Candidate]:
        """The next version, frozen with its probe reference the way a trainer prepares one before publishing
        it: before the window opens, so that CPU work (a snapshot hash and a PEFT forward on this process's
        event loop, where the progress monitor also reads its chunks) is not measured as an engine stall."""
        self.serial += 1
        return self.stack.candidate(f"v{self.serial}", adapter="AB"[self.serial % 2])

    async def publish_managed(self, prepared: tuple[VersionKey, Candidate]) -> dict[str, Any]:
        version, candidate = prepared
        label = version.version_id
        started = time.monotonic()
        outcome = await self.stack.publisher.publish(version, candidate)
        seconds = time.monotonic() - started
        if not outcome.committed:
            raise RuntimeError(f"managed publication of {label} failed: {outcome}")
        previous = self.current
        self.current = (version, label)
        return {"mode": "managed", "version": label, "start": started, "seconds": seconds,
                "phases": dict(outcome.phases), "previous": previous}

    async def reclaim_previous(self, previous: tuple[VersionKey, str] | None) -> None:
        if previous is None:
            return
        version, label = previous
        started = time.monotonic()
        while time.monotonic() - started < 120:
            entry = (await self.stack.registry.publication_view()).versions.get(version)
            if entry is None or entry.session_refs == 0:
                break
            await asyncio.sleep(0.25)
        outcome = await self.stack.reclaimer.reclaim(version)
        self.reclaims.append({"version": label, "status": outcome.status, "seconds": outcome.seconds,
                              "waited_for_sessions_s": time.monotonic() - started - outcome.seconds})
        if outcome.status != "RECLAIMED":
            # Its sessions have not all finished (a very slow machine): try again before the next managed
            # publication, which needs the slot.
            self._pending_reclaim = previous
            print(f"  reclaim of {label}: {outcome.status}; retried later", flush=True)

    async def publish_baseline(self) -> dict[str, Any]:
        self.serial += 1
        started = time.monotonic()
        phases = await overwrite_publication(list(self.stack.clients.values()),
                                             self.stack.fixtures.adapters["AB"[self.serial % 2]])
        return {"mode": "baseline", "version": FIXED_NAME, "start": started, "seconds": time.monotonic() - started,
                "phases": phases}

    async def measure_floor(self, raw: RawTransferFloor) -> None:
        transfer = await raw.measure()
        load, probe = await native_load_and_probe(list(self.stack.clients.values()), raw.candidate.snapshot,
                                                  list(self.stack.fixtures.probe_prompt))
        self.floors.append({"raw_transfer_s": transfer, "native_load_s": load, "probe_s": probe,
                            "floor_s": transfer + load + probe})

    async def window(self, mode: str, kind: str, pair: int) -> Window:
        prepared = self.next_candidate() if (mode, kind) == ("managed", "publication") else None
        if kind == "control" and mode == "managed" and self._pending_reclaim is not None:
            pending, self._pending_reclaim = self._pending_reclaim, None
            await self.reclaim_previous(pending)  # outside the window: its clock starts after this
        return await self.window_at(mode, kind, pair, time.monotonic(), self.args.offset, prepared)

    async def window_at(self, mode: str, kind: str, pair: int, start: float, offset: float,
                        prepared: tuple[VersionKey, Candidate] | None) -> Window:
        """One measured window, [start, start + window): the open-loop method aligns `start` with the arrival
        schedule's period, the closed-loop one starts it now. A publication window publishes `offset` seconds
        in (the managed candidate prepared before the window)."""
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        counted = await self.read_counters()
        audit = await self.audit_total()
        window = Window(mode, kind, pair, start, start + self.args.window)
        publication: dict[str, Any] | None = None
        if kind == "publication":
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            publication = await (self.publish_managed(prepared) if prepared is not None else self.publish_baseline())
            publication["start"] -= self.t0
            publication["pair"] = pair
            publication["offset_s"] = offset
            self.publications.append(publication)
        await asyncio.sleep(max(0.0, window.end - time.monotonic()))
        counted_after = await self.read_counters()
        if counted is not None and counted_after is not None:
            window.engine = window_counts(counted, counted_after)
        after = await self.audit_total()
        window.audit = {k: after[k] - audit[k] for k in AUDITED}
        window.managed_max = max((s.managed for s in self.sampler.samples if start <= s.t <= window.end), default=0)
        self.windows.append(window)
        if publication is not None and publication.get("previous") is not None:
            self._pending_reclaim = publication["previous"]
        return window

    async def read_counters(self) -> dict[str, Counts] | None:
        """The engines' counters now, or None for engines that do not export them (attached ones started
        without `--enable-metrics`: the engine ratios are then left out, and the run says so)."""
        if self.counters is None:
            return None
        try:
            return await self.counters.read()
        except MetricsUnavailable as exc:
            print(f"  engine counters unavailable ({exc}): no engine_tput_ratio in this run", flush=True)
            await self.counters.close()
            self.counters = None
            return None

    async def run_open_loop(self, raw: RawTransferFloor | None) -> None:
        """Per pair and mode (modes alternating pair by pair): open-loop traffic on the one seeded schedule,
        period 0 discarded (warm-up, and the cold cache after a baseline flush), period 1 the steady window,
        period 2 the publication window with the publication at the pair's seeded offset (the same for both
        modes of a pair). Everything else (reclaim, floor, candidate preparation) happens between pairs,
        outside the traffic."""
        args = self.args
        schedule = ArrivalSchedule.seeded(args.window, args.rate, args.seed)
        self.schedule = schedule
        offsets = random.Random(args.seed + 1)
        floors_left = args.floors
        for pair in range(args.pairs):
            offset = offsets.uniform(0.1, 0.6) * args.window
            for mode in ("managed", "baseline") if pair % 2 == 0 else ("baseline", "managed"):
                prepared = self.next_candidate() if mode == "managed" else None
                traffic = self.open_traffic(mode, schedule)
                t0 = time.monotonic() + 0.05
                traffic.start(t0)
                first = args.settle  # periods 0 .. settle-1 are discarded: the traffic ramps up through them
                for period, kind in ((first, "control"), (first + 1, "steady"), (first + 2, "publication")):
                    w = await self.window_at(mode, kind, pair, t0 + period * args.window, offset, prepared)
                    print(f"  {mode:8s} pair {pair} {kind:11s} done; audit {w.audit}", flush=True)
                traffic.stop()
                await traffic.join()
                self.transcripts = getattr(self, "transcripts", []) + traffic.transcripts
                if mode == "managed":
                    pending, self._pending_reclaim = self._pending_reclaim, None
                    await self.reclaim_previous(pending)
                    if self._pending_reclaim is not None:  # not yet RECLAIMED: the next publication needs the slot
                        pending, self._pending_reclaim = self._pending_reclaim, None
                        await self.reclaim_previous(pending)
                    if raw is not None and floors_left > 0:
                        floors_left -= 1
                        await self._floor(raw)

    async def _floor(self, raw: RawTransferFloor) -> None:
        try:
            await self.measure_floor(raw)
            print(f"  floor: {json.dumps(jsonable(self.floors[-1]))}", flush=True)
        except Exception as exc:  # a floor that could not be measured is reported, not fatal
            self.floor_errors.append(f"{type(exc).__name__}: {exc}"[:500])
            print(f"  floor measurement failed: {self.floor_errors[-1]}", flush=True)

    async def run(self) -> None:
        stack, args = self.stack, self.args
        self.t0 = time.monotonic()
        self._pending_reclaim = None
        await stack.publisher.sync_incarnations()
        first = await self.publish_managed(self.next_candidate())  # bootstrap: the managed mode's first default
        self.publications.append({**first, "start": first["start"] - self.t0, "pair": -1, "bootstrap": True})
        for client in stack.clients.values():  # the baseline's fixed name, loaded once up front
            if await client.adapter(FIXED_NAME) is not None:  # left by an interrupted run
                await client.unload_lora_adapter(FIXED_NAME)
            result = await client.load_lora_adapter(FIXED_NAME, str(stack.fixtures.adapters["A"]))
            if not result.get("success"):
                raise RuntimeError(f"loading {FIXED_NAME}: {result}")
        raw = RawTransferFloor(stack.candidates[self.current[0]], repeats=args.floors) if self.current else None
        self.sampler.start()
        self.monitor.start()
        floors_left = args.floors
        try:
            if args.method == "open-loop":
                await self.run_open_loop(raw)
                return
            for pair in range(args.pairs):
                for mode in ("managed", "baseline") if pair % 2 == 0 else ("baseline", "managed"):
                    traffic = self.traffic(mode)
                    traffic.start()
                    await asyncio.sleep(args.warmup)  # discarded: mode switch, and the cold cache after a flush
                    for kind in ("control", "steady", "publication"):
                        w = await self.window(mode, kind, pair)
                        print(f"  {mode:8s} pair {pair} {kind:11s} done; audit {w.audit}", flush=True)
                    if mode == "managed":
                        pending, self._pending_reclaim = self._pending_reclaim, None
                        await self.reclaim_previous(pending)
                        if raw is not None and floors_left > 0:
                            floors_left -= 1
                            await self._floor(raw)
                    traffic.stop()
                    await traffic.join()
                    self.transcripts = getattr(self, "transcripts", []) + traffic.transcripts
        finally:
            await self.monitor.stop()
            await self.sampler.stop()
            if self.counters is not None:
                await self.counters.close()
            if raw is not None:
                try:
                    await raw.close()
                except Exception as exc:  # the receivers are daemons; they die with this process
                    self.floor_errors.append(f"close: {type(exc).__name__}: {exc}"[:300])
            for client in stack.clients.values():
                await client.unload_lora_adapter(FIXED_NAME)

    def report(self) -> dict[str, Any]:
        # Computed after the run: the progress monitor appends a stream's chunk times when it completes.
        for w in self.windows:
            w.figures = window_figures(w, self.recorder, self.monitor)
            _log_window(w)
        per_mode: dict[str, Any] = {}
        for mode in ("managed", "baseline"):
            pairs = sorted({w.pair for w in self.windows if w.mode == mode})
            rows = []
            for pair in pairs:
                steady = next(w for w in self.windows if (w.mode, w.kind, w.pair) == (mode, "steady", pair))
                pub = next(w for w in self.windows if (w.mode, w.kind, w.pair) == (mode, "publication", pair))
                s, p = steady.figures, pub.figures
                control = next((w for w in self.windows if (w.mode, w.kind, w.pair) == (mode, "control", pair)), None)
                rows.append({
                    "pair": pair,
                    # Steady over the control window just before it, with no publication in either: what the
                    # method reads when nothing happens (its bias, and by its interval the width it can resolve).
                    "null_ratio": None if control is None else ratio(s["tokens_per_s"],
                                                                     control.figures["tokens_per_s"]),
                    "tput_ratio": ratio(p["tokens_per_s"], s["tokens_per_s"]),
                    # The engines' own decode tokens (every stream on them, the progress monitor's included):
                    # what they did in the window, whatever the offered load asked of them.
                    "engine_null_ratio": engine_ratio(s, None if control is None else control.figures),
                    "engine_tput_ratio": engine_ratio(p, s),
                    "rps_ratio": ratio(p["throughput_rps"], s["throughput_rps"]),
                    "p95_ratio": ratio(p["latency_p95_s"], s["latency_p95_s"]),
                    "gap_ratio": ratio(p["no_progress_max_s"], s["no_progress_max_s"]),
                    "cache_rate_steady": s["cached_token_rate_continuing"],
                    "cache_rate_publication": p["cached_token_rate_continuing"],
                })
            mine = [w for w in self.windows if w.mode == mode]
            pubs = [x for x in self.publications if x["mode"] == mode and not x.get("bootstrap")]
            per_mode[mode] = {
                "pairs": rows,
                "tput_ratio": bootstrap_median([r["tput_ratio"] for r in rows]),
                "null_ratio": bootstrap_median([r["null_ratio"] for r in rows if r["null_ratio"] is not None]),
                "engine_tput_ratio": bootstrap_median([r["engine_tput_ratio"] for r in rows
                                                       if r["engine_tput_ratio"] is not None]),
                "engine_null_ratio": bootstrap_median([r["engine_null_ratio"] for r in rows
                                                       if r["engine_null_ratio"] is not None]),
                "rps_ratio": bootstrap_median([r["rps_ratio"] for r in rows]),
                "p95_ratio": bootstrap_median([r["p95_ratio"] for r in rows]),
                "gap_ratio": bootstrap_median([r["gap_ratio"] for r in rows]),
                "publish_s": bootstrap_median([x["seconds"] for x in pubs]),
                "failed": sum(w.figures["failed"] for w in mine),
                "aborted": sum(w.figures["aborted"] for w in mine),
                "unknown": sum(w.figures["unknown"] for w in mine),
                "audit": {k: sum(w.audit.get(k, 0) for w in mine) for k in AUDITED},
                "managed_versions_max": max((w.managed_max for w in mine), default=0),
                "cache_rate_steady": bootstrap_median([r["cache_rate_steady"] for r in rows]),
                "cache_rate_publication": bootstrap_median([r["cache_rate_publication"] for r in rows]),
            }
        floor = bootstrap_median([f["floor_s"] for f in self.floors])
        managed_publish = per_mode["managed"]["publish_s"][0]
        return {
            "design": {k: getattr(self.args, k) for k in DESIGN_KEYS},
            "arrival_schedule": None if getattr(self, "schedule", None) is None else attrs.asdict(self.schedule),
            "traffic_shape": attrs.asdict(self.shape),
            "modes": per_mode,
            "floor": {"components": self.floors, "errors": self.floor_errors, "floor_s": floor,
                      "floor_ratio": ratio(managed_publish, floor[0])},
            "publications": [{k: v for k, v in p.items() if k != "previous"} for p in self.publications],
            "reclaims": self.reclaims,
            "windows": [{"mode": w.mode, "kind": w.kind, "pair": w.pair, "start": w.start - self.t0,
                         "end": w.end - self.t0, "audit": w.audit, "managed_max": w.managed_max,
                         "engine_counts": None if w.engine is None else {k: attrs.asdict(c) for k, c in
                                                                          w.engine.items()},
                         **w.figures}
                        for w in self.windows],
            "managed_over_time": [{"t": s.t - self.t0, "registry": s.managed, "engines": list(s.engine_managed)}
                                  for s in self.sampler.samples],
            "progress_probe_errors": self.monitor.errors[:20],
            "session_errors": [t.error for t in getattr(self, "transcripts", []) if t.error][:20],
        }


def _log_window(w: Window) -> None:
    f = w.figures
    engine = "" if f.get("engine_tokens_per_s") is None else (
        f" (engines {f['engine_tokens_per_s']:6.1f} tok/s, {f['engine_decode_passes_per_s']:5.1f} decode passes/s)")
    print(f"  {w.mode:8s} pair {w.pair} {w.kind:11s} {f['tokens_per_s']:6.1f} tok/s{engine} "
          f"{f['throughput_rps']:5.2f} req/s  p95 "
          f"{1000 * f['latency_p95_s']:6.0f} ms  gap {f['no_progress_max_s']:5.2f} s  failed {f['failed']} "
          f"aborted {f['aborted']}  cache {f['cached_token_rate_continuing']:.0%}  audit {w.audit}", flush=True)


def last_line(managed: dict[str, Any], floor_ratio: float) -> str:
    """The machine-readable summary line (issue 9): managed mode's medians and the floor ratio."""
    m = managed
    return (f"tput_ratio={m['tput_ratio'][0]:.3f} p95_ratio={m['p95_ratio'][0]:.3f} gap_ratio={m['gap_ratio'][0]:.3f} "
            f"failed={m['failed']} aborted={m['aborted']} pauses={m['audit']['pause_generation']} "
            f"publish_s={m['publish_s'][0]:.3f} floor_ratio={floor_ratio:.3f} "
            f"tput_ci={m['tput_ratio'][1]:.3f},{m['tput_ratio'][2]:.3f}")


async def _main(args: argparse.Namespace, urls: list[str], token: str | None, fixtures: Any, out: Path,
                key_file: Path) -> int:
    stack = Stack(urls, token, out, fixtures, capability_key_file=key_file)
    stack.bucket_bytes = args.bucket_bytes
    bench = Bench(stack, args)
    try:
        await bench.run()
    finally:
        if args.engines:
            await stack.unload_leftovers()
        await stack.close()
    report = bench.report()
    (out / "online_publication.json").write_text(json.dumps(jsonable(report), indent=2))
    for mode, m in report["modes"].items():
        print(f"{mode:8s} tput_ratio {fmt_interval(m['tput_ratio'])}  (req/s ratio {fmt_interval(m['rps_ratio'])})  "
              f"p95_ratio {fmt_interval(m['p95_ratio'])}  gap_ratio "
              f"{fmt_interval(m['gap_ratio'])}  publish_s {fmt_interval(m['publish_s'])}  failed {m['failed']} "
              f"aborted {m['aborted']} unknown {m['unknown']}  audit {m['audit']}  cached-token rate steady "
              f"{m['cache_rate_steady'][0]:.0%} -> publication {m['cache_rate_publication'][0]:.0%}  "
              f"versions held max {m['managed_versions_max']}")
    fl = report["floor"]
    managed = report["modes"]["managed"]
    null, engine, engine_null = managed["null_ratio"], managed["engine_tput_ratio"], managed["engine_null_ratio"]
    print(f"null_ratio={null[0]:.3f} null_ci={null[1]:.3f},{null[2]:.3f} (managed steady over control: no "
          f"publication in either window)")
    print(f"engines' own decode tokens: engine_tput_ratio={engine[0]:.3f} engine_tput_ci={engine[1]:.3f},"
          f"{engine[2]:.3f} engine_null_ratio={engine_null[0]:.3f} engine_null_ci={engine_null[1]:.3f},"
          f"{engine_null[2]:.3f}")
    print(f"floor_s {fmt_interval(fl['floor_s'])} (raw transfer + native load + probe; components in the JSON)")
    print(f"report: {out / 'online_publication.json'}")
    print(last_line(report["modes"]["managed"], fl["floor_ratio"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--method", default="open-loop", choices=("open-loop", "closed-loop"),
                        help="open-loop: sessions on a seeded arrival schedule, many short window pairs (the "
                             "figures); closed-loop: the agentic sessions back to back (descriptive)")
    parser.add_argument("--pairs", type=int, help="window pairs per mode (default: open-loop 30, closed-loop 5)")
    parser.add_argument("--window", type=float, help="window length, seconds (default: open-loop 3, closed-loop 15; "
                        "open-loop: also the arrival schedule's period)")
    parser.add_argument("--offset", type=float, default=3.0,
                        help="closed-loop: publication start within its window, seconds (open-loop: seeded per pair)")
    parser.add_argument("--warmup", type=float, default=6.0,
                        help="closed-loop: discarded traffic before every pair, seconds (open-loop: one period)")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop agentic sessions")
    # 6/s (3 turns of 12 tokens each: ~216 tokens/s offered) saturated the two tiny engines of the 2-core host,
    # which delivered ~100 tokens/s: queues grew through every window (2026-12-02-online-publication-open-loop-
    # rate6.txt). An open-loop load must stay well below what the engines deliver.
    # One discarded period was not enough (2026-12-03-online-publication-open-loop-rate1.5): the traffic, started
    # afresh per pair and mode, was still ramping up, its steady windows completing 19 of the 36 requests a
    # period offers and its publication windows 26, and each pair's two windows splitting one backlog (request
    # counts correlated -0.6), so the ratio read the ramp, not the publication.
    # With one torch thread per engine (EngineConfig.cpu_threads, 2026-12-04) a request of this load lives ~0.1 s
    # and a session ~1 s: one discarded period is the whole ramp-up, and 4 cost 9 of every 21 s of traffic.
    parser.add_argument("--settle", type=int, default=1,
                        help="open-loop: periods discarded per pair and mode before its control window")
    parser.add_argument("--rate", type=float, default=1.5, help="open-loop: session arrivals per second")
    parser.add_argument("--seed", type=int, default=7, help="open-loop: the arrival schedule and publication offsets")
    parser.add_argument("--floors", type=int, default=5, help="floor measurements (one after each managed pair)")
    parser.add_argument("--bucket-bytes", type=int, default=1 << 20,
                        help="max bucket size (default 1 MiB: the ~28 KB fixture adapter is one bucket)")
    parser.add_argument("--quick", action="store_true", help="window 8 s, offset 2 s, warm-up 4 s")
    parser.add_argument("--engines", help="attach to running engines: URL0,URL1 (default: start two)")
    parser.add_argument("--token", help="managed-endpoint token of the attached engines")
    parser.add_argument("--capability-key-file", help="the capability key file the attached engines were started with")
    parser.add_argument("--fixture", default=TINY, choices=FIXTURE_NAMES,
                        help="model and adapters A/B (qwen3-0.6b-shape: r=64 on all seven modules, ~80 MB)")
    args = parser.parse_args(argv)
    open_loop = args.method == "open-loop"
    args.pairs = args.pairs or (20 if open_loop else 5)  # open loop: 20 pairs, ~10 minutes of traffic
    args.window = args.window or (3.0 if open_loop else 15.0)
    if args.quick:
        if open_loop:
            args.pairs = 6
        else:
            args.window, args.offset, args.warmup = 8.0, 2.0, 4.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if open_loop:
        print(f"design (fixed before the run): open loop; {args.pairs} pairs per mode, alternating; window "
              f"{args.window}s = the period of one seeded arrival schedule (seed {args.seed}, {args.rate}/s); per "
              f"pair and mode {args.settle} periods discarded, then control, steady, and publication at a seeded "
              f"offset in [0.1, 0.6] of the window; buckets <= {args.bucket_bytes} bytes; fixture {args.fixture}",
              flush=True)
    else:
        print(f"design (fixed before the run): closed loop; {args.pairs} pairs per mode, alternating; window "
              f"{args.window}s; publication at +{args.offset}s; warm-up {args.warmup}s discarded before every pair; "
              f"{args.concurrency} closed-loop agentic sessions; buckets <= {args.bucket_bytes} bytes; "
              f"fixture {args.fixture}", flush=True)
    fixtures = build_fixtures(fixture=args.fixture)
    started_ray = ensure_ray()
    engines = []
    try:
        if args.engines:
            urls, token = args.engines.split(","), args.token
            if not args.capability_key_file:
                parser.error("--engines needs --capability-key-file: the key the engines were started with")
            key_file = Path(args.capability_key_file)
        else:
            token = new_token()
            key_file = write_key_file(out / "capability.key")  # the engines' and the registry actor's
            began = time.monotonic()
            # --enable-metrics: the scheduler's own counters (demo.engine_counters), read at every window's edges
            engines = start_engines(fixtures, out, token, capability_key_file=key_file,
                                    extra_args=("--enable-metrics",))
            print(f"engines up in {time.monotonic() - began:.0f}s", flush=True)
            urls = [e.url for e in engines]
        return asyncio.run(_main(args, urls, token, fixtures, out, key_file))
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
