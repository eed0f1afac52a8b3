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
