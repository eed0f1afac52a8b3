"""The README's quickstart, as it stands: its `trainer.py` block is extracted and run in a child process against a
registry started the way the quickstart's shell block starts one (recording the engines' URLs, with their key),
over the session's two real engines. The block trains a PEFT adapter (three real optimizer steps), publishes it
each step with three sessions in flight, checks every session stayed on one version and every retired version was
reclaimed; it imports only what the README names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import ray
from engine_helpers import capability_key_file, client_for, run
from ops_helpers import token_file

from versioned_lora import start_registry, stop_registry

ROOT = Path(__file__).resolve().parents[2]
NAMED_IN_README = {"asyncio", "os", "torch", "peft", "transformers", "versioned_lora"}


def quickstart_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the quickstart has one Python block"
    return blocks[0]


def test_the_quickstart_imports_only_what_the_readme_names() -> None:
    tree = ast.parse(quickstart_block())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert modules <= NAMED_IN_README, modules - NAMED_IN_README
    assert "versioned_lora" in modules and not any(m.startswith("versioned_lora.") for m in modules)


def test_the_readme_quickstart_runs_as_it_stands(engines, fixtures, tmp_path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(quickstart_block())
    name = f"quickstart-{uuid.uuid4().hex[:8]}"
    info = start_registry(tmp_path / "registry.sqlite", {"E0": engines.e0.url, "E1": engines.e1.url},
                          key_file=capability_key_file(), address=None, name=name)
    env = {**os.environ, "VL_BASE_MODEL": str(fixtures.model_dir), "VL_ADAPTER": str(fixtures.adapters["A"]),
           "VL_RAY_ADDRESS": ray.get_runtime_context().gcs_address, "VL_REGISTRY": name,
           "VL_TOKEN_FILE": str(token_file(tmp_path))}
    try:
        done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=1800)
    finally:
        async def teardown() -> None:  # test teardown, not the protocol: free the engines' slots for later tests
            for url in (engines.e0.url, engines.e1.url):
                async with client_for(url) as client:
                    for adapter in (await client.status())["managed"]:
                        if adapter["state"] in ("READY", "STAGING") and f"@{info.epoch}-" in adapter["name"]:
                            await client.managed("reclaim", lora_name=adapter["name"], reclaim_id="teardown",
                                                 wait_s=60)

        run(teardown())
        stop_registry(name, address=None)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("QUICKSTART ")]
    assert summary == ["QUICKSTART 9 sessions, published ['step-0', 'step-1', 'step-2', 'step-3'], default step-3"], \
        done.stdout[-3000:]
