"""Deterministic test fixtures: a random Qwen3 and PEFT LoRA adapters A, B, C, in two sizes and one variant.

- ``tiny`` (the default everywhere): vocab 512, hidden 128, 2 layers; r=8 on q_proj/v_proj.
- ``tiny-real-logits``: the tiny model with a trained model's logit magnitudes (top logits 20-30, near-ties at
  the top; REAL_LOGITS_HEAD), and its own adapters A, B, C.
- ``qwen3-0.6b-shape``: the real Qwen3-0.6B dimensions (hidden 1024, 28 layers, 16 query and 8 KV heads
  of 128, MLP 3072, vocab 151,936, tied embeddings) with random weights; r=64 on all seven linear
  modules (392 tensors, about 80 MB per adapter): the size users publish.

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


# The probe every `end` scores for a fixture's weights (adapters/probe_check.py). Tiny: 20 ids inside any
# vocabulary.
TINY_PROBE_PROMPT = tuple(range(10, 30))
# Qwen3-0.6B shape: a window where A's, B's and C's reference tokens lead their next best clearly and the versions'
# tokens score far apart under one another (tests/zz_scale asserts both), found by a search over 600 windows
# range(s, s + 20).
QWEN3_0_6B_PROBE_PROMPT = tuple(range(1492, 1512))


@attrs.frozen
class Fixtures:
    model_dir: Path
    adapters: dict[str, Path]
    root: Path
    # What an engine serving these adapters must be started with (EngineConfig.max_lora_rank and
    # .lora_target_modules): the adapters' rank and the modules they target.
    name: str = "tiny"
    lora_rank: int = LORA_RANK
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    probe_prompt: tuple[int, ...] = TINY_PROBE_PROMPT


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


# ---- qwen3-0.6b-shape: the real Qwen3-0.6B dimensions, random weights, r=64 LoRA on every linear module.

QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# How the random weights are drawn (each tensor N(0, std^2) from its own generator, seeded by its name).
# Logits stay small: SGLang and transformers both round the lm_head's output to bf16, and the engine and
# the reference differ by about one rounding step of the top logit, which is 2^-7 for |logit| in [1, 2),
# 2^-6 in [2, 4), 2^-5 in [4, 8): measured with a final norm of 1 (top logits about 3, some later ones
# over 4), the first token was 0.0156 off and a later one 0.031, over the 0.02 probe tolerance. Halving
# the final norm halves every logit exactly (a power of two), and so the rounding step. A peaked
# distribution over 151,936 tokens would need large logits; the versions separate instead through the
# adapters, which move the hidden state as much as the base layers do (`lora_strength` 1: |BAx| about
# |Wx|), so a version's tokens score tenths of a nat to nats apart under another version.
QWEN3_0_6B_WEIGHTS: dict[str, float] = {
    "embedding_std": 0.02,  # tied: the input embedding and the lm_head
    "linear_std": 0.02,
    "final_norm": 0.5,  # the weight of the last RMSNorm (the others are 1): logits of rms 0.32, top about 1.6
    "lora_strength": 1.0,  # rms of B(Ax) over rms of Wx, for an input of rms 1
}
ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FULL_LORA_RANK = 64
FULL_LORA_ALPHA = 64  # scaling alpha/r = 1


def _seeded(seed: int, name: str) -> Any:
    import torch

    return torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}/{name}".encode()).hexdigest()[:15], 16))


def qwen3_0_6b_shape(root: Path | None = None) -> Path:
    """A Qwen3 checkpoint with Qwen3-0.6B's dimensions and random weights, bf16 (about 1.2 GB)."""
    spec = {"rev": _GENERATOR_REVISION, "config": QWEN3_0_6B, "weights": QWEN3_0_6B_WEIGHTS, "seed": MODEL_SEED}
    target = (root or cache_root()) / f"qwen3-0.6b-shape-{_spec_digest(spec)}"

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(**QWEN3_0_6B)
        with torch.device("meta"):  # names and shapes only; every value is drawn below
            shapes = {name: tuple(p.shape) for name, p in Qwen3ForCausalLM(config).state_dict().items()}
        state = {}
        for name, shape in shapes.items():
            if name == "lm_head.weight":  # tied to the embedding: not stored
                continue
            if name.endswith("norm.weight"):
                value = QWEN3_0_6B_WEIGHTS["final_norm"] if name == "model.norm.weight" else 1.0
                tensor = torch.full(shape, value)
            else:
                std = QWEN3_0_6B_WEIGHTS["embedding_std" if "embed" in name else "linear_std"]
                tensor = torch.randn(shape, generator=_seeded(MODEL_SEED, name)) * std
            state[name] = tensor.to(torch.bfloat16)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.architectures = ["Qwen3ForCausalLM"]  # what SGLang picks its model class by
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)

    return _materialise(target, build)


