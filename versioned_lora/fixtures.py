"""Deterministic test fixtures: a tiny random Qwen3 and PEFT LoRA adapters A, B, C.

Nothing is downloaded. Every fixture is generated from a spec (dimensions, seeds) and cached on
disk under a directory named by the SHA-256 of that spec, so a second call is a directory lookup
and two machines with the same spec get byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs

# Bump when the generation code changes in a way that changes the produced bytes.
_GENERATOR_REVISION = 1

TINY_QWEN3: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODEL_SEED = 1234

LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGET_MODULES = ("q_proj", "v_proj")
ADAPTER_SEEDS = {"A": 101, "B": 202, "C": 303}


@attrs.frozen
class Fixtures:
    model_dir: Path
    adapters: dict[str, Path]
    root: Path


def cache_root() -> Path:
    env = os.environ.get("VERSIONED_LORA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "versioned_lora"


def _spec_digest(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _materialise(target: Path, build: Any) -> Path:
    """Build into a temporary sibling and rename, so a crash never leaves a half-written fixture."""
    if (target / ".complete").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def tiny_qwen3(root: Path | None = None) -> Path:
    """The tiny random Qwen3 checkpoint (real Qwen3 architecture, small dimensions), bf16."""
    spec = {"rev": _GENERATOR_REVISION, "config": TINY_QWEN3, "seed": MODEL_SEED}
    target = (root or cache_root()) / f"qwen3-tiny-{_spec_digest(spec)}"

    def build(out: Path) -> None:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(MODEL_SEED)
        config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "torch_dtype"})
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)

    return _materialise(target, build)


def lora_adapter(name: str, model_dir: Path, root: Path | None = None, seed: int | None = None) -> Path:
    """A PEFT LoRA adapter for `model_dir` with non-zero A and B matrices.

    `init_lora_weights=False` gives random (non-zero) B, so the adapter changes outputs; we
    additionally scale B so the three fixtures' greedy outputs differ clearly on a random model.
    """
    seed = ADAPTER_SEEDS[name] if seed is None else seed
    spec = {
        "rev": _GENERATOR_REVISION,
        "model": model_dir.name,
        "seed": seed,
        "r": LORA_RANK,
        "alpha": LORA_ALPHA,
        "targets": list(LORA_TARGET_MODULES),
    }
    target = (root or cache_root()) / f"lora-{name}-{_spec_digest(spec)}"

    def build(out: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import Qwen3ForCausalLM

        base = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        torch.manual_seed(seed)
        config = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            target_modules=list(LORA_TARGET_MODULES),
            init_lora_weights=False,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(base, config)
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if "lora_B" in pname:
                    param.mul_(4.0)
        peft_model.save_pretrained(out, safe_serialization=True)

    return _materialise(target, build)


def build_fixtures(root: Path | None = None) -> Fixtures:
    model_dir = tiny_qwen3(root)
    adapters = {name: lora_adapter(name, model_dir, root) for name in ADAPTER_SEEDS}
    return Fixtures(model_dir=model_dir, adapters=adapters, root=root or cache_root())
