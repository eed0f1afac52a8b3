"""Medians with bootstrap intervals, as every benchmark here reports them (no imports beyond the standard library,
so a benchmark that runs where the package's other dependencies are not, the device machine's, can use them)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def bootstrap_median(values: Sequence[float], rounds: int = 2000, seed: int = 7) -> tuple[float, float, float]:
    """(median, low, high): the median of `values` (NaN dropped) and its 95% percentile-bootstrap interval."""
    clean = [v for v in values if v == v]  # drop NaN
    if not clean:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(clean, k=len(clean))) for _ in range(rounds))
    return statistics.median(clean), medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def fmt_interval(triple: Sequence[float]) -> str:
    """A (median, low, high) triple as `median [low, high]`."""
    return f"{triple[0]:.3f} [{triple[1]:.3f}, {triple[2]:.3f}]"
