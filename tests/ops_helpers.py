"""Running `versioned-lora` as a child process against a test deployment, and reading its output."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Iterator
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
    """`versioned-lora ARGS` run in this process (`versioned_lora.cli.main`, on a thread of its own, so that its
    `asyncio.run` has a loop of its own): argument parsing, the command and its exit status as the console entry
    point has them, its stdout and stderr captured. The command finds this process's Ray connection already made
    (it joins a cluster only when none is: ops/commands.py), so `--address` is parsed but not dialled.

    A child process costs an import of torch, SGLang and Ray (about 8 s on this host) a call; `cli_process` keeps
    one for what only a process boundary shows: signals, the exit status a shell sees, the console."""
    return await asyncio.wait_for(asyncio.to_thread(cli_here, *args), CLI_TIMEOUT_S)


def cli_here(*args: str) -> CliRun:
    """`versioned-lora ARGS` run in this thread (`cli`'s body, for tests without an event loop of their own)."""
    from versioned_lora.cli import main

    out, err = io.StringIO(), io.StringIO()
    with _console_env(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors, sys.exit in a command
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:  # what the console entry point prints before it exits 1
            traceback.print_exc()
            code = 1
    return CliRun(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _console_env() -> Iterator[None]:
    """A wide console without colour, as the child processes are given (rich reads both when a Console is made)."""
    saved = {name: os.environ.get(name) for name in _CONSOLE_ENV}
    os.environ.update(_CONSOLE_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_CONSOLE_ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


async def cli_process(*args: str) -> CliRun:
    """`python -m versioned_lora.cli ARGS` in a child process; its exit status, stdout and stderr."""
    env = {**os.environ, **_CONSOLE_ENV}
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "versioned_lora.cli", *args, env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(), CLI_TIMEOUT_S)
    finally:
        if child.returncode is None:
            child.kill()
    assert child.returncode is not None
    return CliRun(child.returncode, out.decode(), err.decode())
