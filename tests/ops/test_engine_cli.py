"""`versioned-lora engine --from-peft-config DIR` serves what a trainer trains: the qwen3-0.6b-shape model with an
r=64 adapter over all seven linear modules, its rank and modules read from the adapter's own config; extra SGLang
arguments pass through after `--`; the ready file appears once it answers and goes when it stops; SIGTERM stops
it without a traceback. One real engine (~5.4 GB), a registry the API starts, a publication and a session on it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from engine_helpers import TEST_TOKEN, capability_key_file, run
from ops_helpers import token_file

from versioned_lora import Outcome, connect, stop_registry
from versioned_lora.adapters.engine_process import free_port_block
from versioned_lora.cli import lora_shape_from_peft_config
from versioned_lora.fixtures import QWEN3_0_6B_SHAPE, build_fixtures


def test_the_rank_and_modules_come_from_the_adapter_config(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 16, "rank_pattern": {"q_proj": 32}, "target_modules": ["v_proj", "q_proj"]}))
    assert lora_shape_from_peft_config(tmp_path) == (32, ("q_proj", "v_proj"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": "all-linear"}))
    assert lora_shape_from_peft_config(tmp_path) == (8, ("all",))


def test_engine_from_peft_config_serves_the_0_6b_shape_r64_all_linear_adapter(tmp_path: Path) -> None:
    fixtures = build_fixtures(fixture=QWEN3_0_6B_SHAPE)
    adapter = fixtures.adapters["A"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 64 and len(config["target_modules"]) == 7, config
    port = free_port_block()
    ready = tmp_path / "engine.ready"
    log = tmp_path / "engine.log"
    env = {**os.environ, "VERSIONED_LORA_TOKEN": TEST_TOKEN}
    out = (tmp_path / "cli.out").open("w")
    child = subprocess.Popen(
        [sys.executable, "-m", "versioned_lora.cli", "engine", "--port", str(port), "--model", str(fixtures.model_dir),
         "--from-peft-config", str(adapter), "--ready-file", str(ready), "--log", str(log),
         "--capability-key-file", str(capability_key_file()), "--", "--max-running-requests", "7"],
        env=env, stdout=out, stderr=subprocess.STDOUT)
    registry = f"engine-cli-{uuid.uuid4().hex[:8]}"
    try:
        while not ready.exists():  # the readiness signal (no timed assertion: the child's own start timeout bounds it)
            assert child.poll() is None, (tmp_path / "cli.out").read_text() + log.read_text()
            time.sleep(1.0)
        url = json.loads(ready.read_text())["url"]
        info = httpx.get(f"{url}/server_info", timeout=60).json()
        launch = str(info.get("launch_command"))  # the command line the engine was asked to serve with
        assert info["max_lora_rank"] == 64 and "--max-lora-rank 64" in launch, launch
        modules = launch.split("--lora-target-modules", 1)[1]
        assert all(module in modules for module in config["target_modules"]), launch
        assert "--max-running-requests 7" in launch, launch  # passed through after `--`

        async def publish_and_generate() -> tuple[object, str | None, list[int]]:
            async with await connect(journal=tmp_path / "registry.sqlite", engines=[url], registry=registry,
                                     token_file=token_file(tmp_path), key_file=capability_key_file(), capacity=1,
                                     reference_model=fixtures.model_dir, probe_prompt=fixtures.probe_prompt,
                                     auto_reclaim=False) as deployment:
                result = await deployment.publish("a", adapter)
                session = deployment.sessions().open(list(fixtures.probe_prompt))
                output = await session.generate(2) if result.committed else []
                await session.finish()
                return result, session.lora_name, output

        result, bound, output = run(publish_and_generate())
        assert result.outcome is Outcome.COMMITTED, result  # type: ignore[attr-defined]
        assert bound == result.lora_name and len(output) == 2  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(ValueError):  # (none was started, if the engine never became ready)
            stop_registry(registry, address=None)
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=120)
        out.close()
    text = (tmp_path / "cli.out").read_text()
    assert code == 0 and "Traceback" not in text and "engine stopped" in text, text
    assert not ready.exists()
