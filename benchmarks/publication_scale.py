"""Publication at scale (issue 22, part 4): latency and its phases against the floor, by adapter size and by
engine count, on real patched SGLang CPU engines, a real Ray registry actor and gloo.

What one run measures, in this order (each stage's engines are stopped before the next stage's start, so no
two stages share the host's memory):

1. Engine count, tiny fixture (r=8 on q/v, ~28 KB, 8 KiB buckets): four engines started; the same series
   of publications on a deployment over the first 1, then 2, then all 4 engines (`publish_s_1/2/4`).
   Per-engine intervals of the phases that run on engines (`begin`, each `bucket_i`, `end`) are recorded
   at the staging port; per phase, concurrency = the sum of the engines' durations over the phase's wall
   time (first start to last finish), averaged over the phases of a publication, then over publications
   (`concurrency_N`; N = fully overlapped, 1 = one engine after another).
2. Size, two engines of the `qwen3-0.6b-shape` fixture (`--max-lora-rank 64`, all seven linear modules):
   0.6B-shape r=16 on q/v (adapters A, B, C cut to their first 16 ranks on q_proj/v_proj, alpha/r kept at 1)
   and 0.6B-shape r=64 on all seven modules (the fixture's A, B, C: 392 tensors, ~80 MB), 16 MiB buckets.
3. 8B shape, r=64 on all seven modules (504 tensors, 349 MB), transfer and verification alone (an 8B engine
   does not fit this host): a sender process sends the buckets (16 MiB) over gloo to this process, which
   receives them as the scheduler does and verifies with the engine's own `StashVerifier`
   (`gpu_validation.verify_bench`'s gloo wire); `transfer_s` is first byte to last bucket landed,
   `verify_s` last bucket landed to the verdict.

Every publication is `Publisher.publish` of a fresh version (the previous one is reclaimed after it, with no
session on it, so capacity never refuses); `publish_s` is the wall time of that call, and its phases are
the Publisher's own: reserve, begin, bucket_i, end, commit. An engine's `end` is the rest of verification
(what is still unhashed when the last bucket lands), the load from the verified stash and the probe; the
engine does not report the three apart, so `end` is one phase here (the floor's load and probe beside it,
and stage 3's `verify_s`, show what its parts cost). After each publication, the floor on the same engines
(`versioned_lora.demo.floor`): a raw gloo transfer of the same buckets to one receiver process per engine,
one stock load of the same tensors from tensors on every engine, and the probe on it; `floor_s` is their
sum. Figures are medians over `--reps` publications; ratios from one run (the host is noisy: nothing here
is a test, nothing is asserted). The probe prompt of each size is chosen before its publications so that
every version's reference token leads its next best by one probe tolerance (on random weights the top
two can sit within bf16 noise). At the 0.6B shape the versions are A and B in turn (a reference forward
there takes seconds).

Last line (publish_s, floor_s and floor_ratio at the 0.6B-shape r=64 size on two engines; scale_max_mb the
largest adapter moved in the run):
    scale_max_mb=… publish_s=… floor_s=… floor_ratio=… publish_s_1=… publish_s_2=… publish_s_4=… concurrency_4=…

    python benchmarks/publication_scale.py [--reps 3] [--out benchmarks/results/FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block, start_all
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_adapter_dir, snapshot_from_tensors
from versioned_lora.capabilities import KEY_FILE_ENV, write_key_file
from versioned_lora.demo.floor import RawTransferFloor, native_load_and_probe
from versioned_lora.demo.stack import Stack, ensure_ray, new_token
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, TINY, Fixtures, build_fixtures
from versioned_lora.spec.wire import TOKEN_ENV

MiB = 2**20
TINY_BUCKET = 8 * 1024  # the demo's: the ~28 KB tiny adapters in 4 buckets, so per-bucket phases show
SCALE_BUCKET = 16 * MiB
ENGINE_PHASES = ("begin", "transfer_bucket", "end")  # the staging port's calls that run on an engine
PROBE_CANDIDATES = [list(range(start, start + 20)) for start in (10, 40, 70, 100, 130, 160, 190, 220)]


# ---------------------------------------------------------------- measuring


class EngineIntervals:
    """Wraps each staging port's engine calls to record (engine, phase, start, end); phase names match the
    Publisher's (`begin`, `bucket_<i>`, `end`)."""

    def __init__(self, stack: Stack) -> None:
        self.intervals: list[tuple[str, str, float, float]] = []
        for name, port in stack.ports.items():
            for method in ENGINE_PHASES:
                setattr(port, method, self._wrap(name, method, getattr(port, method)))

    def _wrap(self, engine: str, method: str, call: Any) -> Any:
        async def timed(candidate: Any, attempt_token: str, *rest: Any) -> Any:
            phase = f"bucket_{rest[0]}" if method == "transfer_bucket" else method
            started = time.monotonic()
            try:
                return await call(candidate, attempt_token, *rest)
            finally:
                self.intervals.append((engine, phase, started, time.monotonic()))

        return timed

    def take(self) -> list[tuple[str, str, float, float]]:
        taken, self.intervals = self.intervals, []
        return taken


