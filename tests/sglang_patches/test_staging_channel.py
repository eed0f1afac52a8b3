"""The staging channel on its own (no engine): real ZMQ sockets, a real serving thread.

The engines' staging tests (test_staged_publication.py and the e2e tests) run every staging call
through it; these pin the channel's own contract: answers matched to concurrent calls, a raising call
reported as a typed failure, and a call nobody answers failing after the timeout instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from versioned_lora.sglang_patches.managed import staging_channel
from versioned_lora.sglang_patches.managed.staging_channel import SchedulerCallFailed


@pytest.fixture
def address(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(staging_channel.ADDRESS_ENV, raising=False)
    return staging_channel.choose_address()  # sets the environment, as the server does before launch


def test_concurrent_calls_get_their_own_answers_and_errors_are_typed(address: str) -> None:
    served_on: list[str] = []

    def dispatch(method: str, payload: dict[str, Any]) -> dict[str, Any]:
        served_on.append(threading.current_thread().name)
        if method == "boom":
            raise KeyError("no such attempt")
        if method == "slow":
            time.sleep(0.2)
        return {"method": method, **payload}

    staging_channel.serve(dispatch)

    async def scenario() -> list[Any]:
        slow = asyncio.create_task(staging_channel.call("slow", n=0))
        quick = [staging_channel.call("echo", n=i) for i in range(1, 20)]
        answers = await asyncio.gather(slow, *quick)
        with pytest.raises(SchedulerCallFailed, match="boom: KeyError: 'no such attempt'"):
            await staging_channel.call("boom")
        return answers

    answers = asyncio.run(scenario())
    assert answers == [{"method": "slow", "n": 0}] + [{"method": "echo", "n": i} for i in range(1, 20)]
    assert set(served_on) == {"vlora-staging-channel"}


def test_a_call_nobody_answers_fails_after_the_timeout(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_channel, "CALL_TIMEOUT_S", 0.3)
    started = time.monotonic()
    with pytest.raises(SchedulerCallFailed, match="no answer from the scheduler process"):
        asyncio.run(staging_channel.call("status"))  # no scheduler serves this address
    assert 0.3 <= time.monotonic() - started < 5


def test_serve_reports_a_bind_failure_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(staging_channel.ADDRESS_ENV, f"ipc://{tmp_path}/no-such-directory/channel.sock")
    with pytest.raises(Exception, match="No such file or directory"):
        staging_channel.serve(lambda method, payload: {})


def test_the_socket_is_private_and_a_stray_message_does_not_stop_the_channel(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zmq

    monkeypatch.setattr(staging_channel, "CALL_TIMEOUT_S", 5.0)  # a dead channel fails the call, not the suite

    directory = Path(address.removeprefix("ipc://")).parent
    assert directory.stat().st_mode & 0o077 == 0  # other users cannot reach the socket

    staging_channel.serve(lambda method, payload: {"method": method})
    stray = zmq.Context.instance().socket(zmq.DEALER)
    stray.connect(address)
    stray.send_multipart([b"only one frame besides the identity", b"x", b"y"])  # four frames at the ROUTER
    stray.close(linger=1000)
    assert asyncio.run(staging_channel.call("still_answering")) == {"method": "still_answering"}


def test_poll_stops_at_the_deadline(address: str) -> None:
    calls: list[int] = []

    def dispatch(method: str, payload: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        return {"state": "PENDING"}

    staging_channel.serve(dispatch)
    answer = asyncio.run(staging_channel.poll("poll_receive", lambda a: a["state"] != "PENDING", 0.1, index=0))
    assert answer is None
    assert len(calls) >= 2


def test_a_directory_left_by_a_killed_server_is_removed_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server killed outright never runs its exit handler; its directory names its pid, and the next server
    to choose an address removes it once that pid is gone. A live server's directory stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = Path(tempfile.mkdtemp(prefix=f"versioned-lora-staging-{dead.pid}-"))
    (left / "channel.sock").touch()
    monkeypatch.delenv(staging_channel.ADDRESS_ENV, raising=False)
    mine = Path(staging_channel.choose_address().removeprefix("ipc://")).parent
    assert not left.exists()
    monkeypatch.delenv(staging_channel.ADDRESS_ENV, raising=False)
    staging_channel.choose_address()
    assert mine.exists() and mine.name.startswith(f"versioned-lora-staging-{os.getpid()}-")


def test_a_directory_that_vanishes_during_the_sweep_does_not_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two engines starting together both sweep the directories of dead servers; one may remove a
    directory between the other's listing and its stat. A dangling link stands for that directory
    (listed, gone when looked at); the sweep goes on and still removes a dead server's directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"versioned-lora-staging-{dead.pid}-vanished").symlink_to(tmp_path / "removed-meanwhile")
    left = Path(tempfile.mkdtemp(prefix=f"versioned-lora-staging-{dead.pid}-"))
    monkeypatch.delenv(staging_channel.ADDRESS_ENV, raising=False)
    staging_channel.choose_address()
    assert not left.exists()
