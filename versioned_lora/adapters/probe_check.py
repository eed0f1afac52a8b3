"""What an engine's probe must show before its READY is recorded: the publisher's `probe_check`.

`end` answers the probe's *scores*: the logprob the loaded candidate gives each token of the deployment's probe
after the tokens before it, teacher-forced in one prefill (`sglang_patches/managed/engine_side.py:_probe`). No
token is chosen by the engine, so no near-tie between two tokens decides anything. (The check of before compared the
engine's greedy first token and its logprob with a reference within 0.02 nats: on a near-flat distribution the
greedy token flipped with bf16 noise and correct candidates were refused, 2 in a 416-step soak.)

Two checks, one tolerance. `tolerance(top_logit, dtype, ulps)` is `ulps` units in the last place of the serving
dtype at the magnitude of the largest logit: two correct kernels that round differently give logits that differ by
a few units in the last place at the logits' own magnitude, and a logprob (a logit minus the log-sum-exp of all of
them) moves by at most twice the largest logit's error. A fixed number of nats cannot be right for every model: a
trained model's top logits sit at 20-30, where one bf16 step is 0.125. `PROBE_ULPS` is measured, not chosen
(tests/e2e/test_probe_scores.py prints the engines' spread in ulps on the fixtures and holds it under the bound).

- `AgreementProbeCheck`, the default, needs no model anywhere: every engine's scores for a candidate must agree,
  within the tolerance at the deployment's stated top-logit magnitude, with the scores of the first engine that
  answered for that candidate (its snapshot's digest); on a deployment of one engine it can only require a complete,
  finite probe (use `ReferenceProbeCheck` there if a forward fits). A candidate whose scores agree with the last
  committed version's as well cannot be told apart from it by this probe: `indistinct` says so (the API reports it as
  a warning on the outcome, never a refusal; the manifest's digest has already proven the bytes).
- `ReferenceProbeCheck` (`adapters/reference_forward.py`), an option for small models and tests: the scores must
  agree with a transformers + PEFT forward of the same snapshot, within the tolerance at the top logit that forward
  measures.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

from versioned_lora.runtime.interfaces import ReadyReceipt

# Explicit mantissa bits of each serving dtype: one unit in the last place at x is 2**(floor(log2 |x|) - bits).
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}

# Measured (tests/sglang_patches/test_probe_scores.py, which holds it): the largest spread between a CPU engine's
# scores and the reference forward's, in ulps of bf16 at the top logit, over 12 correct candidates per fixture, was
# 2.49 on the real-logit fixture (top logits up to 38) and 0.75 on the tiny one. 4 leaves 1.6x of the worst to spare
# before the factor 2 of `tolerance`; the check of before refused 6 of the same 12 real-logit candidates.
PROBE_ULPS = 4.0

# The magnitude of a trained language model's top logits (20-30 for the models this project serves): the
# agreement check's default where the deployment does not state its own (`connect(probe_top_logit=...)`).
DEFAULT_TOP_LOGIT = 32.0

# Below this magnitude the tolerance stops shrinking: a probe of a model whose logits are all near 0 still
# allows the rounding of the softmax's own arithmetic.
MIN_TOP_LOGIT = 1.0


def ulp(magnitude: float, dtype: str = "bfloat16") -> float:
    """One unit in the last place of `dtype` at |magnitude| (at least at MIN_TOP_LOGIT)."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"unknown serving dtype {dtype!r}: one of {sorted(MANTISSA_BITS)}")
    x = max(abs(magnitude), MIN_TOP_LOGIT)
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA_BITS[dtype])


def tolerance(top_logit: float, dtype: str = "bfloat16", ulps: float = PROBE_ULPS) -> float:
    """How far two correct scores of one token may be apart, in nats: `ulps` units in the last place at the top
    logit, twice (a logprob carries its own logit's error and the log-sum-exp's)."""
    return 2.0 * ulps * ulp(top_logit, dtype)


@attrs.frozen
class Difference:
    """Where two probes' scores differ most: the probe position, both scores, and by how much."""

    position: int
    mine: float
    theirs: float

    @property
    def nats(self) -> float:
        return abs(self.mine - self.theirs)


