"""The staging channel: the server process calls `scheduler_side.StashStore` in the scheduler process.

The stash of a candidate lives in the scheduler process (where the torch.distributed group and, on a
GPU, the model's device are); the engine-side machine lives in the server. The channel is a ZMQ
ROUTER socket served by a thread of its own in the scheduler process, and a DEALER socket on the
server's event loop. Requests are ``[call id, JSON {"method", "payload"}]``; replies
``[call id, JSON {"ok", "result" | "error"}]``.

Why not SGLang's own scheduler IPC (a request type routed by the scheduler's dispatcher, which this
module replaced): the scheduler reads its control requests only between two forward passes, so under
decode load every call waited for the batch in flight, up to a whole prefill (measured: 0.1-0.8 s a
call, ~7 calls a publication, while the stock load and the probe take two). Staging touches neither
the model nor the scheduler's state, only its own buffers and groups, so it needs no place in that
loop. Only the load of a verified candidate goes through the scheduler (SGLang's own load path).

The address is chosen by the server process before it spawns the scheduler (a Unix socket in a
private directory, named in the environment the child inherits), so each engine incarnation has its
own channel.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from versioned_lora.spec.wire import STAGING_ADDRESS_ENV

logger = logging.getLogger(__name__)

ADDRESS_ENV = STAGING_ADDRESS_ENV
# A call the scheduler process never answers (it died, or hangs) fails after this long; what it held
# stays held (the caller reports an unknown outcome, never a success).
CALL_TIMEOUT_S = 60.0
SLOW_CALL_S = 0.05


class SchedulerCallFailed(Exception):
    """A staging call raised in the scheduler process, or got no answer in time."""


def choose_address() -> str:
    """Server process, before launch: name this engine's channel for the scheduler it will spawn.

    A socket file in a fresh directory only this user can enter: the channel carries no token, so
    filesystem permissions are what keep other users' processes off it (an abstract socket has none).
    The directory is removed at exit; one left by a server killed outright (its name holds that server's pid)
    is removed by the next server that finds its pid gone."""
    _remove_dead_servers_directories()
    directory = tempfile.mkdtemp(prefix=f"{_DIRECTORY_PREFIX}{os.getpid()}-")  # mode 0700
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    address = f"ipc://{directory}/channel.sock"
    os.environ[ADDRESS_ENV] = address
    return address


_DIRECTORY_PREFIX = "versioned-lora-staging-"


def _remove_dead_servers_directories() -> None:
    for directory in Path(tempfile.gettempdir()).glob(f"{_DIRECTORY_PREFIX}*-*"):
        pid = directory.name.removeprefix(_DIRECTORY_PREFIX).split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            mine = directory.stat().st_uid == os.getuid()
        except FileNotFoundError:
            # Gone since the listing: two engines starting together both sweep, and one removed it
            # first (seen in a test run: the other engine failed to start), or its owner exited.
            continue
        if mine and not psutil.pid_exists(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)


def _address() -> str:
    address = os.environ.get(ADDRESS_ENV)
    if not address:
        raise SchedulerCallFailed(f"{ADDRESS_ENV} is not set: the managed patch set did not run in the server")
    return address


# ---------------------------------------------------------------- scheduler process


Dispatch = Callable[[str, dict[str, Any]], dict[str, Any]]


def serve(dispatch: Dispatch, on_thread_start: Callable[[], None] = lambda: None) -> threading.Thread:
    """Answer calls with `dispatch(method, payload)` from a daemon thread, one call at a time.

    Returns once the socket is bound (a bind error raises here, at scheduler start). Calls are
    serialised on this one thread, so what `dispatch` reaches needs no lock against other calls."""
    import zmq

    bound = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            socket.bind(_address())
            on_thread_start()
        except BaseException as exc:
            failure.append(exc)
            bound.set()
            return
        bound.set()
        while True:
            frames = socket.recv_multipart()
            if len(frames) != 3:  # not our client's [call id, request]: no caller to answer
                logger.warning("versioned-lora staging channel: dropped a message of %d frames", len(frames))
                continue
            identity, call_id, raw = frames
            socket.send_multipart([identity, call_id, _answer(dispatch, raw)])

    thread = threading.Thread(target=run, name="vlora-staging-channel", daemon=True)
    thread.start()
    bound.wait()
    if failure:
        raise failure[0]
    return thread


def _answer(dispatch: Dispatch, raw: bytes) -> bytes:
    started = time.perf_counter()
    method = "?"
    try:
        request = json.loads(raw)
        method = str(request["method"])
        result = dispatch(method, request["payload"])
        return json.dumps({"ok": True, "result": result}).encode()
    except Exception as exc:
        logger.exception("versioned-lora staging call %s failed", method)
        return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode()
    finally:
        elapsed = time.perf_counter() - started
        if elapsed > SLOW_CALL_S:
            logger.warning("versioned-lora staging call %s took %.3fs", method, elapsed)


# ---------------------------------------------------------------- server process


class _Client:
    """One DEALER socket on the server's event loop; concurrent calls matched to replies by id."""

    def __init__(self, address: str) -> None:
        import zmq
        import zmq.asyncio

        self.address = address
        self.loop = asyncio.get_running_loop()
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count()
        self._waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self._reader = self.loop.create_task(self._read())

    async def _read(self) -> None:
        while True:
            call_id, raw = await self._socket.recv_multipart()
            future = self._waiting.get(call_id)
            if future is not None and not future.done():  # a late answer to a call that timed out: dropped
                future.set_result(raw)

    async def call(self, method: str, timeout_s: float, payload: dict[str, Any]) -> dict[str, Any]:
        call_id = str(next(self._ids)).encode()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            await self._socket.send_multipart([call_id, json.dumps({"method": method, "payload": payload}).encode()])
            raw = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise SchedulerCallFailed(f"{method}: no answer from the scheduler process in {timeout_s}s") from None
        finally:
            self._waiting.pop(call_id, None)
        reply = json.loads(raw)
        if not reply["ok"]:
            raise SchedulerCallFailed(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply["result"]
        return result


_client: _Client | None = None


async def call(method: str, /, **payload: Any) -> dict[str, Any]:
    """Call `StashStore.<method>(**payload)` in the scheduler process and return its JSON answer (a call
    the scheduler process does not answer in `CALL_TIMEOUT_S` raises `SchedulerCallFailed`)."""
    global _client
    address = _address()
    if _client is None or _client.address != address or _client.loop is not asyncio.get_running_loop():
        _client = _Client(address)  # the server has one loop and one address; tests may have several
    return await _client.call(method, CALL_TIMEOUT_S, payload)


async def poll(
    method: str,
    /,
    done: Callable[[dict[str, Any]], bool],
    deadline_s: float,
    first_interval_s: float = 0.001,
    max_interval_s: float = 0.02,
    **payload: Any,
) -> dict[str, Any] | None:
    """Call `method` until `done(answer)` or the deadline passes (then None).

    The interval doubles from `first_interval_s` up to `max_interval_s`: a bucket that lands within
    milliseconds is seen within milliseconds, while a stalled one costs the scheduler process at most
    50 wake-ups a second. (Every answer wakes a thread there; on a small CPU box each wake-up can preempt
    one of the forward pass's OpenMP threads, so a fixed 2 ms poll measurably slowed decode.)"""
    deadline = time.monotonic() + deadline_s
    interval = first_interval_s
    while True:
        answer = await call(method, **payload)
        if done(answer):
            return answer
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval)
        interval = min(2 * interval, max_interval_s)
