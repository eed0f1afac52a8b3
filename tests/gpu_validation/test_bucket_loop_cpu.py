"""The one-device bucket loop (gpu_validation/bucket_loop.py) on the CPU: it runs the publication's own
`EngineLink.transfer_bucket` for every bucket of the plan, sends each through the labelled stand-in, and leaves
`send_bucket` as it found it. (Its figures are for a GPU; here only the code path is checked.)"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_validation import bucket_loop
from gpu_validation.transfer_bench import ALL_LINEAR, Case, synthetic_tensors
from versioned_lora.adapters import engine_link


def test_the_loop_sends_every_bucket_through_transfer_bucket_and_restores_the_wire(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    original, copy = engine_link.send_bucket, bucket_loop.d2d_send

    def counting(group: Any, flat: Any, *args: Any, **kwargs: Any) -> None:
        sent.append(flat.numel())
        copy(group, flat)

    monkeypatch.setattr(bucket_loop, "d2d_send", counting)
    case = Case("all_r2_cpu", 2, ALL_LINEAR, 1024 * 1024)
    figures = bucket_loop.measure(case.label, synthetic_tensors(case, "cpu", 1),
                                  {"r": 2, "lora_alpha": 4, "target_modules": list(ALL_LINEAR)},
                                  case.max_bucket_bytes, "cpu", reps=3, warmup=0)
    assert figures.buckets >= 2 and len(sent) == 3 * figures.buckets  # every bucket, every loop repetition
    assert sum(sent[:figures.buckets]) == figures.nbytes
    assert engine_link.send_bucket is original
    assert figures.raw_s > 0 and figures.loop_s > 0
