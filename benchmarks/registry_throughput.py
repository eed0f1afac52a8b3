"""Registry throughput through the Ray actor, with 10^5 sessions open (issue 9, RFC §7.3).

One registry actor (the real `create_registry_actor`: single writer, SQLite journal in WAL mode with
`synchronous=FULL`, so every call that changes state costs one fsync). A version is published, then
10^5 sessions are bound (opened) and left open. Then, each for `--seconds`:

- raw: a no-op actor method (`pid`), the Ray call rate of the same actor in the same run;
- unbatched: one `BindFirst` of a fresh session per call (one journal row, one fsync per bind);
- batched: `--batch` (<= 256) `BindFirst` events per call (one journal row, one fsync per batch).

Calls are issued from one asyncio loop with `--in-flight` calls outstanding (default 1); per-call latency
is measured from submit to answer, so with more than one outstanding it includes the wait behind the others
(the actor applies calls one at a time): two in flight raise throughput by overlapping Ray's transport with
the actor's work (27.6k binds/s against 20.7k) and double the latency (p50 18 ms against 12). Not a test:
nothing is asserted; the last line is machine-readable:

    batched_binds_per_s=… p99_ms=… unbatched_binds_per_s=… raw_calls_per_s=…

    python benchmarks/registry_throughput.py [--quick] [--open 100000] [--seconds 10] [--in-flight 2]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.adapters.ray_registry import RayRegistry, create_registry_actor
from versioned_lora.capabilities import write_key_file
from versioned_lora.lifecycle import (
    AcquireLease,
    BindFirst,
    Bound,
    Commit,
    Committed,
    LeaseGranted,
    RecordPrepared,
    RecordReady,
    Reserve,
    Reserved,
    SessionKey,
    VersionKey,
)
from versioned_lora.runtime.interfaces import MAX_BATCH

ENGINES = ("E0", "E1")
EPOCH = 1


async def publish_bootstrap(registry: RayRegistry) -> None:
    version = VersionKey(EPOCH, "A")
    digest = hashlib.sha256(b"bench-A").hexdigest()
    lease = (await registry.submit(AcquireLease("publisher", 3600.0))).result  # the one publisher
    assert isinstance(lease, LeaseGranted), lease
    reserved = (await registry.submit(Reserve(version, digest, lease.fence))).result
    assert isinstance(reserved, Reserved), reserved
    token = reserved.attempt_token
    await registry.submit_batch([kind(version, token, engine, 0, digest) for engine in ENGINES
                                 for kind in (RecordPrepared, RecordReady)])
    committed = (await registry.submit(Commit(version, token, 0, lease.fence))).result
    assert isinstance(committed, Committed), committed


class Sessions:
    """Fresh session keys: (epoch, shard, seq), seq increasing per shard."""

    def __init__(self, shards: int = 16) -> None:
        self.shards = shards
        self.next_seq = [0] * shards
        self.turn = 0

    def take(self, count: int) -> list[SessionKey]:
        keys = []
        for _ in range(count):
            shard = self.turn % self.shards
            self.turn += 1
            keys.append(SessionKey(EPOCH, shard, self.next_seq[shard]))
            self.next_seq[shard] += 1
        return keys


async def closed_loop(call: Callable[[], Awaitable[int]], seconds: float, in_flight: int) -> dict[str, Any]:
    """Keep `in_flight` calls outstanding for `seconds`; each call returns how many binds it did."""
    latencies: list[float] = []
    units = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal units
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            done = await call()
            units += done
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "calls": len(latencies),
        "units": units,
        "seconds": round(elapsed, 3),
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "units_per_s": round(units / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 3),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "max_ms": round(1000 * latencies[-1], 3),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-"))
    handle = create_registry_actor(workdir / "registry.sqlite", name=f"registry-bench-{uuid.uuid4().hex[:8]}",
                                   engines=ENGINES, epoch=EPOCH,
                                   # keyed as deployed: every answer carries the key ids (issue 41)
                                   capability_key_file=write_key_file(workdir / "capability.key"))
    registry = RayRegistry(handle)
    sessions = Sessions()
    try:
        await publish_bootstrap(registry)
        started = time.perf_counter()
        for offset in range(0, args.open, MAX_BATCH):
            keys = sessions.take(min(MAX_BATCH, args.open - offset))
            answers = await registry.submit_batch([BindFirst(k) for k in keys])
            assert all(isinstance(a.result, Bound) for a in answers)
        fill_s = time.perf_counter() - started
        print(f"opened and bound {args.open} sessions in {fill_s:.1f}s", flush=True)

        async def raw() -> int:
            await handle.pid.remote()
            return 1

        async def unbatched() -> int:
            answer = await registry.submit(BindFirst(sessions.take(1)[0]))
            assert isinstance(answer.result, Bound)
            return 1

        async def batched() -> int:
            answers = await registry.submit_batch([BindFirst(k) for k in sessions.take(args.batch)])
            assert isinstance(answers[-1].result, Bound)
            return len(answers)

        results: dict[str, Any] = {"open_sessions": args.open, "fill_seconds": round(fill_s, 2),
                                   "in_flight": args.in_flight, "batch": args.batch, "seconds": args.seconds}
        for name, call in (("raw", raw), ("unbatched", unbatched), ("batched", batched)):
            await closed_loop(call, min(1.0, args.seconds), args.in_flight)  # warm-up, discarded
            results[name] = await closed_loop(call, args.seconds, args.in_flight)
            print(f"{name:10s} {json.dumps(results[name])}", flush=True)
        results["journal"] = ray.get(handle.journal_stats.remote())
        results["sessions_open_at_end"] = sessions.turn
        return results
    finally:
        ray.kill(handle, no_restart=True)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--open", type=int, default=100_000, help="sessions open during the measurement")
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement time per mode")
    parser.add_argument("--batch", type=int, default=MAX_BATCH, help=f"binds per batched call (<= {MAX_BATCH})")
    parser.add_argument("--in-flight", type=int, default=1, help="calls outstanding at once")
    parser.add_argument("--quick", action="store_true", help="3 s per mode")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.batch > MAX_BATCH:
        parser.error(f"--batch must be <= {MAX_BATCH}")
    if args.quick:
        args.seconds = 3.0
    results = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"batched_binds_per_s={results['batched']['units_per_s']:.0f} p99_ms={results['batched']['p99_ms']:.2f} "
          f"unbatched_binds_per_s={results['unbatched']['units_per_s']:.0f} "
          f"raw_calls_per_s={results['raw']['calls_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