def concurrency(intervals: Sequence[tuple[str, str, float, float]]) -> dict[str, float]:
    """Per phase: the engines' summed durations over the phase's wall time (first start to last finish)."""
    by_phase: dict[str, list[tuple[float, float]]] = {}
    for _, phase, start, end in intervals:
        by_phase.setdefault(phase, []).append((start, end))
    ratios = {}
    for phase, spans in by_phase.items():
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
        ratios[phase] = sum(e - s for s, e in spans) / wall if wall > 0 else float(len(spans))
    return ratios


def median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 4) if values else float("nan")


async def publication_series(stack: Stack, snapshots: Sequence[Snapshot], reps: int, tag: str, probe: list[int],
                             floor: bool) -> dict[str, Any]:
    """`reps` publications of fresh versions (snapshots taken in turn), each previous one reclaimed after; the
    floor after each publication when `floor`."""
    clock = EngineIntervals(stack)
    await stack.publisher.sync_incarnations()
    runs: list[dict[str, Any]] = []
    previous = None
    raw: RawTransferFloor | None = None
    try:
        for i in range(reps):
            snapshot = snapshots[i % len(snapshots)]
            version, candidate = stack.candidate(f"{tag}-{i}", snapshot=snapshot)
            clock.take()
            started = time.monotonic()
            outcome = await stack.publisher.publish(version, candidate)
            publish_s = time.monotonic() - started
            if not outcome.committed:
                raise RuntimeError(f"{tag}: publication {i} not committed: {outcome}")
            intervals = clock.take()
            ratios = concurrency(intervals)
            run: dict[str, Any] = {
                "publish_s": round(publish_s, 4), "phases": {k: round(v, 4) for k, v in outcome.phases.items()},
                "buckets": candidate.bucket_count, "bytes": snapshot.total_bytes,
                "engine_phase_s": {f"{e}.{p}": round(t1 - t0, 4) for e, p, t0, t1 in intervals},
                "concurrency_by_phase": {k: round(v, 3) for k, v in ratios.items()},
                "concurrency": round(statistics.mean(ratios.values()), 3),
            }
            if previous is not None:
                reclaimed = await stack.reclaimer.reclaim(previous)
                if str(reclaimed.status) != "RECLAIMED":
                    raise RuntimeError(f"{tag}: reclaim of {previous} {reclaimed}")
            previous = version
            if floor:
                if raw is None:
                    raw = RawTransferFloor(candidate, receivers=len(stack.clients), repeats=reps)
                transfer_s = await raw.measure()
                # Fresh connections: an engine's HTTP server closes a keep-alive connection idle for 5 s, and a
                # request sent on it as it closes fails with ReadError (seen here after the raw transfer).
                fresh = [SGLangClient(c.base_url, timeout_s=600.0, token=stack.token) for c in stack.clients.values()]
                try:
                    load_s, probe_s = await native_load_and_probe(fresh, snapshot, probe)
                finally:
                    for client in fresh:
                        await client.aclose()
                run["floor"] = {"raw_transfer_s": round(transfer_s, 4), "load_s": round(load_s, 4),
                                "probe_s": round(probe_s, 4), "floor_s": round(transfer_s + load_s + probe_s, 4)}
            runs.append(run)
    finally:
        if raw is not None:
            await raw.close()
        await stack.unload_leftovers()
    summary: dict[str, Any] = {
        "engines": len(stack.clients), "reps": reps, "buckets": runs[0]["buckets"], "bytes": runs[0]["bytes"],
        "publish_s": median([r["publish_s"] for r in runs]),
        "concurrency": round(statistics.mean(r["concurrency"] for r in runs), 3),
        "phases_median": {p: median([r["phases"][p] for r in runs if p in r["phases"]])
                          for p in runs[0]["phases"]},
        "runs": runs,
    }
    if floor:
        summary["floor_s"] = median([r["floor"]["floor_s"] for r in runs])
        summary["floor_parts_median"] = {k: median([r["floor"][k] for r in runs])
                                         for k in ("raw_transfer_s", "load_s", "probe_s")}
        summary["floor_ratio"] = round(summary["publish_s"] / summary["floor_s"], 3)
    return summary


