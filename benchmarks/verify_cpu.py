"""Issue 20's CPU goal on this host: the tail and the hashing CPU-seconds of an engine's verification of a
349 MB stash (Qwen3-8B shapes, r=64 on all seven linear modules: 504 bf16 tensors), pipelined and pooled,
each as a ratio to today's serial verification measured in the same run, rep by rep.

Buckets land over the CPU engine's own receive path (gloo from a sender process, `gpu_validation.
verify_bench.GlooWire`: 64 MiB buckets back to back, polled as the scheduler polls them). Variants, all
over the same landing, in an order rotated every rep so that drift of the host's load falls on all alike:

- `receive`: the landing alone, nothing hashed: what every variant spends besides hashing;
- `serial v1` (the baseline, today's verification): after the last bucket, each tensor hashed with SHA-256
  on one thread and compared (`verify_bench.serial_verify`);
- `pool v1` / `pool v2`: after the last bucket, every tensor hashed on the hashing pool
  (`hashing.hash_tensors`), then compared: parallel, not pipelined;
- `pipelined v1` / `pipelined v2`: the engine's own `StashVerifier`, each bucket hashed as it lands
  (`verify_bench.pipelined_verify`); `pipelined v2 1t` the same on a pool of one thread.

Per variant and rep: `land` = first byte sent -> last bucket landed, `tail` = last bucket landed -> verified
(wall s); `cpu` = the process's CPU-seconds (every thread) from the first byte to the verdict; `hash cpu` =
`cpu` minus the same rep's `receive` cpu, the CPU-seconds the verification itself costs; `pool threads cpu`
the part of `cpu` run by the hashing pool's threads (the hashing itself, for pool and pipelined). Ratios are to
`serial v1` of the same rep; medians over reps with 95% bootstrap intervals (resampling reps).
Not a test: nothing is asserted. Last line:
    tail_ratio_v2=… hash_cpu_ratio_v2=… tail_ratio_v1=… hash_cpu_ratio_v1=… serial_tail_s=… commit=…

    python benchmarks/verify_cpu.py [--reps 9] [--out benchmarks/results/FILE.txt]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.online_publication import bootstrap_median, fmt_interval
from gpu_validation.transfer_bench import ALL_LINEAR, Case, MiB, synthetic_tensors
from gpu_validation.verify_bench import CONFIG, GlooWire, pipelined_verify, serial_verify

BASELINE = "serial v1"
MEASURED_CODE = ("versioned_lora/adapters", "gpu_validation", "benchmarks")


def commit() -> str:
    """HEAD's short hash, with "+dirty" when files this benchmark runs (the hashing, the verifier, the
    benchmarks) differ from it; other sessions' uncommitted work elsewhere in the tree does not count."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED_CODE],
                           cwd=root, capture_output=True, text=True)  # fmt: skip
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def hash_thread_cpu() -> float:
    """CPU-seconds run so far by the hashing pool's threads (every pool size; Linux schedstat, ns)."""
    import threading

    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith("vlora-hash") and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as stat:
                total += int(stat.read().split()[0])
    return total / 1e9


def receive_only(plan: Any, wire: GlooWire) -> dict[str, float]:
    held: dict[int, Any] = {}
    c0 = time.process_time()
    t_first, t_last = wire.land(plan, "sha256", held.__setitem__)
    t_done = time.perf_counter()
    return {"verify_s": t_done - t_last, "first_s": t_done - t_first, "cpu_s": time.process_time() - c0}


