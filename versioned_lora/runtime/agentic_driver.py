"""A small agentic session driver that behaves like Relax's session service, on top of SessionBinder.

Each session: first generation (binds the version) → tool turn (the tool's tokens are appended) →
next generation … → finish. Along the way, the driver does what the agentic layer owns (RFC §4.2):

* retries a generation only after a *known* failure (`BackendFailure`), as a new attempt with a new rid;
* on an *unknown* outcome it never resends: it first resolves the attempt (abort by rid), then retries;
* a temporary abort (Relax's partial rollout) cuts a generation short; the resume continues from the
  prefix plus the partial output, on the same lora_path (the binding never changes).

The engine call is the `GenerationBackend` port: SGLang engines in end-to-end runs, a scripted double
in unit tests. Every rid is `<session_id>/t<turn>/a<attempt>` so tests and logs can name attempts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import attrs

from versioned_lora.lifecycle import SessionKey, VersionKey
from versioned_lora.runtime.interfaces import BackendFailure, BackendResponse, OutcomeUnknown
from versioned_lora.runtime.session_binder import CloseReport, SessionBinder

Tool = Callable[[str, int, tuple[int, ...]], Awaitable[tuple[int, ...]]]


async def echo_tool(session_id: str, turn: int, context: tuple[int, ...]) -> tuple[int, ...]:
    """A deterministic stand-in tool: returns a few tokens derived from the turn and the last token."""
    last = context[-1] if context else 0
    return tuple((last * 7 + turn * 13 + i) % 500 + 1 for i in range(3))


@attrs.frozen
class SessionScript:
    session_id: str
    prompt: tuple[int, ...]
    turns: int = 3  # generations; a tool turn sits between consecutive ones
    max_new_tokens: int = 8
    max_retries: int = 2  # retries per turn after known failures or resolved unknown outcomes
    abort_resume_turn: int | None = None  # this turn is aborted once mid-generation, then resumed
    abort_after_s: float = 0.005


@attrs.frozen
class Attempt:
    turn: int
    rid: str
    kind: str  # "generate" | "retry" | "resume"
    version: VersionKey
    lora_path: str
    prefix_len: int
    outcome: str  # "ok" | "aborted" | "failed" | "unknown"
    output_ids: tuple[int, ...] = ()


@attrs.frozen
class SessionTranscript:
    session_id: str
    key: SessionKey
    version: VersionKey | None
    lora_paths: frozenset[str]  # every lora_path this session's requests carried (exactly one)
    attempts: tuple[Attempt, ...]
    token_ids: tuple[int, ...]  # prompt + every generation + every tool result
    close: CloseReport
    error: str | None = None


class TurnFailed(Exception):
    pass


class AgenticDriver:
    def __init__(self, binder: SessionBinder, tool: Tool = echo_tool) -> None:
        self.binder = binder
        self.tool = tool

    async def run(self, scripts: Sequence[SessionScript], concurrency: int = 16) -> list[SessionTranscript]:
        limit = asyncio.Semaphore(concurrency)

        async def one(script: SessionScript) -> SessionTranscript:
            async with limit:
                return await self.run_session(script)

        return list(await asyncio.gather(*(one(script) for script in scripts)))

    async def run_session(self, script: SessionScript) -> SessionTranscript:
        key = self.binder.open(script.session_id)
        attempts: list[Attempt] = []
        ids = list(script.prompt)
        error: str | None = None
        try:
            for turn in range(script.turns):
                ids.extend(await self._turn(key, script, turn, tuple(ids), attempts))
                if turn + 1 < script.turns:
                    ids.extend(await self.tool(script.session_id, turn, tuple(ids)))
        except Exception as exc:  # the session ends with an error; it is still finished exactly once
            error = f"{type(exc).__name__}: {exc}"
        finally:
            close = await self.binder.finish(key)
        return SessionTranscript(
            session_id=script.session_id,
            key=key,
            version=attempts[0].version if attempts else None,
            lora_paths=frozenset(a.lora_path for a in attempts),
            attempts=tuple(attempts),
            token_ids=tuple(ids),
            close=close,
            error=error,
        )

    async def _turn(
        self, key: SessionKey, script: SessionScript, turn: int, prefix: tuple[int, ...], attempts: list[Attempt]
    ) -> tuple[int, ...]:
        produced: tuple[int, ...] = ()
        kind = "generate"
        retries = 0
        abort_pending = script.abort_resume_turn == turn
        attempt_no = 0
        while len(produced) < script.max_new_tokens:
            rid = f"{script.session_id}/t{turn}/a{attempt_no}"
            attempt_no += 1
            context = prefix + produced
            binding = await self.binder.bind_first(key)
            call = asyncio.create_task(
                self.binder.generate(key, context, script.max_new_tokens - len(produced), rid=rid)
            )
            if abort_pending:
                abort_pending = False
                await asyncio.sleep(script.abort_after_s)
                await self.binder.abort(key, rid)  # temporary abort: binding and session ref are kept
            try:
                response: BackendResponse = await call
            except BackendFailure:
                attempts.append(Attempt(turn, rid, kind, binding.version, binding.lora_path, len(context), "failed"))
                retries += 1
                if retries > script.max_retries:
                    raise TurnFailed(f"turn {turn}: out of retries") from None
                kind = "retry"
                continue
            except OutcomeUnknown:
                attempts.append(Attempt(turn, rid, kind, binding.version, binding.lora_path, len(context), "unknown"))
                # Never resend blindly: end the attempt on the engine first; then it is a known failure.
                await self.binder.resolve_unknown(key, rid)
                retries += 1
                if retries > script.max_retries:
                    raise TurnFailed(f"turn {turn}: out of retries") from None
                kind = "retry"
                continue
            produced += response.output_ids
            aborted = response.finish_reason == "abort"
            outcome = "aborted" if aborted else "ok"
            attempts.append(
                Attempt(turn, rid, kind, binding.version, binding.lora_path, len(context), outcome,
                        response.output_ids)
            )
            if not aborted:
                break
            kind = "resume"
        return produced