# ---------------------------------------------------------------- stages


def key_file_in(workdir: Path) -> Path:
    """The run's capability key, shared by its engines and its registry actors (a managed engine needs one)."""
    path = workdir / "capability.key"
    return path if path.exists() else write_key_file(path)


def start(fixtures: Fixtures, count: int, token: str, log_dir: Path, tag: str) -> list[EngineProcess]:
    configs = []
    env = {TOKEN_ENV: token, KEY_FILE_ENV: str(key_file_in(log_dir.parent))}
    for index in range(count):
        configs.append(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(),
                                    log_path=log_dir / f"{tag}-E{index}.log", max_lora_rank=fixtures.lora_rank,
                                    lora_target_modules=fixtures.target_modules, env=env))
    return start_all(configs)


def stack_over(engines: Sequence[EngineProcess], token: str, workdir: Path, fixtures: Fixtures,
               probe: list[int], reference: ReferenceModel | None, bucket_bytes: int) -> Stack:
    return Stack([e.url for e in engines], token, workdir, fixtures, probe_prompt=probe, reference=reference,
                 bucket_bytes=bucket_bytes, bucket_deadline_s=120.0, client_timeout_s=600.0,
                 capability_key_file=key_file_in(workdir))


def rank_cut(snapshot: Snapshot, rank: int, modules: tuple[str, ...]) -> Snapshot:
    """The adapter's first `rank` ranks on `modules` only (lora_A's first rows, lora_B's first columns), with
    alpha = rank (alpha/r stays 1): a valid smaller adapter for the same model."""
    tensors = {}
    for name, tensor in snapshot.tensors.items():
        if not any(f".{module}." in name for module in modules):
            continue
        tensors[name] = (tensor[:rank] if ".lora_A." in name else tensor[:, :rank]).contiguous()
    config = {**snapshot.adapter_config(), "r": rank, "lora_alpha": rank, "target_modules": list(modules)}
    return snapshot_from_tensors(tensors, config)


# How far each version's greedy probe token must lead its next best (nats): the margins are reported beside the
# publication figures. (The probe check itself compares teacher-forced scores, where no lead matters.)
PROBE_LEAD = 0.02


