"""`/generate` refusals made before (or beside) the managed gate get its typed envelope (issue 41, item 10):
``{"error": {"reason", "field", "message"}}``, 400, like every other refusal of a managed engine.

SGLang 0.5.23 refuses a bad `/generate` in three places the managed gate (`generate_gate.contract_error`) does not
run in, each with an envelope of its own and no reason:

- FastAPI's parse of the body into `GenerateReqInput` (``http_server.generate_request``'s ``obj`` parameter):
  a body that is not JSON (a NaN or Infinity literal: its decoder is strict; nesting past its depth limit), not an
  object, or with a field of the wrong type (``"input_ids": "abc"``, a fractional id) raise
  `RequestValidationError`, which ``http_server.validation_exception_handler`` answers
  ``{"object": "error", "message", "type", "code"}``; a body the decoder raises anything else on gets FastAPI's
  `HTTPException` 400, answered by SGLang's `HTTPException` handler alike.
  We put a handler of ours in front of both in ``app.exception_handlers``, for ``/generate`` only.
- SGLang's own checks inside ``TokenizerManager.generate_request`` (``SamplingParams.verify``: ``top_k`` 0,
  non-finite numbers; ``GenerateReqInput._validate_rid_uniqueness``: duplicate rids in a batch; our own
  `generate_gate.RequestRefused` from the tokenizer manager's per-request check) raise `ValueError`, which
  ``http_server.serve_generate_request`` answers through ``http_server._create_error_response``
  (``{"error": {"message"}}``). We wrap ``serve_generate_request`` to mark the request as `/generate`'s, and
  ``_create_error_response`` to answer a marked request typed (a `RequestRefused` with its own reason and field;
  another `ValueError` `MALFORMED_REQUEST`, with the field SGLang's message names where it names one).

Applied with the managed patch set (the version guard of `mechanism.replace_attribute` refuses any SGLang but the
pinned one, whose handlers are the ones read above). A streamed `/generate`'s refusal is sent inside the stream
(``serve_generate_request``'s ``stream_results``) and keeps SGLang's form.
"""

from __future__ import annotations

import contextvars
import functools
import re
from typing import Any

from versioned_lora.sglang_patches.managed import metrics
from versioned_lora.sglang_patches.mechanism import replace_attribute
from versioned_lora.spec.wire import EngineRefusal

PATCH_SET = "managed"
GENERATE_PATH = "/generate"
BODY = "body"  # the field named when the body as a whole is refused

_IN_GENERATE: contextvars.ContextVar[bool] = contextvars.ContextVar("versioned_lora_in_generate", default=False)

# What SGLang 0.5.23's own ValueErrors name: "<sampling param> must be ..." (SamplingParams.verify) and the
# duplicate rid checks (GenerateReqInput._validate_rid_uniqueness, TokenizerManager's "Duplicate request ID").
_SAMPLING_MESSAGE = re.compile(r"(\w+) must be ")
_DUPLICATE_RID = re.compile(r"Duplicate request ID")
SAMPLING_PARAMS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "n",
})


def envelope(reason: str, field: str, message: str) -> dict[str, Any]:
    """The typed body of every `/generate` refusal."""
    return {"error": {"reason": reason, "field": field, "message": message}}


def refusal(reason: str, field: str, message: str) -> dict[str, Any]:
    """A refusal made here: counted, then enveloped."""
    metrics.count_refusal("generate", reason)
    return envelope(reason, field, message)


def validation_message(errors: Any) -> str:
    """pydantic's errors as `location: message`, without the input they echo (a body may be megabytes) or the
    server's source location FastAPI adds to the exception's text."""
    shown = [f"{'.'.join(str(part) for part in e.get('loc', ()))}: {e.get('msg', '')}"
             for e in (errors if isinstance(errors, (list, tuple)) else [])[:3] if isinstance(e, dict)]
    return "the body does not parse: " + ("; ".join(shown) or "invalid")


