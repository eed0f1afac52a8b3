"""Verification at wire speed: how long an engine takes from a stash's last bucket landing to its verdict,
and the snapshot side's manifest and digest, for a Qwen3-8B LoRA (r=64 on all seven linear modules: 504
tensors, 349 MB, bf16).

    python -m gpu_validation.verify_bench --device cuda --out gpu_validation/results/<date>-verify-h200.txt
    python -m gpu_validation.verify_bench --device cpu  --out gpu_validation/results/<date>-verify-cpu.txt

What is timed, per manifest hash kind (v1 "sha256", v2 "sha256-chunked-65536"):

- `verify_s`: the engine's own verifier (`adapters.stash_verifier.StashVerifier`, what
  `scheduler_side.StashStore` runs) fed bucket by bucket as each lands, from the last bucket landing to the
  verdict; `first_s` beside it, from the first byte sent to the verdict. Buckets (64 MiB, the plan the
  publisher would build) are sent back to back into fresh receive buffers, as `start_receive_bucket`
  allocates them: on the CPU over the engine's own path, gloo between two processes (a sender process runs
  `send_all`; this one posts `start_receive_bucket` for every bucket and polls `done()` as the scheduler
  does, every 1 ms); on a GPU by device-to-device copies on a stream of their own, each bucket's landing
  seen by polling its event. (One GPU: NCCL refuses two ranks on one device, so there the wire is a copy
  engine; gpu_validation/transfer_bench has the NCCL transfer itself, 1.1 ms for these bytes on an H200
  pair.) `--wire copy` uses the copy wire on the CPU too (a sender thread), faster than gloo.
- `verify_serial_s`: the verification before this change, over the same received buffers: each tensor
  copied to the host and hashed with SHA-256 on one thread (`manifest.tensor_sha256`), then compared.
- `digest_s`: the snapshot side, `manifest_from_tensors` + `digest` from the tensors where they are (on the
  GPU for `--device cuda`).
- A chunk-size table: the chunked hash of all 504 tensors at 16 KiB, 64 KiB and 1 MiB chunks (and v1), on
  the host's pool and, with `--device cuda`, in the GPU kernel.

Every hash the GPU computes is compared with the CPU's (hashlib) before any figure is printed. Times are
medians over `--reps` runs after a warm-up. The last line is
`verify_s_r64=… verify_serial_s_r64=… digest_s_r64=… hash=…` for `--hash` (default: v2).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_validation.transfer_bench import ALL_LINEAR, Case, MiB, synthetic_tensors

CHUNK_SIZES = (16 * 1024, 64 * 1024, 1024 * 1024)
CONFIG = {"r": 64, "lora_alpha": 64, "target_modules": list(ALL_LINEAR)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(work: Callable[[], Any], device: Any, reps: int, warmup: int = 1) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds (all threads) of `work`."""
    walls, cpus = [], []
    for rep in range(warmup + reps):
        _sync(device)
        c0, w0 = time.process_time(), time.perf_counter()
        work()
        _sync(device)
        if rep >= warmup:
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


# ---- buckets landing ------------------------------------------------------------------------------------------


