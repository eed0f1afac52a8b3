"""A transformers + PEFT forward of the same weights an engine serves: the reference of `ReferenceProbeCheck`, an
option for small models and tests (the default check needs no model: `adapters/probe_check.py`).

`end` on an engine answers the probe's scores (the candidate's teacher-forced logprob of each probe token); this
check accepts READY_LOCAL only if they agree with this forward's scores of the same snapshot within the tolerance at
the top logit this forward measures (`probe_check.tolerance`). Running the base model in its checkpoint dtype (bf16
for the fixtures) keeps the comparison like for like; the tolerance covers the kernels' different rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from versioned_lora.adapters.probe_check import PROBE_ULPS, agree, explained, tolerance
from versioned_lora.runtime.interfaces import ReadyReceipt


@attrs.frozen
class ProbeReference:
    token_id: int
    logprob: float


@attrs.frozen
class ProbeScores:
    """A forward's teacher-forced logprob of each probe token after the ones before it, and the largest logit
    magnitude over those positions (what the tolerance is derived from)."""

    scores: tuple[float, ...]
    top_logit: float


class ReferenceModel:
    """A base model kept in memory; each call swaps in one adapter's weights (no reload of the base)."""

    def __init__(self, model_dir: str | Path, dtype: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._dtype = dtype or torch.bfloat16
        base: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self._dtype)
        base.eval()  # transformers' eval() is untyped: called through Any
        self._base = base

    def first_token(self, snapshot: Any, input_ids: Sequence[int]) -> ProbeReference:
        return self.logprobs(snapshot, input_ids, positions=1)[0]

    def logprobs(self, snapshot: Any, input_ids: Sequence[int], positions: int = 1) -> list[ProbeReference]:
        """Greedy continuation of `positions` tokens under the snapshot's adapter (None = base)."""
        torch = self._torch
        model = self._with_adapter(snapshot)
        try:
            ids = list(input_ids)
            out: list[ProbeReference] = []
            with torch.no_grad():
                for _ in range(positions):
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                    logprobs = torch.log_softmax(logits, dim=-1)
                    token = int(logprobs.argmax())
                    out.append(ProbeReference(token, float(logprobs[token])))
                    ids.append(token)
            return out
        finally:
            if snapshot is not None:
                self._base = model.unload()

    def next_token_logprobs(self, snapshot: Any, input_ids: Sequence[int]) -> Any:
        """The whole next-token log-distribution (float32, one entry per vocabulary token) after `input_ids`
        under the snapshot's adapter (None = base), computed as `logprobs` computes its first position: what
        the separation between versions and the margin of a probe's token are measured on."""
        torch = self._torch
        model = self._with_adapter(snapshot)
        try:
            with torch.no_grad():
                logits = model(torch.tensor([list(input_ids)])).logits[0, -1].float()
            return torch.log_softmax(logits, dim=-1)
        finally:
            if snapshot is not None:
                self._base = model.unload()

    def probe(self, snapshot: Any, input_ids: Sequence[int]) -> ProbeScores:
        """The probe as an engine's `end` scores it (one forward over the probe), with the top logit's magnitude."""
        torch = self._torch
        model = self._with_adapter(snapshot)
        try:
            ids = list(input_ids)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            scores = tuple(float(logprobs[i, token]) for i, token in enumerate(ids[1:]))
            return ProbeScores(scores, float(logits.abs().max()))
        finally:
            if snapshot is not None:
                self._base = model.unload()

    def score(self, snapshot: Any, prefix: Sequence[int], continuation: Sequence[int]) -> list[float]:
        """Teacher-forced logprobs of `continuation` after `prefix` (one forward pass): how an engine's
        own tokens are checked, since on a near-flat distribution greedy argmax can flip between
        near-tied tokens with bf16 noise while the logprobs still agree."""
        torch = self._torch
        model = self._with_adapter(snapshot)
        try:
            ids = list(prefix) + list(continuation)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            start = len(prefix) - 1
            return [float(logprobs[start + i, token]) for i, token in enumerate(continuation)]
        finally:
            if snapshot is not None:
                self._base = model.unload()

    def _with_adapter(self, snapshot: Any) -> Any:
        if snapshot is None:
            return self._base
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = LoraConfig(**{k: v for k, v in snapshot.adapter_config().items() if k in _LORA_CONFIG_KEYS})
        model = get_peft_model(self._base, config)
        state = {name: tensor.to(self._dtype) for name, tensor in snapshot.to_peft_state().items()}
        result: Any = set_peft_model_state_dict(model, state)  # peft's namedtuple (typed loosely upstream)
        if result.unexpected_keys:
            raise ValueError(f"adapter tensors the model does not have: {result.unexpected_keys[:5]}")
        model.eval()
        return model


_LORA_CONFIG_KEYS = frozenset({"r", "lora_alpha", "target_modules", "bias", "use_rslora", "fan_in_fan_out",
                               "task_type", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern"})


class ReferenceProbeCheck:
    """The publisher's `probe_check` against a reference forward: an engine's probe scores must agree with this
    forward's of the same snapshot (computed once per digest) within `ulps` units in the last place of `dtype` at
    the top logit the forward measured."""

    def __init__(self, model: ReferenceModel, probe_input_ids: Sequence[int], ulps: float = PROBE_ULPS,
                 dtype: str = "bfloat16") -> None:
        if len(probe_input_ids) < 2:
            raise ValueError("a probe needs at least two tokens: the first is scored by none")
        self.model = model
        self.probe_input_ids = list(probe_input_ids)
        self.ulps = ulps
        self.dtype = dtype
        self._by_digest: dict[str, ProbeScores] = {}

    def reference(self, candidate: Any) -> ProbeScores:
        digest = candidate.snapshot.digest
        if digest not in self._by_digest:
            self._by_digest[digest] = self.model.probe(candidate.snapshot, self.probe_input_ids)
        return self._by_digest[digest]

    def within(self, candidate: Any) -> float:
        return tolerance(self.reference(candidate).top_logit, self.dtype, self.ulps)

    def __call__(self, candidate: Any, receipt: ReadyReceipt) -> bool:
        return agree(receipt.probe_scores, self.reference(candidate).scores, self.within(candidate))

    def explain(self, candidate: Any, receipt: ReadyReceipt) -> str:
        """The reference side of a refusal and the rule, for its message."""
        reference = self.reference(candidate)
        return explained(receipt.probe_scores, reference.scores, "the reference forward's", self.within(candidate),
                         f"{self.ulps:g} ulps of {self.dtype} at the reference's top logit "
                         f"{reference.top_logit:.3f}, twice")
