"""Issue 46, item 1: what the engine's read-back of a loaded adapter from its LoRA memory pool costs, at the
qwen3-0.6b-shape fixture's adapter A (r=64 on all seven linear modules of 28 layers: 392 bf16 tensors, ~80 MB), on
this host's CPU.

The read-back is the scheduler's own function (`sglang_patches/managed/served_readback.read_back`: unstack and
unpad every tensor from the pool's slot, hash each with the manifest's hash kind on the hashing pool, fold the served
digest), run here in-process over pool-shaped buffers: SGLang 0.5.23's `LoRAMemoryPool` layout for this model
(`A_buffer[module][layer]` = ``[max_loras, c * max_rank, in]``, `B_buffer` = ``[max_loras, out_total, max_rank]``,
q/k/v and gate/up stacked, the adapter in slot 1 of 3), filled the way `load_lora_weight_to_buffer` fills it. Every
rep checks the digest read back equals the snapshot's served record (the figure is of a read-back that proves the
version). A running 0.6B engine is not needed for this cost (the read-back does not touch the model), and one
takes ~5.4 GB here; tests/e2e/test_served_digest.py holds the same function to real engines.

Two arms, `a` and `b`, are the same read-back, interleaved rep by rep (order rotated): `read_s` is arm a's wall
time; `null_ratio` is a/b per rep, the method timed against itself (near 1 with an interval as narrow as the
host allows: the noise floor any comparison of read-back times must clear). `snapshot_served_s` is the publisher's
side for a float32 snapshot of the same tensors (convert to bf16 with round-to-nearest-even and hash: what
`snapshot_from_*` spends on the record; a bf16 snapshot reuses its manifest's hashes and costs nothing more).
Medians over reps with 95% bootstrap intervals. The host's 1-minute load average is printed at the start and the end:
on a 2-core host shared with other work the conversion's OpenMP regions wait for a descheduled worker at every
barrier (measured here: 0.04-0.2 s alone, ~3 s beside two busy processes), while the read-back's hashing runs on
Python threads without barriers. Not a test: nothing is asserted but the digest. Last line:
    read_s=… read_ci=…,… null_ratio=… null_ci=…,… snapshot_served_s=… tensors=… mbytes=… threads=… loadavg=…,…
    commit=…

With `--engine N`, the same figure from a running engine as well: one qwen3-0.6b-shape CPU engine (`--max-lora-rank
64`, every linear module), N publications through the managed path (begin, 16 MiB buckets over gloo, end), adapters
A, B, C in turn under fresh names, each reclaimed after it: `served_s` is what that engine's `end` spent reading the
candidate back from its real pool (its status's `end_parts`), every digest checked against the snapshot's;
`engine_null_ratio` is publication 2k's served_s over 2k+1's. Its line comes before the last:
    engine_served_s=… engine_served_ci=…,… engine_null_ratio=… engine_null_ci=…,… publications=N

    python benchmarks/served_digest.py [--reps 15] [--engine 0] [--out benchmarks/results/FILE.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from benchmarks.intervals import bootstrap_median, fmt_interval
from benchmarks.pool_layout import LORA_ID, manager_with, pool_with
from benchmarks.publication_scale import SCALE_BUCKET, key_file_in
from versioned_lora import capabilities
from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.engine_process import EngineConfig, free_port_block, start_all
from versioned_lora.adapters.hashing import default_threads
from versioned_lora.adapters.manifest import Manifest
from versioned_lora.adapters.served import served_record
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.capabilities import KEY_FILE_ENV, Action, mint
from versioned_lora.fixtures import QWEN3_0_6B_PROBE_PROMPT, QWEN3_0_6B_SHAPE, build_fixtures, lora_module_shapes
from versioned_lora.sglang_patches.managed.served_readback import read_back
from versioned_lora.spec.identities import VersionKey, lora_name
from versioned_lora.spec.wire import TOKEN_ENV

MEASURED_CODE = ("versioned_lora/adapters", "versioned_lora/sglang_patches/managed", "benchmarks")
MAX_LORAS, SLOT = 3, 1


def commit() -> str:
    """HEAD's short hash, with "+dirty" when the code this benchmark runs differs from it."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED_CODE],
                           cwd=root, capture_output=True, text=True)  # fmt: skip
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


