"""Issue 22, part 1: the start time and memory of one engine serving the `qwen3-0.6b-shape` fixture.

One real patched SGLang CPU engine, started alone with `--max-lora-rank 64` and all seven linear modules
targeted (as tests/zz_scale starts its engines, but one, so the start time is a lone start's). Measured:

- `start_s`: from spawning the server to its health check answering as ours (`EngineProcess.start`);
- RSS of the engine's whole process tree (server, scheduler, detokenizer), sampled every 0.2 s: its peak
  during the start, after the start, and after one r=64 all-module adapter (A, ~80 MB) is loaded and one
  short generation ran on it; `peak_rss_gib` is the highest sample of the run. RSS sums count shared pages
  once per process, so the tree figure is an upper bound of what the engine holds;
- the host's used memory (total - available) before the start and at its peak.

Not a test: nothing is asserted. Writes JSON (with the commit it ran at) and ends with the line
    start_s=… rss_after_start_gib=… rss_with_adapter_gib=… peak_rss_gib=…

    python benchmarks/engine_footprint.py [--out benchmarks/results/FILE.json] [--fixture qwen3-0.6b-shape]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.capabilities import KEY_FILE_ENV, write_key_file
from versioned_lora.fixtures import FIXTURE_NAMES, QWEN3_0_6B_SHAPE, build_fixtures
from versioned_lora.spec.wire import TOKEN_ENV

GIB = 2**30


def tree_rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:  # exited since it was listed
            pass
    return total


class Sampler:
    """The engine tree's RSS every `period_s`; the peak since the last `mark()` and over the whole run."""

    def __init__(self, engine: EngineProcess, period_s: float = 0.2) -> None:
        self.engine = engine
        self.period_s = period_s
        self.peak = 0
        self.window_peak = 0
        self.host_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def sample(self) -> int:
        try:
            rss = tree_rss(self.engine.process_ids())
        except psutil.Error:
            rss = 0
        vm = psutil.virtual_memory()
        self.host_peak = max(self.host_peak, vm.total - vm.available)
        self.peak, self.window_peak = max(self.peak, rss), max(self.window_peak, rss)
        return rss

    def mark(self) -> int:
        peak, self.window_peak = self.window_peak, 0
        return peak

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "versioned_lora", "benchmarks"],
                           cwd=root, capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


async def with_adapter(url: str, adapter_dir: Path) -> dict[str, Any]:
    async with SGLangClient(url, timeout_s=600.0) as client:
        began = time.monotonic()
        loaded = await client.load_lora_adapter("footprint-A", str(adapter_dir))
        load_s = time.monotonic() - began
        if not loaded.get("success"):
            raise RuntimeError(f"load failed: {loaded}")
        began = time.monotonic()
        await client.generate(list(range(10, 30)), "footprint-A", max_new_tokens=4)
        return {"load_s": round(load_s, 2), "generate_4_s": round(time.monotonic() - began, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", default=QWEN3_0_6B_SHAPE, choices=FIXTURE_NAMES)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    fixtures = build_fixtures(fixture=args.fixture)
    vm = psutil.virtual_memory()
    host_before = vm.total - vm.available
    log = Path(tempfile.mkdtemp(prefix="footprint-")) / "engine.log"
    engine = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=free_port_block(), log_path=log,
                                        max_lora_rank=fixtures.lora_rank,
                                        lora_target_modules=fixtures.target_modules,
                                        env={TOKEN_ENV: secrets.token_hex(16),
                                             KEY_FILE_ENV: str(write_key_file(log.with_name("capability.key")))}))
    report: dict[str, Any] = {
        "benchmark": "engine_footprint", "fixture": args.fixture, "commit": commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": psutil.cpu_count(), "mem_gib": round(vm.total / GIB, 1), "python": platform.python_version(),
                 "load_avg_before": [round(x, 2) for x in psutil.getloadavg()]},
        "max_lora_rank": fixtures.lora_rank, "lora_target_modules": list(fixtures.target_modules),
        "host_used_before_gib": round(host_before / GIB, 2),
    }
    try:
        with Sampler(engine) as sampler:
            began = time.monotonic()
            engine.start()
            report["start_s"] = round(time.monotonic() - began, 1)
            report["rss_peak_during_start_gib"] = round(sampler.mark() / GIB, 2)
            time.sleep(2.0)
            report["rss_after_start_gib"] = round(sampler.sample() / GIB, 2)
            report["processes"] = len(engine.process_ids())
            report["adapter"] = asyncio.run(with_adapter(engine.url, fixtures.adapters["A"]))
            time.sleep(1.0)
            report["rss_with_adapter_gib"] = round(sampler.sample() / GIB, 2)
            report["peak_rss_gib"] = round(sampler.peak / GIB, 2)
            report["host_used_peak_gib"] = round(sampler.host_peak / GIB, 2)
    finally:
        engine.stop()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(" ".join(f"{k}={report[k]}" for k in ("start_s", "rss_after_start_gib", "rss_with_adapter_gib",
                                                "peak_rss_gib")))


if __name__ == "__main__":
    main()
