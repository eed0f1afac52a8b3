"""What packing a publication's buckets costs beside two engines under traffic: the CPU packing
`transfer.pack_bucket` does now (one numpy concatenation a bucket) against the `torch.cat` it did before
772cb07, each inside real publications of the same run.

Two engines of the `qwen3-0.6b-shape` fixture (one torch thread each, as every engine here), a real Ray
registry actor, gloo, N closed-loop base-model generation streams per engine (`end_phase.Traffic`) through
the whole run. This process, the publisher's, keeps torch's default intra-op threads, as a trainer's does.
Publications of adapters A and B in turn (r=64 on all seven modules, ~80 MB, 16 MiB buckets), each from a
snapshot read afresh (so every publication packs its buckets: the packed buckets are cached per snapshot),
alternating the packing:

- `torch.cat`: `pack_bucket` with the concatenation it had before 772cb07 (this benchmark swaps it in);
- `numpy`: `pack_bucket` as it is.

Per publication: `pack_s` (the CPU time of every `pack_bucket` call, wall seconds), its `bucket_0` phase
(the first bucket on every engine, packing included) and `publish_s`. Medians [95% bootstrap interval] per
variant, and the ratio of the medians torch.cat / numpy. Not a test: nothing is asserted. Last line:
    pack_s_numpy=… pack_s_torch=… pack_ratio=… bucket0_s_numpy=… bucket0_s_torch=… failed=… commit=…

    python benchmarks/pack_under_load.py [--reps 6] [--traffic 2] [--out benchmarks/results/FILE.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.end_phase import PIPELINED, Traffic, start_pair
from benchmarks.online_publication import bootstrap_median, fmt_interval
from benchmarks.publication_scale import SCALE_BUCKET, commit, stack_over
from versioned_lora.adapters import transfer
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.demo.stack import ensure_ray, new_token
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, build_fixtures

TORCH_CAT, NUMPY = "torch.cat", "numpy"
_today = transfer.pack_bucket


def _pack_with_torch_cat(tensors: Any, plan: Any, index: int, device: Any = "cpu", *, check: bool = True) -> Any:
    """`pack_bucket` before 772cb07 (its CPU path: every part on the CPU, one torch.cat)."""
    import torch

    transfer.check_bucket_tensors(tensors, plan, index, check_dtype_and_shape=check)
    target = torch.device(device)
    parts = transfer._byte_parts(tensors, plan.buckets[index], target)
    return torch.cat(parts) if len(parts) > 1 else parts[0].to(target, copy=True)


@contextlib.contextmanager
def packing(variant: str, spent: list[float]) -> Iterator[None]:
    """Pack with `variant` meanwhile, adding each call's seconds to `spent`."""
    chosen = _pack_with_torch_cat if variant == TORCH_CAT else _today

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return chosen(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    transfer.pack_bucket = timed  # packed_buckets looks it up in the module at every call
    try:
        yield
    finally:
        transfer.pack_bucket = _today


async def run(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    import torch

    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    say(f"# pack under load {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} commit={commit()} "
        f"torch threads here={torch.get_num_threads()} reps={args.reps} per variant, traffic={args.traffic} "
        f"streams per engine")
    workdir = Path(tempfile.mkdtemp(prefix="pack-under-load-"))
    (workdir / "logs").mkdir()
    token = new_token()
    started_ray = ensure_ray()
    engines = start_pair(fixtures, PIPELINED, token, workdir, "pack")
    rows: list[dict[str, Any]] = []
    try:
        reference = ReferenceModel(fixtures.model_dir)
        stack = stack_over(engines, token, workdir, fixtures, fixtures.probe_prompt, reference, SCALE_BUCKET)
        try:
            await stack.publisher.sync_incarnations()
            load = Traffic(stack, args.traffic)
            load.start()
            await asyncio.sleep(5)  # the streams reach their steady state
            previous = None
            for i in range(2 * args.reps):
                variant = (TORCH_CAT, NUMPY)[(i + i // 2) % 2]  # T N N T T N ...: neither always goes first
                snapshot = snapshot_from_adapter_dir(fixtures.adapters["AB"[i % 2]])  # fresh: nothing cached
                version, candidate = stack.candidate(f"p{i}", snapshot=snapshot)
                spent: list[float] = []
                with packing(variant, spent):
                    started = time.monotonic()
                    outcome = await stack.publisher.publish(version, candidate)
                    publish_s = time.monotonic() - started
                if not outcome.committed:
                    raise RuntimeError(f"publication {i} not committed: {outcome}")
                rows.append({"variant": variant, "pack_s": sum(spent), "packs": len(spent),
                             "bucket_0": outcome.phases["bucket_0"], "publish_s": publish_s})
                say(f"# {i:2d} {variant:9s} pack_s {sum(spent):.4f} ({len(spent)} buckets)  "
                    f"bucket_0 {outcome.phases['bucket_0']:.3f}  publish_s {publish_s:.3f}")
                if previous is not None:
                    await stack.reclaimer.reclaim(previous)
                previous = version
                await asyncio.sleep(2)
            served = await load.stop()
        finally:
            await stack.close()
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()
    say(f"# traffic: {served}")
    say("# per variant: median [95% interval] over publications")
    summary: dict[tuple[str, str], tuple[float, float, float]] = {}
    for variant in (TORCH_CAT, NUMPY):
        for key in ("pack_s", "bucket_0", "publish_s"):
            summary[(variant, key)] = bootstrap_median([r[key] for r in rows if r["variant"] == variant])
        say(f"{variant:10s} pack_s {fmt_interval(summary[(variant, 'pack_s')])}  "
            f"bucket_0 {fmt_interval(summary[(variant, 'bucket_0')])}  "
            f"publish_s {fmt_interval(summary[(variant, 'publish_s')])}")
    ratio = summary[(TORCH_CAT, "pack_s")][0] / summary[(NUMPY, "pack_s")][0]
    say(f"pack_s_numpy={summary[(NUMPY, 'pack_s')][0]:.4f} pack_s_torch={summary[(TORCH_CAT, 'pack_s')][0]:.4f} "
        f"pack_ratio={ratio:.1f} bucket0_s_numpy={summary[(NUMPY, 'bucket_0')][0]:.3f} "
        f"bucket0_s_torch={summary[(TORCH_CAT, 'bucket_0')][0]:.3f} failed={served['failed']} commit={commit()}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/pack_under_load.py")
    parser.add_argument("--reps", type=int, default=6, help="publications per variant")
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
