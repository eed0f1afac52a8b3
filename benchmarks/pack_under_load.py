"""What packing a publication's buckets costs the publisher's process beside two engines under traffic: the
CPU packing `transfer.pack_bucket` does now (one numpy concatenation a bucket) against the `torch.cat` it did
before 772cb07, both measured in this run, over the same tensors.

Two engines of the `qwen3-0.6b-shape` fixture (one torch thread each, as every engine here) serve N closed-loop
base-model generation streams each (`end_phase.Traffic`) for the whole run; this process keeps torch's default
intra-op threads, as a publisher's process does. Per rep, in an order rotated every rep, each variant packs
every bucket of adapter A (r=64 on all seven modules, ~80 MB, 16 MiB buckets) from scratch:

- `torch.cat`: the bucket's uint8 parts concatenated by `torch.cat`, the code before 772cb07;
- `numpy`: `transfer.pack_bucket`, today's code.

Also, before the traffic starts, the same reps on idle engines. Reported: seconds per adapter, median [95%
bootstrap interval] over reps, and the median of the per-rep ratio torch.cat / numpy. Not a test: nothing is
asserted. Last line:
    pack_s_numpy=… pack_s_torch=… ratio=… idle_pack_s_numpy=… idle_pack_s_torch=… traffic_tokens_per_s=… commit=…

    python benchmarks/pack_under_load.py [--reps 15] [--traffic 2] [--out benchmarks/results/FILE.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.end_phase import PIPELINED, Traffic, start_pair
from benchmarks.online_publication import bootstrap_median, fmt_interval
from benchmarks.publication_scale import SCALE_BUCKET, commit, stack_over
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.adapters.transfer import BucketPlan, _byte_parts, pack_bucket
from versioned_lora.demo.stack import ensure_ray, new_token
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, build_fixtures


def variants(tensors: Any, plan: BucketPlan) -> dict[str, Callable[[], None]]:
    import torch

    cpu = torch.device("cpu")

    def with_torch_cat() -> None:
        for bucket in plan.buckets:
            torch.cat(_byte_parts(tensors, bucket, cpu))

    def with_numpy() -> None:
        for index in range(len(plan.buckets)):
            pack_bucket(tensors, plan, index, cpu, check=False)

    return {"torch.cat": with_torch_cat, "numpy": with_numpy}


def measure(runs: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            started = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - started)
    return seconds


async def run(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    import torch

    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["A"])
    plan = BucketPlan.build(snapshot.manifest, SCALE_BUCKET)
    runs = variants(snapshot.tensors, plan)
    say(f"# pack under load {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} commit={commit()} "
        f"torch threads here={torch.get_num_threads()} buckets={len(plan.buckets)} "
        f"bytes={sum(b.nbytes for b in plan.buckets)} reps={args.reps} traffic={args.traffic} streams per engine")
    workdir = Path(tempfile.mkdtemp(prefix="pack-under-load-"))
    (workdir / "logs").mkdir()
    token = new_token()
    started_ray = ensure_ray()
    engines = start_pair(fixtures, PIPELINED, token, workdir, "pack")
    try:
        stack = stack_over(engines, token, workdir, fixtures, fixtures.probe_prompt, None, SCALE_BUCKET)
        try:
            idle = measure(runs, args.reps)
            load = Traffic(stack, args.traffic)
            load.start()
            await asyncio.sleep(5)  # the streams reach their steady state
            # The packing runs on a thread, as the publisher's link runs it: the streams' event loop keeps going.
            busy = await asyncio.to_thread(measure, runs, args.reps)
            served = await load.stop()
        finally:
            await stack.close()
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()
    for label, seconds in (("idle", idle), ("traffic", busy)):
        for name, values in seconds.items():
            say(f"# {label} {name}: " + " ".join(f"{v:.4f}" for v in values))
    say(f"# traffic served while packing: {served}")
    say("# seconds to pack the adapter's buckets: median [95% interval] over reps; ratio = torch.cat / numpy, "
        "rep by rep")
    summary: dict[str, tuple[float, float, float]] = {}
    for label, seconds in (("idle", idle), ("traffic", busy)):
        ratio = bootstrap_median([t / n for t, n in zip(seconds["torch.cat"], seconds["numpy"], strict=True)])
        for name, values in seconds.items():
            summary[f"{label} {name}"] = bootstrap_median(values)
            say(f"{label:8s} {name:10s} {fmt_interval(summary[f'{label} {name}'])}")
        summary[f"{label} ratio"] = ratio
        say(f"{label:8s} ratio      {fmt_interval(ratio)}")
    say(f"pack_s_numpy={summary['traffic numpy'][0]:.4f} pack_s_torch={summary['traffic torch.cat'][0]:.4f} "
        f"ratio={summary['traffic ratio'][0]:.1f} idle_pack_s_numpy={summary['idle numpy'][0]:.4f} "
        f"idle_pack_s_torch={summary['idle torch.cat'][0]:.4f} traffic_tokens_per_s={served['tokens_per_s']} "
        f"commit={commit()}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/pack_under_load.py")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--traffic", type=int, default=2, help="closed-loop generation streams per engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    asyncio.run(run(args, say))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
