"""The publication floor (issue 9): what moving a version's bytes, loading them natively and probing them
costs at the very least on these engines, measured in the same run and under the same load:

- a raw gloo transfer of the candidate's exact buckets (`raw_broadcast`, nothing else: no HTTP, no
  scheduler IPC, no stash, no verification) from this process to one receiver process per engine,
  both groups at once as the Publisher sends to both engines;
- one native load from tensors on both engines at once (stock `/load_lora_adapter_from_tensors` of the
  candidate's own tensors under a fresh name, through SGLang's tokenizer manager and scheduler like the
  managed load, which also loads from tensors: those of its verified stash);
- the probe: one 1-token generation of the probe prompt on the fresh name, on both engines at once.

The engines' schedulers have no raw receive entry point (only the managed, verified one), so the raw
transfer lands in a plain process on the same host; that makes the floor lower, never higher.
"""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing
import time
import uuid
from typing import Any

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot
from versioned_lora.adapters.transfer import (
    allocate_buckets,
    free_port,
    init_transfer_group,
    pack_all,
    raw_broadcast,
)

# Receivers wait between measurements (minutes apart, between managed pairs): a pending receive must outlive that.
GROUP_TIMEOUT = datetime.timedelta(hours=1)


def _receiver(port: int, plan_json: str, repeats: int, group_name: str) -> None:
    from versioned_lora.adapters.transfer import BucketPlan

    plan = BucketPlan.from_json(plan_json)
    group = init_transfer_group(master_address="127.0.0.1", master_port=port, rank=1, group_name=group_name,
                                timeout=GROUP_TIMEOUT)
    buffers = allocate_buckets(plan)
    for _ in range(repeats):
        raw_broadcast(group, buffers)


class RawTransferFloor:
    """One receiver process per engine, groups formed once; `measure()` times one raw transfer to all."""

    def __init__(self, candidate: Candidate, receivers: int = 2, repeats: int = 8) -> None:
        self.candidate = candidate
        self.repeats = repeats
        self.used = 0
        context = multiprocessing.get_context("spawn")
        self.groups: list[Any] = []
        self.procs = []
        plan_json = candidate.plan.to_json()
        for _ in range(receivers):
            port, name = free_port(), f"floor-{uuid.uuid4().hex[:8]}"
            proc = context.Process(target=_receiver, args=(port, plan_json, repeats, name), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.groups.append(init_transfer_group(master_address="127.0.0.1", master_port=port, rank=0,
                                                   group_name=name, timeout=GROUP_TIMEOUT))
        self.packed = pack_all(candidate.snapshot.tensors, candidate.plan)

    async def measure(self) -> float:
        if self.used >= self.repeats:
            raise RuntimeError("receivers exhausted")
        self.used += 1
        started = time.monotonic()
        await asyncio.gather(*(asyncio.to_thread(raw_broadcast, group, self.packed) for group in self.groups))
        return time.monotonic() - started

    async def close(self) -> None:
        while self.used < self.repeats:  # let the receivers finish their loop
            await self.measure()
        for proc in self.procs:
            proc.join(timeout=30)
        from versioned_lora.adapters.transfer import destroy_transfer_group

        for group in self.groups:
            destroy_transfer_group(group)


async def native_load_and_probe(clients: list[SGLangClient], snapshot: Snapshot, probe: list[int]
                                ) -> tuple[float, float]:
    """Stock load of `snapshot`'s tensors under a fresh name on every engine at once, then the probe; the
    name is unloaded afterwards (not timed). Returns (load seconds, probe seconds)."""
    name = f"floor-{uuid.uuid4().hex[:8]}"
    config = snapshot.adapter_config()
    started = time.monotonic()
    results = await asyncio.gather(*(c.load_lora_adapter_from_tensors(name, snapshot.tensors, config)
                                     for c in clients))
    loaded = time.monotonic()
    if not all(r.get("success") for r in results):
        raise RuntimeError(f"floor load failed: {results}")
    try:
        await asyncio.gather(*(c.generate(probe, name, max_new_tokens=1) for c in clients))
        probed = time.monotonic()
    finally:
        await asyncio.gather(*(c.unload_lora_adapter(name) for c in clients))
    return loaded - started, probed - loaded