def choose_probe(reference: ReferenceModel, snapshots: Sequence[Snapshot]) -> tuple[list[int], list[float]]:
    """The first candidate prompt on which every snapshot's reference token leads its next best by one probe
    tolerance (fixed before any publication of the size): at least two and a half bf16 steps of a top logit
    under 2 (fixtures.QWEN3_0_6B_WEIGHTS), what the engine's logits and the reference's differ by."""
    for prompt in PROBE_CANDIDATES:
        margins = []
        for snapshot in snapshots:
            top = reference.next_token_logprobs(snapshot, prompt).topk(2)
            margins.append(round(float(top.values[0] - top.values[1]), 4))
        if min(margins) >= PROBE_LEAD:
            return prompt, margins
    raise RuntimeError("no candidate probe prompt separates every version's token by one tolerance")


async def engine_count_stage(reps: int, token: str, workdir: Path, log_dir: Path) -> dict[str, Any]:
    fixtures = build_fixtures(fixture=TINY)
    snapshots = [snapshot_from_adapter_dir(fixtures.adapters[n]) for n in ("A", "B", "C")]
    engines = start(fixtures, 4, token, log_dir, "tiny")
    reference = ReferenceModel(fixtures.model_dir)
    probe = PROBE_CANDIDATES[0]
    out: dict[str, Any] = {}
    try:
        for count in (1, 2, 4):
            stack = stack_over(engines[:count], token, workdir, fixtures, probe, reference, TINY_BUCKET)
            try:
                out[f"tiny_r8_e{count}"] = await publication_series(stack, snapshots, reps, f"t{count}", probe,
                                                                    floor=True)
            finally:
                await stack.close()
            print(f"# tiny r=8, {count} engine(s): publish_s={out[f'tiny_r8_e{count}']['publish_s']} "
                  f"concurrency={out[f'tiny_r8_e{count}']['concurrency']}", flush=True)
    finally:
        for engine in engines:
            engine.stop()
    return out


async def size_stage(reps: int, token: str, workdir: Path, log_dir: Path) -> dict[str, Any]:
    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    # A and B in turn: each version's reference forward at this size takes seconds on this host
    full = [snapshot_from_adapter_dir(fixtures.adapters[n]) for n in ("A", "B")]
    cut = [rank_cut(s, 16, ("q_proj", "v_proj")) for s in full]
    reference = ReferenceModel(fixtures.model_dir)
    probes = {"0.6b_r16_qv": choose_probe(reference, cut), "0.6b_r64_all": choose_probe(reference, full)}
    started = time.monotonic()
    engines = start(fixtures, 2, token, log_dir, "0.6b")
    out: dict[str, Any] = {"engine_start_s_two_at_once": round(time.monotonic() - started, 1)}
    try:
        for size, snapshots in (("0.6b_r16_qv", cut), ("0.6b_r64_all", full)):
            probe, margins = probes[size]
            stack = stack_over(engines, token, workdir, fixtures, probe, reference, SCALE_BUCKET)
            try:
                out[size] = await publication_series(stack, snapshots, reps, size.replace("_", "-"), probe,
                                                     floor=True)
            finally:
                await stack.close()
            out[size].update(probe=probe, probe_margins=margins)
            print(f"# {size}, 2 engines: publish_s={out[size]['publish_s']} floor_s={out[size]['floor_s']} "
                  f"floor_ratio={out[size]['floor_ratio']} buckets={out[size]['buckets']}", flush=True)
    finally:
        for engine in engines:
            engine.stop()
    return out


