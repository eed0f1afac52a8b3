"""Async HTTP client for one SGLang engine: generate with an exact ``lora_path``, the stock LoRA
control endpoints, and the versioned-lora status endpoint.

No hidden retries: a request is sent once. A timeout or a dropped connection means the outcome is
unknown (the engine may have accepted the request), which the caller must treat as such; it is
raised as :class:`UnknownOutcome`, never folded into a failure.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx

from versioned_lora.spec.wire import MANAGED_PREFIX, STATUS_PATH, TOKEN_HEADER


class UnknownOutcome(Exception):
    """The request may or may not have taken effect on the engine (timeout, lost connection)."""


class EngineHTTPError(Exception):
    """The engine answered with an error status; the request certainly failed there."""

    def __init__(self, status_code: int, body: str) -> None:
        super().__init__(f"HTTP {status_code}: {body[:500]}")
        self.status_code = status_code
        self.body = body


@attrs.frozen
class Generation:
    output_ids: list[int]
    logprobs: list[float]  # logprob of each generated token
    cached_tokens: int
    finish_reason: Any
    raw: dict[str, Any]


KEEPALIVE_EXPIRY_S = 2.0  # below the engines' keep-alive timeout (SGLang 0.5.23: SGLANG_TIMEOUT_KEEP_ALIVE, 5 s)


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 120.0, token: str | None = None) -> None:
        self.base_url = base_url
        headers = {TOKEN_HEADER: token} if token else None
        # SGLang's uvicorn closes a keep-alive connection idle for 5 s; httpx's default expiry is the same 5 s: a
        # request sent on such a connection as the server closes it fails with ReadError, an unknown outcome for
        # a POST. Idle connections are dropped here first.
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=headers,
                                       limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, payload: dict[str, Any], timeout_s: float | None = None) -> httpx.Response:
        try:
            if timeout_s is None:
                return await self._http.post(path, json=payload)
            return await self._http.post(path, json=payload, timeout=timeout_s)
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise UnknownOutcome(f"POST {path}: {type(exc).__name__}: {exc}") from exc

    async def generate(
        self,
        input_ids: Sequence[int],
        lora_path: str | None,
        max_new_tokens: int = 8,
        *,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        rid: str | None = None,
        timeout_s: float | None = None,
        extra_sampling: dict[str, Any] | None = None,
        extra_fields: dict[str, Any] | None = None,
    ) -> Generation:
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "ignore_eos": ignore_eos,
                **(extra_sampling or {}),
            },
            "return_logprob": True,
        }
        if lora_path is not None:
            payload["lora_path"] = lora_path
        if rid is not None:
            payload["rid"] = rid
        payload.update(extra_fields or {})
        response = await self._post("/generate", payload, timeout_s)
        if response.status_code != 200:
            raise EngineHTTPError(response.status_code, response.text)
        body = response.json()
        meta = body["meta_info"]
        return Generation(
            output_ids=list(body.get("output_ids") or []),
            logprobs=[entry[0] for entry in meta.get("output_token_logprobs") or []],
            cached_tokens=int(meta.get("cached_tokens") or 0),
            finish_reason=meta.get("finish_reason"),
            raw=body,
        )

    async def stream_progress(
        self, input_ids: Sequence[int], lora_path: str | None, max_new_tokens: int
    ) -> list[tuple[float, int]]:
        """Stream a greedy generation; return (monotonic arrival time, tokens so far) per chunk —
        how tests and benchmarks see whether decode keeps making progress."""
        import json
        import time

        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
            **({"lora_path": lora_path} if lora_path is not None else {}),
        }
        progress: list[tuple[float, int]] = []
        async with self._http.stream("POST", "/generate", json=payload) as response:
            if response.status_code != 200:
                raise EngineHTTPError(response.status_code, (await response.aread()).decode())
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:
                    raise EngineHTTPError(int(chunk["error"].get("code", 500)), line)
                progress.append((time.monotonic(), int(chunk["meta_info"]["completion_tokens"])))
        return progress

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        response = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned})
        return _json_or_raise(response)

    async def load_lora_adapter_from_tensors(
        self, name: str, tensors: Mapping[str, Any], adapter_config: Mapping[str, Any], pinned: bool = False
    ) -> dict[str, Any]:
        """SGLang's stock /load_lora_adapter_from_tensors. The tensors travel by value: plain pickle writes
        each storage's bytes (``torch.storage._load_from_bytes``, which SGLang's SafeUnpickler maps to a
        weights-only torch.load), where its own MultiprocessingSerializer would share memory handles."""
        import pickle

        blob = base64.b64encode(pickle.dumps({k: t.contiguous() for k, t in tensors.items()})).decode()
        response = await self._post("/load_lora_adapter_from_tensors", {
            "lora_name": name, "config_dict": dict(adapter_config), "serialized_named_tensors": [blob],
            "pinned": pinned,
        })
        return _json_or_raise(response)

    async def unload_lora_adapter(self, name: str, timeout_s: float | None = None) -> dict[str, Any]:
        response = await self._post("/unload_lora_adapter", {"lora_name": name}, timeout_s)
        return _json_or_raise(response)

    async def abort_request(self, rid: str) -> None:
        response = await self._post("/abort_request", {"rid": rid})
        if response.status_code != 200:
            raise EngineHTTPError(response.status_code, response.text)

    # ---- managed endpoints (versioned_lora.sglang_patches.managed.endpoints)
    async def managed(self, operation: str, http_timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        """POST /versioned_lora/<operation>. Returns the envelope (incarnation, result, adapter) or
        raises ManagedRefusal; a lost reply raises UnknownOutcome."""
        response = await self._post(MANAGED_PREFIX + operation, body, http_timeout_s)
        payload: dict[str, Any] = response.json()
        if response.status_code != 200:
            error = payload.get("error", {})
            raise ManagedRefusal(response.status_code, error.get("reason", "?"), error.get("message", ""),
                                 error.get("row"))
        return payload

    async def status(self) -> dict[str, Any]:
        try:
            try:
                response = await self._http.get(STATUS_PATH)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                # A pooled keep-alive connection the engine closed as it was reused (one idle for 5 s; and seen
                # right after an engine's unhandled 500): the pool has dropped it, and a read-only GET may be
                # asked once more, on a fresh connection.
                response = await self._http.get(STATUS_PATH)
        except httpx.HTTPError as exc:
            raise UnknownOutcome(f"GET status: {exc}") from exc
        return _json_or_raise(response)

    async def adapter(self, name: str) -> dict[str, Any] | None:
        """The status entry of one registered adapter, or None if the name is not registered."""
        return next((a for a in (await self.status())["adapters"] if a["name"] == name), None)


class ManagedRefusal(Exception):
    """A typed refusal from a managed endpoint (409 from the spec table, 400/401/413 for bad input)."""

    def __init__(self, status_code: int, reason: str, message: str, row: str | None) -> None:
        super().__init__(f"{reason} (HTTP {status_code}): {message}")
        self.status_code = status_code
        self.reason = reason
        self.row = row


def _json_or_raise(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        raise EngineHTTPError(response.status_code, response.text)
    body: dict[str, Any] = response.json()
    return body
