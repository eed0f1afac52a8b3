"""The publication's own per-bucket loop on ONE device, the broadcast replaced by a device-to-device copy.

A publication sends bucket by bucket: `EngineLink.transfer_bucket` packs (once per snapshot, `packed_buckets`),
posts the engine's `receive_bucket` confirmation and runs `send_bucket` on a thread, one bucket at a time per
link, and returns when both finished. This runs that very method, unchanged, with two stand-ins, both labelled:

- the wire: `send_bucket` (looked up by name in `adapters/engine_link.py`) is replaced by a copy of the packed
  bucket into a fresh buffer of its size on the same device (what a receive allocates), followed by the same
  device sync `send_bucket` makes (`_sync_device`);
- the barrier: the engine's confirmation answers at once (`InstantConfirm`), so the RFC's per-bucket round trip
  to the engine is excluded (the two-GPU run measures it on its own).

Against it, in the same invocation and alternating (rotated each repetition): `raw`, the same copies of the same
packed buckets back to back into fresh buffers, one device sync at the end. What the loop adds per bucket is
`(loop - raw) / buckets`; its null reading is `raw` against a second `raw` drawn the same way (`raw2`), so a
figure whose null interval excludes 1 says the method drifts more than the effect.

    python -m gpu_validation.transfer_bench --loop --device cuda --out results.txt     # one GPU is enough
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs

LABEL = "wire=d2d-copy barrier=excluded"


class InstantConfirm:
    """The engine's side of `receive_bucket`, answered at once (the barrier's round trip excluded)."""

    async def managed(self, operation: str, http_timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return {"result": {"state": "STAGING", "index": body.get("index")}, "incarnation": body.get("incarnation")}


def d2d_send(group: Any, flat: Any, src_rank: int = 0, timeout: datetime.timedelta | None = None) -> None:
    """`send_bucket`'s stand-in: the bucket's bytes copied into a fresh buffer on the same device, then the sync
    `send_bucket` makes after its broadcast."""
    import torch

    received = torch.empty_like(flat)
    received.copy_(flat)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()


def raw_copies(buckets: Sequence[Any]) -> None:
    import torch

    for flat in buckets:
        torch.empty_like(flat).copy_(flat)
    if buckets and buckets[0].is_cuda:
        torch.cuda.current_stream(buckets[0].device).synchronize()


@attrs.frozen
class LoopFigures:
    label: str
    buckets: int
    nbytes: int
    loop_s: float
    raw_s: float
    ratio: float  # raw / loop: the loop's share of the copies' own speed
    ratio_ci: tuple[float, float]
    null_ratio: float  # raw / raw2
    null_ci: tuple[float, float]
    overhead_us_per_bucket: float

    def row(self) -> str:
        return (f"{self.label:<14} {self.buckets:>7} {self.nbytes / 2**20:>9.1f} {self.raw_s * 1e3:>9.3f} "
                f"{self.loop_s * 1e3:>9.3f} {self.ratio:>6.3f} [{self.ratio_ci[0]:.3f}, {self.ratio_ci[1]:.3f}] "
                f"{self.null_ratio:>6.3f} [{self.null_ci[0]:.3f}, {self.null_ci[1]:.3f}] "
                f"{self.overhead_us_per_bucket:>9.1f}")


HEADER = (f"{'case':<14} {'buckets':>7} {'MiB':>9} {'raw ms':>9} {'loop ms':>9} {'ratio':>6} {'95% CI':<16} "
          f"{'null':>6} {'95% CI':<16} {'us/bucket':>9}")


def measure(label: str, tensors: dict[str, Any], config: dict[str, Any], max_bucket_bytes: int, device: str,
            reps: int, warmup: int) -> LoopFigures:
    """One case: the snapshot of `tensors`, its plan at `max_bucket_bytes`, the loop and raw over `reps`."""
    import torch

    from gpu_validation.transfer_bench import ratio_interval
    from versioned_lora.adapters import engine_link
    from versioned_lora.adapters.engine_link import Candidate, EngineLink
    from versioned_lora.adapters.snapshot import snapshot_from_tensors
    from versioned_lora.adapters.transfer import packed_buckets

    snapshot = snapshot_from_tensors(tensors, config)
    candidate = Candidate.build("bench-v1-" + snapshot.digest[:12], snapshot, max_bucket_bytes)
    buckets = packed_buckets(snapshot, candidate.plan, device)  # what transfer_bucket sends (cached: packed once)
    link = EngineLink(InstantConfirm(), incarnation=1, group=None, group_name="d2d", device=device)  # type: ignore[arg-type]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    original = engine_link.send_bucket
    engine_link.send_bucket = d2d_send

    async def loop_once() -> None:
        for index in range(candidate.bucket_count):
            await link.transfer_bucket(candidate, "bench", index)

    def timed(kind: str) -> float:
        sync()
        began = time.perf_counter()
        if kind == "loop":
            asyncio.run(loop_once())
        else:
            raw_copies(buckets)
        sync()
        return time.perf_counter() - began

    try:
        for _ in range(warmup):
            timed("loop")
            timed("raw")
        times: dict[str, list[float]] = {"loop": [], "raw": [], "raw2": []}
        kinds = ("loop", "raw", "raw2")
        for rep in range(reps):
            for kind in kinds[rep % 3:] + kinds[:rep % 3]:
                times[kind].append(timed("loop" if kind == "loop" else "raw"))
    finally:
        engine_link.send_bucket = original
    loop_s, raw_s = statistics.median(times["loop"]), statistics.median(times["raw"])
    return LoopFigures(
        label=label, buckets=candidate.bucket_count, nbytes=snapshot.total_bytes, loop_s=loop_s, raw_s=raw_s,
        ratio=raw_s / loop_s, ratio_ci=ratio_interval(times["raw"], times["loop"]),
        null_ratio=statistics.median(times["raw"]) / statistics.median(times["raw2"]),
        null_ci=ratio_interval(times["raw"], times["raw2"]),
        overhead_us_per_bucket=(loop_s - raw_s) / candidate.bucket_count * 1e6,
    )


def run(cases: Sequence[Any], device: str, reps: int, warmup: int, seed: int) -> list[str]:
    """Every case (transfer_bench.Case) on `device`: the report's lines, the last one the figures of the first
    64 MiB all-linear r=64 case there is (else the last case)."""
    from gpu_validation.transfer_bench import synthetic_tensors

    rows = []
    for case in cases:
        tensors = synthetic_tensors(case, device, seed)
        config = {"r": case.rank, "lora_alpha": 2 * case.rank, "target_modules": list(case.modules)}
        rows.append(measure(case.label, tensors, config, case.max_bucket_bytes, device, reps, warmup))
        del tensors
    pick = next((r for r in rows if r.label.startswith("all_r64_b64")), rows[-1])
    return [
        f"# the publication's per-bucket loop (EngineLink.transfer_bucket, unchanged) on one {device} device; "
        f"{LABEL}; reps={reps} warmup={warmup}; medians; ratio = raw / loop with a 95% bootstrap interval; "
        "null = raw / raw2 (the same copies drawn twice)",
        HEADER, *(row.row() for row in rows),
        f"loop=product {LABEL.replace(' ', ' ')} device={device} case={pick.label} buckets={pick.buckets} "
        f"ratio={pick.ratio:.3f} ratio_ci={pick.ratio_ci[0]:.3f},{pick.ratio_ci[1]:.3f} "
        f"null={pick.null_ratio:.3f} null_ci={pick.null_ci[0]:.3f},{pick.null_ci[1]:.3f} "
        f"overhead_us_per_bucket={pick.overhead_us_per_bucket:.1f}",
    ]
