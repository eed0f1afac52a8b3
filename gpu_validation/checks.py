"""Verdicts. Each check is a pure function of observations and pre-registered numbers, so a negative control
goes through exactly the code that judges the real runs: it must come out FAIL for the harness to count as
able to detect that error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from gpu_validation.engines import Observation

PASS, FAIL = "PASS", "FAIL"


@attrs.frozen
class Baseline:
    """The clean single-version answer for one prefix: greedy tokens and their logprobs."""

    version: str
    prefix_id: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @classmethod
    def from_observation(cls, version: str, observation: Observation) -> Baseline:
        return cls(version, observation.prefix_id, observation.output_ids, observation.logprobs)


@attrs.frozen
class Check:
    name: str
    kind: str  # "positive": must PASS; "negative": a control that must FAIL
    verdict: str
    detail: str
    data: dict[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict == (PASS if self.kind == "positive" else FAIL)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "verdict": self.verdict, "ok": self.ok,
                "detail": self.detail, "data": self.data}  # fmt: skip


@attrs.frozen
class Comparison:
    """One generation against one baseline, position by position."""

    verdict: str
    compared: int
    max_abs_diff: float
    first_token_mismatch: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def compare(observation: Observation, baseline: Baseline, epsilon: float) -> Comparison:
    """Positions up to the first differing token; a differing token, a missing position or a logprob farther
    than epsilon is FAIL. After a token differs, the sequences diverged and nothing later is comparable."""
    expected = len(baseline.output_ids)
    compared, max_diff = 0, 0.0
    for i, (token, logprob) in enumerate(zip(observation.output_ids, observation.logprobs, strict=False)):
        if i >= expected:
            break
        if token != baseline.output_ids[i]:
            return Comparison(
                FAIL, compared, max_diff, i, f"token {token} != baseline {baseline.output_ids[i]} at {i}"
            )
        max_diff = max(max_diff, abs(logprob - baseline.logprobs[i]))
        compared += 1
    if compared < expected:
        return Comparison(FAIL, compared, max_diff, None, f"{compared} of {expected} positions generated")
    if max_diff > epsilon:
        return Comparison(FAIL, compared, max_diff, None, f"max |dlogprob| {max_diff:.4g} > epsilon {epsilon}")
    return Comparison(PASS, compared, max_diff, None, f"max |dlogprob| {max_diff:.4g} <= epsilon {epsilon}")


def numerics_check(name: str, kind: str, pairs: Sequence[tuple[Observation, Baseline]], epsilon: float) -> Check:
    """Every observation matches its baseline (same full prefix, version the session is bound to)."""
    rows = []
    for observation, baseline in pairs:
        result = compare(observation, baseline, epsilon)
        rows.append({"engine": observation.engine, "prefix_id": observation.prefix_id, "phase": observation.phase,
                     "lora_name": observation.lora_name, "baseline": baseline.version,
                     "cached_tokens": observation.cached_tokens, **result.to_dict()})  # fmt: skip
    failed = [r for r in rows if r["verdict"] == FAIL]
    worst = max((r["max_abs_diff"] for r in rows), default=0.0)
    verdict = FAIL if failed or not rows else PASS
    detail = (f"{len(rows) - len(failed)}/{len(rows)} generations match their baseline; worst |dlogprob| {worst:.4g}"
              + (f"; first failure: {failed[0]['engine']} {failed[0]['prefix_id']}: {failed[0]['reason']}"
                 if failed else ""))  # fmt: skip
    return Check(name, kind, verdict, detail, {"comparisons": rows})


def kv_isolation_check(
    name: str,
    kind: str,
    warm: Observation,
    cross: Observation,
    repeat: Observation,
    cross_cold_baseline: Baseline,
    epsilon: float,
) -> Check:
    """RFC §7.2 flowchart, one direction: version X warmed, then version Y on the same prompt must start cold
    (no cached tokens: X's KV not reused) and match Y's cold baseline; Y repeated must hit its own cache and
    still match. The cached-token rules are judged first and separately, so a cache key that ignores the
    adapter is caught by the cache evidence itself, not only by its numerical side effect."""
    rules = {
        "warm_started_cold": warm.cached_tokens == 0,
        "cross_not_served_from_other_version_cache": cross.cached_tokens == 0,
        "cross_matches_cold_baseline": compare(cross, cross_cold_baseline, epsilon).verdict == PASS,
        "repeat_hits_own_cache": repeat.cached_tokens >= repeat.prompt_tokens - 1,
        "repeat_matches_cold_baseline": compare(repeat, cross_cold_baseline, epsilon).verdict == PASS,
    }
    broken = [rule for rule, held in rules.items() if not held]
    detail = (
        f"cached tokens warm={warm.cached_tokens} cross={cross.cached_tokens} repeat={repeat.cached_tokens} "
        f"(prompt {cross.prompt_tokens}); " + ("all rules hold" if not broken else f"broken: {broken}")
    )
    data = {"rules": rules, "warm": warm.to_dict(), "cross": cross.to_dict(), "repeat": repeat.to_dict(),
            "cross_vs_baseline": compare(cross, cross_cold_baseline, epsilon).to_dict()}  # fmt: skip
    return Check(name, kind, FAIL if broken else PASS, detail, data)


def stability_check(name: str, pairs: Sequence[tuple[Observation, Observation]], epsilon: float) -> Check:
    """A baseline is usable only if scoring the same prefix again in the same clean engine agrees with it."""
    rows = []
    for first, again in pairs:
        result = compare(again, Baseline.from_observation("first", first), epsilon)
        rows.append({"prefix_id": first.prefix_id, "first_cached": first.cached_tokens,
                     "again_cached": again.cached_tokens, **result.to_dict()})  # fmt: skip
    failed = [r for r in rows if r["verdict"] == FAIL]
    worst = max((r["max_abs_diff"] for r in rows), default=0.0)
    return Check(name, "positive", FAIL if failed or not rows else PASS,
                 f"{len(rows) - len(failed)}/{len(rows)} prefixes stable on repeat; worst |dlogprob| {worst:.4g}",
                 {"repeats": rows})  # fmt: skip


def discrimination_check(
    baselines: dict[str, dict[str, Baseline]], prefix_ids: Sequence[str], min_separation: float
) -> Check:
    """The scoring positions tell A from B: for every prefix, the two clean baselines differ in a greedy token
    or by at least `min_separation` in a logprob; otherwise a wrong version could pass unnoticed."""
    rows = []
    for prefix_id in prefix_ids:
        a, b = baselines["A"][prefix_id], baselines["B"][prefix_id]
        mismatch = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)) if x != y), None)
        upto = len(a.logprobs) if mismatch is None else mismatch
        gap = max((abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto], strict=False)), default=0.0)
        rows.append({"prefix_id": prefix_id, "first_token_mismatch": mismatch, "max_logprob_gap": gap,
                     "separated": mismatch is not None or gap >= min_separation})  # fmt: skip
    weak = [r["prefix_id"] for r in rows if not r["separated"]]
    detail = f"{len(rows) - len(weak)}/{len(rows)} prefixes separate A from B" + (f"; weak: {weak}" if weak else "")
    return Check("baselines_discriminate", "positive", FAIL if weak else PASS, detail, {"prefixes": rows})


def cold_start_check(name: str, first: Observation) -> Check:
    """The first scored request of a fresh engine process must find nothing in its cache."""
    verdict = PASS if first.cached_tokens == 0 else FAIL
    return Check(name, "positive", verdict, f"first request {first.prefix_id}: cached_tokens={first.cached_tokens}",
                 {"first": first.to_dict()})  # fmt: skip