def largest_difference(mine: Sequence[float], theirs: Sequence[float]) -> Difference | None:
    """The position where two score vectors differ most, or None if they cannot be compared (lengths differ, or a
    score is not finite: such a probe agrees with nothing)."""
    if len(mine) != len(theirs) or not mine:
        return None
    if not all(math.isfinite(x) for x in (*mine, *theirs)):
        return None
    position = max(range(len(mine)), key=lambda i: abs(mine[i] - theirs[i]))
    return Difference(position, mine[position], theirs[position])


def agree(mine: Sequence[float], theirs: Sequence[float], within: float) -> bool:
    difference = largest_difference(mine, theirs)
    return difference is not None and difference.nats <= within


class AgreementProbeCheck:
    """Every engine's probe scores of a candidate agree with the first engine's (module doc). Remembers the first
    scores of the last `keep` candidates (by snapshot digest) and of the last committed version."""

    def __init__(self, top_logit: float = DEFAULT_TOP_LOGIT, dtype: str = "bfloat16", ulps: float = PROBE_ULPS,
                 keep: int = 8) -> None:
        if not (math.isfinite(top_logit) and top_logit > 0):
            raise ValueError(f"probe_top_logit must be a positive number, got {top_logit!r}")
        if not (math.isfinite(ulps) and ulps > 0):
            raise ValueError(f"probe ulps must be a positive number, got {ulps!r}")
        self.top_logit = top_logit
        self.dtype = dtype
        self.ulps = ulps
        self.within = tolerance(top_logit, dtype, ulps)
        self.keep = keep
        self._first: OrderedDict[str, tuple[float, ...]] = OrderedDict()
        self._committed: tuple[float, ...] | None = None

    def __call__(self, candidate: Any, receipt: ReadyReceipt) -> bool:
        digest = candidate.snapshot.digest
        first = self._first.get(digest)
        if first is None:
            # The first engine to answer sets the candidate's scores; it must still be a complete, finite probe.
            if largest_difference(receipt.probe_scores, receipt.probe_scores) is None:
                return False
            self._first[digest] = receipt.probe_scores
            while len(self._first) > self.keep:
                self._first.popitem(last=False)
            return True
        return agree(receipt.probe_scores, first, self.within)

    def explain(self, candidate: Any, receipt: ReadyReceipt) -> str:
        first = self._first.get(candidate.snapshot.digest)
        if first is None:
            return f"its probe scores are incomplete or not finite: {list(receipt.probe_scores)}"
        return explained(receipt.probe_scores, first, "the first engine's", self.within, self._rule())

    def committed(self, candidate: Any) -> None:
        """The candidate is now the default version: the next candidate's scores are compared with its own."""
        self._committed = self._first.get(candidate.snapshot.digest, self._committed)

    def indistinct(self, candidate: Any) -> str | None:
        """A warning if this probe cannot tell the candidate from the last committed version, else None."""
        mine = self._first.get(candidate.snapshot.digest)
        if mine is None or self._committed is None or mine is self._committed:
            return None
        if not agree(mine, self._committed, self.within):
            return None
        difference = largest_difference(mine, self._committed)
        assert difference is not None
        return (f"the probe cannot tell this version from the previous default: their scores differ by at most "
                f"{difference.nats:.5f} nats, within the tolerance {self.within:.5f} ({self._rule()}); a longer "
                f"or more specific probe would")

    def _rule(self) -> str:
        return f"{self.ulps:g} ulps of {self.dtype} at top logit {self.top_logit:g}, twice"


def explained(mine: Sequence[float], theirs: Sequence[float], whose: str, within: float, rule: str) -> str:
    """A refusal's message: where the scores differ most and the rule they broke."""
    difference = largest_difference(mine, theirs)
    if difference is None:
        return (f"its probe scores ({len(mine)}) cannot be compared with {whose} ({len(theirs)}): a length "
                f"differs or a score is not finite")
    return (f"its probe scores differ from {whose} by {difference.nats:.5f} nats at probe position "
            f"{difference.position + 1} ({difference.mine:.5f} against {difference.theirs:.5f}); tolerance "
            f"{within:.5f} nats ({rule})")
