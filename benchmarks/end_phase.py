"""Issue 20 on real engines: what the pipelined verifier takes out of a publication's `end` phase, against
the verification as it was before (every hash after the last bucket, on one thread), both measured in this run.

Two engines of the `qwen3-0.6b-shape` fixture (`--max-lora-rank 64`, every linear module), a real Ray
registry actor, gloo, and the fixture's adapters A and B in turn (r=64 on all seven modules: 392 tensors,
~80 MB, in 16 MiB buckets: six buckets, so most of an adapter lands before its last bucket). The engines
run in blocks, one verification mode a block, alternating (`after-last-bucket`, `pipelined`, and again):
an engine reads its mode at start (`spec.wire.VERIFY_MODE_ENV`), so each block starts its own pair, and
the alternation spreads the host's drift over both modes.

Per publication (`Publisher.publish` of a fresh version; the previous one reclaimed after it), from the
Publisher: `publish_s` and its `end` phase (the slower engine's `end` call, as the Publisher waits for
both); from each engine's status view (`end_parts`, what that engine's `end` spent): `verify_tail_s`
(scheduler: last bucket landed -> verified; the scheduler starts verifying as the last bucket lands, so
part of it runs before `end` arrives), `verify_wait_s` (what `end` itself waited for the verdict),
`load_s` and `probe_s`. Medians per mode with 95% bootstrap intervals (over publications x engines for
the engine parts, over publications for the Publisher's), and each mode's median ratio pipelined / baseline.
With `--traffic N`, N closed-loop generation streams per engine (the base model, 16 tokens each, ignore_eos)
run through every publication of a block, so `end` competes with decoding as it does online; the streams'
tokens/s and failures per mode are reported beside the phases (a failed generation is counted, not hidden).
Not a test: nothing is asserted. Last line:
    verify_tail_s_pipelined=… verify_tail_s_baseline=… tail_ratio=… verify_wait_s_pipelined=…
    verify_wait_s_baseline=… end_s_pipelined=… end_s_baseline=… commit=…

    python benchmarks/end_phase.py [--reps 6] [--blocks 2] [--traffic 0] [--out benchmarks/results/FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.online_publication import bootstrap_median, fmt_interval
from benchmarks.publication_scale import SCALE_BUCKET, commit, key_file_in, stack_over
from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.capabilities import KEY_FILE_ENV
from versioned_lora.demo.stack import Stack, ensure_ray, new_token
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, build_fixtures
from versioned_lora.spec.wire import TOKEN_ENV, VERIFY_MODE_ENV

BASELINE, PIPELINED = "after-last-bucket", "pipelined"
ENGINE_PARTS = ("verify_tail_s", "verify_wait_s", "load_s", "probe_s")


def start_pair(fixtures: Any, mode: str, token: str, workdir: Path, tag: str) -> list[EngineProcess]:
    env = {TOKEN_ENV: token, KEY_FILE_ENV: str(key_file_in(workdir)), VERIFY_MODE_ENV: mode}
    configs = []
    for index in range(2):
        configs.append(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                    log_path=workdir / "logs" / f"{tag}-E{index}.log",
                                    max_lora_rank=fixtures.lora_rank, lora_target_modules=fixtures.target_modules,
                                    env=env))
    return start_all(configs)


TRAFFIC_TOKENS = 16


class Traffic:
    """`streams` closed-loop base-model generations per engine, from `start()` until `stop()`."""

    def __init__(self, stack: Stack, streams: int) -> None:
        self.stack, self.streams = stack, streams
        self.tokens = self.failed = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.started = self.ended = 0.0

    async def _loop(self, client: Any) -> None:
        prompt = list(self.stack.fixtures.probe_prompt)
        while True:
            try:
                generation = await client.generate(prompt, None, TRAFFIC_TOKENS, ignore_eos=True)
                self.tokens += len(generation.output_ids)
            except Exception:  # counted and reported: a failed generation must not stop the benchmark
                self.failed += 1

    def start(self) -> None:
        self.started = time.monotonic()
        self.tasks = [asyncio.create_task(self._loop(client))
                      for client in self.stack.clients.values() for _ in range(self.streams)]

    async def stop(self) -> dict[str, Any]:
        self.ended = time.monotonic()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        wall = self.ended - self.started
        return {"streams": self.streams * len(self.stack.clients), "tokens": self.tokens, "failed": self.failed,
                "wall_s": round(wall, 2), "tokens_per_s": round(self.tokens / wall, 2) if wall > 0 else None}


async def block(stack: Stack, snapshots: list[Any], reps: int, tag: str, traffic: int = 0
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    await stack.publisher.sync_incarnations()
    load = Traffic(stack, traffic) if traffic else None
    if load is not None:
        load.start()
    runs: list[dict[str, Any]] = []
    previous = None
    for i in range(reps):
        version, candidate = stack.candidate(f"{tag}-{i}", snapshot=snapshots[i % len(snapshots)])
        started = time.monotonic()
        outcome = await stack.publisher.publish(version, candidate)
        publish_s = time.monotonic() - started
        if not outcome.committed:
            raise RuntimeError(f"{tag}: publication {i} not committed: {outcome}")
        parts = {}
        for engine, client in stack.clients.items():
            view = next(a for a in (await client.status())["managed"] if a["name"] == candidate.lora_name)
            parts[engine] = view["end_parts"]
        runs.append({"publish_s": round(publish_s, 4), "end_s": round(outcome.phases["end"], 4),
                     "buckets": candidate.bucket_count, "engines": parts})
        if previous is not None:
            reclaimed = await stack.reclaimer.reclaim(previous)
            if str(reclaimed.status) != "RECLAIMED":
                raise RuntimeError(f"{tag}: reclaim of {previous}: {reclaimed}")
        previous = version
    served = await load.stop() if load is not None else None
    await stack.unload_leftovers()
    return runs, served


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {key: bootstrap_median([r[key] for r in runs]) for key in ("publish_s", "end_s")}
    for part in ENGINE_PARTS:
        out[part] = bootstrap_median([p[part] for r in runs for p in r["engines"].values() if p[part] is not None])
    out["publications"] = len(runs)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    snapshots = [snapshot_from_adapter_dir(fixtures.adapters[n]) for n in ("A", "B")]
    reference = ReferenceModel(fixtures.model_dir)
    token = new_token()
    workdir = Path(tempfile.mkdtemp(prefix="end-phase-"))
    (workdir / "logs").mkdir()
    report: dict[str, Any] = {
        "benchmark": "end_phase", "commit": commit(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fixture": QWEN3_0_6B_SHAPE, "bucket_bytes": SCALE_BUCKET, "reps": args.reps, "blocks": args.blocks,
        "traffic_streams_per_engine": args.traffic, "traffic": {BASELINE: [], PIPELINED: []},
        "host": {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in os.getloadavg()]},
        "runs": {BASELINE: [], PIPELINED: []},
    }
    started_ray = ensure_ray()
    began = time.monotonic()
    try:
        for b in range(args.blocks):
            for mode in (BASELINE, PIPELINED):
                tag = f"{'base' if mode == BASELINE else 'pipe'}{b}"
                engines = start_pair(fixtures, mode, token, workdir, tag)
                try:
                    stack = stack_over(engines, token, workdir, fixtures, fixtures.probe_prompt, reference,
                                       SCALE_BUCKET)
                    try:
                        runs, served = await block(stack, snapshots, args.reps, tag, args.traffic)
                    finally:
                        await stack.close()
                finally:
                    for engine in engines:
                        engine.stop()
                report["runs"][mode] += runs
                if served is not None:
                    report["traffic"][mode].append(served)
                tails = [p["verify_tail_s"] for r in runs for p in r["engines"].values()]
                print(f"# block {b} {mode}: end_s {[r['end_s'] for r in runs]} verify_tail_s {tails}"
                      + (f" traffic {served}" if served is not None else ""), flush=True)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    report["wall_s"] = round(time.monotonic() - began, 1)
    report["host"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    report["summary"] = {mode: summarize(runs) for mode, runs in report["runs"].items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=6, help="publications per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per mode (alternating)")
    parser.add_argument("--traffic", type=int, default=0,
                        help="closed-loop generation streams per engine during every publication (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    base, pipe = report["summary"][BASELINE], report["summary"][PIPELINED]
    print(f"{'median [95% interval]':<16}" + "".join(f"{k:>26}" for k in ("end_s", *ENGINE_PARTS)))
    for mode, summary in ((BASELINE, base), (PIPELINED, pipe)):
        print(f"{mode:<16}" + "".join(f"{fmt_interval(summary[k]):>26}" for k in ("end_s", *ENGINE_PARTS)))
    for mode in (BASELINE, PIPELINED):
        for served in report["traffic"][mode]:
            print(f"# traffic {mode}: {served}")
    report["last_line"] = {
        "verify_tail_s_pipelined": round(pipe["verify_tail_s"][0], 4),
        "verify_tail_s_baseline": round(base["verify_tail_s"][0], 4),
        "tail_ratio": round(pipe["verify_tail_s"][0] / base["verify_tail_s"][0], 3),
        "verify_wait_s_pipelined": round(pipe["verify_wait_s"][0], 4),
        "verify_wait_s_baseline": round(base["verify_wait_s"][0], 4),
        "end_s_pipelined": round(pipe["end_s"][0], 4), "end_s_baseline": round(base["end_s"][0], 4),
        "traffic": args.traffic,
        "traffic_failed": sum(t["failed"] for runs in report["traffic"].values() for t in runs),
        "commit": report["commit"],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {args.out}")
    print(" ".join(f"{k}={v}" for k, v in report["last_line"].items()))


if __name__ == "__main__":
    main()
