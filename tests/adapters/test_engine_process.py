"""The engine launcher: health means *our* process answers; restart leaves no orphans."""

from __future__ import annotations

import httpx
import psutil
import pytest

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, EngineStartError


def _status(url: str) -> dict:
    return httpx.get(f"{url}/versioned_lora/status", timeout=10).json()


def test_restart_mints_new_incarnation_and_leaves_no_orphans(engines) -> None:
    engine = engines.e1
    before = _status(engine.url)
    old_pids = engine.process_ids()
    assert before["pid"] == engine.pid
    assert len(old_pids) >= 3  # server, scheduler, detokenizer

    engine.restart()

    after = _status(engine.url)
    assert after["pid"] == engine.pid != before["pid"]
    assert after["incarnation"] != before["incarnation"]
    assert after["adapters"] == []  # a new process starts with nothing loaded
    assert not [pid for pid in old_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_start_refuses_a_port_held_by_another_server(engines, fixtures) -> None:
    squatter = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=engines.e0.config.port))
    with pytest.raises(EngineStartError, match="already in use"):
        squatter.start(timeout_s=5)
