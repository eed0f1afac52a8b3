"""Compare one run's per-suite wall times with the committed budget (benchmarks/test_budget.json).

    python scripts/test_times.py STATS.json   # STATS: what tests/conftest.py writes ($VERSIONED_LORA_TEST_STATS)

Prints one row a suite: its time, its budget and the difference, the suites over budget marked. It never fails a
run (timing stays out of assertions; scripts/test.sh ignores its exit status): it tells where the time went.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUDGET = Path(__file__).resolve().parents[1] / "benchmarks" / "test_budget.json"


def compare(stats: dict[str, object], budget: dict[str, float]) -> list[str]:
    suites = stats["suites"]
    assert isinstance(suites, dict)
    lines = [f"{'suite':<24} {'time':>8} {'budget':>8} {'over':>8}"]
    total = total_budget = 0.0
    for suite in sorted(set(suites) | set(budget), key=lambda name: -float(suites.get(name, {}).get("seconds", 0))):
        seconds = float(suites.get(suite, {}).get("seconds", 0.0))
        allowed = float(budget.get(suite, 0.0))
        total, total_budget = total + seconds, total_budget + allowed
        mark = "  OVER" if seconds > allowed else ""
        lines.append(f"{suite:<24} {seconds:8.1f} {allowed:8.1f} {seconds - allowed:+8.1f}{mark}")
    lines.append(f"{'sum':<24} {total:8.1f} {total_budget:8.1f} {total - total_budget:+8.1f}")
    return lines


def main(argv: list[str]) -> int:
    stats = json.loads(Path(argv[1]).read_text())
    budget = {k: v for k, v in json.loads(BUDGET.read_text()).items() if not k.startswith("_")}
    print("=== suite times against benchmarks/test_budget.json ===")
    print("\n".join(compare(stats, budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