def validation_field(errors: Any) -> str:
    """The field of pydantic's first error: its location's names below ``body`` (list indices dropped)."""
    first = errors[0] if isinstance(errors, (list, tuple)) and errors else {}
    loc = first.get("loc", ()) if isinstance(first, dict) else ()
    names = [str(part) for part in loc[1:] if isinstance(part, str)]
    # pydantic names the member of a Union it tried ("list[int]", "function-after[...]"): not a field.
    names = [name for name in names if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)]
    return ".".join(names) or BODY


def value_error_field(message: str) -> str:
    if _DUPLICATE_RID.search(message):
        return "rid"
    named = _SAMPLING_MESSAGE.match(message)
    if named and named.group(1) in SAMPLING_PARAMS:
        return f"sampling_params.{named.group(1)}"
    return BODY


def typed_value_error(error: Any) -> tuple[int, dict[str, Any]]:
    """What `_create_error_response` answers for `/generate`: (status, envelope)."""
    from versioned_lora.sglang_patches.managed.generate_gate import RequestRefused
    from versioned_lora.sglang_patches.managed.guards import ManagedVersionUnavailable

    if isinstance(error, RequestRefused):  # counted where it was raised
        payload = error.refusal.payload()
        return error.status_code, {"error": {"field": BODY, **payload}}
    if isinstance(error, ManagedVersionUnavailable):  # counted where it was raised; 409, not a malformed body
        return int(error.status_code), envelope(error.reason, "lora_path", str(error))
    message = str(error)
    return int(getattr(error, "status_code", 400)), refusal(EngineRefusal.MALFORMED_REQUEST,
                                                            value_error_field(message), message)


def install() -> None:
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    stock_validation = app.exception_handlers[RequestValidationError]
    stock_http = app.exception_handlers[HTTPException]

    async def validation_error(request: Any, exc: RequestValidationError) -> Any:
        if request.url.path != GENERATE_PATH:
            return await stock_validation(request, exc)
        return ORJSONResponse(status_code=400, content=refusal(
            EngineRefusal.MALFORMED_REQUEST, validation_field(exc.errors()), validation_message(exc.errors())))

    async def http_error(request: Any, exc: HTTPException) -> Any:
        # FastAPI's 400 "There was an error parsing the body" (fastapi.routing.get_request_handler): a body its JSON
        # decoder raised on other than JSONDecodeError, e.g. nesting past the recursion limit.
        if request.url.path != GENERATE_PATH or exc.status_code != 400:
            return await stock_http(request, exc)
        return ORJSONResponse(status_code=400, content=refusal(EngineRefusal.MALFORMED_REQUEST, BODY,
                                                               str(exc.detail)))

    # Recorded like every patch (the status lists it); the app keeps its handlers in a dict, set alongside.
    replace_attribute(PATCH_SET, http_server, "validation_exception_handler", validation_error,
                      why="/generate's parse refusals typed (reason, field), like the managed gate's")
    app.exception_handlers[RequestValidationError] = validation_error
    app.exception_handlers[HTTPException] = http_error

    stock_serve = http_server.serve_generate_request
    stock_error_response = http_server._create_error_response

    @functools.wraps(stock_serve)
    async def serve_generate_request(obj: Any, request: Any) -> Any:
        marked = _IN_GENERATE.set(True)
        try:
            return await stock_serve(obj, request)
        finally:
            _IN_GENERATE.reset(marked)

    @functools.wraps(stock_error_response)
    def create_error_response(e: Any) -> Any:
        if not _IN_GENERATE.get() or not isinstance(e, ValueError):
            return stock_error_response(e)
        status, content = typed_value_error(e)
        return ORJSONResponse(content, status_code=status)

    # http_server.generate_request and the handlers call both by their module names at request time.
    replace_attribute(PATCH_SET, http_server, "serve_generate_request", serve_generate_request,
                      why="mark a request as /generate's, so its ValueError refusal is answered typed")
    replace_attribute(PATCH_SET, http_server, "_create_error_response", create_error_response,
                      why="/generate's ValueError refusals (SGLang's checks, the tokenizer manager's) typed")
