"""Running `versioned-lora` as a child process against a test deployment, and reading its output."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import attrs
from engine_helpers import TEST_TOKEN

from versioned_lora.adapters.ray_registry import REGISTRY_NAMESPACE

CLI_TIMEOUT_S = 600.0


@attrs.frozen
class CliRun:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def receipt(self) -> Any:
        lines = [line for line in self.stdout.splitlines() if line.startswith("RECEIPT ")]
        assert len(lines) == 1, self.stdout + self.stderr
        return json.loads(lines[0][len("RECEIPT "):])


def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "engine.token"
    path.write_text(TEST_TOKEN + "\n")
    path.chmod(0o600)
    return path


def connection_args(deployment: Any, tmp_path: Path, token: bool = True) -> list[str]:
    """`--address` (this test's own cluster, by its GCS address: 'auto' may find another run's), the
    deployment's registry actor by name, its engines in the registry's order, the token file."""
    import ray

    urls = ",".join(client.base_url for client in deployment.clients.values())
    args = ["--address", ray.get_runtime_context().gcs_address, "--namespace", REGISTRY_NAMESPACE,
            "--name", deployment.registry_name, "--engines", urls]
    return args + (["--token-file", str(token_file(tmp_path))] if token else [])


async def cli(*args: str) -> CliRun:
    """`python -m versioned_lora.cli ARGS` in a child process; its exit status, stdout and stderr."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "versioned_lora.cli", *args, env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(), CLI_TIMEOUT_S)
    finally:
        if child.returncode is None:
            child.kill()
    assert child.returncode is not None
    return CliRun(child.returncode, out.decode(), err.decode())
