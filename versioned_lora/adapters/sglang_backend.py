"""`GenerationBackend` over SGLang engines: the runtime's engine-facing port, implemented with the async
HTTP client. Sends each request once; a timeout or lost connection is `OutcomeUnknown`, an error status
`BackendFailure`. Requests of one session go to one engine (sticky by the rid's session prefix) so its
KV cache is reused, among the engines the request may go to (`BackendRequest.engines`, the registry's
dispatch view); the router never changes `lora_path`."""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Sequence

from versioned_lora.adapters.sglang_client import EngineHTTPError, SGLangClient, UnknownOutcome
from versioned_lora.runtime.interfaces import BackendFailure, BackendRequest, BackendResponse, OutcomeUnknown
from versioned_lora.spec.reasons import Reason

Route = Callable[[BackendRequest], int]


def sticky_by_session(engines: int) -> Route:
    """The engine index from the rid's session prefix (`<session_id>/...`), stable across processes."""
    return lambda request: zlib.crc32(request.rid.split("/", 1)[0].encode()) % engines


class SGLangBackend:
    def __init__(
        self, clients: Sequence[SGLangClient], route: Route | None = None, names: Sequence[str] | None = None
    ) -> None:
        """`names`: the registry's engine names of `clients`, in order (default E0, E1, ...)."""
        if not clients:
            raise ValueError("at least one engine client is needed")
        self._clients = tuple(clients)
        self._names = tuple(names) if names is not None else tuple(f"E{i}" for i in range(len(self._clients)))
        if len(self._names) != len(self._clients):
            raise ValueError(f"{len(self._names)} names for {len(self._clients)} engines")
        self._route = route or sticky_by_session(len(self._clients))
        self._engine_of: dict[str, SGLangClient] = {}  # rid -> the engine it went to (for abort)
        self.sent: collections.Counter[str] = collections.Counter()  # requests sent, per engine name

    def _choose(self, request: BackendRequest) -> int:
        """The routed engine if the request may go there; else the allowed engine the session's stable hash
        picks among the allowed ones (still sticky while the allowed set stays the same)."""
        index = self._route(request)
        if not request.engines or self._names[index] in request.engines:
            return index
        allowed = [i for i, name in enumerate(self._names) if name in request.engines]
        if not allowed:
            raise BackendFailure(f"no engine of {sorted(request.engines)} is known to this backend")
        return allowed[zlib.crc32(request.rid.split("/", 1)[0].encode()) % len(allowed)]

    async def generate(self, request: BackendRequest) -> BackendResponse:
        index = self._choose(request)
        client = self._clients[index]
        self._engine_of[request.rid] = client
        self.sent[self._names[index]] += 1
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
            # The managed patch answers a version it does not serve with 409 and the reason code first in its
            # message (guards.ManagedVersionUnavailable).
            unavailable = exc.status_code == 409 and Reason.VERSION_UNAVAILABLE.value in exc.body
            raise BackendFailure(str(exc), exc.status_code, engine=self._names[index],
                                 reason=Reason.VERSION_UNAVAILABLE if unavailable else None) from exc
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