async def engine_figures(fixtures: Any, publications: int, say: Any) -> None:
    """`publications` managed publications on one running 0.6B engine; each `end`'s read-back time from its status."""
    token = "served-digest-bench"
    with tempfile.TemporaryDirectory(prefix="served-digest-") as tmp:
        key_file = key_file_in(Path(tmp))
        key = capabilities.parse_key(key_file.read_text())
        config = EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(), log_path=Path(tmp) / "engine.log",
                              max_lora_rank=fixtures.lora_rank, lora_target_modules=fixtures.target_modules,
                              env={TOKEN_ENV: token, KEY_FILE_ENV: str(key_file)})
        (engine,) = start_all([config])
        try:
            snapshots = {label: snapshot_from_adapter_dir(fixtures.adapters[label]) for label in "ABC"}
            client = SGLangClient(engine.url, timeout_s=600.0, token=token)
            link = await EngineLink.connect(client)
            served_s: list[float] = []
            for index in range(publications):
                snapshot = snapshots["ABC"[index % 3]]
                name = lora_name(VersionKey(7, f"bench{index}-{uuid.uuid4().hex[:6]}"), snapshot.digest)
                candidate = Candidate.build(name, snapshot, SCALE_BUCKET)
                attempt = f"attempt-{uuid.uuid4().hex[:8]}"
                await link.begin(candidate, attempt)
                for bucket in range(candidate.bucket_count):
                    await link.transfer_bucket(candidate, attempt, bucket)
                answer = (await link.end(candidate, attempt, QWEN3_0_6B_PROBE_PROMPT))["adapter"]
                assert answer["served"].get("digest") == candidate.served_identity().digest, answer["served"]
                parts = answer["end_parts"]
                served_s.append(float(parts["served_s"]))
                say(f"publication={index} adapter={'ABC'[index % 3]} served_s={parts['served_s']:.4f} "
                    f"probe_s={parts['probe_s']:.4f} load_s={parts['load_s']:.4f}")
                reclaim_id = f"bench-{index}"
                await client.managed("reclaim", lora_name=name, reclaim_id=reclaim_id, wait_s=60, http_timeout_s=120,
                                     capability=mint(key, Action.RECLAIM, name, reclaim_id))
            link.close()
            await client.aclose()
        finally:
            engine.stop()
    served = bootstrap_median(served_s)
    pairs = [a / b for a, b in zip(served_s[0::2], served_s[1::2], strict=False)]
    null = bootstrap_median(pairs)
    say(f"# engine read-back s (end_parts served_s): {fmt_interval(served)}; null ratio of publication pairs: "
        f"{fmt_interval(null)}")
    say(f"engine_served_s={served[0]:.4f} engine_served_ci={served[1]:.4f},{served[2]:.4f} "
        f"engine_null_ratio={null[0]:.3f} engine_null_ci={null[1]:.3f},{null[2]:.3f} publications={publications}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--engine", type=int, default=0, help="publications through a running 0.6B engine (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    config = json.loads((fixtures.model_dir / "config.json").read_text())
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["A"])
    manifest: Manifest = snapshot.manifest
    assert manifest.served is not None
    serving = manifest.serving_config
    rank = int(serving["r"])
    pool = pool_with(snapshot.tensors, lora_module_shapes(config), config["num_hidden_layers"], rank, MAX_LORAS, SLOT)
    manager = manager_with(pool, serving)
    float32 = {name: t.to(torch.float32) for name, t in snapshot.tensors.items()}

    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    load_start = os.getloadavg()[0]
    say(f"# benchmarks/served_digest.py {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} "
        f"commit={commit()} host_cpus={os.cpu_count()} threads={default_threads()} torch={torch.__version__} "
        f"loadavg_1m={load_start:.2f}")
    say(f"# fixture {QWEN3_0_6B_SHAPE} adapter A: {len(manifest.tensors)} tensors, "
        f"{manifest.total_bytes / 1e6:.1f} MB, r={rank}, dtype {manifest.tensors[0].dtype}, "
        f"hash {manifest.hash_kind}, pool slot {SLOT} of {MAX_LORAS}")
    read_back(manager, LORA_ID, manifest)  # warm-up: the hashing pool's threads start
    a_s: list[float] = []
    ratios: list[float] = []
    snap_s: list[float] = []
    for rep in range(args.reps):
        times: dict[str, float] = {}
        for arm in ("ab" if rep % 2 == 0 else "ba"):
            began = time.perf_counter()
            answer = read_back(manager, LORA_ID, manifest)
            times[arm] = time.perf_counter() - began
            assert answer["digest"] == manifest.served.digest and answer["dtype"] == manifest.served.dtype, answer
        began = time.perf_counter()
        record = served_record(float32, "bfloat16", manifest.hash_kind)
        snap_s.append(time.perf_counter() - began)
        assert record == manifest.served  # bf16 -> f32 -> bf16 is exact: the same served digest
        a_s.append(times["a"])
        ratios.append(times["a"] / times["b"])
        say(f"rep={rep} read_a_s={times['a']:.4f} read_b_s={times['b']:.4f} ratio={ratios[-1]:.3f} "
            f"snapshot_served_s={snap_s[-1]:.4f}")
    if args.engine:
        asyncio.run(engine_figures(fixtures, args.engine, say))
    read, null, snap = bootstrap_median(a_s), bootstrap_median(ratios), bootstrap_median(snap_s)
    say(f"# read-back (engine side) s: {fmt_interval(read)}; null ratio a/b: {fmt_interval(null)}; "
        f"snapshot's served record from float32 (publisher side) s: {fmt_interval(snap)}")
    say(f"read_s={read[0]:.4f} read_ci={read[1]:.4f},{read[2]:.4f} null_ratio={null[0]:.3f} "
        f"null_ci={null[1]:.3f},{null[2]:.3f} snapshot_served_s={snap[0]:.4f} tensors={len(manifest.tensors)} "
        f"mbytes={manifest.total_bytes / 1e6:.1f} threads={default_threads()} "
        f"loadavg={load_start:.2f},{os.getloadavg()[0]:.2f} commit={commit()}")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
