"""A warm standby for the session's default engines: a killed or restarted engine is replaced in seconds, not
re-started cold (25-60 s on this 2-core host).

The pool keeps one standby engine of the session's default configuration: a real SGLang process, started at
lower CPU priority (`nice 10`) with its model loaded and its scheduler running, waiting with no HTTP port bound
(`EngineProcess.start_standby`). A test that restarts one of the session's engines (`engines.e1.restart()`,
after a real `kill -9` or a stop) gets the standby, activated on the engine's own port: a new process and a new
incarnation on the same address, as a supervisor restarting the engine would give. The pool then launches the
next standby at once, one at a time: at most one standby exists, so the suite holds at most one engine more
than before. What the standbys cost (their CPU-seconds before they were taken) is counted and printed at the
end of the run, with every cold start a test waited for (`COUNTERS`).

An incarnation is minted when an engine process starts (introspection.INCARNATION, nanoseconds): a standby
launched after the engine it replaces was started, so the replacement's incarnation is the larger, as a restart's
is. Every standby is launched after the previous one was taken and after the session's engines started.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import attrs
import psutil

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, free_port_block


@attrs.define
class Counters:
    cold_starts: int = 0  # engine starts a test (or a fixture) waited for, from nothing
    standby_starts: int = 0  # standbys launched in the background
    standby_takes: int = 0  # restarts served by a standby
    standby_cpu_s: float = 0.0  # CPU-seconds the taken standbys used before they were taken
    take_wait_s: float = 0.0  # time restarts waited for a standby still starting

    def line(self) -> str:
        return (f"engine pool: cold_starts={self.cold_starts} standby_starts={self.standby_starts} "
                f"standby_takes={self.standby_takes} standby_cpu_s={self.standby_cpu_s:.1f} "
                f"take_wait_s={self.take_wait_s:.1f}")


COUNTERS = Counters()

STANDBY_NICENESS = 10


def tree_cpu_seconds(engine: EngineProcess) -> float:
    total = 0.0
    for pid in engine.process_ids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class StandbyPool:
    """One standby at a time, of `template`'s configuration (its port and log path are the standby's own)."""

    def __init__(self, template: EngineConfig, directory: Path) -> None:
        self.template = template
        self.directory = directory
        self._lock = threading.Lock()
        self._standby: EngineProcess | None = None
        self._launched = 0
        self._closed = False

    def refill(self) -> None:
        """Launch the next standby if none is waiting (a launch returns at once: the start runs in the engine)."""
        with self._lock:
            if self._closed or self._standby is not None:
                return
            self._launched += 1
            index = self._launched
            config = attrs.evolve(self.template, port=free_port_block(),
                                  log_path=self.directory / f"standby-{index}.log", env=dict(self.template.env))
            standby = EngineProcess(config)
            standby.start_standby(self.directory / f"standby-{index}.activate", niceness=STANDBY_NICENESS)
            self._standby = standby
            COUNTERS.standby_starts += 1

    def take(self, timeout_s: float = 300.0) -> EngineProcess:
        """The waiting standby once it is ready (it may still be starting); the next one is launched at once."""
        self.refill()
        with self._lock:
            standby, self._standby = self._standby, None
        assert standby is not None, "the pool is closed"
        began = time.monotonic()
        try:
            while not standby.standby_ready():
                if time.monotonic() - began > timeout_s:
                    raise TimeoutError(f"standby engine not ready after {timeout_s:.0f} s: {standby.config.log_path}")
                time.sleep(0.2)
        except BaseException:
            standby.stop()
            raise
        COUNTERS.take_wait_s += time.monotonic() - began
        COUNTERS.standby_cpu_s += tree_cpu_seconds(standby)
        COUNTERS.standby_takes += 1
        return standby

    def close(self) -> None:
        with self._lock:
            self._closed = True
            standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()


class PooledEngine(EngineProcess):
    """One of the session's engines: its first start is cold, every later start (a restart) adopts the pool's
    standby on this engine's port."""

    def __init__(self, config: EngineConfig, pool: StandbyPool) -> None:
        super().__init__(config)
        self.pool = pool
        self._started_once = False

    def start(self, timeout_s: float = 300.0) -> None:
        if not self._started_once:
            super().start(timeout_s)
            self._started_once = True
            return
        self.adopt(self.pool.take(timeout_s), timeout_s)
