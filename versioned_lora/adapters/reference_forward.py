"""The reference a probe is checked against: a transformers + PEFT forward of the same weights.

`end` on an engine answers the first-token logprob of an exact-version probe; the publisher accepts
READY_LOCAL only if it matches this forward within `PROBE_EPSILON`. Running the base model in its
checkpoint dtype (bf16 for the fixture) keeps the comparison like for like; the tolerance covers
the kernels' different accumulation order (measured on the fixture: |Δ| ≤ 0.004 nats).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

# Declared before any run (issue: staged publication); measured spread on the CPU fixture is 0.004.
PROBE_EPSILON = 0.02


@attrs.frozen
class ProbeReference:
    token_id: int
    logprob: float

    def matches(self, token_id: int, logprob: float, epsilon: float = PROBE_EPSILON) -> bool:
        return token_id == self.token_id and abs(logprob - self.logprob) <= epsilon


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
    """The publisher's `probe_check`: an engine's probe must match this forward of the same snapshot
    (computed once per digest) within `epsilon`."""

    def __init__(self, model: ReferenceModel, probe_input_ids: Sequence[int], epsilon: float = PROBE_EPSILON) -> None:
        self.model = model
        self.probe_input_ids = list(probe_input_ids)
        self.epsilon = epsilon
        self._by_digest: dict[str, ProbeReference] = {}

    def reference(self, candidate: Any) -> ProbeReference:
        digest = candidate.snapshot.digest
        if digest not in self._by_digest:
            self._by_digest[digest] = self.model.first_token(candidate.snapshot, self.probe_input_ids)
        return self._by_digest[digest]

    def __call__(self, candidate: Any, token_id: int, logprob: float) -> bool:
        return self.reference(candidate).matches(token_id, logprob, self.epsilon)

    def explain(self, candidate: Any) -> str:
        """The reference side of a refusal and the rule, for its message: the token must be the reference's and
        its logprob within `epsilon` of the reference's."""
        reference = self.reference(candidate)
        return (f"the reference forward answers {reference.token_id}/{reference.logprob:.5f}; tolerance: the same "
                f"token, its logprob within {self.epsilon} nats")
