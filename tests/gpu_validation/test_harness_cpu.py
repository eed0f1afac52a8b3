"""CI runs the RFC §7.2 harness against the two CPU engines of the session and reads its report: every
positive check PASS, both negative controls detected (FAIL). The harness's two fresh baseline processes come from
the suite's standby pool (tests/engine_pool.py): real engine processes that never served a request, activated on a
port of their own when the harness asks, instead of two cold starts of ~60 s each one after the other."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from engine_helpers import TEST_TOKEN, capability_key_file

from gpu_validation import harness
from gpu_validation.__main__ import main
from versioned_lora.adapters.engine_process import EngineProcess, free_port_block


def test_harness_against_the_session_engines(engines, fixtures, tmp_path, standby_pool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async def fresh_from_the_pool(spec: Any, label: str) -> EngineProcess:
        process = await asyncio.to_thread(standby_pool.take)
        await asyncio.to_thread(process.activate, free_port_block())
        return process

    monkeypatch.setattr(harness, "start_engine", fresh_from_the_pool)
    out = tmp_path / "gpu_validation"
    code = main(["run", "--engines", f"{engines.e0.url},{engines.e1.url}", "--token", TEST_TOKEN, "--out", str(out),
                 "--capability-key-file", str(capability_key_file())])
    report = json.loads((out / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    bad = {name: (c["verdict"], c["detail"][-600:]) for name, c in checks.items() if not c["ok"]}
    assert not bad, bad
    assert code == 0 and report["summary"]["ok"]

    # The pre-registered config was written first and fixes what the brief asks for.
    pre = json.loads((out / "preregistered.json").read_text())
    assert {"model", "code_revision", "fixtures", "dtype", "sampling", "epsilon", "scoring_prefixes"} <= set(pre)
    assert pre["digest"] == report["preregistered"]["digest"]
    assert pre["fixtures"]["A"]["digest"] != pre["fixtures"]["B"]["digest"]
    # A tool turn's full prefix is the previous prefix + the generated tokens + the tool's output.
    prefixes = {p["prefix_id"]: p["token_ids"] for p in pre["scoring_prefixes"]}
    old = pre["sessions"]["S_old"]
    assert prefixes["S_old/turn2"] == (prefixes["S_old/turn1"] + old["reference_generated"][0]
                                       + list(old["tool_outputs"][0]))  # fmt: skip

    # Both negative controls came from real engine runs and were flagged by the rule they target.
    assert checks["control_B_served_under_A_name"]["verdict"] == "FAIL"
    blind = checks["control_cache_key_ignores_adapter"]
    assert blind["verdict"] == "FAIL"
    assert blind["data"]["rules"]["cross_not_served_from_other_version_cache"] is False
    assert blind["data"]["cross"]["cached_tokens"] > 0

    # Two-way KV isolation with cached tokens recorded; both engines covered by the scenario.
    for name in ("kv_A_warm_then_B_cold_on_E0", "kv_B_warm_then_A_cold_on_E1"):
        assert checks[name]["data"]["cross"]["cached_tokens"] == 0
        assert checks[name]["data"]["repeat"]["cached_tokens"] > 0
    engines_seen = {o["engine"] for o in report["observations"] if not o["phase"].startswith("baseline")}
    assert {"E0", "E1"} <= engines_seen
    assert (out / "report.md").read_text().startswith("# RFC §7.2 validation report")
