"""Smoke test of `versioned-lora demo` (issue 9): the whole story, short, on the session's two engines
and Ray cluster. Budget: under 4 minutes. Asserts outcomes, never timings."""

from __future__ import annotations

import argparse
import json

from engine_helpers import TEST_TOKEN, capability_key_file

from versioned_lora.adapters.manifest import MANIFEST_FORMAT_V2
from versioned_lora.demo import run_demo


def test_demo_story_holds_under_traffic(engines, fixtures, ray_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = argparse.Namespace(out=str(tmp_path), duration=20.0, concurrency=3, turns=3,
                              engines=f"{engines.e0.url},{engines.e1.url}", token=TEST_TOKEN,
                              capability_key_file=str(capability_key_file()), no_live=True)
    assert run_demo(args) == 0

    report = json.loads((tmp_path / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["failed"] == []
    for name in ("B published under load (COMMITTED)", "C rejected with CAPACITY_ERROR",
                 "rejected C reached no engine (0 begin calls)", "A reclaimed on both engines",
                 "each engine unloaded A exactly once", "corrupted C ends FAILED_CLEAN",
                 "E1 refused at end with a digest mismatch", "corrupted candidate cleaned on both engines",
                 "capacity freed after the failure (1 version held)", "0 failed requests", "0 aborted requests",
                 "0 pause/flush/abort_all/base-weight calls", "managed versions never above 2",
                 "every session used exactly one version", "versions are published as manifest v2"):
        assert checks[name]["ok"], checks[name]
    outcomes = report["summary"]["outcomes"]
    assert outcomes["ok"] > 0 and outcomes["failed"] == outcomes["aborted"] == outcomes["unknown"] == 0
    assert report["publications"]["C (capacity)"]["reason"] == "CAPACITY_ERROR"
    assert report["publications"]["C (corrupt)"]["status"] == "FAILED_CLEAN"
    assert report["publications"]["reclaim A"]["status"] == "RECLAIMED"
    assert {report["publications"][label]["manifest"] for label in ("A", "B", "C (corrupt)")} == {MANIFEST_FORMAT_V2}
    assert set(report["summary"]["per_version"]) >= {"A", "B"}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
