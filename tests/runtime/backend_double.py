"""A scripted double of the engine-facing `GenerationBackend` port.

Used where a real engine cannot produce the case on demand (fault injection): an unknown outcome or
a 5xx for one exact rid, a response held back until after its session closed. Tokens are a
deterministic function of (lora_path, context), emitted one at a time so an abort cuts a generation
short and the call returns its partial output with finish_reason "abort", as SGLang does.

Tests that use it say `injected` in their names; `test_backend_double_conformance.py` holds it to a real engine
on every operation they use."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

from versioned_lora.runtime.interfaces import (
    BackendFailure,
    BackendRequest,
    BackendResponse,
    OutcomeUnknown,
)

Fault = Callable[[BackendRequest], str | None]  # "5xx" | "unknown" | None


def token(lora_path: str, context: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{lora_path}|{context[-4:]}|{len(context)}".encode()).digest()
    return int.from_bytes(digest[:2], "little") % 500 + 1


class ScriptedBackend:
    def __init__(self, token_delay_s: float = 0.0005, fault: Fault | None = None) -> None:
        self.token_delay_s = token_delay_s
        self.fault = fault
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
        return BackendResponse(request.rid, tuple(out), tuple(-1.0 for _ in out), "length")

    async def abort(self, rid: str) -> None:
        self.aborts.append(rid)
        self._aborted.add(rid)

    def lora_paths_of(self, rid_prefix: str) -> set[str]:
        return {c.lora_path for c in self.calls if c.rid.startswith(rid_prefix)}
