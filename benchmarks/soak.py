"""A long RL-style run (issue 48): one publication per training step, for `--steps` steps, on two engines under
continuous agentic traffic, each retired version reclaimed as soon as it may be.

- Traffic: `--concurrency` closed-loop agentic sessions (the demo's: tool turns between generations; one in
  `ABORT_SHARE` aborts a turn mid-generation and resumes it), each closed through the binder. Beside them, on
  sessions of their own (bound, so the registry knows their version is in use), the traffic that finds the
  native LoRA refcount bugs reported upstream (sglang #31808, #36894, #34205): a request aborted while in
  prefill, an over-context request (the engine answers 400), a streamed request whose client disconnects after
  its first chunk.
- Trainer: a real PEFT training step on the fixture's adapter A each step (one AdamW step of the causal-LM loss
  on a seeded random batch, `snapshot_from_peft_model`), published with the library's Publisher. A publication
  refused for capacity waits for the reclaimer and tries again (counted).
- Reclaimer: every RETIRED version without session refs (and every RECLAIMING one) is reclaimed as soon as it
  is seen (polled every `RECLAIM_POLL_S`). Reclaim lag: from the later of the version's retirement (the next
  version's commit) and its last session's close, to its RECLAIMED answer. An unload (the reclaim call) over
  `SLOW_UNLOAD_S` counts as slow.
- Every `--drain-every` steps the traffic is drained (every session finished, nothing in flight) and every
  managed adapter's native refcount on every engine is read: each must be 0 (the client has nothing in flight);
  one that is not is a drift.
- Per publication: latency and phases, each engine's RSS (the server and its children) and LoRA pool slots
  (pinned adapters in SGLang's registry), each engine's status payload size, the journal's bytes (SQLite file,
  WAL included), the registry state's pickled size, versions managed.

Writes `soak.json` to `--out`, PNG plots (one figure per measure against the step) to `--plots`, and fits each
growth per publication (least squares) after `--warmup` steps. Last line:

    fixture=… capacity=… steps=N failed_requests=… max_managed=… rss_growth_kb_per_step=… journal_bytes_per_step=…
    reclaim_lag_p99_s=… refcount_drift=… slow_unloads=… failed_publications=…

    python benchmarks/soak.py [--steps 1000] [--fixture tiny|qwen3-0.6b-shape] [--out runs/soak] [--plots DIR]
        [--engines URL0,URL1 --token T --capability-key-file K]   (attach to running engines, as tests do)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pickle
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient
from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.report import jsonable
from versioned_lora.demo.stack import Stack, ensure_ray, new_token, start_engines
from versioned_lora.demo.traffic import SHARED_PREFIX, RecordingBackend, percentile, tool_with_latency
from versioned_lora.fixtures import FIXTURE_NAMES, TINY, build_fixtures
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.agentic_driver import AgenticDriver, SessionScript
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.session_binder import SessionBinder

ABORT_SHARE = 0.3  # agentic sessions whose one turn is aborted mid-generation and resumed
RECLAIM_POLL_S = 0.1
SLOW_UNLOAD_S = 2.0
CAPACITY_WAIT_S = 0.05
STUCK_S = 180.0  # a step that waits this long for a free slot ends the run (and its report says why)
# Liveness bounds with room for a loaded 2-core host (tests/e2e/deployment.py's), not speed targets.
DEADLINES = Deadlines(reserve=30.0, begin=90.0, bucket=60.0, commit=30.0, abort=30.0, report=30.0)


# ------------------------------------------------------------------------------------------ the trainer


class Trainer:
    """The fixture's adapter A as a trainable PEFT model over the fixture's base: `step()` is one optimizer step
    on a seeded random batch; `snapshot()` freezes the adapter's weights as they are now."""

    def __init__(self, fixtures: Any, seed: int = 0, lr: float = 1e-3) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.torch = torch
        # One intra-op thread: torch's default (every core) fought the two engines for this host's two cores, and
        # a step of the tiny fixture took 2.5 s instead of 0.07 s.
        torch.set_num_threads(1)
        # The tiny fixture trains in float32; the 0.6B shape in bfloat16 (memory on a shared host).
        self.dtype = torch.float32 if fixtures.name == TINY else torch.bfloat16
        base = AutoModelForCausalLM.from_pretrained(fixtures.model_dir, dtype=self.dtype)
        self.model = PeftModel.from_pretrained(base, fixtures.adapters["A"], is_trainable=True)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr)
        self.vocab = int(base.config.vocab_size)
        self.rng = torch.Generator().manual_seed(seed)
        self.losses: list[float] = []

    def step(self) -> float:
        batch = self.torch.randint(1, self.vocab, (2, 16), generator=self.rng)
        out = self.model(input_ids=batch, labels=batch)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
        self.losses.append(loss)
        return loss

    def snapshot(self) -> Any:
        from versioned_lora.adapters.snapshot import snapshot_from_peft_model

        return snapshot_from_peft_model(self.model, dtype=self.torch.bfloat16)


