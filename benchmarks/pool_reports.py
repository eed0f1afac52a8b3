"""Pool several runs of `online_publication.py` into one estimate (issue 9).

One run is 5 window pairs per mode; on a shared 2-core host a window's throughput moves by +-20% from one
window to the next, so one run's median ratio has a wide interval. This pools the per-pair ratios, the
publications and the floor samples of every run given, and prints the same figures with 95% bootstrap
intervals over the pooled samples. Nothing is re-measured; each run's own figures stay in its report.
Last line, as the benchmark's:

    tput_ratio=… p95_ratio=… gap_ratio=… failed=… aborted=… pauses=… publish_s=… floor_ratio=…

    python benchmarks/pool_reports.py runs/bench-a runs/bench-b ...   (directories or report files)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.online_publication import AUDITED, bootstrap_median, fmt_interval, last_line, ratio

RATIOS = ("tput_ratio", "rps_ratio", "p95_ratio", "gap_ratio")
# A publication's phases as the Publisher times them (`PublishOutcome.phases`); "buckets" sums bucket_0..n.
PHASES = ("reserve", "begin", "buckets", "end", "commit")


def phase_seconds(publication: dict[str, Any]) -> dict[str, float]:
    """One publication's seconds per phase of PHASES (a phase it never reached is left out)."""
    phases: dict[str, float] = publication.get("phases") or {}
    out = {name: phases[name] for name in PHASES if name in phases}
    buckets = [seconds for name, seconds in phases.items() if name.startswith("bucket_")]
    if buckets:
        out["buckets"] = sum(buckets)
    return out


def load(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((path / "online_publication.json" if path.is_dir() else path).read_text())
    return report


def pool(reports: list[dict[str, Any]]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in ("managed", "baseline"):
        rows = [row for r in reports for row in r["modes"][mode]["pairs"]]
        measured = [p for r in reports for p in r["publications"] if p["mode"] == mode and not p.get("bootstrap")]
        pubs = [p["seconds"] for p in measured]
        timed = [phase_seconds(p) for p in measured]
        modes[mode] = {
            "pairs": len(rows),
            **{name: bootstrap_median([row[name] for row in rows]) for name in RATIOS},
            "publish_s": bootstrap_median(pubs),
            "publications": len(pubs),
            "phases": {name: bootstrap_median([t[name] for t in timed if name in t]) for name in PHASES
                       if any(name in t for t in timed)},
            **{k: sum(r["modes"][mode][k] for r in reports) for k in ("failed", "aborted", "unknown")},
            "audit": {k: sum(r["modes"][mode]["audit"][k] for r in reports) for k in AUDITED},
        }
    floors = [c["floor_s"] for r in reports for c in r["floor"]["components"]]
    floor = bootstrap_median(floors)
    return {"runs": len(reports), "modes": modes, "floor_s": floor, "floor_samples": len(floors),
            "floor_ratio": ratio(modes["managed"]["publish_s"][0], floor[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    pooled = pool([load(path) for path in parser.parse_args(argv).reports])
    for mode, m in pooled["modes"].items():
        print(f"{mode:8s} {m['pairs']} pairs, {m['publications']} publications: "
              + "  ".join(f"{name} {fmt_interval(m[name])}" for name in (*RATIOS, "publish_s"))
              + f"  failed {m['failed']} aborted {m['aborted']} unknown {m['unknown']}  audit {m['audit']}")
        if m["phases"]:
            timed = "  ".join(f"{name} {fmt_interval(v)}" for name, v in m["phases"].items())
            print(f"{mode:8s} phases (s): {timed}")
    print(f"floor_s {fmt_interval(pooled['floor_s'])} over {pooled['floor_samples']} samples of {pooled['runs']} runs")
    print(last_line(pooled["modes"]["managed"], pooled["floor_ratio"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
