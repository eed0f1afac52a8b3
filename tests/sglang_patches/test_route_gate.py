"""Which paths a managed engine refuses (managed/route_gate.py), checked against the routes stock SGLang 0.5.23
registers: every generation route other than /generate is refused; /generate, the model, health, metrics,
admin and managed routes are not. (The refusal itself, on real engines: tests/boundary/table.py, `route`.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from versioned_lora.sglang_patches.managed import route_gate

OPEN = ("/generate", "/health", "/health_generate", "/model_info", "/get_model_info", "/server_info", "/metrics",
        "/v1/models", "/v1/models/some/model", "/load_lora_adapter", "/unload_lora_adapter", "/abort_request",
        "/flush_cache", "/pause_generation", "/continue_generation", "/versioned_lora/status",
        "/versioned_lora/begin", "/versioned_lora/reclaim", "/")
REFUSED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/abc/cancel", "/v1/score",
           "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/realtime",
           "/v1/audio/transcriptions", "/v1/anything", "/v1", "/v1/", "/v1/completions/", "/encode", "/classify",
           "/invocations", "/vertex_generate", "/api/chat", "/api/generate", "/api/show", "/api/tags")


@pytest.mark.parametrize("path", OPEN)
def test_open_routes_pass(path: str) -> None:
    assert not route_gate.refused(path)


@pytest.mark.parametrize("path", REFUSED)
def test_generation_routes_other_than_generate_are_refused(path: str) -> None:
    assert route_gate.refused(path)


def test_routes_moved_by_the_environment_follow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/predict-here")
    assert route_gate.refused("/predict-here") and not route_gate.refused("/vertex_generate")


def _call(scope_type: str, path: str) -> tuple[list[dict[str, Any]], bool]:
    sent: list[dict[str, Any]] = []
    reached = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    async def send(message: Any) -> None:
        sent.append(dict(message))

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(route_gate.RouteGate(app)({"type": scope_type, "path": path}, receive, send))
    return sent, reached


def test_a_refused_route_is_answered_typed_before_any_handler() -> None:
    sent, reached = _call("http", "/v1/completions")
    assert not reached
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 404
    error = json.loads(sent[1]["body"])["error"]
    assert (error["reason"], error["field"]) == ("ROUTE_NOT_SERVED", "path") and "/v1/completions" in error["message"]
    closed, reached = _call("websocket", "/v1/realtime")
    assert not reached and closed == [{"type": "websocket.close", "code": 1008}]
    passed, reached = _call("http", "/generate")
    assert reached and passed == []
    nothing, reached = _call("lifespan", "")  # not HTTP: passed on untouched
    assert reached and nothing == []