def transfer_verify_8b(reps: int) -> dict[str, Any]:
    import torch

    from gpu_validation.transfer_bench import ALL_LINEAR, Case, synthetic_tensors
    from gpu_validation.verify_bench import CONFIG, GlooWire, pipelined_verify
    from versioned_lora.adapters.manifest import PUBLISHED_HASH_KIND, manifest_from_tensors
    from versioned_lora.adapters.transfer import BucketPlan

    seed, bucket_mib = 20261201, SCALE_BUCKET // MiB
    case = Case("all_r64", 64, ALL_LINEAR, SCALE_BUCKET)
    tensors = synthetic_tensors(case, torch.device("cpu"), seed)  # what the sender process sends
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=PUBLISHED_HASH_KIND)
    plan = BucketPlan.build(manifest, SCALE_BUCKET)
    nbytes, count = sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)
    del tensors
    wire = GlooWire(seed, bucket_mib)
    runs = []
    try:
        for _ in range(reps + 1):  # the first is a warm-up
            runs.append(pipelined_verify(manifest, plan, [], torch.device("cpu"), None, wire))
    finally:
        wire.close()
    runs = runs[1:]
    return {"bytes": nbytes, "tensors": count,
            "buckets": len(plan.buckets), "hash_kind": PUBLISHED_HASH_KIND, "reps": reps,
            "transfer_s": median([r["first_s"] - r["verify_s"] for r in runs]),
            "verify_s": median([r["verify_s"] for r in runs]),
            "transfer_and_verify_s": median([r["first_s"] for r in runs]),
            "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs]}


# ---------------------------------------------------------------- report


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "versioned_lora", "benchmarks",
                            "gpu_validation"], cwd=root, capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def table(report: dict[str, Any]) -> list[str]:
    lines = [f"{'size / engines':<22}{'MB':>8}{'buckets':>8}{'publish s':>11}{'floor s':>9}{'ratio':>7}"
             f"{'conc.':>7}  phases (median s)"]
    for key in ("tiny_r8_e1", "tiny_r8_e2", "tiny_r8_e4", "0.6b_r16_qv", "0.6b_r64_all"):
        row = report[key]
        phases = row["phases_median"]
        buckets = [v for p, v in phases.items() if p.startswith("bucket_")]
        shown = {p: v for p, v in phases.items() if not p.startswith("bucket_")}
        shown["buckets_sum"] = round(sum(buckets), 4)
        label = key if key.startswith("tiny") else f"{key} e2"
        lines.append(f"{label:<22}{row['bytes'] / 1e6:>8.2f}{row['buckets']:>8}{row['publish_s']:>11.3f}"
                     f"{row['floor_s']:>9.3f}{row['floor_ratio']:>7.2f}{row['concurrency']:>7.2f}  {shown}")
    big = report["8b_r64_all"]
    lines.append(f"{'8b_r64_all (gloo, 2 proc)':<22}{big['bytes'] / 1e6:>8.1f}{big['buckets']:>8}"
                 f"  transfer_s={big['transfer_s']} verify_s={big['verify_s']} "
                 f"transfer_and_verify_s={big['transfer_and_verify_s']}")
    return lines


def save(report: dict[str, Any], out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    token = new_token()
    workdir = Path(tempfile.mkdtemp(prefix="publication-scale-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    started_ray = ensure_ray()
    report: dict[str, Any] = {"benchmark": "publication_scale", "commit": commit(),
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps}
    import os

    report["host"] = {"cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in os.getloadavg()]}
    began = time.monotonic()
    try:
        report.update(await engine_count_stage(args.reps, token, workdir, log_dir))
        save(report, args.out)  # each stage's figures are kept should a later stage fail
        report.update(await size_stage(args.reps, token, workdir, log_dir))
        save(report, args.out)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    report["8b_r64_all"] = transfer_verify_8b(args.reps)
    report["wall_s"] = round(time.monotonic() - began, 1)
    report["host"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="publications per size and engine count")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run_all(args))
    scale = report["0.6b_r64_all"]
    report["last_line"] = {
        "scale_max_mb": round(report["8b_r64_all"]["bytes"] / 1e6, 1), "publish_s": scale["publish_s"],
        "floor_s": scale["floor_s"], "floor_ratio": scale["floor_ratio"],
        "publish_s_1": report["tiny_r8_e1"]["publish_s"], "publish_s_2": report["tiny_r8_e2"]["publish_s"],
        "publish_s_4": report["tiny_r8_e4"]["publish_s"], "concurrency_4": report["tiny_r8_e4"]["concurrency"],
    }
    save(report, args.out)
    for line in table(report):
        print(line)
    print(" ".join(f"{k}={v}" for k, v in report["last_line"].items()))


if __name__ == "__main__":
    main()
