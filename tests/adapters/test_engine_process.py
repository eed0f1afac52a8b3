"""The engine launcher: health means *our* process answers; restart, and a killed owner, leave no orphans."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import psutil
import pytest
from engine_pool import COUNTERS

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess, EngineStartError, free_port_block
from versioned_lora.spec.wire import EXIT_WITH_PARENT_ENV


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


def test_a_cpu_engine_forks_its_scheduler_and_detokenizer_from_a_fork_server(engines) -> None:
    """sglang_patches/cpu_compat.py: on a CPU host the server's children are forked from one process that imported
    their modules (multiprocessing's fork server), not spawned from a fresh interpreter each; they are the
    engine's processes all the same (process_ids, and so kill_hard, reach them)."""
    processes = [psutil.Process(pid) for pid in engines.e0.process_ids()]
    children = {" ".join(p.cmdline()): p for p in processes}
    for title in ("sglang::scheduler", "sglang::detokenizer"):
        (child,) = [p for line, p in children.items() if line.startswith(title)]
        parent = child.parent()
        assert parent is not None and "multiprocessing.forkserver" in " ".join(parent.cmdline()), title
        assert parent.pid in engines.e0.process_ids()


def test_a_restart_is_served_by_the_warm_standby_a_real_process_on_the_same_port(engines) -> None:
    """The suite's pool (tests/engine_pool.py): a kill -9 and a restart give a new process, a new and larger
    incarnation and the same address, and the standby that served it had bound no port before it was taken."""
    engine = engines.e1
    before = _status(engine.url)
    takes = COUNTERS.standby_takes
    engine.kill_hard()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{engine.url}/health", timeout=5)
    engine.restart()
    after = _status(engine.url)
    assert COUNTERS.standby_takes == takes + 1
    assert after["pid"] == engine.pid != before["pid"]
    assert after["incarnation"] > before["incarnation"]
    assert psutil.Process(engine.pid).nice() == 0  # back to normal priority once it serves
    assert engine.config.log_path is not None and "standby" in engine.config.log_path.name


def test_a_standby_binds_no_port_until_it_is_activated(standby_pool, fixtures) -> None:
    standby = standby_pool.take()
    try:
        listening = {c.laddr.port for pid in standby.process_ids()
                     for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert standby.config.port not in listening  # no HTTP server yet
        assert psutil.Process(standby.pid).nice() == 10
        port = free_port_block()
        standby.activate(port)
        assert _status(standby.url)["pid"] == standby.pid and standby.config.port == port
    finally:
        standby.stop()


def test_start_refuses_a_port_held_by_another_server(engines, fixtures) -> None:
    squatter = EngineProcess(EngineConfig(model_dir=fixtures.model_dir, port=engines.e0.config.port))
    with pytest.raises(EngineStartError, match="already in use"):
        squatter.start(timeout_s=5)


def test_engines_are_started_to_exit_with_their_parent(engines) -> None:
    environ = psutil.Process(engines.e0.pid).environ()
    assert environ.get(EXIT_WITH_PARENT_ENV) == "1"


# A stand-in for the engine's server: leads its own process group (as EngineProcess starts it), arms the watch,
# starts a child in its group (as the scheduler is), then waits.
_SERVER = """
import os, subprocess, sys, time
from versioned_lora.sglang_patches.server import exit_with_parent
exit_with_parent()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(os.getpid(), child.pid, flush=True)
time.sleep(600)
"""
# The engine's owner (a test run, the CLI): starts the server in a session of its own and reports its pids.
_OWNER = f"""
import subprocess, sys
server = subprocess.Popen([sys.executable, "-c", {_SERVER!r}], stdout=subprocess.PIPE, start_new_session=True)
print(server.stdout.readline().decode().strip(), flush=True)
server.wait()
"""


def test_a_killed_owner_takes_its_engine_process_group_down() -> None:
    """SIGKILL of the owner runs none of its cleanup; the server notices it was re-parented and stops its group."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE)
    assert owner.stdout is not None
    server_pid, child_pid = (int(p) for p in owner.stdout.readline().split())
    assert psutil.pid_exists(server_pid) and psutil.pid_exists(child_pid)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 30
    alive = [server_pid, child_pid]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        time.sleep(0.2)
    assert alive == []


def test_engine_ports_are_drawn_below_the_ephemeral_range_so_a_restart_finds_its_port_unclaimed() -> None:
    # A port from bind(0) is ephemeral: while an engine restarts on it, any outgoing connection on the
    # host may be handed the same port (a clean-clone CI run saw Errno 98 on port 46477 this way).
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    bases = [free_port_block() for _ in range(50)]
    assert all(base >= 30000 and base + 20 < ephemeral_low for base in bases), bases
    assert len(set(bases)) > 1  # drawn, not one fixed port that parallel runs would share
    for i, base in enumerate(bases):  # blocks drawn back to back (engines started together) never overlap
        assert all(abs(base - other) >= 20 for other in bases[max(0, i - 15) : i]), (i, bases)
