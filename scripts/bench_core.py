"""Micro-benchmark of the pure core (not a test).

One op is one `step`: a `BindFirst` of a fresh session or a `CloseAndRelease` of the oldest open one,
alternating over the shards, with 10^5 sessions open and 10^6 closed behind the per-shard low-water
marks. Compared in the same run with a plain mutable-dict registry doing the same bookkeeping without
copies, and with the same table run through the `transitions` library instead of the compiled lookup.

    python scripts/bench_core.py [--open 100000] [--closed 1000000] [--ops 200000] [--shards 16]

The last line is machine-readable: `ops_per_s=… step_median_us=… baseline_ops_per_s=…`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.lifecycle import (
    CORE,
    BindFirst,
    CloseAndRelease,
    Commit,
    RecordReady,
    RegistryEvent,
    RegistryState,
    Reserve,
    SessionKey,
    VersionKey,
    initial_state,
    step,
)

EPOCH = 0
VERSION_A = VersionKey(EPOCH, "A")


def bootstrap() -> RegistryState:
    """A registry with version A published on E0 and E1, so binds have a default to read."""
    state = initial_state(engines=("E0", "E1"), capacity=2, epoch=EPOCH)
    digest = "a" * 64
    state, reserved, _ = step(state, Reserve(VERSION_A, digest))
    token = reserved.attempt_token  # type: ignore[union-attr]
    for engine in ("E0", "E1"):
        state, _, _ = step(state, RecordReady(VERSION_A, token, engine, 0, digest))
    state, _, _ = step(state, Commit(VERSION_A, token, 0))
    return state


def run(state: RegistryState, events: Iterable[RegistryEvent]) -> RegistryState:
    for event in events:
        state = step(state, event)[0]
    return state


class Workload:
    """Round-robin over shards: bind the next fresh seq, close the oldest open seq (in order, so the
    shard's mark moves by one and the open population stays constant)."""

    def __init__(self, shards: int, first_open: int, open_per_shard: int) -> None:
        self.shards = shards
        self.oldest = [first_open] * shards
        self.next = [first_open + open_per_shard] * shards

    def ops(self, count: int) -> list[RegistryEvent]:
        events: list[RegistryEvent] = []
        for i in range(count):
            shard = (i // 2) % self.shards
            if i % 2 == 0:
                events.append(BindFirst(SessionKey(EPOCH, shard, self.next[shard])))
                self.next[shard] += 1
            else:
                events.append(CloseAndRelease(SessionKey(EPOCH, shard, self.oldest[shard])))
                self.oldest[shard] += 1
        return events


class DictRegistry:
    """The baseline: the same session bookkeeping on mutable dicts, updated in place (no copies)."""

    def __init__(self, default: VersionKey) -> None:
        self.default = default
        self.sessions: dict[SessionKey, VersionKey | None] = {}
        self.tombstones: set[SessionKey] = set()
        self.low_water: dict[int, int] = {}
        self.refs: dict[VersionKey, int] = {}

    def apply(self, event: RegistryEvent) -> object:
        if isinstance(event, BindFirst):
            key = event.session
            if key.seq < self.low_water.get(key.shard, 0) or key in self.tombstones:
                return "SESSION_CLOSED"
            bound = self.sessions.get(key)
            if bound is None:
                bound = self.sessions[key] = self.default
                self.refs[bound] = self.refs.get(bound, 0) + 1
            return bound
        assert isinstance(event, CloseAndRelease)
        key = event.session
        mark = self.low_water.get(key.shard, 0)
        if key.seq < mark or key in self.tombstones:
            return "closed"
        bound = self.sessions.pop(key, None)
        if bound is not None:
            self.refs[bound] -= 1
        if key.seq != mark:
            self.tombstones.add(key)
            return "closed"
        mark += 1
        while (successor := SessionKey(key.epoch, key.shard, mark)) in self.tombstones:
            self.tombstones.discard(successor)
            mark += 1
        self.low_water[key.shard] = mark
        return "closed"


def throughput(apply: Callable[[RegistryEvent], object], events: list[RegistryEvent]) -> float:
    start = time.perf_counter()
    for event in events:
        apply(event)
    return len(events) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--open", type=int, default=100_000)
    parser.add_argument("--closed", type=int, default=1_000_000)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--transitions-ops", type=int, default=20_000)
    args = parser.parse_args()
    shards = args.shards
    closed_per_shard, open_per_shard = args.closed // shards, args.open // shards

    t0 = time.perf_counter()
    state = bootstrap()
    # 10^6 sessions bound and closed through `step`, in order: they end up behind the marks.
    for seq in range(closed_per_shard):
        state = run(state, [BindFirst(SessionKey(EPOCH, s, seq)) for s in range(shards)])
        state = run(state, [CloseAndRelease(SessionKey(EPOCH, s, seq)) for s in range(shards)])
    # 10^5 sessions bound and left open above the marks.
    state = run(
        state,
        (
            BindFirst(SessionKey(EPOCH, s, seq))
            for s in range(shards)
            for seq in range(closed_per_shard, closed_per_shard + open_per_shard)
        ),
    )
    setup_s = time.perf_counter() - t0
    closed_total = sum(state.low_water.values())
    print(
        f"setup: {closed_total} sessions closed behind {len(state.low_water)} low-water marks, "
        f"{len(state.sessions)} session records held, {state.session_refs[VERSION_A]} refs on A ({setup_s:.1f} s)"
    )

    workload = Workload(shards, closed_per_shard, open_per_shard)
    gc.collect()
    gc.disable()  # timing the core, not the collector's pauses over 10^5 live records
    try:
        # Throughput: one op = one `step`, events built beforehand.
        events = workload.ops(args.ops)
        holder = [state]

        def apply_core(event: RegistryEvent) -> object:
            holder[0], result, _ = step(holder[0], event)
            return result

        ops_per_s = throughput(apply_core, events)

        # Latency: per-op timing on a further stretch of the same workload.
        timings: list[int] = []
        current = holder[0]
        for event in workload.ops(args.ops):
            t = time.perf_counter_ns()
            current = step(current, event)[0]
            timings.append(time.perf_counter_ns() - t)
        step_median_us = statistics.median(timings) / 1000
        step_p99_us = statistics.quantiles(timings, n=100)[98] / 1000

        # The same table through `transitions` vs the compiled lookup, on identical ops from one state.
        compare = workload.ops(args.transitions_ops)
        holder = [current]

        def apply_transitions(event: RegistryEvent) -> object:
            holder[0], result, _ = CORE.transitions_step(holder[0], event)
            return result

        CORE.transitions_step(current, compare[0])  # builds the machines outside the timing
        transitions_ops_per_s = throughput(apply_transitions, compare)
        holder = [current]
        lookup_ops_per_s = throughput(apply_core, compare)

        # Baseline: plain dicts, same population, same ops.
        baseline = DictRegistry(VERSION_A)
        baseline.low_water = dict.fromkeys(range(shards), closed_per_shard)
        for s in range(shards):
            for seq in range(closed_per_shard, closed_per_shard + open_per_shard):
                baseline.apply(BindFirst(SessionKey(EPOCH, s, seq)))
        baseline_workload = Workload(shards, closed_per_shard, open_per_shard)
        baseline_ops_per_s = throughput(baseline.apply, baseline_workload.ops(args.ops))
    finally:
        gc.enable()

    print(f"lookup step: {ops_per_s:,.0f} ops/s, median {step_median_us:.2f} us, p99 {step_p99_us:.2f} us")
    print(
        f"dispatch on {len(compare)} identical ops: compiled lookup {lookup_ops_per_s:,.0f} ops/s, "
        f"transitions {transitions_ops_per_s:,.0f} ops/s ({lookup_ops_per_s / transitions_ops_per_s:.1f}x)"
    )
    print(f"plain-dict baseline: {baseline_ops_per_s:,.0f} ops/s ({baseline_ops_per_s / ops_per_s:.1f}x the core)")
    print(f"goal >= 200000 ops/s: {'met' if ops_per_s >= 200_000 else 'NOT met'}")
    print(f"ops_per_s={ops_per_s:.0f} step_median_us={step_median_us:.2f} baseline_ops_per_s={baseline_ops_per_s:.0f}")


if __name__ == "__main__":
    main()
