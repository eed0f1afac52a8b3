"""`versioned-lora demo`: the main job on two local CPU engines (issue 9, RFC §7.3 at this scale); its arguments
are `versioned_lora.demo.add_arguments`.

Starts a small local Ray cluster and two patched SGLang CPU engines with the fixture model (or attaches
to running ones with `--engines`), then runs the story in `scenario.py` under sustained closed-loop
agentic traffic, with a live view; writes `report.json` and `timeline.png` to `--out` and prints a
summary. Exit status 1 if any expectation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.report import plot_timeline, summary_table, write_json
from versioned_lora.demo.scenario import DemoRun
from versioned_lora.demo.stack import Stack, ensure_ray, load_fixtures, new_token, start_engines
from versioned_lora.demo.traffic import TrafficShape, percentile
from versioned_lora.ops.status_render import blocking_table, engines_table, versions_table

__all__ = ["run_demo"]


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fixtures = load_fixtures()
    started_ray = ensure_ray()
    engines = []
    key_file: Path | None = None
    try:
        if getattr(args, "engines", None):
            urls, token = args.engines.split(","), getattr(args, "token", None)
            given = getattr(args, "capability_key_file", None)  # attached engines: started by someone else
            if not given:
                raise SystemExit("--engines needs --capability-key-file: the key the engines were started with")
            key_file = Path(given)
        else:
            token = new_token()
            # The engines and the registry actor check cleanups and reclaims against the registry's capability
            # (docs/integration.md): a key per run, in a 0600 file beside the report.
            key_file = write_key_file(out_dir / "capability.key")
            with console.status("starting two SGLang CPU engines with the fixture (a minute or two)..."):
                began = time.monotonic()
                engines = start_engines(fixtures, out_dir, token, capability_key_file=key_file,
                                        capacity=getattr(args, "capacity", 2))
            console.print(f"engines up in {time.monotonic() - began:.0f}s: {', '.join(e.url for e in engines)}")
            urls = [e.url for e in engines]
        return asyncio.run(_run(args, console, out_dir, urls, token, fixtures, attached=not engines,
                                key_file=key_file))
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()


async def _run(args: argparse.Namespace, console: Console, out_dir: Path, urls: list[str], token: str | None,
               fixtures: Any, attached: bool, key_file: Path | None = None) -> int:
    stack = Stack(urls, token, out_dir, fixtures, capability_key_file=key_file, capacity=getattr(args, "capacity", 2))
    shape = TrafficShape(concurrency=args.concurrency, turns=args.turns)
    demo = DemoRun(stack, args.duration, shape)
    console.print(f"epoch {stack.epoch}; traffic: {shape.concurrency} closed-loop agentic sessions, {shape.turns} "
                  f"generations of {shape.max_new_tokens} tokens each with tool turns between, sticky per engine")
    error: BaseException | None = None
    warnings = _WarningLog()
    logging.getLogger("versioned_lora").addHandler(warnings)
    try:
        if getattr(args, "no_live", False) or not console.is_terminal:
            await _with_log(demo, console)
        else:
            with Live(console=console, refresh_per_second=4, get_renderable=lambda: _live_view(demo)):
                await demo.run()
    except BaseException as exc:
        error = exc
        demo.traffic.stop()
        demo.check("demo ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        if attached:
            await stack.unload_leftovers()
        await stack.close()
    if error is not None and not isinstance(error, Exception):
        raise error

    summary = demo.summary()
    for table in summary_table(summary, demo.outcomes, demo.checks):
        console.print(table)
    report = {
        "epoch": stack.epoch,
        "engines": urls,
        "traffic_shape": {"concurrency": shape.concurrency, "turns": shape.turns,
                          "max_new_tokens": shape.max_new_tokens, "tool_latency_s": shape.tool_latency_s},
        "summary": summary,
        "publications": demo.outcomes,
        "audit_deltas": getattr(demo, "audit_deltas", None),
        "steps": [{"name": s.name, "start": s.start - demo.t0, "end": (s.end or s.start) - demo.t0,
                   "status": s.status, "detail": s.detail} for s in demo.steps],
        "phases": [{"version": p.version, "phase": p.phase, "start": p.start - demo.t0, "end": p.end - demo.t0}
                   for p in demo.phases],
        "managed_over_time": [{"t": s.t - demo.t0, "registry": s.managed, "engines": list(s.engine_managed),
                               "default": s.default, "refs": s.refs} for s in demo.sampler.samples],
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in demo.checks],
        "runtime_warnings": warnings.lines,
        "failed": [n for n, _ in demo.failures],
    }
    write_json(out_dir / "report.json", report)
    plot_timeline(out_dir / "timeline.png", demo.t0, demo.recorder.records, demo.phases, demo.sampler.samples,
                  demo.label, markers=[(s.start, s.name) for s in demo.steps[1:]],
                  title=f"versioned-lora demo: {shape.concurrency} agentic sessions on 2 CPU engines")
    console.print(f"report: {out_dir / 'report.json'}  timeline: {out_dir / 'timeline.png'}")
    if demo.failures:
        console.print(f"[red]{len(demo.failures)} expectation(s) failed:[/red] "
                      + "; ".join(f"{n} ({d})" for n, d in demo.failures))
        return 1
    console.print("[green]all expectations held[/green]")
    return 0


class _WarningLog(logging.Handler):
    """Keeps the runtime's warnings (e.g. a cleanup that was not confirmed) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}"[:2000])