class GlooWire:
    """The CPU engine's receive path: a sender process (rank 0) runs `send_all` of the same tensors each time
    it is told to; this process (rank 1) receives as the scheduler does."""

    def __init__(self, seed: int, bucket_mib: int) -> None:
        import torch.multiprocessing as mp

        from versioned_lora.adapters.transfer import free_port, init_transfer_group

        port = free_port()
        self.orders: Any = mp.get_context("spawn").Queue()
        self.sender = mp.get_context("spawn").Process(target=_gloo_sender, args=(port, seed, bucket_mib, self.orders))
        self.sender.start()
        self.group = init_transfer_group(master_address="127.0.0.1", master_port=port, rank=1,
                                         group_name="vlora-verify-bench", device="cpu",
                                         timeout=datetime.timedelta(seconds=300))  # fmt: skip

    def land(self, plan: Any, kind: str, on_landed: Callable[[int, Any], None]) -> tuple[float, float]:
        from versioned_lora.adapters.transfer import start_receive_bucket

        self.orders.put(kind)
        _gate(self.group)
        t_first = time.perf_counter()
        pending: list[Any] = [start_receive_bucket(self.group, plan, i, "cpu") for i in range(len(plan.buckets))]
        t_last = t_first
        for index in range(len(pending)):
            bucket = pending[index]
            while not bucket.done():
                time.sleep(0.001)  # the server polls a pending receive at 1 ms first (staging_channel.poll)
            t_last = time.perf_counter()
            flat = bucket.result()
            # Dropped before the verifier sees the bucket, as `scheduler_side.StashStore.poll_receive` pops it:
            # freeing a completed gloo receive costs ~5-15 ms (its buffers), once a bucket, not all at the end.
            pending[index] = bucket = None
            on_landed(index, flat)
        return t_first, t_last

    def close(self) -> None:
        from versioned_lora.adapters.transfer import destroy_transfer_group

        self.orders.put(None)
        _gate(self.group)
        self.sender.join(timeout=60)
        destroy_transfer_group(self.group)


def _gate(group: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.zeros(1), src=1, group=group)


def _gloo_sender(port: int, seed: int, bucket_mib: int, orders: Any) -> None:
    import torch

    from versioned_lora.adapters.manifest import manifest_from_tensors
    from versioned_lora.adapters.transfer import BucketPlan, init_transfer_group, send_all

    case = Case("all_r64", 64, ALL_LINEAR, bucket_mib * MiB)
    tensors = synthetic_tensors(case, torch.device("cpu"), seed)
    group = init_transfer_group(master_address="127.0.0.1", master_port=port, rank=0,
                                group_name="vlora-verify-bench", device="cpu",
                                timeout=datetime.timedelta(seconds=300))  # fmt: skip
    plans: dict[str, Any] = {}
    while True:
        kind = orders.get()
        _gate(group)
        if kind is None:
            break
        if kind not in plans:
            manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=kind)
            plans[kind] = BucketPlan.build(manifest, case.max_bucket_bytes)
        send_all([group], tensors, plans[kind], device="cpu").raise_for_failures()


def land_buckets(packed: Sequence[Any], device: Any, on_landed: Callable[[int, Any], None]) -> tuple[float, float]:
    """Send every packed bucket back to back into fresh receive buffers (the copy wire); call
    `on_landed(i, buffer)` as each lands, in order. Returns (time of the first byte sent, time the last bucket
    was seen landed)."""
    import torch

    buffers = [torch.empty(flat.numel(), dtype=torch.uint8, device=device) for flat in packed]
    _sync(device)
    if device.type == "cuda":
        wire = torch.cuda.Stream(device)
        wire.wait_stream(torch.cuda.current_stream(device))
        events = []
        t_first = time.perf_counter()
        with torch.cuda.stream(wire):
            for flat, buffer in zip(packed, buffers, strict=True):
                buffer.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(wire)
                events.append(event)
        for index, (event, buffer) in enumerate(zip(events, buffers, strict=True)):
            while not event.query():  # what the scheduler's poll of PendingBucket.done() sees
                pass
            t_last = time.perf_counter()
            torch.cuda.current_stream(device).wait_event(event)  # PendingBucket.result(): in stream order
            on_landed(index, buffer)
        return t_first, t_last
    landed: queue.Queue[int] = queue.Queue()

    def send() -> None:
        for index, (flat, buffer) in enumerate(zip(packed, buffers, strict=True)):
            buffer.copy_(flat)
            landed.put(index)

    sender = threading.Thread(target=send, name="bench-wire")
    t_first = time.perf_counter()
    sender.start()
    for _ in packed:
        index = landed.get()
        t_last = time.perf_counter()
        on_landed(index, buffers[index])
    sender.join()
    return t_first, t_last


def _land(wire: GlooWire | None, manifest: Any, plan: Any, packed: Sequence[Any], device: Any,
          on_landed: Callable[[int, Any], None]) -> tuple[float, float]:  # fmt: skip
    if wire is not None:
        return wire.land(plan, manifest.hash_kind, on_landed)
    return land_buckets(packed, device, on_landed)