# ------------------------------------------------------------------------------------------ traffic


@attrs.define
class Counters:
    sessions: int = 0
    session_errors: list[str] = attrs.field(factory=list)
    prefill_aborts: int = 0
    over_context_400: int = 0
    over_context_other: list[str] = attrs.field(factory=list)
    disconnects: int = 0
    odd_failures: list[str] = attrs.field(factory=list)  # a request of the mixed traffic that failed unexpectedly
    in_flight: int = 0


class Traffic:
    """Agentic sessions and the mixed refcount-bug traffic, until `stop()`; `join()` waits for every session."""

    def __init__(self, stack: Stack, binder: SessionBinder, recorder: RecordingBackend, concurrency: int,
                 context_len: int, seed: int) -> None:
        self.stack = stack
        self.binder = binder
        self.recorder = recorder
        self.driver = AgenticDriver(binder, tool=tool_with_latency(0.02))
        self.concurrency = concurrency
        self.context_len = context_len
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.last_close: dict[VersionKey, float] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._agentic(i)) for i in range(self.concurrency)]
        self._tasks.append(asyncio.create_task(self._mixed()))

    def stop(self) -> None:
        self._stop.set()

    async def join(self) -> None:
        await asyncio.gather(*self._tasks)
        self._tasks = []

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}@E{self._n % 2}"

    async def _agentic(self, index: int) -> None:
        while not self._stop.is_set():
            session_id = self._name(f"s{index}-")
            prompt = SHARED_PREFIX + tuple(self.rng.randrange(1, 500) for _ in range(8))
            script = SessionScript(session_id, prompt, turns=3, max_new_tokens=8,
                                   abort_resume_turn=(self.rng.randrange(3) if self.rng.random() < ABORT_SHARE
                                                      else None), abort_after_s=0.01)
            transcript = await self.driver.run_session(script)
            self.counters.sessions += 1
            if transcript.error:
                self.counters.session_errors.append(f"{session_id}: {transcript.error}"[:300])
            if transcript.version is not None:
                self.last_close[transcript.version] = time.monotonic()

    async def _mixed(self) -> None:
        kinds = ("prefill_abort", "over_context", "disconnect")
        turn = 0
        while not self._stop.is_set():
            kind = kinds[turn % len(kinds)]
            turn += 1
            session_id = self._name(f"m{kind[0]}-")
            key = self.binder.open(session_id)
            version: VersionKey | None = None
            try:
                binding = await self.binder.bind_first(key)
                version = binding.version
                client = self.stack.clients[session_id.rsplit("@", 1)[1]]
                self.counters.in_flight += 1
                try:
                    await getattr(self, f"_{kind}")(client, binding.lora_path, session_id)
                finally:
                    self.counters.in_flight -= 1
            except Exception as exc:
                self.counters.odd_failures.append(f"{kind} {session_id}: {type(exc).__name__}: {exc}"[:300])
            finally:
                await self.binder.finish(key)
                if version is not None:
                    self.last_close[version] = time.monotonic()
            await asyncio.sleep(0.05)

    async def _prefill_abort(self, client: SGLangClient, lora_path: str, rid: str) -> None:
        """A long prompt, aborted while the engine is still on its prefill (or has it queued)."""
        prompt = [self.rng.randrange(1, 500) for _ in range(min(1024, self.context_len // 2))]
        call = asyncio.create_task(client.generate(prompt, lora_path, 32, rid=rid))
        try:
            await asyncio.sleep(0.002)
            await client.abort_request(rid)
        finally:  # the request is over before its session closes, whatever the abort did
            with contextlib.suppress(EngineHTTPError):  # an aborted request may come back as an error body
                await call
        self.counters.prefill_aborts += 1

    async def _over_context(self, client: SGLangClient, lora_path: str, rid: str) -> None:
        """More tokens than the model's context: the engine refuses it (400) after it took the adapter's name."""
        prompt = [self.rng.randrange(1, 500) for _ in range(self.context_len + 16)]
        try:
            await client.generate(prompt, lora_path, 4, rid=rid)
        except EngineHTTPError as exc:
            if exc.status_code == 400:
                self.counters.over_context_400 += 1
                return
            self.counters.over_context_other.append(f"HTTP {exc.status_code}")
            return
        self.counters.over_context_other.append("accepted")

    async def _disconnect(self, client: SGLangClient, lora_path: str, rid: str) -> None:
        """A streamed generation whose client goes away after the first chunk."""
        payload = {"input_ids": [self.rng.randrange(1, 500) for _ in range(24)], "lora_path": lora_path, "rid": rid,
                   "sampling_params": {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}, "stream": True}
        async with client._http.stream("POST", "/generate", json=payload) as response:
            if response.status_code != 200:
                raise EngineHTTPError(response.status_code, (await response.aread()).decode()[:300])
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # leaving the block closes the connection mid-stream
        self.counters.disconnects += 1


# ------------------------------------------------------------------------------------------ measurements


def rss_kb(server_pid: int | None) -> int:
    """RSS of an engine's server process and every descendant (scheduler, detokenizer), in kB."""
    import psutil

    if server_pid is None:
        return 0
    total = 0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(server_pid)
        for process in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
    return total // 1024


def journal_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace, fixtures: Any) -> None:
        self.stack = stack
        self.args = args
        self.fixtures = fixtures
        self.recorder = RecordingBackend(stack.backend, stack.route)
        self.binder = stack.new_binder(self.recorder, shard=0)
        context = int(json.loads((fixtures.model_dir / "config.json").read_text())["max_position_embeddings"])
        self.traffic = Traffic(stack, self.binder, self.recorder, args.concurrency, context, args.seed)
        self.trainer = Trainer(fixtures, seed=args.seed)
        self.rows: list[dict[str, Any]] = []
        self.drains: list[dict[str, Any]] = []
        self.reclaims: list[dict[str, Any]] = []
        self.retired_at: dict[VersionKey, float] = {}
        self.capacity_waits = 0
        self.max_managed = 0
        self.publish_failures: list[str] = []
        self._claimed_at: dict[VersionKey, float] = {}  # when a reclaim of the version was first asked for
        self._stop_reclaimer = asyncio.Event()

    # ---- the reclaimer
    async def reclaimer(self) -> None:
        while not self._stop_reclaimer.is_set():
            try:
                await self.reclaim_eligible()
            except Exception as exc:
                self.publish_failures.append(f"reclaimer: {type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(RECLAIM_POLL_S)

    async def reclaim_eligible(self) -> None:
        view = await self.stack.registry.publication_view()
        self.max_managed = max(self.max_managed, view.managed_count())
        for key, version in sorted(view.versions.items()):
            if str(version.state) not in ("RETIRED", "RECLAIMING") or version.session_refs:
                continue
            started = self._claimed_at.setdefault(key, time.monotonic())
            outcome = await self.stack.reclaimer.reclaim(key)
            done = time.monotonic()
            if str(outcome.status) != "RECLAIMED":  # PENDING (an engine still drains): asked again next poll
                continue
            ready = max(self.retired_at.get(key, started), self.traffic.last_close.get(key, 0.0))
            # unload_s: from the first reclaim call to the RECLAIMED answer, over every call it took.
            self.reclaims.append({"version": key.version_id, "unload_s": done - started,
                                  "lag_s": max(0.0, done - ready), "at": done})

    # ---- the run
    async def engine_figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {}
        for name, client in self.stack.clients.items():
            status = await client.status()
            figures[name] = {
                "rss_kb": rss_kb(status.get("pid")),
                "pool_slots": sum(1 for a in status.get("adapters", []) if a.get("pinned")),
                "native_adapters": len(status.get("adapters", [])),
                "managed_records": len(status.get("managed", [])),
                "status_bytes": len(json.dumps(status)),
            }
        return figures

    async def registry_figures(self) -> dict[str, Any]:
        state = await self.stack.handle.state.remote()
        stats = await self.stack.handle.journal_stats.remote()
        return {"state_bytes": len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)),
                "versions_in_state": len(state.versions), "journal_stats": stats}

    async def publish_step(self, step: int) -> None:
        loss = await asyncio.to_thread(self.trainer.step)
        snapshot = await asyncio.to_thread(self.trainer.snapshot)
        version, candidate = self.stack.candidate(f"step{step:05d}", snapshot=snapshot)
        started = time.monotonic()
        waits = 0
        while True:
            # As a trainer would: wait for a free slot (the reclaimer frees the version retired a step ago), then
            # publish; a reserve refused for capacity all the same (a race) waits and tries again.
            ops = await self.stack.registry.operations_view()
            if ops.occupied >= ops.capacity:
                if time.monotonic() - started > STUCK_S:
                    raise RuntimeError(f"step {step}: no free slot for {STUCK_S:.0f} s (a reclaim that never ends?)")
                waits += 1
                await asyncio.sleep(CAPACITY_WAIT_S)
                continue
            outcome = await self.stack.publisher.publish(version, candidate)
            if outcome.status == "REJECTED" and outcome.reason == "CAPACITY_ERROR":
                waits += 1
                await asyncio.sleep(CAPACITY_WAIT_S)
                continue
            break
        seconds = time.monotonic() - started
        self.capacity_waits += waits
        if not outcome.committed:
            self.publish_failures.append(f"step {step}: {outcome.status} {outcome.reason} {outcome.detail}"[:300])
        view = await self.stack.registry.publication_view()
        for key, v in view.versions.items():
            if str(v.state) == "RETIRED" and key not in self.retired_at:
                self.retired_at[key] = time.monotonic()
        self.max_managed = max(self.max_managed, view.managed_count())
        self.stack.candidates.pop(version, None)  # the soak keeps no candidate it will not publish again
        self.rows.append({
            "step": step, "version": version.version_id, "status": str(outcome.status), "loss": loss,
            "publish_s": seconds, "capacity_waits": waits, "phases": dict(outcome.phases),
            "managed": view.managed_count(), "engines": await self.engine_figures(),
            "journal_bytes": journal_bytes(self.args.journal_path), **await self.registry_figures(),
        })

    async def drain_and_check(self, step: int, restart: bool = True) -> None:
        self.traffic.stop()
        await self.traffic.join()
        deadline = time.monotonic() + 60.0
        while (self.recorder.in_flight or self.traffic.counters.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # an aborted or disconnected request's release reaches the scheduler
        # SGLang's request counter of every registered adapter (None: no counter, nothing ever held it), of every
        # unregistered one still draining, and the managed table's mirror of it: all 0 with nothing in flight.
        drift = []
        engine_in_flight = {}
        for name, client in self.stack.clients.items():
            status = await client.status()
            engine_in_flight[name] = status.get("requests_in_flight")
            for adapter in status.get("adapters", []):
                if (adapter.get("refcount") or 0) != 0:
                    drift.append({"engine": name, "adapter": adapter["name"], "refcount": adapter["refcount"]})
            for entry in status.get("draining", []):
                if (entry.get("refcount") or 0) != 0:
                    drift.append({"engine": name, "draining_lora_id": entry["lora_id"], "refcount": entry["refcount"]})
            for adapter in status.get("managed", []):
                if (adapter.get("native_refcount") or 0) != 0:
                    drift.append({"engine": name, "adapter": adapter["name"],
                                  "native_refcount": adapter["native_refcount"]})
        in_flight = self.recorder.in_flight + self.traffic.counters.in_flight
        self.drains.append({"step": step, "client_in_flight": in_flight, "engine_requests_in_flight": engine_in_flight,
                            "drift": drift})
        print(f"  drain at step {step}: in flight {self.drains[-1]['client_in_flight']}, drift {len(drift)}",
              flush=True)
        if restart:
            self.traffic.start()

    async def run(self) -> None:
        await self.stack.publisher.sync_incarnations()
        await self.publish_step(0)  # the bootstrap version: the traffic binds it
        self.traffic.start()
        reclaimer = asyncio.create_task(self.reclaimer())
        began = time.monotonic()
        try:
            for step in range(1, self.args.steps):
                if self.args.max_minutes and time.monotonic() - began > 60 * self.args.max_minutes:
                    print(f"  stopping after {step} steps: --max-minutes {self.args.max_minutes}", flush=True)
                    break
                try:
                    await self.publish_step(step)
                except RuntimeError as exc:
                    self.publish_failures.append(str(exc))
                    break
                if step % self.args.drain_every == 0:
                    await self.drain_and_check(step)
                if step % 10 == 0:
                    last = self.rows[-1]
                    print(f"  step {step}: publish {last['publish_s']:.2f}s, managed {last['managed']}, rss "
                          f"{[e['rss_kb'] for e in last['engines'].values()]} kB, journal {last['journal_bytes']} B",
                          flush=True)
        finally:
            await self.drain_and_check(len(self.rows) - 1, restart=False)
            self._stop_reclaimer.set()
            await reclaimer
            await self.reclaim_eligible()

    # ---- the report
    def report(self) -> dict[str, Any]:
        rows = self.rows
        steps = len(rows)
        warm = [r for r in rows if r["step"] >= self.args.warmup]
        xs = [r["step"] for r in warm]
        names = list(self.stack.clients)
        rss_slopes = {n: fit_slope(xs, [r["engines"][n]["rss_kb"] for r in warm]) for n in names}
        journal_slope = fit_slope(xs, [r["journal_bytes"] for r in warm])
        state_slope = fit_slope(xs, [r["state_bytes"] for r in warm])
        status_slope = {n: fit_slope(xs, [r["engines"][n]["status_bytes"] for r in warm]) for n in names}
        records = self.recorder.records
        failed = [r for r in records if r.outcome in ("failed", "unknown")]
        c = self.traffic.counters
        lags = [r["lag_s"] for r in self.reclaims]
        drift = sum(len(d["drift"]) for d in self.drains)
        return {
            "fixture": self.fixtures.name, "capacity": 2, "steps": steps, "warmup": self.args.warmup,
            "commit": self.args.commit, "concurrency": self.args.concurrency,
            # Requests that failed (the agentic ones, a session that ended in an error, the mixed traffic's
            # unexpected answers); a publication that did not commit is counted apart.
            "failed_requests": len(failed) + len(c.session_errors) + len(c.odd_failures),
            "failed_publications": len(self.publish_failures),
            "failures": {"backend": [f"{r.session_id} {r.detail}" for r in failed][:50],
                         "sessions": c.session_errors[:50], "mixed": c.odd_failures[:50],
                         "publications": self.publish_failures[:50]},
            "requests": len(records), "aborted_resumed": sum(1 for r in records if r.outcome == "aborted"),
            "sessions": c.sessions, "prefill_aborts": c.prefill_aborts, "over_context_400": c.over_context_400,
            "over_context_other": c.over_context_other[:20], "disconnects": c.disconnects,
            "max_managed": self.max_managed, "capacity_waits": self.capacity_waits,
            "rss_growth_kb_per_step": rss_slopes, "journal_bytes_per_step": journal_slope,
            "state_bytes_per_step": state_slope, "engine_status_bytes_per_step": status_slope,
            "reclaims": len(self.reclaims), "reclaim_lag_p50_s": percentile(lags, 0.5),
            "reclaim_lag_p99_s": percentile(lags, 0.99),
            "slow_unloads": sum(1 for r in self.reclaims if r["unload_s"] > SLOW_UNLOAD_S),
            "refcount_drift": drift, "drains": self.drains,
            "publish_s_p50": percentile([r["publish_s"] for r in rows], 0.5),
            "publish_s_p99": percentile([r["publish_s"] for r in rows], 0.99),
            "loss_first_last": [self.trainer.losses[0], self.trainer.losses[-1]] if self.trainer.losses else None,
            "rows": rows, "reclaim_rows": self.reclaims,
        }


def plot(report: dict[str, Any], folder: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    names = list(rows[0]["engines"])
    panels: list[tuple[str, str, dict[str, list[float]]]] = [
        ("rss", "engine RSS (MB, server + children)", {n: [r["engines"][n]["rss_kb"] / 1024 for r in rows]
                                                       for n in names}),
        ("pool", "LoRA pool slots held (pinned adapters)", {n: [r["engines"][n]["pool_slots"] for r in rows]
                                                            for n in names}),
        ("journal", "journal bytes (SQLite + WAL)", {"journal": [r["journal_bytes"] for r in rows]}),
        ("state", "registry state (pickled bytes)", {"state": [r["state_bytes"] for r in rows]}),
        ("status", "engine status payload (bytes)", {n: [r["engines"][n]["status_bytes"] for r in rows]
                                                     for n in names}),
        ("publish", "publication latency (s)", {"publish_s": [r["publish_s"] for r in rows]}),
    ]
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    for key, title, series in panels:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, ys in series.items():
            ax.plot(steps, ys, label=label, linewidth=1)
        ax.set_xlabel("step (publication)")
        ax.set_title(f"{title}: {report['fixture']}, {report['steps']} steps at {report['commit']}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{prefix}-{key}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    lags = report["reclaim_rows"]
    if lags:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(range(len(lags)), [r["lag_s"] for r in lags], ".", markersize=3, label="reclaim lag (s)")
        ax.plot(range(len(lags)), [r["unload_s"] for r in lags], ".", markersize=3, label="reclaim call (s)")
        ax.set_xlabel("reclaim")
        ax.set_title(f"reclaim lag and unload time: {report['fixture']}, {report['steps']} steps", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{prefix}-reclaim.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def last_line(report: dict[str, Any]) -> str:
    rss = max(report["rss_growth_kb_per_step"].values()) if report["rss_growth_kb_per_step"] else 0.0
    return (f"fixture={report['fixture']} capacity={report['capacity']} steps={report['steps']} "
            f"failed_requests={report['failed_requests']} max_managed={report['max_managed']} "
            f"rss_growth_kb_per_step={rss:.1f} journal_bytes_per_step={report['journal_bytes_per_step']:.0f} "
            f"reclaim_lag_p99_s={report['reclaim_lag_p99_s']:.3f} refcount_drift={report['refcount_drift']} "
            f"slow_unloads={report['slow_unloads']} failed_publications={report['failed_publications']}")


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def _main(args: argparse.Namespace, urls: list[str], fixtures: Any, out: Path, token: str | None,
                key_file: Path) -> dict[str, Any]:
    stack = Stack(urls, token, out, fixtures, deadlines=DEADLINES, capability_key_file=key_file,
                  client_timeout_s=300.0)
    args.journal_path = out / f"registry-{stack.epoch}.sqlite"
    soak = Soak(stack, args, fixtures)
    try:
        await soak.run()
    finally:
        if args.engines:  # attached: leave the engines' managed slots free for whoever runs next
            await stack.unload_leftovers()
        await stack.close()
    return soak.report()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="publications (training steps), default 1000")
    parser.add_argument("--fixture", default=TINY, choices=FIXTURE_NAMES)
    parser.add_argument("--out", default=None, help="report directory (default: a temporary one)")
    parser.add_argument("--plots", default=None, help="where the PNGs go (default: --out)")
    parser.add_argument("--prefix", default="soak", help="file name prefix of the PNGs and the JSON")
    parser.add_argument("--concurrency", type=int, default=3, help="closed-loop agentic sessions")
    parser.add_argument("--drain-every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the growth fits "
                        "(default: min(50, steps // 5))")
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop publishing after this long (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the commit this code is (default: git's HEAD here; a copy of a commit "
                        "run from outside the checkout names it)")
    parser.add_argument("--engines", help="attach to running engines: URL0,URL1 (default: start two)")
    parser.add_argument("--token", help="managed-endpoint token of the attached engines")
    parser.add_argument("--capability-key-file", help="the key file the attached engines were started with")
    args = parser.parse_args(argv)
    args.warmup = min(50, args.steps // 5) if args.warmup is None else args.warmup
    args.commit = args.commit or git_commit()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: fixture {args.fixture}, {args.steps} steps, {args.concurrency} agentic sessions + mixed traffic, "
          f"drain every {args.drain_every}, warm-up {args.warmup}, at {args.commit}; out {out}", flush=True)
    fixtures = build_fixtures(fixture=args.fixture)
    started_ray = ensure_ray()
    engines: list[Any] = []
    try:
        if args.engines:
            if not args.capability_key_file:
                raise SystemExit("--engines needs --capability-key-file: the key the engines were started with")
            urls, token, key_file = args.engines.split(","), args.token, Path(args.capability_key_file)
        else:
            token = new_token()
            key_file = write_key_file(out / "capability.key")
            began = time.monotonic()
            engines = start_engines(fixtures, out, token, capability_key_file=key_file)
            print(f"engines up in {time.monotonic() - began:.0f}s", flush=True)
            urls = [e.url for e in engines]
        report = asyncio.run(_main(args, urls, fixtures, out, token, key_file))
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()
    (out / f"{args.prefix}.json").write_text(json.dumps(jsonable(report), indent=1))
    for path in plot(report, Path(args.plots) if args.plots else out, args.prefix):
        print(f"plot: {path}")
    summary = {k: v for k, v in report.items() if k not in ("rows", "reclaim_rows", "drains")}
    print(json.dumps(jsonable(summary), indent=1))
    print(last_line(report), flush=True)
    return 0 if report["failed_requests"] == 0 and report["refcount_drift"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
