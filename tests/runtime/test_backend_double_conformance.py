"""`ScriptedBackend` (backend_double.py) held to a real engine: the same sequence of calls, sent to the double
and to `SGLangBackend` over a real patched SGLang engine serving two managed versions, gets the same answers and
refusals, on every operation the `injected` tests use (generate, a 503 for one rid, a lost reply for one rid,
abort of a request in flight, abort of a finished or unknown rid, a continuation of a session's own output).

The double's tokens are a hash of (lora_path, context), not the model's, so "the same answer" is compared as
what the injected tests rely on: the outcome's kind (response, failure with its status, unknown outcome), the
finish reason, how many tokens came back and with a logprob each, whether two versions answer differently,
whether the same request answers the same, and whether a continuation of a session's own output reproduces it.
The double emits every token it is asked for (it never stops at an EOS); the real requests here carry
`ignore_eos`, which is how the injected tests' scenarios read, and the difference is the only one this accepts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from backend_double import ScriptedBackend
from engine_helpers import PROMPT, client_for, managed_view, publish_from_disk, run, wait_until

from versioned_lora.adapters.sglang_backend import SGLangBackend
from versioned_lora.runtime.interfaces import BackendFailure, BackendRequest, GenerationBackend, OutcomeUnknown

FAILING, LOST, LONG = "c/503", "c/lost", "c/long"
LONG_TOKENS = 1900  # in flight for seconds even at the ~400 tokens/s an idle host decodes


class FaultsByRid:
    """The real engine's counterparts of the double's faults, for one rid each: a request that carries a top-level
    `priority` (the test engines run with --abort-on-priority-when-disabled, so SGLang answers 503 from inside the
    request path), and a request whose reply the client stops waiting for (SGLangClient's timeout: the backend's
    OutcomeUnknown). Every other call is the wrapped client's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def generate(self, *args: Any, rid: str | None = None, **kwargs: Any) -> Any:
        if rid == FAILING:
            kwargs["extra_fields"] = {"priority": 1}
        if rid == LOST:
            kwargs["timeout_s"] = 0.01
        return await self.inner.generate(*args, rid=rid, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def double_faults(request: BackendRequest) -> str | None:
    return {FAILING: "5xx", LOST: "unknown"}.get(request.rid)


async def transcript(
    backend: GenerationBackend, a: str, b: str, in_flight: Callable[[str], Awaitable[bool]],
    idle: Callable[[], Awaitable[bool]],
) -> list[tuple[Any, ...]]:
    """The sequence of calls, each answer reduced to what the injected tests rely on."""
    answers: list[tuple[Any, ...]] = []

    async def generate(rid: str, lora_path: str, input_ids: list[int], tokens: int) -> Any:
        request = BackendRequest(rid, tuple(input_ids), lora_path, tokens, {"ignore_eos": True})
        try:
            response = await backend.generate(request)
        except BackendFailure as failure:
            answers.append((rid, "failure", failure.status_code))
            return None
        except OutcomeUnknown:
            answers.append((rid, "unknown"))
            return None
        # How many tokens an abort cuts off at depends on timing: "cut short" below is what is compared for it.
        tokens = None if response.finish_reason == "abort" else len(response.output_ids)
        answers.append((rid, "response", response.finish_reason, tokens,
                        len(response.logprobs) == len(response.output_ids)))
        return response

    first = await generate("c/a1", a, PROMPT, 6)
    again = await generate("c/a2", a, PROMPT, 6)
    other = await generate("c/b1", b, PROMPT, 6)
    answers.append(("same request, same tokens", first.output_ids == again.output_ids))
    answers.append(("other version, other tokens", first.output_ids != other.output_ids))
    continued = await generate("c/a3", a, [*PROMPT, *first.output_ids[:3]], 3)  # a session's next turn
    answers.append(("continuation reproduces", continued.output_ids == first.output_ids[3:]))

    await generate(FAILING, a, PROMPT, 6)
    # Long enough that the client's 0.01 s timeout always fires first: with 6 tokens of a cached prompt the
    # engine once answered inside it (a clean-clone CI run got 'length', 6 tokens, for this rid).
    await generate(LOST, a, PROMPT, LONG_TOKENS)
    await backend.abort(LOST)  # resolving an unknown outcome: harmless whether or not it ran
    answers.append((LOST, "aborted without error"))

    await wait_until(idle, timeout_s=60)  # nothing else of A runs: "in flight" below is the long request
    long = asyncio.create_task(generate(LONG, a, PROMPT, LONG_TOKENS))
    await wait_until(lambda: in_flight(LONG), timeout_s=60)
    await asyncio.sleep(0.3)  # some tokens out, most to come
    await backend.abort(LONG)
    partial = await long
    answers.append((LONG, "cut short", partial is not None and 0 < len(partial.output_ids) < LONG_TOKENS))
    await backend.abort("c/a1")  # a finished rid: harmless
    answers.append(("c/a1", "aborted without error"))
    return answers


def test_scripted_backend_answers_as_a_real_engine_on_every_operation_the_injected_tests_use(
    engines, fixtures
) -> None:
    async def body() -> None:
        async with client_for(engines.e0) as client:
            a = await publish_from_disk(client, fixtures.adapters["A"], "A")
            b = await publish_from_disk(client, fixtures.adapters["B"], "B")
            try:
                real = SGLangBackend([FaultsByRid(client)], names=["E0"])  # type: ignore[list-item]

                async def running_on_engine(rid: str) -> bool:
                    view = await managed_view(client, a.name)
                    return view is not None and int(view["native_refcount"]) == 1

                on_engine = await transcript(real, a.name, b.name, running_on_engine,
                                             lambda: _idle(client, a.name))

                double = ScriptedBackend(token_delay_s=0.005, fault=double_faults)

                async def running_in_double(rid: str) -> bool:
                    return any(call.rid == rid for call in double.calls)

                in_double = await transcript(double, a.name, b.name, running_in_double, _always)
            finally:
                for staged in (a, b):
                    await wait_until(lambda staged=staged: _idle(client, staged.name), timeout_s=60)
                    await client.managed("reclaim", lora_name=staged.name, reclaim_id=f"teardown-{staged.name}",
                                         wait_s=60)
            assert in_double == on_engine
            assert ("c/503", "failure", 503) in on_engine and ("c/lost", "unknown") in on_engine  # the faults ran

    run(body())


async def _always() -> bool:
    return True


async def _idle(client: Any, name: str) -> bool:
    view = await managed_view(client, name)
    return view is None or int(view["native_refcount"]) == 0