def pipelined_verify(
    manifest: Any, plan: Any, packed: Sequence[Any], device: Any, threads: int | None, wire: GlooWire | None
) -> dict[str, float]:
    from versioned_lora.adapters.stash_verifier import StashVerifier

    verifier = StashVerifier(manifest, plan, threads=threads)
    verifier.prepare(device)  # at allocate (begin), before any byte
    c0 = time.process_time()
    t_first, t_last = _land(wire, manifest, plan, packed, device, verifier.bucket_landed)
    verifier.finish(manifest.digest)
    t_done = time.perf_counter()
    return {"verify_s": t_done - t_last, "first_s": t_done - t_first, "cpu_s": time.process_time() - c0}


def serial_verify(
    manifest: Any, plan: Any, packed: Sequence[Any], device: Any, wire: GlooWire | None
) -> dict[str, float]:
    """The verification as it was before the pipelined verifier: after the last bucket, every tensor copied to
    the host and hashed on one thread (SHA-256 for v1: exactly the code before; the chunked hash for v2),
    then compared."""
    from versioned_lora.adapters.manifest import raise_mismatches, tensor_sha256
    from versioned_lora.adapters.transfer import received_tensors

    held: dict[int, Any] = {}
    c0 = time.process_time()
    t_first, t_last = _land(wire, manifest, plan, packed, device, held.__setitem__)
    tensors = received_tensors(plan, held)
    described = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()}
    hashes = {name: tensor_sha256(t, manifest.hash_kind) for name, t in tensors.items()}
    raise_mismatches(manifest, described, hashes, manifest.digest)
    t_done = time.perf_counter()
    return {"verify_s": t_done - t_last, "first_s": t_done - t_first, "cpu_s": time.process_time() - c0}


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


