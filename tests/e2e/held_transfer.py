"""A staging port that holds its transfer after a bucket (an injected fault, test-only): a real engine cannot be made
to stop an exact bucket into an attempt on demand, so the publisher's side of the link stops there instead, and the
test kills what it needs to while the attempt is mid-transfer. Every other call goes to the real port it wraps."""

from __future__ import annotations

import asyncio
from typing import Any

from versioned_lora.adapters.engine_staging import EngineStaging


class HeldAfterBucket:
    def __init__(self, inner: EngineStaging, after: int | None) -> None:
        self.inner = inner
        self.after = after  # hold once this bucket index was sent (None: hold nothing)
        self.held = asyncio.Event()

    async def transfer_bucket(self, candidate: Any, attempt_token: str, index: int) -> None:
        await self.inner.transfer_bucket(candidate, attempt_token, index)
        if self.after is not None and index >= self.after:
            self.held.set()
            await asyncio.Event().wait()  # held until the caller cancels (the test kills the engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
