"""The probe checks' comparison (adapters/probe_check.py), without engines: the tolerance in ulps at the top logit,
the agreement of every engine with the first one for a candidate, what a refusal says, the warning for a candidate
the probe cannot tell from the last committed version, and the probe ids the command line reads."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import attrs
import pytest

from versioned_lora.adapters.probe_check import (
    AgreementProbeCheck,
    agree,
    largest_difference,
    tolerance,
    ulp,
)
from versioned_lora.ops.commands import OperationError, probe_ids
from versioned_lora.runtime.interfaces import ReadyReceipt


@attrs.frozen
class Snap:
    digest: str


@attrs.frozen
class Cand:
    snapshot: Snap


def receipt(*scores: float) -> ReadyReceipt:
    return ReadyReceipt("n", "d", "t", 1, 7, -1.0, tuple(scores))


def test_one_ulp_is_the_dtype_spacing_at_the_magnitude() -> None:
    assert ulp(24.0) == 0.125 and ulp(-24.0) == 0.125 and ulp(32.0) == 0.25  # bf16: 7 explicit mantissa bits
    assert ulp(1.5) == ulp(0.01) == 2**-7  # below MIN_TOP_LOGIT the spacing stops shrinking
    assert ulp(24.0, "float16") == 2**-6 and ulp(24.0, "float32") == 2**-19
    assert tolerance(24.0, "bfloat16", 4) == 1.0
    with pytest.raises(ValueError, match="unknown serving dtype"):
        ulp(1.0, "int8")


def test_scores_that_differ_in_length_or_are_not_finite_agree_with_nothing() -> None:
    assert largest_difference([-1.0, -2.0], [-1.0]) is None
    assert largest_difference([], []) is None
    assert largest_difference([-1.0, math.nan], [-1.0, -2.0]) is None
    assert not agree([-1.0, math.inf], [-1.0, math.inf], 10.0)
    difference = largest_difference([-1.0, -2.0, -3.0], [-1.1, -2.5, -3.0])
    assert difference is not None and (difference.position, difference.mine, difference.theirs) == (1, -2.0, -2.5)
    assert agree([-1.0, -2.0], [-1.0, -2.5], 0.5) and not agree([-1.0, -2.0], [-1.0, -2.5], 0.49)


def test_every_engine_must_agree_with_the_first_that_answered_for_the_candidate() -> None:
    check = AgreementProbeCheck(top_logit=24.0, ulps=4)  # tolerance 1.0 nats
    a, b = Cand(Snap("a")), Cand(Snap("b"))
    assert check(a, receipt(-1.0, -2.0))  # the first engine sets A's scores
    assert check(a, receipt(-1.5, -2.9))  # within 1.0 of them
    assert not check(a, receipt(-1.0, -3.2))  # 1.2 away at position 2
    assert "by 1.20000 nats at probe position 2 (-3.20000 against -2.00000); tolerance 1.00000 nats (4 ulps of " \
           "bfloat16 at top logit 24, twice)" in check.explain(a, receipt(-1.0, -3.2))
    assert check(b, receipt(-5.0, -6.0))  # another candidate: its own first engine
    assert not check(Cand(Snap("c")), receipt(-1.0, math.nan))  # an incomplete first answer is never the reference
    assert "not finite" in check.explain(Cand(Snap("c")), receipt(-1.0, math.nan))


def test_only_the_last_candidates_are_remembered() -> None:
    check = AgreementProbeCheck(keep=2)
    for digest in "abc":
        assert check(Cand(Snap(digest)), receipt(-1.0, -2.0))
    assert check(Cand(Snap("a")), receipt(-9.0, -9.0))  # forgotten: a new first answer


def test_a_candidate_the_probe_cannot_tell_from_the_committed_one_gets_a_warning() -> None:
    check = AgreementProbeCheck(top_logit=24.0, ulps=4)
    v1, v2, v3 = Cand(Snap("1")), Cand(Snap("2")), Cand(Snap("3"))
    check(v1, receipt(-1.0, -2.0))
    assert check.indistinct(v1) is None  # nothing committed yet
    check.committed(v1)
    check(v2, receipt(-1.2, -2.3))  # within 1.0 of v1's scores everywhere
    warning = check.indistinct(v2)
    assert warning is not None and "cannot tell this version from the previous default" in warning
    check.committed(v2)
    check(v3, receipt(-4.0, -2.0))
    assert check.indistinct(v3) is None


def test_the_check_refuses_a_nonsense_configuration() -> None:
    with pytest.raises(ValueError, match="probe_top_logit"):
        AgreementProbeCheck(top_logit=0.0)
    with pytest.raises(ValueError, match="ulps"):
        AgreementProbeCheck(ulps=math.nan)


def args(ids: str | None = None, file: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(probe_ids=ids, probe_file=None if file is None else str(file))


def test_the_command_line_reads_probe_ids_from_a_flag_or_a_file(tmp_path: Path) -> None:
    assert probe_ids(args("5, 6,7")) == [5, 6, 7]
    assert probe_ids(args()) == list(range(10, 30))  # the fixtures' probe
    (tmp_path / "probe.txt").write_text("# a probe of my domain\n101 102\n103,104  # the rest\n")
    assert probe_ids(args(file=tmp_path / "probe.txt")) == [101, 102, 103, 104]
    for bad, said in [(args("1"), "at least two"), (args("1,-2"), "none negative"), (args("a,b"), "integers"),
                      (args("1,2", tmp_path / "probe.txt"), "not both"),
                      (args(file=tmp_path / "missing.txt"), "cannot read")]:
        with pytest.raises(OperationError, match=said):
            probe_ids(bad)
