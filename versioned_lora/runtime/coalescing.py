"""Pack concurrent session calls into registry batches, so a session shard with thousands of sessions
costs one registry call (one fsync) per up to MAX_BATCH binds or closes.

While one batch is in flight, new calls queue; when it returns, the queue goes out as the next batch.
A lone call therefore waits for no timer, and under load batches fill up by themselves.

Only session events are coalesced (OpenSession, BindFirst, BeginClose, CloseAndRelease). A batch has
its own idempotency key, so a caller's per-call key is not kept; that is safe for exactly these events
because the table makes them idempotent per session (a repeated bind returns the same binding, a
repeated close releases nothing). Publication and reclaim events go through unchanged, with their keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence

from versioned_lora.lifecycle import (
    BeginClose,
    BindFirst,
    CloseAndRelease,
    OpenSession,
    ProtocolError,
    RegistryEvent,
    VersionKey,
    VersionState,
)
from versioned_lora.runtime.interfaces import MAX_BATCH, RegistryAnswer, RegistryPort
from versioned_lora.runtime.views import DispatchView

SESSION_EVENTS = (OpenSession, BindFirst, BeginClose, CloseAndRelease)


class CoalescingRegistry:
    """A `RegistryPort` in front of another one."""

    def __init__(self, inner: RegistryPort, max_batch: int = MAX_BATCH) -> None:
        self._inner = inner
        self._max_batch = min(max_batch, MAX_BATCH)
        self._pending: list[tuple[RegistryEvent, asyncio.Future[RegistryAnswer]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches_sent = 0

    async def submit(self, event: RegistryEvent, key: str | None = None) -> RegistryAnswer:
        if not isinstance(event, SESSION_EVENTS):
            return await self._inner.submit(event, key)
        future: asyncio.Future[RegistryAnswer] = asyncio.get_running_loop().create_future()
        self._pending.append((event, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._drain())
        return await future

    async def submit_batch(
        self, events: Sequence[RegistryEvent], key: str | None = None
    ) -> tuple[RegistryAnswer, ...]:
        return await self._inner.submit_batch(events, key)

    async def version_states(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, VersionState]:
        return await self._inner.version_states(versions)

    async def key_ids(self) -> tuple[str, ...]:
        return await self._inner.key_ids()

    async def dispatch_view(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, DispatchView]:
        return await self._inner.dispatch_view(versions)

    async def state_digest(self) -> str:
        return await self._inner.state_digest()

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            events = [event for event, _ in batch]
            try:
                answers = await self._inner.submit_batch(events)
                self.batches_sent += 1
            except ProtocolError:
                # A batch is atomic, so one buggy event would fail its neighbours: send each alone.
                await self._one_by_one(batch)
                continue
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), answer in zip(batch, answers, strict=True):
                if not future.done():  # a cancelled waiter just does not get its answer
                    future.set_result(answer)

    async def _one_by_one(self, batch: list[tuple[RegistryEvent, asyncio.Future[RegistryAnswer]]]) -> None:
        for event, future in batch:
            try:
                answer = await self._inner.submit(event)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(answer)
