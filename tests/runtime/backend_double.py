"""A scripted double of the engine-facing `GenerationBackend` port.

Used where a real engine cannot produce the case on demand (fault injection): an unknown outcome or
a 5xx for one exact rid, a response held back until after its session closed. Tokens are a
deterministic function of (lora_path, context), emitted one at a time so an abort cuts a generation
short and the call returns its partial output with finish_reason "abort", as SGLang does.

Tests that use it say `injected` in their names; `test_backend_double_conformance.py` holds it to a real engine
on every operation they use."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable

from versioned_lora.runtime.interfaces import (
    BackendFailure,
    BackendRequest,
    BackendResponse,
    OutcomeUnknown,
)

Fault = Callable[[BackendRequest], str | None]  # "5xx" | "unknown" | None
Stall = Callable[[BackendRequest], bool]  # True: the generation waits after its first token until aborted
STALL_LIMIT_S = 30.0  # ... or this long


def token(lora_path: str, context: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{lora_path}|{context[-4:]}|{len(context)}".encode()).digest()
    return int.from_bytes(digest[:2], "little") % 500 + 1


class ScriptedBackend:
    def __init__(self, token_delay_s: float = 0.0005, fault: Fault | None = None, stall: Stall | None = None) -> None:
        self.token_delay_s = token_delay_s
        self.fault = fault
        # A stalled generation is a slow engine on demand: an abort sent "mid-generation" then always
        # finds it running, however late the loaded test machine delivers the abort.
        self.stall = stall
        self._abort_events: dict[str, asyncio.Event] = {}
        self.calls: list[BackendRequest] = []
        self.aborts: list[str] = []
        self.held: dict[str, asyncio.Event] = {}  # rid -> released when set; ignores aborts while held
        self._aborted: set[str] = set()

    async def generate(self, request: BackendRequest) -> BackendResponse:
        self.calls.append(request)
        fault = self.fault(request) if self.fault else None
        if fault == "5xx":
            raise BackendFailure(f"{request.rid}: 503 injected", 503)
        if fault == "unknown":
            raise OutcomeUnknown(f"{request.rid}: reply lost (injected)")
        hold = self.held.get(request.rid)
        if hold is not None:
            await hold.wait()
        context, out = request.input_ids, []
        for _ in range(request.max_new_tokens):
            if request.rid in self._aborted and hold is None:
                # As SGLang: the partial output, a logprob for each token (test_backend_double_conformance.py).
                return BackendResponse(request.rid, tuple(out), tuple(-1.0 for _ in out), "abort")
            await asyncio.sleep(self.token_delay_s)
            out.append(token(request.lora_path, context + tuple(out)))
            if len(out) == 1 and hold is None and self.stall is not None and self.stall(request):
                # Bounded: an abort that never comes (sent before the request was) must not hang the test.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._abort_events.setdefault(request.rid, asyncio.Event()).wait(),
                                           STALL_LIMIT_S)
        return BackendResponse(request.rid, tuple(out), tuple(-1.0 for _ in out), "length")

    async def abort(self, rid: str) -> None:
        self.aborts.append(rid)
        self._aborted.add(rid)
        self._abort_events.setdefault(rid, asyncio.Event()).set()

    def lora_paths_of(self, rid_prefix: str) -> set[str]:
        return {c.lora_path for c in self.calls if c.rid.startswith(rid_prefix)}
