"""The online benchmark's throughput estimate (pure arithmetic over request records; no engine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from versioned_lora.demo.traffic import RequestRecord

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "online_publication.py"
_SPEC = importlib.util.spec_from_file_location("online_publication", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def record(start: float, end: float, tokens: int, outcome: str = "ok") -> RequestRecord:
    return RequestRecord(start=start, end=end, engine=0, session_id="s", turn=0, lora_path="x", prompt_tokens=10,
                         output_tokens=tokens, cached_tokens=0, outcome=outcome)


def test_generated_tokens_counts_what_was_generated_inside_the_window() -> None:
    records = [
        record(0.0, 10.0, 100),   # wholly inside: all 100
        record(8.0, 12.0, 40),    # half inside: 20
        record(-2.0, 2.0, 40),    # half inside: 20
        record(-5.0, 15.0, 200),  # spans the window: 10/20 of it
        record(10.0, 11.0, 50),   # after the window: none
        record(1.0, 2.0, 30, outcome="aborted"),  # a lost request generated nothing the user got
    ]
    assert bench.generated_tokens(records, 0.0, 10.0) == pytest.approx(100 + 20 + 20 + 100)


def test_one_request_ending_just_outside_moves_the_estimate_by_its_share_only() -> None:
    inside = [record(float(i), float(i) + 2.0, 20) for i in range(8)]
    edge = record(8.5, 10.01, 20)
    by_end_time = sum(r.output_tokens for r in [*inside, edge] if r.end < 10.0)
    assert by_end_time == 160  # the edge request drops out wholly
    assert bench.generated_tokens([*inside, edge], 0.0, 10.0) == pytest.approx(160 + 20 * 1.5 / 1.51)


def _report(pairs: list[float], publications: list[float], floors: list[float], aborted: int) -> dict:
    def mode(values: list[float], aborted: int) -> dict:
        return {"pairs": [{"tput_ratio": v, "rps_ratio": v, "p95_ratio": v, "gap_ratio": v} for v in values],
                "failed": 0, "aborted": aborted, "unknown": 0, "audit": dict.fromkeys(bench.AUDITED, aborted)}

    return {"modes": {"managed": mode(pairs, 0), "baseline": mode(pairs, aborted)},
            "publications": [{"mode": "managed", "seconds": 9.0, "bootstrap": True}]
            + [{"mode": m, "seconds": s} for s in publications for m in ("managed", "baseline")],
            "floor": {"components": [{"floor_s": f} for f in floors]}}


def test_pooled_runs_take_medians_over_every_run_s_samples() -> None:
    pool_path = Path(__file__).resolve().parents[2] / "benchmarks" / "pool_reports.py"
    spec = importlib.util.spec_from_file_location("pool_reports", pool_path)
    assert spec is not None and spec.loader is not None
    pool_reports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_reports)
    pooled = pool_reports.pool([_report([0.8, 0.9, 1.0], [0.5, 0.6], [0.3], aborted=2),
                                _report([1.1, 1.2], [0.7], [0.4, 0.5], aborted=3)])
    managed = pooled["modes"]["managed"]
    assert managed["tput_ratio"][0] == 1.0 and managed["pairs"] == 5  # median of the five pairs, not of run medians
    assert managed["publish_s"][0] == 0.6 and managed["publications"] == 3  # the bootstrap publication is not one
    assert pooled["floor_s"][0] == 0.4 and pooled["floor_ratio"] == pytest.approx(1.5)
    assert pooled["modes"]["baseline"]["aborted"] == 5 and managed["aborted"] == 0
    low, high = managed["tput_ratio"][1:]
    assert low < 1.0 < high
    assert bench.last_line(managed, pooled["floor_ratio"]) == (
        "tput_ratio=1.000 p95_ratio=1.000 gap_ratio=1.000 failed=0 aborted=0 pauses=0 publish_s=0.600 "
        f"floor_ratio=1.500 tput_ci={low:.3f},{high:.3f}")


def test_pooled_phases_sum_a_publication_s_buckets_and_skip_phases_it_never_reached() -> None:
    pool_path = Path(__file__).resolve().parents[2] / "benchmarks" / "pool_reports.py"
    spec = importlib.util.spec_from_file_location("pool_reports", pool_path)
    assert spec is not None and spec.loader is not None
    pool_reports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_reports)
    assert pool_reports.phase_seconds({"phases": {"reserve": 0.1, "bucket_0": 0.2, "bucket_1": 0.3, "end": 0.4}}) == {
        "reserve": 0.1, "buckets": 0.5, "end": 0.4}
    report = _report([1.0], [0.5, 0.7], [0.3], aborted=0)
    for publication, end in zip(report["publications"], (9.0, 0.2, 9.0, 0.6, 9.0), strict=True):
        publication["phases"] = {"begin": 0.01, "bucket_0": 0.02, "end": end}
    phases = pool_reports.pool([report])["modes"]["managed"]["phases"]
    assert set(phases) == {"begin", "buckets", "end"}  # the bootstrap publication's 9 s end is not counted
    assert phases["end"][0] == pytest.approx(0.4) and phases["buckets"][0] == pytest.approx(0.02)
