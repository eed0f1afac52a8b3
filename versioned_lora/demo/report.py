"""What a run leaves behind: the summary table (rich), a JSON report and a PNG timeline."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from versioned_lora.demo.traffic import RegistrySample, RequestRecord

PHASE_COLOURS = {"reserve": "#999999", "begin": "#1f77b4", "bucket": "#17becf", "end": "#2ca02c",
                 "commit": "#d62728", "reclaim": "#9467bd", "cleanup": "#ff7f0e"}


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(jsonable(report), indent=2))


def summary_table(summary: dict[str, Any], outcomes: dict[str, dict[str, Any]],
                  checks: Sequence[tuple[str, bool, str]]) -> list[Table]:
    traffic = Table(title=f"traffic: {summary['concurrency']} closed-loop agentic sessions, "
                          f"{summary['traffic_seconds']:.0f}s")
    for column in ("version", "sessions", "ok", "failed", "aborted"):
        traffic.add_column(column, justify="right")
    for label, row in summary["per_version"].items():
        traffic.add_row(label, str(row["sessions"]), str(row["ok"]), str(row["failed"]), str(row["aborted"]))
    lat = summary["latency_s"]
    traffic.caption = (f"{summary['throughput_rps']:.1f} req/s; latency p50 {lat['p50'] * 1000:.0f} ms, "
                       f"p95 {lat['p95'] * 1000:.0f} ms, p99 {lat['p99'] * 1000:.0f} ms; cached-token rate of "
                       f"continuing turns {summary['cached_token_rate_continuing']:.0%}; longest no-progress "
                       + ", ".join(f"{e} {g:.2f}s" for e, g in summary["longest_no_progress_s"].items()))

    pubs = Table(title="publications and reclaim")
    for column in ("what", "status", "manifest", "seconds", "phases"):
        pubs.add_column(column)
    for label, outcome in outcomes.items():
        phases = " ".join(f"{k}={v:.2f}" for k, v in (outcome.get("phases") or {}).items())
        status = f"{outcome['status']} {outcome.get('reason') or ''}".strip()
        manifest = str(outcome.get("manifest") or "").removeprefix("versioned-lora/manifest/")
        pubs.add_row(label, status, manifest, f"{outcome['seconds']:.2f}", phases)

    verdicts = Table(title="expectations")
    verdicts.add_column("check")
    verdicts.add_column("result")
    verdicts.add_column("detail")
    for name, ok, detail in checks:
        verdicts.add_row(name, "[green]ok[/green]" if ok else "[red]FAILED[/red]", detail[:80])
    return [traffic, pubs, verdicts]


def plot_timeline(path: Path, t0: float, records: Sequence[RequestRecord], phases: Sequence[Any],
                  samples: Sequence[RegistrySample], label_of: Any, markers: Sequence[tuple[float, str]] = (),
                  title: str = "versioned-lora demo") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 2, 1.5]})
    labels = sorted({label_of(r.lora_path) for r in records})
    colours = {label: plt.get_cmap("tab10")(i) for i, label in enumerate(labels)}
    end = max((r.end for r in records), default=t0) - t0

    ax = axes[0]
    width = 2.0  # seconds per bin
    bins = max(1, math.ceil(end / width))
    for label in labels:
        counts = [0.0] * (bins + 1)
        for r in records:
            if label_of(r.lora_path) == label and r.outcome == "ok":
                counts[min(bins, int((r.end - t0) / width))] += 1 / width
        ax.step([width * i for i in range(bins + 1)], counts, where="post", label=f"version {label}",
                color=colours[label])
    bad = [r for r in records if r.outcome != "ok"]
    if bad:
        ax.scatter([r.end - t0 for r in bad], [0] * len(bad), marker="x", color="red", label="failed/aborted")
    ax.set_ylabel("completed requests / s")
    ax.legend(loc="upper left")

    ax = axes[1]
    for label in labels:
        mine = [r for r in records if label_of(r.lora_path) == label and r.outcome == "ok"]
        ax.scatter([r.end - t0 for r in mine], [1000 * r.latency for r in mine], s=6, color=colours[label],
                   label=f"version {label}")
    ax.set_ylabel("request latency (ms)")
    ax.legend(loc="upper left")

    ax = axes[2]
    rows = sorted({p.version for p in phases}, key=lambda v: min(p.start for p in phases if p.version == v))
    for y, version in enumerate(rows):
        for p in phases:
            if p.version != version:
                continue
            kind = p.phase.split("_", 1)[0]
            ax.broken_barh([(p.start - t0, max(p.end - p.start, 0.05))], (y - 0.35, 0.7),
                           color=PHASE_COLOURS.get(kind, "#333333"))
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylabel("publication phases")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    ax.legend(handles, list(PHASE_COLOURS), loc="upper left", ncol=len(PHASE_COLOURS), fontsize=8)
    for t, text in markers:
        for axis in axes:
            axis.axvline(t - t0, color="#888888", linestyle=":", linewidth=0.8)
        axes[0].annotate(text, (t - t0, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                         va="top", ha="right")

    ax = axes[3]
    if samples:
        ax.step([s.t - t0 for s in samples], [s.managed for s in samples], where="post", label="registry")
        for i in range(len(samples[0].engine_managed)):
            ax.step([s.t - t0 for s in samples], [s.engine_managed[i] + 0.05 * (i + 1) for s in samples],
                    where="post", linestyle="--", label=f"E{i} loaded")
    ax.axhline(2, color="red", linewidth=0.8, linestyle=":")
    ax.set_ylim(-0.2, 3.2)
    ax.set_ylabel("versions held")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
