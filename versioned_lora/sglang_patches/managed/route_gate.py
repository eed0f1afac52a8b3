"""Which serving routes a managed engine answers (issue 19): generation goes through `/generate` only.

Stock SGLang 0.5.23 serves generations on many more routes than `/generate` (`http_server`: the OpenAI
`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/score`, `/v1/messages`, the realtime
websocket, Ollama's `/api/*`, SageMaker's `/invocations`, Vertex's predict route, `/encode`, `/classify`), each
with its own schema of dozens of fields, most of which need the tokenizer these engines are started without
(text prompts, chat templates, tools, stop strings). `/generate` has a field allow-list (`generate_gate`);
rather than keep a second allow-list per route, a managed engine refuses those routes outright, typed:
404 ``{"error": {"reason": "ROUTE_NOT_SERVED", "field": "path", "message"}}``. What stays open: `/generate`,
the read-only model and health routes (`/v1/models` included), `/metrics`, SGLang's admin routes (which refuse
every managed name: `guards`) and the managed endpoints. Token ids are range-checked on every route that
remains (`generate_gate.validate_request`, in the tokenizer manager).

A plain ASGI middleware in front of the app: it answers before any route handler or body parser runs.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from versioned_lora.sglang_patches.managed import metrics
from versioned_lora.spec.wire import EngineRefusal

REASON = EngineRefusal.ROUTE_NOT_SERVED
# The generation routes of sglang 0.5.23's http_server besides /generate (read from its @app decorators;
# the patch mechanism refuses any other SGLang version). /v1/models and /v1/models/{model} stay open.
_REFUSED_EXACT = frozenset({"/encode", "/classify", "/invocations"})
_OPEN_UNDER_V1 = ("/v1/models",)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _env_routes() -> frozenset[str]:
    """Routes whose path stock SGLang reads from the environment at import time (same names, same defaults)."""
    return frozenset({
        os.environ.get("AIP_PREDICT_ROUTE", "/vertex_generate"),
        os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat"),
        os.environ.get("SGLANG_OLLAMA_GENERATE_ROUTE", "/api/generate"),
        os.environ.get("SGLANG_OLLAMA_SHOW_ROUTE", "/api/show"),
        os.environ.get("SGLANG_OLLAMA_TAGS_ROUTE", "/api/tags"),
    })


def refused(path: str, env_routes: frozenset[str] | None = None) -> bool:
    """True for a serving route other than /generate (see the module docstring)."""
    path = path.rstrip("/") or "/"
    if path in _REFUSED_EXACT or path in (env_routes if env_routes is not None else _env_routes()):
        return True
    if path.startswith("/v1/") or path == "/v1":
        return not any(path == open_ or path.startswith(f"{open_}/") for open_ in _OPEN_UNDER_V1)
    return False


class RouteGate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.env_routes = _env_routes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not refused(str(scope["path"]), self.env_routes):
            await self.app(scope, receive, send)
            return
        metrics.count_refusal("route", REASON)
        if scope["type"] == "websocket":  # a close before the accept: the client sees HTTP 403
            await send({"type": "websocket.close", "code": 1008})
            return
        body = orjson.dumps({"error": {
            "reason": REASON, "field": "path",
            "message": f"{scope['path']} is not served by an engine with the managed patch set: generation goes "
                       f"through /generate (README, 'Engines')",
        }})
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def install(app: Any) -> None:
    # Starlette builds its middleware stack on the first request; the patch set installs before the server
    # starts, so this lands in front of every route (add_middleware refuses once the app has started).
    app.add_middleware(RouteGate)
