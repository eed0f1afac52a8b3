"""`GenerationBackend` over SGLang engines: the runtime's engine-facing port, implemented with the async
HTTP client. Sends each request once; a timeout or lost connection is `OutcomeUnknown`, an error status
`BackendFailure`. Requests of one session go to one engine (sticky by the rid's session prefix) so its
KV cache is reused; the router never changes `lora_path`."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient, UnknownOutcome
from versioned_lora.runtime.interfaces import BackendFailure, BackendRequest, BackendResponse, OutcomeUnknown

Route = Callable[[BackendRequest], int]


def sticky_by_session(engines: int) -> Route:
    """The engine index from the rid's session prefix (`<session_id>/...`), stable across processes."""
    return lambda request: zlib.crc32(request.rid.split("/", 1)[0].encode()) % engines


class SGLangBackend:
    def __init__(self, clients: Sequence[SGLangClient], route: Route | None = None) -> None:
        if not clients:
            raise ValueError("at least one engine client is needed")
        self._clients = tuple(clients)
        self._route = route or sticky_by_session(len(self._clients))
        self._engine_of: dict[str, SGLangClient] = {}  # rid -> the engine it went to (for abort)

    async def generate(self, request: BackendRequest) -> BackendResponse:
        client = self._clients[self._route(request)]
        self._engine_of[request.rid] = client
        sampling = dict(request.sampling)
        temperature = float(sampling.pop("temperature", 0.0))
        try:
            generation = await client.generate(
                request.input_ids, request.lora_path, request.max_new_tokens,
                temperature=temperature, rid=request.rid, extra_sampling=sampling,
            )
        except UnknownOutcome as exc:
            raise OutcomeUnknown(str(exc)) from exc
        except EngineHTTPError as exc:
            self._engine_of.pop(request.rid, None)
            raise BackendFailure(str(exc), exc.status_code) from exc
        self._engine_of.pop(request.rid, None)
        finish = generation.finish_reason
        finish_type = finish.get("type", "stop") if isinstance(finish, dict) else str(finish or "stop")
        return BackendResponse(
            request.rid, tuple(generation.output_ids), tuple(generation.logprobs), finish_type,
            generation.cached_tokens,
        )

    async def abort(self, rid: str) -> None:
        clients = [self._engine_of[rid]] if rid in self._engine_of else list(self._clients)
        try:
            for client in clients:  # unknown engine (e.g. after a restart of this process): ask every one
                await client.abort_request(rid)
        except UnknownOutcome as exc:
            raise OutcomeUnknown(str(exc)) from exc
        except EngineHTTPError as exc:
            raise BackendFailure(str(exc), exc.status_code) from exc