async def _with_log(demo: DemoRun, console: Console) -> None:
    seen = 0

    async def log() -> None:
        nonlocal seen
        while True:
            while seen < len(demo.steps):
                console.print(f"[{demo.steps[seen].start - demo.t0:6.1f}s] {demo.steps[seen].name}")
                seen += 1
            await asyncio.sleep(0.5)

    task = asyncio.create_task(log())
    try:
        await demo.run()
    finally:
        task.cancel()


def _live_view(demo: DemoRun) -> Any:
    now = time.monotonic()
    steps = Table(title=f"versioned-lora demo  t={now - demo.t0:5.1f}s", expand=False)
    for column in ("t", "step", "status", "detail"):
        steps.add_column(column)
    for s in demo.steps:
        colour = {"running": "yellow", "COMMITTED": "green", "RECLAIMED": "green", "done": "green"}.get(
            s.status.split(" ")[0], "cyan")
        steps.add_row(f"{s.start - demo.t0:5.1f}", s.name, f"[{colour}]{s.status}[/{colour}]", s.detail[:70])
    records = demo.recorder.records
    recent = [r for r in records if r.end > now - 5.0]
    traffic = Table(title="traffic (last 5 s)")
    for column in ("version", "ok", "failed", "aborted", "req/s", "p95 ms"):
        traffic.add_column(column, justify="right")
    for label in sorted({demo.label(r.lora_path) for r in records}):
        mine = [r for r in records if demo.label(r.lora_path) == label]
        last = [r.latency for r in recent if demo.label(r.lora_path) == label and r.outcome == "ok"]
        traffic.add_row(label, *(str(sum(1 for r in mine if r.outcome == o)) for o in ("ok", "failed", "aborted")),
                        f"{len(last) / 5.0:.1f}", f"{1000 * percentile(last, 0.95):.0f}" if last else "-")
    sample = demo.sampler.samples[-1] if demo.sampler.samples else None
    held = (f"default {sample.default}; versions held {sample.managed} (engines {list(sample.engine_managed)}); "
            f"states {sample.states}; session refs {sample.refs}") if sample else "registry: -"
    rows = demo.sampler.rows
    if rows is None:
        return Group(steps, traffic, held)
    return Group(steps, traffic, versions_table(rows), engines_table(rows), blocking_table(rows))
