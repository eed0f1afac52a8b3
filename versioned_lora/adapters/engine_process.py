"""Start, health-check, restart and stop one SGLang server process with the versioned-lora patches.

The server runs in a new process session (``start_new_session=True``), so its pid is also the id
of a process group holding the server and everything SGLang spawns; stopping signals that group by
pid, which leaves no orphan scheduler or detokenizer behind.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from versioned_lora.lifecycle.core import DEFAULT_CAPACITY
from versioned_lora.spec.wire import EXIT_WITH_PARENT_ENV, PATCHES_ENV, STANDBY_FILE_ENV, STATUS_PATH


def loaded_adapter_slots(capacity: int) -> int:
    """The loaded-adapter slots of an engine serving a registry of capacity K: K pinned managed versions plus one
    slot for the stock path (the engine refuses a `begin` NO_FREE_SLOT once K are staged or ready). The one knob
    is K; this is the only place the engines' slots are derived from it (issue 46, item 4)."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    return capacity + 1


def managed_lora_args(capacity: int = DEFAULT_CAPACITY) -> tuple[str, ...]:
    """RFC "first supported configuration" at K = `capacity`: K + 1 loaded adapters, all of them allowed in one
    batch (every held version may have sessions at once); radix cache on (SGLang's default); overlap scheduling,
    speculative decoding and CUDA graphs off."""
    slots = str(loaded_adapter_slots(capacity))
    return ("--enable-lora", "--max-loras-per-batch", slots, "--max-loaded-loras", slots,
            "--disable-overlap-schedule", "--disable-cuda-graph")

# CPU-only host (DESIGN.md §5): the torch-native LoRA and attention backends, a bounded KV pool
# (otherwise the scheduler reserves ~70% of RAM), and --sleep-on-idle: without it an idle scheduler
# busy-polls its sockets (Scheduler.on_idle in a tight loop) and holds a whole core, which on a
# 2-core host halves the speed of the other engine.
CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--sleep-on-idle",
    "--lora-backend", "torch_native",
    "--attention-backend", "torch_native",
    "--max-total-tokens", "8192",
)

DEFAULT_PATCHES: tuple[str, ...] = ("cpu", "introspection", "managed")


def default_log_path(port: int) -> Path:
    return Path(f"/tmp/versioned_lora_engine_{port}.log")


class EngineStartError(RuntimeError):
    """The engine did not become healthy; the message carries the tail of its log."""


@attrs.define
class EngineConfig:
    model_dir: Path
    port: int
    host: str = "127.0.0.1"
    max_lora_rank: int = 8
    lora_target_modules: Sequence[str] = ("q_proj", "v_proj")
    patches: Sequence[str] = DEFAULT_PATCHES
    cpu: bool = True
    extra_args: Sequence[str] = ()
    log_path: Path | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    # torch's intra-op threads in a CPU engine (OMP_NUM_THREADS; None: inherit). torch takes every core by
    # default, so two engines on this 2-core host ran four busy OpenMP threads on two cores: the tiny fixture
    # decoded 6-8x slower than with one thread each (2026-12-04, benchmarks/results/RESULTS.md "One torch
    # thread per CPU engine"). `env` still wins over this.
    cpu_threads: int | None = 1
    # The registry capacity K this engine serves: it is started with K + 1 loaded-adapter slots.
    capacity: int = DEFAULT_CAPACITY

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "versioned_lora.sglang_patches.server",
            "--model-path", str(self.model_dir),
            "--host", self.host,
            "--port", str(self.port),
            "--skip-tokenizer-init",
            "--max-lora-rank", str(self.max_lora_rank),
            "--lora-target-modules", *self.lora_target_modules,
            *managed_lora_args(self.capacity),
        ]
        if self.cpu:
            args += CPU_ARGS
        return args + list(self.extra_args)


