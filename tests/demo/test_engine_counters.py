"""`demo.engine_counters.parse` on /metrics pages shaped like SGLang 0.5.23's (held to a real engine's page by
tests/ops/test_metrics.py)."""

from __future__ import annotations

import pytest

from versioned_lora.demo.engine_counters import Counts, MetricsUnavailable, parse, total, window_counts

PAGE = """\
# HELP sglang:realtime_tokens_total Total number of tokens processed (updated on each log interval).
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{engine_type="unified",mode="prefill_compute",pp_rank="0",tp_rank="0"} 400.0
sglang:realtime_tokens_total{engine_type="unified",mode="decode",pp_rank="0",tp_rank="0"} 123.0
# HELP sglang:cuda_graph_passes_total Total number of forward passes categorized by CUDA graph.
# TYPE sglang:cuda_graph_passes_total counter
sglang:cuda_graph_passes_total{engine_type="unified",mode="decode_none",pp_rank="0",tp_rank="0"} 61.0
sglang:cuda_graph_passes_total{engine_type="unified",mode="prefill_none",pp_rank="0",tp_rank="0"} 9.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",pp_rank="0",tp_rank="0"} 2.0
"""


def test_decode_tokens_and_passes_by_kind_are_read_and_prefill_tokens_are_not() -> None:
    assert parse(PAGE) == Counts(decode_tokens=123.0, decode_passes=61.0, prefill_passes=9.0)


def test_an_engine_that_has_not_decoded_yet_counts_zero() -> None:
    idle = "\n".join(line for line in PAGE.splitlines() if "mode=" not in line) + "\n"
    assert parse(idle) == Counts()


def test_a_page_without_sglang_metrics_is_refused() -> None:
    with pytest.raises(MetricsUnavailable):
        parse("# HELP python_info x\n# TYPE python_info gauge\npython_info{version=\"3.11\"} 1.0\n")


def test_a_window_is_the_difference_of_its_edges_per_engine_and_engines_add_up() -> None:
    before = {"E0": Counts(10, 5, 1), "E1": Counts(0, 0, 0)}
    after = {"E0": Counts(30, 15, 2), "E1": Counts(8, 8, 1)}
    diff = window_counts(before, after)
    assert diff == {"E0": Counts(20, 10, 1), "E1": Counts(8, 8, 1)}
    assert total(list(diff.values())) == Counts(28, 18, 2)
