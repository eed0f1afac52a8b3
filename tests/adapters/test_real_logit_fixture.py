"""The real-logit fixture (issue 46, item 3): generated from a spec and cached (nothing downloaded), the tiny model
with a trained model's logit magnitudes: under each of its adapters the top logit's median over the probe sits at
20-30, where one bf16 step is 0.125, and its adapters move what the model answers."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from versioned_lora.fixtures import REAL_LOGITS, TINY_PROBE_PROMPT, build_fixtures


def top_logits(model_dir: Path, adapter_dir: Path | None) -> tuple[list[float], list[int]]:
    """The top logit and its token at each position of the probe, bf16, transformers (+ PEFT for an adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model: Any = base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir))
    with torch.no_grad():
        logits = model(torch.tensor([list(TINY_PROBE_PROMPT)])).logits[0].float()
    top = logits.max(-1)
    return top.values.tolist(), top.indices.tolist()


def test_the_real_logit_fixture_has_top_logits_of_a_trained_model_under_its_adapters() -> None:
    fixtures = build_fixtures(fixture=REAL_LOGITS)
    assert build_fixtures(fixture=REAL_LOGITS) == fixtures  # cached: the second call is a lookup
    assert fixtures.name == REAL_LOGITS and set(fixtures.adapters) == {"A", "B", "C"}
    assert "real-logits" in fixtures.model_dir.name and fixtures.model_dir != build_fixtures().model_dir
    base_values, base_tokens = top_logits(fixtures.model_dir, None)
    medians = {}
    for name, adapter_dir in fixtures.adapters.items():
        values, tokens = top_logits(fixtures.model_dir, adapter_dir)
        medians[name] = statistics.median(values)
        assert tokens != base_tokens, name  # the adapter changes what the model answers
    print(f"top logit p50: base {statistics.median(base_values):.2f}, "
          + ", ".join(f"{n} {m:.2f}" for n, m in medians.items()))
    assert all(20.0 <= m <= 30.0 for m in medians.values()), medians