def lora_module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear module of a Qwen3 layer."""
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
            "down_proj": (mlp, hidden)}


def full_lora_adapter(name: str, model_dir: Path, root: Path | None = None) -> Path:
    """A PEFT LoRA adapter at r=64 on all seven linear modules of every layer of `model_dir` (a
    qwen3-0.6b-shape checkpoint), written directly in PEFT's format: 2 tensors per module, 392 in all."""
    seed = ADAPTER_SEEDS[name]
    spec = {
        "rev": _GENERATOR_REVISION,
        "model": model_dir.name,
        "seed": seed,
        "r": FULL_LORA_RANK,
        "alpha": FULL_LORA_ALPHA,
        "targets": list(ALL_LINEAR_MODULES),
        "strength": QWEN3_0_6B_WEIGHTS["lora_strength"],
    }
    target = (root or cache_root()) / f"lora-0.6b-{name}-{_spec_digest(spec)}"

    def build(out: Path) -> None:
        import math

        import torch
        from peft import LoraConfig
        from safetensors.torch import save_file

        config = json.loads((model_dir / "config.json").read_text())
        shapes = lora_module_shapes(config)
        # rms(B A x) = strength * rms(W x) for x of rms 1: A's rows have unit norm in expectation, so
        # rms(Ax) = 1; B's std makes rms(B(Ax)) = strength * linear_std * sqrt(hidden).
        b_std = QWEN3_0_6B_WEIGHTS["lora_strength"] * QWEN3_0_6B_WEIGHTS["linear_std"] * math.sqrt(
            config["hidden_size"]) / math.sqrt(FULL_LORA_RANK)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module in ALL_LINEAR_MODULES:
                block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                fan_in, fan_out = shapes[module]
                a = torch.randn((FULL_LORA_RANK, fan_in), generator=_seeded(seed, f"{prefix}.lora_A"))
                a = a / math.sqrt(fan_in)
                b = torch.randn((fan_out, FULL_LORA_RANK), generator=_seeded(seed, f"{prefix}.lora_B")) * b_std
                tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        LoraConfig(r=FULL_LORA_RANK, lora_alpha=FULL_LORA_ALPHA, target_modules=list(ALL_LINEAR_MODULES),
                   lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                   base_model_name_or_path=str(model_dir)).save_pretrained(str(out))

    return _materialise(target, build)


# ---- tiny-real-logits: the tiny Qwen3 with a trained model's logit magnitudes (issue 46, item 3).
#
# Every other fixture keeps its logits small on purpose (top logits below 2, where a bf16 step is 2^-7 or less). A
# trained model's top logits sit at 20-30, where one bf16 step is 0.125, and its top is often a near-tie of a few
# tokens. This variant is the tiny model (same config, same seed, same layers) with another lm_head: the vocabulary
# in groups of `group` tokens whose rows share a random centre plus `noise` of their own (tokens that mean nearly
# the same thing), scaled to `std`. Measured over the probe (range(10, 30)), bf16, transformers (2026-12-07): top
# logit p50 base 21.75, under A 26.81, B 21.00, C 22.31 (16.9-37.8 across positions; tests/adapters/
# test_real_logit_fixture.py holds each adapter's p50 in [20, 30]); p_top p50 0.36-0.51 (0.18-0.94). The plain init
# with its lm_head scaled up to the same top logits had p_top 0.95: no near-ties, and so no meeting with rounding.
REAL_LOGITS_HEAD: dict[str, float] = {"group": 8, "noise": 0.2, "std": 0.8}


def tiny_real_logits_qwen3(root: Path | None = None) -> Path:
    """The tiny Qwen3 (tiny_qwen3's config and seed) with REAL_LOGITS_HEAD's lm_head, bf16."""
    spec = {"rev": _GENERATOR_REVISION, "config": TINY_QWEN3, "seed": MODEL_SEED, "head": REAL_LOGITS_HEAD}
    target = (root or cache_root()) / f"qwen3-tiny-real-logits-{_spec_digest(spec)}"

    def build(out: Path) -> None:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(MODEL_SEED)
        config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "torch_dtype"})
        model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]
        vocab, hidden = model.lm_head.weight.shape
        group = int(REAL_LOGITS_HEAD["group"])
        generator = _seeded(MODEL_SEED, "lm_head")
        centres = torch.randn((vocab // group, hidden), generator=generator)
        rows = centres.repeat_interleave(group, 0) + REAL_LOGITS_HEAD["noise"] * torch.randn(
            (vocab, hidden), generator=generator)
        with torch.no_grad():
            model.lm_head.weight.copy_(rows / rows.std() * REAL_LOGITS_HEAD["std"])
        model.bfloat16().save_pretrained(out, safe_serialization=True)

    return _materialise(target, build)


TINY = "tiny"
QWEN3_0_6B_SHAPE = "qwen3-0.6b-shape"
REAL_LOGITS = "tiny-real-logits"
FIXTURE_NAMES = (TINY, QWEN3_0_6B_SHAPE, REAL_LOGITS)


def build_fixtures(root: Path | None = None, fixture: str = TINY) -> Fixtures:
    """The model and adapters A, B, C of `fixture` (one of FIXTURE_NAMES), built once and cached."""
    if fixture == QWEN3_0_6B_SHAPE:
        model_dir = qwen3_0_6b_shape(root)
        adapters = {name: full_lora_adapter(name, model_dir, root) for name in ADAPTER_SEEDS}
        return Fixtures(model_dir=model_dir, adapters=adapters, root=root or cache_root(), name=QWEN3_0_6B_SHAPE,
                        lora_rank=FULL_LORA_RANK, target_modules=ALL_LINEAR_MODULES,
                        probe_prompt=QWEN3_0_6B_PROBE_PROMPT)
    if fixture == REAL_LOGITS:
        # Adapters A, B, C as the tiny fixture's (same rank, targets, seeds), for this model: the probe check meets a
        # trained model's rounding here (tests/e2e/test_probe_scores.py).
        model_dir = tiny_real_logits_qwen3(root)
        adapters = {name: lora_adapter(name, model_dir, root) for name in ADAPTER_SEEDS}
        return Fixtures(model_dir=model_dir, adapters=adapters, root=root or cache_root(), name=REAL_LOGITS)
    if fixture != TINY:
        raise ValueError(f"unknown fixture {fixture!r}; known: {', '.join(FIXTURE_NAMES)}")
    model_dir = tiny_qwen3(root)
    adapters = {name: lora_adapter(name, model_dir, root) for name in ADAPTER_SEEDS}
    return Fixtures(model_dir=model_dir, adapters=adapters, root=root or cache_root())
