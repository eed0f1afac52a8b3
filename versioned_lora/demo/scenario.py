"""The demo's story under sustained agentic traffic (RFC §3.4, §5.2, §7.3 at this machine's scale):

1. bootstrap A through the Publisher (the same protocol as every later version);
2. closed-loop agentic sessions run on both engines and keep running to the end;
3. B is published under that load (sessions bound to A keep A, new sessions bind B);
4. C is refused with CAPACITY_ERROR (A and B hold both managed slots) and reaches no engine;
5. A's sessions finish on their own; A is reclaimed (each engine unloads it exactly once);
6. C is published again, but E1's port sends altered bytes under C's manifest: E1 refuses at `end`
   (digest mismatch), the attempt is aborted and cleaned on both engines (FAILED_CLEAN), the slot is
   free again, and the traffic never notices.

Every expectation is checked at the end; `DemoRun.failures` lists the ones that did not hold.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import attrs

from versioned_lora.adapters.manifest import MANIFEST_FORMAT_V2
from versioned_lora.demo.stack import Stack
from versioned_lora.demo.traffic import (
    ClosedLoopTraffic,
    ProgressMonitor,
    RecordingBackend,
    RegistrySampler,
    TrafficShape,
    longest_gap,
    percentile,
    tool_with_latency,
)
from versioned_lora.lifecycle import VersionKey
from versioned_lora.runtime.agentic_driver import AgenticDriver
from versioned_lora.runtime.publisher import PublishOutcome
from versioned_lora.spec.states import VersionState

ENGINE_WIDE = ("pause_generation", "flush_cache", "abort_all", "base_weight_update", "continue_generation")


@attrs.define
class Step:
    name: str
    start: float
    end: float | None = None
    status: str = "running"
    detail: str = ""


@attrs.define
class PhaseSpan:
    version: str
    phase: str
    start: float
    end: float


class DemoRun:
    def __init__(self, stack: Stack, duration_s: float, shape: TrafficShape) -> None:
        self.stack = stack
        self.duration_s = duration_s
        self.shape = shape
        self.t0 = time.monotonic()
        self.steps: list[Step] = []
        self.phases: list[PhaseSpan] = []
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.checks: list[tuple[str, bool, str]] = []
        self._publishing = ""
        stack.publisher._on_phase = self._on_phase  # the Publisher reports each phase's duration here
        self.recorder = RecordingBackend(stack.backend, stack.route)
        self.binder = stack.new_binder(self.recorder, shard=0)
        self.driver = AgenticDriver(self.binder, tool=tool_with_latency(shape.tool_latency_s))
        self.traffic = ClosedLoopTraffic(self.driver, shape, name="s")
        self.monitor = ProgressMonitor(list(stack.clients.values()))
        self.sampler = RegistrySampler(stack.registry, list(stack.clients.values()), self.label)

    # ---- helpers
    def label(self, lora_name: str) -> str:
        return self.stack.labels.get(lora_name, lora_name)

    def now(self) -> float:
        return time.monotonic()

    def _on_phase(self, _version: str, phase: str, seconds: float) -> None:
        end = self.now()
        self.phases.append(PhaseSpan(self._publishing, phase, end - seconds, end))

    def step(self, name: str) -> Step:
        step = Step(name, self.now())
        self.steps.append(step)
        return step

    def done(self, step: Step, status: str, detail: str = "") -> None:
        step.end, step.status, step.detail = self.now(), status, detail

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        return bool(ok)

    @property
    def failures(self) -> list[tuple[str, str]]:
        return [(name, detail) for name, ok, detail in self.checks if not ok]

    async def publish(self, label: str, version: VersionKey, candidate: Any) -> PublishOutcome:
        self._publishing = label
        started = self.now()
        outcome = await self.stack.publisher.publish(version, candidate)
        self.outcomes[label] = {"status": outcome.status, "reason": outcome.reason, "detail": outcome.detail,
                                "phases": dict(outcome.phases), "start": started - self.t0,
                                "seconds": self.now() - started, "lora_name": outcome.lora_name,
                                "manifest": candidate.snapshot.manifest.format}
        self._publishing = ""
        return outcome

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    # ---- the story
    async def run(self) -> None:
        stack = self.stack
        await stack.publisher.sync_incarnations()
        audit_before = await stack.audit()
        a_version, a = stack.candidate("A")
        b_version, b = stack.candidate("B")
        c_version, c = stack.candidate("C")
        # Every version this demo publishes is a new publication: manifest v2, the snapshots' default (issue 20).
        self.check("versions are published as manifest v2",
                   {x.snapshot.manifest.format for x in (a, b, c)} == {MANIFEST_FORMAT_V2})

        # A window of K > 2 versions (`--capacity K`): K - 2 older versions W1.. are published first and stay held,
        # idle, so that A and B fill the window and C meets it full, as at K = 2.
        for index in range(1, stack.capacity - 1):
            step = self.step(f"bootstrap W{index} (window of {stack.capacity})")
            w_version, w = stack.candidate(f"W{index}", "B")
            outcome = await self.publish(f"W{index}", w_version, w)
            self.done(step, outcome.status)
            if not self.check(f"W{index} published (COMMITTED)", outcome.committed, outcome.detail):
                return

        step = self.step("bootstrap A")
        outcome = await self.publish("A", a_version, a)
        self.done(step, outcome.status)
        if not self.check("A bootstrapped (COMMITTED)", outcome.committed, outcome.detail):
            return

        self.sampler.start()
        self.monitor.start()
        self.traffic.start()
        step = self.step(f"agentic traffic: {self.shape.concurrency} closed-loop sessions")
        traffic_step = step
        await self.sleep(max(5.0, 0.25 * self.duration_s))

        step = self.step("publish B under load")
        outcome = await self.publish("B", b_version, b)
        self.done(step, outcome.status, _phase_line(outcome.phases))
        self.check("B published under load (COMMITTED)", outcome.committed, outcome.detail)
        await self.sleep(0.15 * self.duration_s)

        step = self.step("publish C (capacity full)")
        begins_before = {e: a["managed_begin"] for e, a in (await stack.audit()).items()}
        outcome = await self.publish("C (capacity)", c_version, c)
        begins_after = {e: a["managed_begin"] for e, a in (await stack.audit()).items()}
        self.done(step, f"{outcome.status} {outcome.reason}")
        refused = (outcome.status, outcome.reason) == ("REJECTED", "CAPACITY_ERROR")
        self.check("C rejected with CAPACITY_ERROR", refused, f"{outcome.status} {outcome.reason}")
        self.check("rejected C reached no engine (0 begin calls)", begins_before == begins_after,
                   f"{begins_before} -> {begins_after}")

        step = self.step("A's sessions finish; reclaim A")
        unload_before = {e: a["physical_unload"] for e, a in (await stack.audit()).items()}
        refs_zero = await self._wait_refs_zero(a_version, timeout_s=max(60.0, self.duration_s))
        reclaim = await stack.reclaimer.reclaim(a_version)
        unload_after = {e: a["physical_unload"] for e, a in (await stack.audit()).items()}
        self.outcomes["reclaim A"] = {"status": reclaim.status, "confirmed": list(reclaim.confirmed),
                                      "seconds": reclaim.seconds, "start": self.now() - reclaim.seconds - self.t0,
                                      "waited_for_sessions_s": refs_zero}
        self.phases.append(PhaseSpan("A", "reclaim", self.now() - reclaim.seconds, self.now()))
        self.done(step, reclaim.status, f"confirmed by {', '.join(reclaim.confirmed)}")
        self.check("A reclaimed on both engines", reclaim.status == "RECLAIMED" and len(reclaim.confirmed) == 2,
                   f"{reclaim.status} {reclaim.confirmed}")
        once = all(unload_after[e] - unload_before[e] == 1 for e in unload_after)
        self.check("each engine unloaded A exactly once", once, f"{unload_before} -> {unload_after}")
        await self.sleep(0.1 * self.duration_s)

        step = self.step("publish C with corrupted bytes to E1")
        restore = self._corrupt_transfers("E1", c)
        try:
            outcome = await self.publish("C (corrupt)", c_version, c)
        finally:
            restore()
        status, retries = outcome.status, 0
        while status == "UNKNOWN" and retries < 20:
            # A cleanup that could not be confirmed keeps the slot (RFC: unknown outcome); the publisher's
            # recovery retries it under the same attempt until every engine confirms.
            retries += 1
            await asyncio.sleep(1.0)
            status = next((o.status for o in await stack.publisher.recover() if o.version == c_version), status)
        self.outcomes["C (corrupt)"].update(final_status=status, cleanup_retries=retries)
        self.phases.append(PhaseSpan("C (corrupt)", "cleanup", self.t0 + self.outcomes["C (corrupt)"]["start"]
                                     + sum(outcome.phases.values()), self.now()))
        self.done(step, status, f"after {retries} cleanup retries; " * bool(retries) + outcome.detail[:100])
        self.check("corrupted C ends FAILED_CLEAN", status == "FAILED_CLEAN",
                   f"first answer {outcome.status} {outcome.reason}; final {status} after {retries} cleanup retries")
        self.check("E1 refused at end with a digest mismatch", "MANIFEST_MISMATCH" in outcome.detail
                   or "DIGEST" in outcome.detail.upper(), outcome.detail[:200])
        view = await stack.registry.publication_view()
        held = stack.capacity - 1
        self.check(f"capacity freed after the failure ({held} version{'s' * (held != 1)} held)",
                   view.managed_count() == held, f"managed_count={view.managed_count()}")
        leftovers = {}
        for name, client in stack.clients.items():
            engine_status = await client.status()
            leftovers[name] = [a["state"] for a in engine_status["managed"] if a["name"] == c.lora_name
                               and a["state"] not in ("CLEANED", "ABSENT")]
        self.check("corrupted candidate cleaned on both engines", not any(leftovers.values()), str(leftovers))

        await self.sleep(max(5.0, 0.2 * self.duration_s))
        step = self.step("drain: sessions finish, traffic stops")
        self.traffic.stop()
        await self.traffic.join()
        await self.monitor.stop()
        await self.sampler.stop()
        self.done(step, "done")
        self.done(traffic_step, "done", f"{self.traffic.sessions_started} sessions")

        audit_after = await stack.audit()
        self.audit_deltas = {f"{e}.{k}": audit_after[e][k] - audit_before[e][k] for e in audit_after
                             for k in ENGINE_WIDE}
        self._final_checks(b_version)

    async def _wait_refs_zero(self, version: VersionKey, timeout_s: float) -> float:
        started = self.now()
        while self.now() - started < timeout_s:
            view = await self.stack.registry.publication_view()
            entry = view.versions.get(version)
            if entry is None or entry.session_refs == 0:
                break
            await asyncio.sleep(0.25)
        return self.now() - started

    def _corrupt_transfers(self, engine: str, candidate: Any) -> Any:
        """Make one engine's port send altered bytes (one element of the first tensor changed) under the
        candidate's unchanged manifest; returns a function that restores the port."""
        port = self.stack.ports[engine]
        tensors = dict(candidate.snapshot.tensors)
        first = candidate.plan.buckets[0].slots[0].name
        altered = tensors[first].clone()
        altered.view(-1)[0] += 1.0
        tensors[first] = altered
        original = port.transfer_bucket

        async def corrupted(cand: Any, attempt_token: str, index: int) -> None:
            link = await port.link()
            await port._call(link.transfer_bucket(cand, attempt_token, index, tensors=tensors))

        port.transfer_bucket = corrupted  # type: ignore[method-assign]

        def restore() -> None:
            port.transfer_bucket = original  # type: ignore[method-assign]

        return restore

    def _final_checks(self, b_version: VersionKey) -> None:
        records = self.recorder.records
        count = {o: sum(1 for r in records if r.outcome == o) for o in ("ok", "failed", "aborted", "unknown")}
        self.check("requests served", count["ok"] > 0, f"{count['ok']} ok")
        self.check("0 failed requests", count["failed"] == 0, str(count["failed"]))
        self.check("0 aborted requests", count["aborted"] == 0, str(count["aborted"]))
        self.check("0 unknown-outcome requests", count["unknown"] == 0, str(count["unknown"]))
        errors = [t.error for t in self.traffic.transcripts if t.error]
        self.check("every session completed", not errors, "; ".join(errors[:3]))
        mixed = [t.session_id for t in self.traffic.transcripts if len(t.lora_paths) > 1]
        self.check("every session used exactly one version", not mixed, ", ".join(mixed[:5]))
        labels = {self.label(r.lora_path) for r in records if r.outcome == "ok"}
        self.check("traffic served both A and B", {"A", "B"} <= labels, str(sorted(labels)))
        nonzero = {k: v for k, v in self.audit_deltas.items() if v}
        self.check("0 pause/flush/abort_all/base-weight calls", not nonzero, str(nonzero))
        most = max((s.managed for s in self.sampler.samples), default=0)
        k = self.stack.capacity
        self.check(f"managed versions never above {k}", most <= k, f"max {most}")
        most_engine = max((max(s.engine_managed) for s in self.sampler.samples), default=0)
        self.check(f"engines never held more than {k} managed adapters", most_engine <= k, f"max {most_engine}")
        final = self.sampler.samples[-1] if self.sampler.samples else None
        self.check("B is the default at the end", final is not None and final.default == "B",
                   str(final.default if final else None))
        self.check("A ended RECLAIMED", final is not None and final.states.get("A") == str(VersionState.RECLAIMED),
                   str(final.states if final else None))

    # ---- figures
    def summary(self) -> dict[str, Any]:
        records = self.recorder.records
        ok = [r for r in records if r.outcome == "ok"]
        latencies = [r.latency for r in ok]
        end = max((r.end for r in records), default=self.now())
        start = min((r.start for r in records), default=self.t0)
        continuing = [r for r in ok if r.turn > 0]
        gaps = [longest_gap(chunks, start, end) if chunks else float("nan") for chunks in self.monitor.chunks]
        per_version: dict[str, dict[str, Any]] = {}
        for label in sorted({self.label(r.lora_path) for r in records}):
            mine = [r for r in records if self.label(r.lora_path) == label]
            per_version[label] = {o: sum(1 for r in mine if r.outcome == o) for o in ("ok", "failed", "aborted")}
            per_version[label]["sessions"] = len({r.session_id for r in mine})
        return {
            "concurrency": self.shape.concurrency,
            "traffic_seconds": end - start,
            "requests": len(records),
            "outcomes": {o: sum(1 for r in records if r.outcome == o) for o in ("ok", "failed", "aborted", "unknown")},
            "sessions": len(self.traffic.transcripts),
            "throughput_rps": len(ok) / (end - start) if end > start else 0.0,
            "latency_s": {"p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95),
                          "p99": percentile(latencies, 0.99)},
            "cached_token_rate_continuing": (sum(r.cached_tokens for r in continuing)
                                             / max(1, sum(r.prompt_tokens for r in continuing))),
            "longest_no_progress_s": {f"E{i}": g for i, g in enumerate(gaps)},
            "progress_probe_errors": self.monitor.errors[:10],
            "per_version": per_version,
            "max_managed_versions": max((s.managed for s in self.sampler.samples), default=0),
        }


def _phase_line(phases: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.2f}s" for k, v in phases.items())