# ---- the run ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_validation.verify_bench")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="hashing pool size (default: every core, <= 8)")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--hash", default=None, help="hash kind of the last line (default: manifest v2's)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--wire", choices=("gloo", "copy"), default=None,
                        help="how buckets land on the CPU (default gloo; a GPU always uses the copy wire)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import torch

    from versioned_lora.adapters import hashing
    from versioned_lora.adapters.manifest import V2_HASH, manifest_from_tensors
    from versioned_lora.adapters.transfer import BucketPlan, pack_all

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    env = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
           "loadavg_1m": round(os.getloadavg()[0], 2),
           "threads": args.threads or hashing.default_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "absent"
    say(f"# verify bench {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} device={args.device}")
    say(f"# env {env}")
    case = Case("all_r64", 64, ALL_LINEAR, args.bucket_mib * MiB)
    tensors = synthetic_tensors(case, device, args.seed)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    host_tensors = {name: t.cpu() for name, t in tensors.items()}
    say(f"# {len(tensors)} tensors, {nbytes / 1e6:.1f} MB, bf16, Qwen3-8B r=64 on {'+'.join(ALL_LINEAR)}; "
        f"buckets of {args.bucket_mib} MiB; median of {args.reps} runs after a warm-up")  # fmt: skip

    # 1. The chunk-size table, and the GPU kernel held to hashlib on every tensor.
    expected = {kind: hashing.hash_tensors(host_tensors, kind) for kind in
                ["sha256", *(hashing.chunked_kind(c) for c in CHUNK_SIZES)]}  # fmt: skip
    say("# chunk sizes: all 504 tensors hashed (wall s / process CPU s); pool = hashing pool on the host's "
        "CPU copies; serial = one thread; gpu = chunk kernel on the device tensors + fold on the host")
    say(f"{'hash kind':<24}{'pool wall':>11}{'pool cpu':>10}{'serial wall':>13}{'gpu wall':>10}{'gpu==cpu':>10}")
    for kind in expected:
        pool_wall, pool_cpu = _timed(lambda k=kind: hashing.hash_tensors(host_tensors, k, args.threads), device,
                                     args.reps)  # fmt: skip
        serial_wall, _ = _timed(lambda k=kind: hashing.hash_tensors(host_tensors, k, 1), device,
                                max(1, args.reps // 2))  # fmt: skip
        gpu = "-"
        same = "-"
        if device.type == "cuda" and kind != "sha256":
            from versioned_lora.adapters import gpu_hash

            chunk = hashing.chunk_size(kind)
            assert chunk is not None
            got = gpu_hash.hash_cuda_tensors(tensors, chunk)
            same = str(got == expected[kind])
            if got != expected[kind]:
                differ = sum(got[n] != expected[kind][n] for n in got)
                say(f"# GPU HASH DIFFERS from hashlib for {kind}: {differ} tensors")
                return 1
            gpu = f"{_timed(lambda c=chunk: gpu_hash.hash_cuda_tensors(tensors, c), device, args.reps)[0]:.4f}"
        say(f"{kind:<24}{pool_wall:>11.4f}{pool_cpu:>10.4f}{serial_wall:>13.4f}{gpu:>10}{same:>10}")

    # 2. Per manifest kind: the snapshot side's digest, then the engine's verification, pipelined and serial.
    summary: dict[str, dict[str, float]] = {}
    wire_kind = "copy" if device.type == "cuda" else args.wire or "gloo"
    wire = GlooWire(args.seed, args.bucket_mib) if wire_kind == "gloo" else None
    say(f"# wire: {wire_kind}")
    say("# per manifest hash kind: digest = manifest_from_tensors + digest from the tensors on the device; "
        "verify = last bucket landed -> verified (first = first byte -> verified), the engine's StashVerifier; "
        "serial = the verification before it (per-tensor copy + SHA-256, one thread); cpu = process CPU s")
    say(f"{'hash kind':<24}{'digest s':>10}{'verify s':>10}{'first s':>10}{'cpu s':>8}{'serial s':>10}"
        f"{'serial first':>14}{'serial cpu':>12}{'buckets':>9}")  # fmt: skip
    for kind in ("sha256", V2_HASH):
        manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=kind, threads=args.threads)
        host_manifest = manifest_from_tensors(host_tensors, CONFIG, hash_kind=kind, threads=args.threads)
        if manifest != host_manifest:
            say(f"# MANIFEST DIFFERS between {args.device} and the host for {kind}")
            return 1
        digest_s, _ = _timed(
            lambda k=kind: manifest_from_tensors(tensors, CONFIG, hash_kind=k, threads=args.threads).digest,
            device, args.reps,
        )  # fmt: skip
        plan = BucketPlan.build(manifest, case.max_bucket_bytes)
        packed = pack_all(tensors, plan, device)
        _sync(device)
        pipelined_verify(manifest, plan, packed, device, args.threads, wire)  # warm-up (kernel compile, pool start)
        fast = _median_of([pipelined_verify(manifest, plan, packed, device, args.threads, wire)
                           for _ in range(args.reps)])  # fmt: skip
        serial_verify(manifest, plan, packed, device, wire)
        slow = _median_of([serial_verify(manifest, plan, packed, device, wire) for _ in range(max(1, args.reps // 2))])
        summary[kind] = {"digest_s": digest_s, **fast, "serial_s": slow["verify_s"], "serial_first_s": slow["first_s"]}
        say(f"{kind:<24}{digest_s:>10.4f}{fast['verify_s']:>10.4f}{fast['first_s']:>10.4f}{fast['cpu_s']:>8.3f}"
            f"{slow['verify_s']:>10.4f}{slow['first_s']:>14.4f}{slow['cpu_s']:>12.3f}"
            f"{len(plan.buckets):>9}")  # fmt: skip
        del packed
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if wire is not None:
        wire.close()
    kind = args.hash or V2_HASH
    row = summary[kind]
    say(f"# wall {time.perf_counter() - started:.1f}s; load average {os.getloadavg()[0]:.2f}; "
        f"tail/serial = {row['verify_s'] / row['serial_s']:.3f}; first byte -> verified {row['first_s']:.4f}s")
    say(f"verify_s_r64={row['verify_s']:.4f} verify_serial_s_r64={row['serial_s']:.4f} "
        f"digest_s_r64={row['digest_s']:.4f} hash={kind}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