class EngineProcess:
    """One SGLang server. ``start()`` blocks until ``/health`` answers or raises EngineStartError."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._activation: Path | None = None  # a standby's (start_standby)
        self._standby_ready: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 300.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"engine on port {self.config.port} is already running (pid {self._proc.pid})")
        if not _port_free(self.config.host, self.config.port):
            raise EngineStartError(f"port {self.config.port} is already in use; is an old engine still running?")
        self._launch({})
        self._wait_until_ours(timeout_s)

    def start_standby(self, activation: Path, niceness: int = 10) -> None:
        """Launch a warm standby and return at once: it loads the model and starts its scheduler (at `niceness`,
        so that it yields the CPU to engines that serve), then waits, with no HTTP port bound, for `activate`.
        `config.port` is not bound by a standby; the port SGLang derives its other ports from is still its own."""
        activation.unlink(missing_ok=True)
        self._standby_ready = activation.with_name(activation.name + ".ready")
        self._standby_ready.unlink(missing_ok=True)
        self._activation = activation
        self._launch({STANDBY_FILE_ENV: str(activation)}, prefix=("nice", "-n", str(niceness)))

    def standby_ready(self) -> bool:
        """The standby has started everything but its HTTP server; raises if it died on the way."""
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            log = self.config.log_path or default_log_path(self.config.port)
            raise EngineStartError(f"standby engine exited with {code} before it was ready; log {log}:\n{_tail(log)}")
        return self._standby_ready is not None and self._standby_ready.exists()

    def activate(self, port: int, timeout_s: float = 300.0) -> None:
        """Serve on `port`: the standby binds it, runs SGLang's warmup and answers as this process. Its priority
        goes back to normal first (as root; elsewhere it stays niced, slower but correct)."""
        import psutil

        assert self._activation is not None, "activate() is for an engine started with start_standby()"
        if not _port_free(self.config.host, port):
            raise EngineStartError(f"port {port} is already in use; is an old engine still running?")
        for pid in self.process_ids():
            try:
                psutil.Process(pid).nice(0)
            except (psutil.Error, OSError):
                pass
        self.config.port = port
        staged = self._activation.with_name(self._activation.name + ".tmp")
        staged.write_text(str(port))
        staged.replace(self._activation)
        self._wait_until_ours(timeout_s)

    def adopt(self, standby: EngineProcess, timeout_s: float = 300.0) -> None:
        """Replace this (stopped or killed) engine by `standby`, activated on this engine's port: a new process
        and a new incarnation on the same address, as a supervisor restarting it would give."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"engine on port {self.config.port} is still running (pid {self._proc.pid})")
        standby.activate(self.config.port, timeout_s)
        self._close_log()
        self._proc, self._log_file = standby._proc, standby._log_file
        self.config.log_path = standby.config.log_path
        standby._proc = standby._log_file = None

    def _launch(self, extra_env: dict[str, str], prefix: Sequence[str] = ()) -> None:
        cpu_threads = self.config.cpu_threads if self.config.cpu else None
        threads = {"OMP_NUM_THREADS": str(cpu_threads)} if cpu_threads else {}
        env = {**os.environ, **threads, **self.config.env, **extra_env, PATCHES_ENV: ",".join(self.config.patches),
               EXIT_WITH_PARENT_ENV: "1"}  # a killed owner (no cleanup ran) must not leave the engine running
        env.setdefault("PYTHONUNBUFFERED", "1")
        log_path = self.config.log_path or default_log_path(self.config.port)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._proc = subprocess.Popen(
            [*prefix, *self.config.command()],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def _wait_until_ours(self, timeout_s: float) -> None:
        log_path = self.config.log_path or default_log_path(self.config.port)
        try:
            self._wait_healthy(timeout_s, log_path)
        except BaseException:
            # Our own session (start_new_session) means no signal to us reaches the server: a caller
            # interrupted while waiting (Ctrl-C, SIGTERM, a failed sibling) must not leave it running.
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float, log_path: Path) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise EngineStartError(
                        f"engine on port {self.config.port} exited with {self._proc.returncode} during start; "
                        f"log {log_path}:\n{_tail(log_path)}"
                    )
                try:
                    if self._answers_as_ours(client):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise EngineStartError(
            f"engine on port {self.config.port} not healthy after {timeout_s:.0f}s; log {log_path}:\n{_tail(log_path)}"
        )

    def _answers_as_ours(self, client: httpx.Client) -> bool:
        """Healthy, and (where the status endpoint exists) served by the process we started, not by
        a stale server still holding the port."""
        if client.get(f"{self.url}/health").status_code != 200:
            return False
        if "introspection" not in self.config.patches:
            return True
        assert self._proc is not None
        return bool(client.get(f"{self.url}{STATUS_PATH}").json()["pid"] == self._proc.pid)

    def process_ids(self) -> list[int]:
        """The server pid and every descendant: the scheduler and the detokenizer (on a CPU host, with the fork server
        they were forked from: sglang_patches/cpu_compat.py) and multiprocessing's resource tracker."""
        import psutil

        if self._proc is None or self._proc.poll() is not None:
            return []
        root = psutil.Process(self._proc.pid)
        return [root.pid, *(child.pid for child in root.children(recursive=True))]

    def kill_hard(self) -> None:
        """SIGKILL the server and its children, like a crash (no graceful shutdown)."""
        for pid in self.process_ids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._proc is not None:
            self._proc.wait(timeout=30)
        self._close_log()

    def stop(self, grace_s: float = 20.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive the server briefly; the group id is the server pid.
        _signal_group(self._proc.pid, signal.SIGKILL)
        if self._proc.poll() is None:
            self._proc.wait(timeout=30)
        self._close_log()

    def restart(self, timeout_s: float = 300.0) -> None:
        self.stop()
        self._proc = None
        self.start(timeout_s)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(configs: list[EngineConfig]) -> list[EngineProcess]:
    """Start engines in parallel (each start is mostly waiting); if one fails, stop all and raise."""
    import threading

    engines = [EngineProcess(config) for config in configs]
    errors: list[BaseException] = []

    def start(engine: EngineProcess) -> None:
        try:
            engine.start()
        except BaseException as exc:  # re-raised below, after every start finished
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for engine in engines:
            engine.stop()
        raise errors[0]
    return engines


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port_block(size: int = 20, host: str = "127.0.0.1") -> int:
    """A base port with `size` free ports above it (SGLang takes a few ports next to --port).

    Drawn below the kernel's ephemeral range, between SGLang's own draws (22000-29999, its
    `get_free_port_below_ephemeral`) and that range: a port from `bind(0)` is ephemeral, and while an
    engine restarts on its port (stopped, then ~60 s of start before uvicorn binds) any outgoing
    connection on the host may be handed the same port, and the restarted server fails with
    `[Errno 98] address already in use` (seen in a clean-clone CI run, on port 46477)."""
    low, high = 30000, _ephemeral_low() - 1 - size
    if high <= low:  # an unusual ephemeral range: fall back to the kernel's choice
        low, high = 1024, 65000 - size
    for _ in range(200):
        base = random.randint(low, high)
        # Blocks drawn for engines started together (start_all) are all drawn before any engine binds, so
        # "free" cannot tell them apart: keep clear of the blocks handed out last as well.
        if any(abs(base - earlier) < size for earlier in _recent_blocks):
            continue
        if all(_port_free(host, base + offset) for offset in range(size)):
            _recent_blocks.append(base)
            return base
    raise RuntimeError("no free port block")


_recent_blocks: collections.deque[int] = collections.deque(maxlen=16)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        # SO_REUSEADDR like uvicorn: a port left in TIME_WAIT by a killed server is free for a
        # restart; only a live listener makes the bind fail.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"