def pooled_verify(manifest: Any, plan: Any, wire: GlooWire, threads: int | None) -> dict[str, float]:
    """Parallel but not pipelined: the stash hashed on the pool once the last bucket landed."""
    from versioned_lora.adapters import hashing
    from versioned_lora.adapters.manifest import raise_mismatches
    from versioned_lora.adapters.transfer import received_tensors

    held: dict[int, Any] = {}
    c0 = time.process_time()
    t_first, t_last = wire.land(plan, manifest.hash_kind, held.__setitem__)
    tensors = received_tensors(plan, held)
    described = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()}
    raise_mismatches(manifest, described, hashing.hash_tensors(tensors, manifest.hash_kind, threads), manifest.digest)
    t_done = time.perf_counter()
    return {"verify_s": t_done - t_last, "first_s": t_done - t_first, "cpu_s": time.process_time() - c0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/verify_cpu.py")
    parser.add_argument("--reps", type=int, default=9, help="measured reps (each runs every variant once)")
    parser.add_argument("--threads", type=int, default=None, help="hashing pool size (default: every core, <= 8)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from versioned_lora.adapters import hashing
    from versioned_lora.adapters.manifest import HASH_SHA256, V2_HASH, manifest_from_tensors
    from versioned_lora.adapters.transfer import BucketPlan

    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    started = time.perf_counter()
    at = commit()
    say(f"# verify cpu bench {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} commit={at}")
    say(f"# env torch={torch.__version__} cpus={os.cpu_count()} threads={args.threads or hashing.default_threads()} "
        f"loadavg_1m={os.getloadavg()[0]:.2f}")  # fmt: skip
    case = Case("all_r64", 64, ALL_LINEAR, 64 * MiB)
    tensors = synthetic_tensors(case, torch.device("cpu"), args.seed)
    manifests = {kind: manifest_from_tensors(tensors, CONFIG, hash_kind=kind) for kind in (HASH_SHA256, V2_HASH)}
    plans = {kind: BucketPlan.build(m, case.max_bucket_bytes) for kind, m in manifests.items()}
    say(f"# {len(tensors)} tensors, {manifests[HASH_SHA256].total_bytes / 1e6:.1f} MB, "
        f"{len(plans[HASH_SHA256].buckets)} buckets of <= 64 MiB over gloo; {args.reps} reps after a warm-up rep, "
        f"variant order rotated per rep")  # fmt: skip
    wire = GlooWire(args.seed, 64)
    v1, v2 = manifests[HASH_SHA256], manifests[V2_HASH]
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "receive": lambda: receive_only(plans[HASH_SHA256], wire),
        BASELINE: lambda: serial_verify(v1, plans[HASH_SHA256], (), torch.device("cpu"), wire),
        "pool v1": lambda: pooled_verify(v1, plans[HASH_SHA256], wire, args.threads),
        "pipelined v1": lambda: pipelined_verify(v1, plans[HASH_SHA256], (), torch.device("cpu"), args.threads, wire),
        "serial v2": lambda: serial_verify(v2, plans[V2_HASH], (), torch.device("cpu"), wire),
        "pool v2": lambda: pooled_verify(v2, plans[V2_HASH], wire, args.threads),
        "pipelined v2": lambda: pipelined_verify(v2, plans[V2_HASH], (), torch.device("cpu"), args.threads, wire),
        # The same with a pool of one thread: the hashing never takes both cores from the receive.
        "pipelined v2 1t": lambda: pipelined_verify(v2, plans[V2_HASH], (), torch.device("cpu"), 1, wire),
    }
    names = list(variants)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(args.reps + 1):
        order = names[rep % len(names):] + names[: rep % len(names)]
        measured = {}
        for name in order:
            before = hash_thread_cpu()
            measured[name] = variants[name]()
            measured[name]["pool_cpu_s"] = hash_thread_cpu() - before
        if rep == 0:
            continue  # warm-up: pool threads, gloo buffers, page faults of fresh receive buffers
        for name, run in measured.items():
            run["hash_cpu_s"] = run["cpu_s"] - measured["receive"]["cpu_s"]
            run["land_s"] = run["first_s"] - run["verify_s"]  # first byte sent -> last bucket seen landed
            runs[name].append(run)
        say(f"# rep {rep}: " + "  ".join(f"{n} {measured[n]['verify_s']:.3f}/{measured[n]['cpu_s']:.3f}"
                                        for n in names))  # fmt: skip
    wire.close()

    say("# per variant: median [95% interval] over reps; tail = last bucket landed -> verified (s); cpu = process "
        "CPU-s first byte -> verdict; hash cpu = cpu - that rep's receive cpu; land = first byte -> last bucket "
        "landed; ratios to serial v1, rep by rep")
    say(f"{'variant':<16}{'land s':>24}{'tail s':>24}{'cpu s':>24}{'hash cpu s':>24}{'tail/serial v1':>24}"
        f"{'hash cpu/serial v1':>24}{'pool threads cpu s':>24}")
    base = runs[BASELINE]
    summary: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name in names:
        own = runs[name]
        row = {
            "land": bootstrap_median([r["land_s"] for r in own]),
            "tail": bootstrap_median([r["verify_s"] for r in own]),
            "cpu": bootstrap_median([r["cpu_s"] for r in own]),
            "hash_cpu": bootstrap_median([r["hash_cpu_s"] for r in own]),
            "pool_cpu": bootstrap_median([r["pool_cpu_s"] for r in own]),
            "tail_ratio": bootstrap_median([r["verify_s"] / b["verify_s"] for r, b in zip(own, base, strict=True)]),
            "cpu_ratio": bootstrap_median([r["hash_cpu_s"] / b["hash_cpu_s"] for r, b in zip(own, base, strict=True)]),
        }
        summary[name] = row
        ratios = ("", "") if name == "receive" else (fmt_interval(row["tail_ratio"]), fmt_interval(row["cpu_ratio"]))
        say(f"{name:<16}{fmt_interval(row['land']):>24}{fmt_interval(row['tail']):>24}{fmt_interval(row['cpu']):>24}"
            f"{fmt_interval(row['hash_cpu']):>24}{ratios[0]:>24}{ratios[1]:>24}"
            f"{fmt_interval(row['pool_cpu']):>24}")  # fmt: skip
    say(f"# wall {time.perf_counter() - started:.1f}s; load average at the end {os.getloadavg()[0]:.2f}")
    say(f"tail_ratio_v2={summary['pipelined v2']['tail_ratio'][0]:.3f} "
        f"hash_cpu_ratio_v2={summary['pipelined v2']['cpu_ratio'][0]:.3f} "
        f"tail_ratio_v1={summary['pipelined v1']['tail_ratio'][0]:.3f} "
        f"hash_cpu_ratio_v1={summary['pipelined v1']['cpu_ratio'][0]:.3f} "
        f"serial_tail_s={summary[BASELINE]['tail'][0]:.4f} commit={at}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
