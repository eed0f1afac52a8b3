"""Where the project's transfer time goes, one side at a time: each row pairs a sender path with a receiver
path over the same group and plan, so a row that differs from `raw/raw` in one side only shows that side's cost.

    NCCL_NVLS_ENABLE=0 python -m gpu_validation.transfer_breakdown --device cuda

Sender paths: `raw` (raw_broadcast of pre-packed buckets), `project` (send_all of a Snapshot, packed buckets
cached). Receiver paths: `raw` (raw_broadcast into pre-allocated buffers), `project` (start_receive_bucket for
every bucket, then result() of each, stashed), `views` (async receives into fresh buffers plus every tensor's
view made while its bucket is on the wire: the receive path before 2026-11-29, kept to show what it cost).
`gate/gate` times the start gate and done ack alone (the floor of every row). Times are host medians in µs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import types
from typing import Any

from gpu_validation.transfer_bench import ALL_LINEAR, QV_ONLY, Case, MiB, _device, _signal, _sync, synthetic_tensors

PAIRS = (("gate", "gate"), ("raw", "raw"), ("project", "raw"), ("raw", "project"), ("project", "project"),
         ("raw", "views"))  # fmt: skip


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("all_r2_quick", 2, ALL_LINEAR, 4 * MiB)]
    return [Case("all_r16_b64", 16, ALL_LINEAR, 64 * MiB), Case("all_r64_b64", 64, ALL_LINEAR, 64 * MiB),
            Case("qv_r16_b64", 16, QV_ONLY, 64 * MiB)]  # fmt: skip


def _rank_main(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    from versioned_lora.adapters.manifest import manifest_from_tensors
    from versioned_lora.adapters.snapshot import Snapshot
    from versioned_lora.adapters.transfer import (
        BucketPlan,
        allocate_buckets,
        init_transfer_group,
        pack_all,
        raw_broadcast,
        send_all,
        start_receive_bucket,
    )

    device = _device(args.device, rank)
    group = init_transfer_group(master_address="127.0.0.1", master_port=port, rank=rank, group_name="vlora-bd",
                                device=args.device, timeout=datetime.timedelta(seconds=300))  # fmt: skip
    for case in _cases(args.quick):
        # Both ranks build the same synthetic tensors (same seed), so both know the manifest without a queue.
        tensors = synthetic_tensors(case, device, args.seed)
        manifest = manifest_from_tensors(tensors, {"r": case.rank, "lora_alpha": case.rank,
                                                   "target_modules": list(case.modules)})  # fmt: skip
        plan = BucketPlan.build(manifest, case.max_bucket_bytes)
        snapshot = Snapshot(tensors=types.MappingProxyType(tensors), manifest=manifest)
        packed = pack_all(tensors, plan, device)
        buffers = allocate_buckets(plan, device)
        _sync(device)
        times: dict[str, list[float]] = {f"{s}/{r}": [] for s, r in PAIRS}
        stash: dict[Any, Any] = {}
        for rep in range(args.warmup + args.reps):
            for send_path, recv_path in PAIRS:
                stash = {}
                _signal(group, device, 0)
                t0 = time.perf_counter()
                if rank == 0:
                    if send_path == "raw":
                        raw_broadcast(group, packed)
                    elif send_path == "project":
                        send_all([group], snapshot, plan, device=device).raise_for_failures()
                elif recv_path == "raw":
                    raw_broadcast(group, buffers)
                elif recv_path == "project":
                    pending = [start_receive_bucket(group, plan, i, device) for i in range(len(plan.buckets))]
                    stash = {bucket.index: bucket.result() for bucket in pending}
                elif recv_path == "views":
                    stash = _receive_with_views(group, plan, device)
                _signal(group, device, 1)
                if rep >= args.warmup:
                    times[f"{send_path}/{recv_path}"].append(time.perf_counter() - t0)
        if rank == 0:
            results.put({"case": case.label, "mb": plan.payload_bytes / 1e6, "buckets": len(plan.buckets),
                         "us": {k: statistics.median(v) * 1e6 for k, v in times.items()}})  # fmt: skip
        del tensors, snapshot, packed, buffers, stash


def _receive_with_views(group: Any, plan: Any, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from versioned_lora.adapters.transfer import _aligned_views, _layout

    flats = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in plan.buckets]
    works: list[Any] = []
    stash: dict[str, Any] = {}
    for i, flat in enumerate(flats):
        works.append(dist.broadcast(flat, src=0, group=group, async_op=True))
        stash.update(_aligned_views(flat, _layout(plan.buckets[i])))
    for work in works:
        work.wait()
    _sync(device)
    return stash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_validation.transfer_breakdown")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    from versioned_lora.adapters.transfer import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, args, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=600) for _ in _cases(args.quick)]
    for proc in procs:
        proc.join(timeout=60)
    labels = [f"{s}/{r}" for s, r in PAIRS]
    print(f"# transfer breakdown device={args.device} reps={args.reps}; host median µs per run (gate included)")
    print(f"{'case':<14}{'MB':>7}{'bkts':>5}" + "".join(f"{label:>18}" for label in labels))
    for row in rows:
        print(f"{row['case']:<14}{row['mb']:>7.1f}{row['buckets']:>5}"
              + "".join(f"{row['us'][label]:>18.1f}" for label in labels))  # fmt: skip
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
