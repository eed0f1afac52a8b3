"""What packing a publication's buckets costs beside two engines under traffic, and what it costs the
publisher's event loop: packing as it is now (on a thread, one numpy concatenation a bucket) against packing
as before 772cb07 (`torch.cat`, on the event loop), each inside real publications of the same run.

Two engines of the `qwen3-0.6b-shape` fixture (one torch thread each, as every engine here), a real Ray
registry actor, gloo, N closed-loop base-model generation streams per engine (`end_phase.Traffic`) through
the whole run. This process, the publisher's, keeps torch's default intra-op threads, as a trainer's does.
Publications of adapters A and B in turn (r=64 on all seven modules, ~80 MB, 16 MiB buckets), each from a
snapshot read afresh (so every publication packs its buckets: the packed buckets are cached per snapshot),
rotating the packing:

- `torch.cat on the loop`: as before 772cb07: `pack_bucket` with torch.cat (this benchmark swaps it in) and
  `packed_buckets` called on the event loop (the link's `asyncio.to_thread` runs it in place);
- `torch.cat`: the same concatenation on the link's thread;
- `numpy`: as it is.

Per publication: `pack_s` (the wall seconds of every `pack_bucket` call), its `bucket_0` phase (the first
bucket on every engine, packing included), `publish_s`, and `loop_lag_s`: the longest the event loop (the one
the traffic's streams and the publisher share) was late for a 10 ms timer during the publication. Medians
[95% bootstrap interval] per variant. Not a test: nothing is asserted. Last line:
    pack_s_numpy=… pack_s_torch=… pack_ratio=… bucket0_s_numpy=… bucket0_s_torch=… loop_lag_s_numpy=…
    loop_lag_s_torch_loop=… bucket0_s_torch_loop=… failed=… commit=…

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
from versioned_lora.adapters import engine_link, transfer
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.demo.stack import ensure_ray, new_token
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, build_fixtures

TORCH_CAT_ON_LOOP, TORCH_CAT, NUMPY = "torch.cat on the loop", "torch.cat", "numpy"
VARIANTS = (TORCH_CAT_ON_LOOP, TORCH_CAT, NUMPY)
_today = transfer.pack_bucket


def _pack_with_torch_cat(tensors: Any, plan: Any, index: int, device: Any = "cpu", *, check: bool = True) -> Any:
    """`pack_bucket` before 772cb07 (its CPU path: every part on the CPU, one torch.cat)."""
    import torch

    transfer.check_bucket_tensors(tensors, plan, index, check_dtype_and_shape=check)
    target = torch.device(device)
    parts = transfer._byte_parts(tensors, plan.buckets[index], target)
    return torch.cat(parts) if len(parts) > 1 else parts[0].to(target, copy=True)


class _PackOnTheLoop:
    """`asyncio` as `engine_link` sees it, except that its `to_thread` runs the packing in place, on the event loop,
    as `EngineLink.transfer_bucket` did before 772cb07 (every other call still goes to a thread)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @staticmethod
    async def to_thread(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if func in (engine_link.packed_buckets, engine_link.pack_bucket):
            return func(*args, **kwargs)
        return await asyncio.to_thread(func, *args, **kwargs)


@contextlib.contextmanager
def packing(variant: str, spent: list[float]) -> Iterator[None]:
    """Pack with `variant` meanwhile, adding each call's seconds to `spent`."""
    chosen = _today if variant == NUMPY else _pack_with_torch_cat

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return chosen(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    transfer.pack_bucket = timed  # packed_buckets looks it up in the module at every call
    if variant == TORCH_CAT_ON_LOOP:
        engine_link.asyncio = _PackOnTheLoop()  # type: ignore[assignment]
    try:
        yield
    finally:
        transfer.pack_bucket = _today
        engine_link.asyncio = asyncio


class LoopLag:
    """The longest the event loop was late for a 10 ms timer since the last `take()`."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.monotonic() - started - 0.01)

    def start(self) -> None:
        self.task = asyncio.create_task(self._watch())

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst


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
            lag = LoopLag()
            lag.start()
            previous = None
            for i in range(len(VARIANTS) * args.reps):
                variant = VARIANTS[(i + i // len(VARIANTS)) % len(VARIANTS)]  # rotated: none always goes first
                snapshot = snapshot_from_adapter_dir(fixtures.adapters["AB"[i % 2]])  # fresh: nothing cached
                version, candidate = stack.candidate(f"p{i}", snapshot=snapshot)
                spent: list[float] = []
                with packing(variant, spent):
                    lag.take()
                    started = time.monotonic()
                    outcome = await stack.publisher.publish(version, candidate)
                    publish_s = time.monotonic() - started
                    loop_lag_s = lag.take()
                if not outcome.committed:
                    raise RuntimeError(f"publication {i} not committed: {outcome}")
                rows.append({"variant": variant, "pack_s": sum(spent), "packs": len(spent),
                             "bucket_0": outcome.phases["bucket_0"], "publish_s": publish_s, "loop_lag_s": loop_lag_s})
                say(f"# {i:2d} {variant:21s} pack_s {sum(spent):.4f} ({len(spent)} buckets)  "
                    f"bucket_0 {outcome.phases['bucket_0']:.3f}  publish_s {publish_s:.3f}  "
                    f"loop_lag_s {loop_lag_s:.3f}")
                if previous is not None:
                    await stack.reclaimer.reclaim(previous)
                previous = version
                await asyncio.sleep(2)
            assert lag.task is not None
            lag.task.cancel()
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
    for variant in VARIANTS:
        for key in ("pack_s", "bucket_0", "publish_s", "loop_lag_s"):
            summary[(variant, key)] = bootstrap_median([r[key] for r in rows if r["variant"] == variant])
        say(f"{variant:21s} pack_s {fmt_interval(summary[(variant, 'pack_s')])}  "
            f"bucket_0 {fmt_interval(summary[(variant, 'bucket_0')])}  "
            f"publish_s {fmt_interval(summary[(variant, 'publish_s')])}  "
            f"loop_lag_s {fmt_interval(summary[(variant, 'loop_lag_s')])}")
    ratio = summary[(TORCH_CAT, "pack_s")][0] / summary[(NUMPY, "pack_s")][0]
    say(f"pack_s_numpy={summary[(NUMPY, 'pack_s')][0]:.4f} pack_s_torch={summary[(TORCH_CAT, 'pack_s')][0]:.4f} "
        f"pack_ratio={ratio:.1f} bucket0_s_numpy={summary[(NUMPY, 'bucket_0')][0]:.3f} "
        f"bucket0_s_torch={summary[(TORCH_CAT, 'bucket_0')][0]:.3f} "
        f"loop_lag_s_numpy={summary[(NUMPY, 'loop_lag_s')][0]:.3f} "
        f"loop_lag_s_torch_loop={summary[(TORCH_CAT_ON_LOOP, 'loop_lag_s')][0]:.3f} "
        f"bucket0_s_torch_loop={summary[(TORCH_CAT_ON_LOOP, 'bucket_0')][0]:.3f} "
        f"failed={served['failed']} commit={commit()}")


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
