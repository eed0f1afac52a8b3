"""Issue 46, item 1: what the engine's read-back of a loaded adapter from its LoRA memory pool costs on a GPU, at an
8B model's shape (Llama-3-8B: 32 layers, hidden 4096, 8 KV heads of 128, MLP 14336) with r=64 on all seven linear
modules (448 bf16 tensors, 335.5 MB), in pool-shaped buffers on the GPU hashed by the existing chunk kernel.

SGLang is not installed on the GPU machines lent here, so no engine runs: the read-back is the scheduler's own
function (`sglang_patches/managed/served_readback.read_back`, loaded from its file: the `managed` package's
`__init__` imports SGLang) over SGLang 0.5.23's pool layout built on the GPU (benchmarks/pool_layout.py: slot 1 of 5,
as an engine serving K = 4 versions holds them). `read_back` unstacks and unpads every tensor (views of the pool),
counts what the kernels would read outside the manifest's tensors, and hashes with the manifest's hash kind; for
CUDA tensors `hashing.submit_tensors` runs the chunk kernel (`adapters/gpu_hash.py`). Every rep checks that the
digest read back on the GPU equals the served record the snapshot computed on the CPU (hashlib), so the figure is
of a read-back that proves the version, and the GPU path is held to the CPU's.

Arms: `gpu` (the read-back, twice per rep, interleaved: `gpu_s` is the first, `null_ratio` first/second, the
method against itself) and `host` (the same read-back after copying the pool's slot views to the host: the CPU
hashing path an engine without the kernel would take; `host_over_gpu` is host/gpu per rep). Medians over reps with
95% bootstrap intervals. Last line:
    gpu_s=… gpu_ci=…,… null_ratio=… null_ci=…,… host_s=… host_over_gpu=… ratio_ci=…,… tensors=… mbytes=… device=…

    python3 benchmarks/served_digest_gpu.py [--reps 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from benchmarks.intervals import bootstrap_median, fmt_interval
from benchmarks.pool_layout import LORA_ID, manager_with, pool_with
from versioned_lora.adapters.snapshot import snapshot_from_tensors

LAYERS, HIDDEN, MLP, Q_OUT, KV_OUT = 32, 4096, 14336, 32 * 128, 8 * 128
DIMS = {"q_proj": (HIDDEN, Q_OUT), "k_proj": (HIDDEN, KV_OUT), "v_proj": (HIDDEN, KV_OUT), "o_proj": (Q_OUT, HIDDEN),
        "gate_proj": (HIDDEN, MLP), "up_proj": (HIDDEN, MLP), "down_proj": (MLP, HIDDEN)}
RANK, ALPHA, MAX_LORAS, SLOT = 64, 128, 5, 1
ROOT = Path(__file__).resolve().parents[1]


def read_back_module() -> ModuleType:
    path = ROOT / "versioned_lora" / "sglang_patches" / "managed" / "served_readback.py"
    spec = importlib.util.spec_from_file_location("served_readback", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adapter_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (in_dim, out_dim) in DIMS.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, in_dim, generator=generator) / 64).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_dim, RANK, generator=generator) / 64).bfloat16()
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU benchmark"
    readback = read_back_module()
    config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(DIMS), "peft_type": "LORA",
              "base_model_name_or_path": "llama-3-8b-shape"}
    snapshot = snapshot_from_tensors(adapter_tensors(), config)
    manifest = snapshot.manifest
    assert manifest.served is not None
    pool = pool_with(snapshot.tensors, DIMS, LAYERS, RANK, MAX_LORAS, SLOT, device="cuda")
    manager = manager_with(pool, manifest.serving_config)
    host_pool = pool_with(snapshot.tensors, DIMS, LAYERS, RANK, MAX_LORAS, SLOT, device="cpu")
    host_manager = manager_with(host_pool, manifest.serving_config)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    def timed(which: object) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        answer = readback.read_back(which, LORA_ID, manifest)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        assert answer["digest"] == manifest.served.digest, (answer, manifest.served)
        return seconds

    say(f"# benchmarks/served_digest_gpu.py device={torch.cuda.get_device_name()} torch={torch.__version__} "
        f"tensors={len(manifest.tensors)} mbytes={manifest.total_bytes / 1e6:.1f} r={RANK} hash={manifest.hash_kind} "
        f"slot {SLOT} of {MAX_LORAS}")
    timed(manager)  # warm-up: the kernel compiles, the chunk table is built
    timed(host_manager)
    gpu: list[float] = []
    null: list[float] = []
    host_ratio: list[float] = []
    host: list[float] = []
    for rep in range(args.reps):
        first, second = timed(manager), timed(manager)
        on_host = timed(host_manager)  # the CPU path: the pool's slot read on the host, hashed by hashlib's threads
        gpu.append(first)
        null.append(first / second)
        host.append(on_host)
        host_ratio.append(on_host / first)
        say(f"rep={rep} gpu_s={first:.4f} gpu_again_s={second:.4f} host_s={on_host:.4f}")
    g, n, h, r = (bootstrap_median(v) for v in (gpu, null, host, host_ratio))
    say(f"# read-back on the GPU s: {fmt_interval(g)}; null ratio (the GPU read-back against itself): "
        f"{fmt_interval(n)}; on the host s: {fmt_interval(h)}; host over GPU: {fmt_interval(r)}")
    say(f"gpu_s={g[0]:.4f} gpu_ci={g[1]:.4f},{g[2]:.4f} null_ratio={n[0]:.3f} null_ci={n[1]:.3f},{n[2]:.3f} "
        f"host_s={h[0]:.4f} host_over_gpu={r[0]:.2f} ratio_ci={r[1]:.2f},{r[2]:.2f} tensors={len(manifest.tensors)} "
        f"mbytes={manifest.total_bytes / 1e6:.1f} device={torch.cuda.get_device_name().replace(' ', '_')}")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
