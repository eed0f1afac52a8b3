"""What `/generate` takes on an engine with the managed patch set (issue 19).

Two checks, both before a request reaches the scheduler:

- `contract_error`, at the HTTP boundary: SGLang 0.5.23's `/generate` handler (`http_server.generate_request`)
  asks `generate_contract_error(await request.json())` for a schema violation and answers a non-None one with
  400 ``{"error": ...}``. We wrap that function in `http_server`'s namespace: after the stock schema check, the
  body must hold only the fields of `ALLOWED_FIELDS` (and `sampling_params` only `ALLOWED_SAMPLING`), each of
  its exact type and inside its bounds, every token id inside the vocabulary. A refusal is
  ``{"reason", "field", "message"}`` naming the field.
- `validate_request`, inside the tokenizer manager (`TokenizerManager._validate_one_request`, which every route
  runs for each single request before it is sent to the scheduler: /generate, the OpenAI routes, the Engine
  API, the managed probe): token ids inside the vocabulary — stock 0.5.23 with ``--skip-tokenizer-init`` does
  not range-check them and an out-of-vocabulary id raises IndexError in the scheduler's embedding layer,
  which takes the whole engine down — and the cache-key rules of `check_cache_keys`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from versioned_lora.sglang_patches.managed import fields, hold_points, metrics
from versioned_lora.sglang_patches.managed.fields import BadRequest
from versioned_lora.sglang_patches.managed.guards import is_managed_name
from versioned_lora.sglang_patches.mechanism import replace_attribute
from versioned_lora.spec.wire import EngineRefusal

PATCH_SET = "managed"

# Top-level /generate fields a managed engine takes (README "Engines" lists them). Everything else — e.g.
# `input_embeds`, `custom_logit_processor`, `text` (these engines skip the tokenizer), multimodal data,
# `return_hidden_states`, session and disaggregation fields — is refused with UNKNOWN_FIELD naming it.
ALLOWED_FIELDS = frozenset({
    "input_ids", "sampling_params", "lora_path", "rid", "stream", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "priority", "extra_key", "cache_salt",
})
# sampling_params keys, with their checks below; grammar-constrained decoding (regex, json_schema, ebnf,
# structural_tag), `n` and stop strings (which need a tokenizer) are refused.
ALLOWED_SAMPLING = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos",
    "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "skip_special_tokens",
    "no_stop_trim",
})
MAX_BATCH = 64  # sub-requests of one batched /generate
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKENS = 64
RID_RE = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: rids are ids, chosen by clients
MAX_LORA_PATH_LEN = 256


class RequestRefused(ValueError):
    """A request refused inside the tokenizer manager: SGLang's handlers answer a ValueError with 400 and
    its message, which starts with the typed reason."""

    status_code = 400

    def __init__(self, refusal: BadRequest) -> None:
        super().__init__(f"{refusal.code}: {refusal}")
        self.refusal = refusal
        metrics.count_refusal("generate", refusal.code)  # raised once per refused request (managed/metrics.py)


class Limits:
    """The engine's vocabulary, context length and managed KV namespaces, read when a request is checked."""

    def __init__(self, tokenizer_manager: Any, managed_lora_ids: Callable[[], Collection[str]]) -> None:
        self.vocab_size = int(tokenizer_manager.model_config.vocab_size)
        self.context_len = int(tokenizer_manager.context_len)
        self.managed_lora_ids = managed_lora_ids


def check_cache_keys(lora_path: object, extra_key: object, cache_salt: object, limits: Limits) -> None:
    """A request naming a managed version cannot choose its KV namespace, and no request can reach one.

    SGLang keys the radix cache by (tokens, extra_key + lora_id, cache_salt) (`Req.__init__` concatenates the
    client's extra_key and the adapter's lora_id): a base request whose extra_key is a managed adapter's
    lora_id (listed by /versioned_lora/status) reads that adapter's KV and writes base-model KV into it
    (upstream #24638; measured on 0.5.23 in tests/boundary/test_cache_keys.py)."""
    names = lora_path if isinstance(lora_path, list) else [lora_path]
    if any(is_managed_name(name) for name in names):
        for field_name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
            if value not in (None, "", []):
                raise BadRequest(EngineRefusal.CACHE_KEY_REFUSED,
                                 f"field {field_name!r} is not accepted on a request naming a "
                                 f"managed version: its KV namespace is the version's own", field=field_name)
    keys = extra_key if isinstance(extra_key, list) else [extra_key]
    managed_ids = limits.managed_lora_ids()
    for key in keys:
        if isinstance(key, str) and key and any(lora_id in key for lora_id in managed_ids):
            raise BadRequest(EngineRefusal.CACHE_KEY_REFUSED,
                             "field 'extra_key' names a managed version's KV namespace",
                             field="extra_key")


def _batch_size(body: Mapping[str, Any]) -> int | None:
    """None for a single request, else the number of sub-requests (input_ids a list of lists)."""
    input_ids = body.get("input_ids")
    if type(input_ids) is list and input_ids and type(input_ids[0]) is list:
        return len(input_ids)
    return None


def _per_request(body: Mapping[str, Any], name: str, batch: int | None) -> list[Any]:
    """A field given once for every sub-request or as a list of one value per sub-request."""
    value = body[name]
    if batch is not None and type(value) is list:
        if len(value) != batch:
            raise BadRequest(EngineRefusal.MALFORMED_REQUEST,
                             f"field {name!r} has {len(value)} entries for {batch} requests",
                             field=name)
        return value
    return [value]


def _check_sampling(params: object, limits: Limits) -> None:
    if type(params) is not dict:
        raise BadRequest(EngineRefusal.MALFORMED_REQUEST, f"field 'sampling_params' must be an object, got "
                         f"{type(params).__name__}", field="sampling_params")
    fields.only(params, ALLOWED_SAMPLING, "/generate's sampling_params")
    context = limits.context_len
    checks: dict[str, Callable[[], object]] = {
        "max_new_tokens": lambda: fields.integer(params, "max_new_tokens", 0, context),
        "min_new_tokens": lambda: fields.integer(params, "min_new_tokens", 0, context),
        "temperature": lambda: fields.number(params, "temperature", 0.0, 100.0),
        "top_p": lambda: fields.number(params, "top_p", 0.0, 1.0, low_open=True),
        "top_k": lambda: fields.integer(params, "top_k", -1, 1 << 30),  # -1: all; 0 is SGLang's to refuse
        "min_p": lambda: fields.number(params, "min_p", 0.0, 1.0),
        "ignore_eos": lambda: fields.boolean(params, "ignore_eos"),
        "stop_token_ids": lambda: fields.token_ids(params["stop_token_ids"], "stop_token_ids", limits.vocab_size,
                                                   MAX_STOP_TOKENS),
        "frequency_penalty": lambda: fields.number(params, "frequency_penalty", -2.0, 2.0),
        "presence_penalty": lambda: fields.number(params, "presence_penalty", -2.0, 2.0),
        "repetition_penalty": lambda: fields.number(params, "repetition_penalty", 0.0, 2.0, low_open=True),
        "skip_special_tokens": lambda: fields.boolean(params, "skip_special_tokens"),
        "no_stop_trim": lambda: fields.boolean(params, "no_stop_trim"),
    }
    for key in params:
        checks[key]()


def check_body(body: object, limits: Limits) -> None:
    """Raises BadRequest naming the first field outside what a managed engine's /generate takes."""
    if type(body) is not dict:
        raise BadRequest(EngineRefusal.MALFORMED_REQUEST, f"body must be a JSON object, got {type(body).__name__}")
    fields.only(body, ALLOWED_FIELDS, "/generate")
    if "input_ids" not in body:
        raise BadRequest(EngineRefusal.MALFORMED_REQUEST,
                         "field 'input_ids' is required (these engines skip the tokenizer)",
                         field="input_ids")
    batch = _batch_size(body)
    max_prompt = limits.context_len - 1
    if batch is None:
        fields.token_ids(body["input_ids"], "input_ids", limits.vocab_size, max_prompt)
    else:
        if batch > MAX_BATCH:
            raise BadRequest(EngineRefusal.MALFORMED_REQUEST,
                             f"field 'input_ids' holds {batch} requests, at most {MAX_BATCH}",
                             field="input_ids")
        for prompt in body["input_ids"]:
            fields.token_ids(prompt, "input_ids", limits.vocab_size, max_prompt)
    if "sampling_params" in body:
        for params in _per_request(body, "sampling_params", batch):
            _check_sampling(params, limits)
    if "lora_path" in body:
        for path in _per_request(body, "lora_path", batch):
            if path is not None and (type(path) is not str or not 0 < len(path) <= MAX_LORA_PATH_LEN):
                raise BadRequest(EngineRefusal.MALFORMED_REQUEST, f"field 'lora_path' must be null or a name of 1.."
                                 f"{MAX_LORA_PATH_LEN} characters", field="lora_path")
    if "rid" in body:
        for rid in _per_request(body, "rid", batch):
            fields.string({"rid": rid}, "rid", RID_RE, max_len=256)
    for flag in ("stream", "return_logprob"):
        if flag in body:
            fields.boolean(body, flag)
    if "logprob_start_len" in body:
        fields.integer(body, "logprob_start_len", -1, limits.context_len)  # -1: SGLang's "no prompt logprobs"
    if "top_logprobs_num" in body:
        fields.integer(body, "top_logprobs_num", 0, MAX_TOP_LOGPROBS)
    if "priority" in body:
        fields.integer(body, "priority", -(2**31), 2**31 - 1)
    for key_field in ("extra_key", "cache_salt"):
        if key_field in body:
            for value in _per_request(body, key_field, batch):
                if value is not None:
                    fields.string({key_field: value}, key_field, max_len=256)
    check_cache_keys(body.get("lora_path"), body.get("extra_key"), body.get("cache_salt"), limits)


def validate_request(obj: Any, input_ids: Any, limits: Limits) -> None:
    """The tokenizer manager's check of one (sub-)request, whatever route it came by."""
    try:
        if input_ids is not None:
            fields.token_ids(list(input_ids), "input_ids", limits.vocab_size, limits.context_len)
        check_cache_keys(getattr(obj, "lora_path", None), getattr(obj, "extra_key", None),
                         getattr(obj, "cache_salt", None), limits)
    except BadRequest as exc:
        raise RequestRefused(exc) from None


def install(limits: Callable[[], Limits]) -> None:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    stock_contract = http_server.generate_contract_error

    @functools.wraps(stock_contract)
    def contract_error(body: Any) -> Any:
        # Ours first: it names the field and its reason; the stock schema check stays behind it.
        try:
            check_body(body, limits())
        except BadRequest as exc:
            metrics.count_refusal("generate", exc.code)
            return exc.payload()
        stock = stock_contract(body)
        if stock is None:
            return None
        metrics.count_refusal("generate", EngineRefusal.MALFORMED_REQUEST)
        return {"reason": EngineRefusal.MALFORMED_REQUEST, "field": "body", "message": str(stock)}

    # http_server.generate_request calls the name from its module namespace at request time.
    replace_attribute(PATCH_SET, http_server, "generate_contract_error", contract_error,
                      why="/generate on a managed engine: field allow-list, exact types, bounds, vocabulary")

    stock_validate = TokenizerManager._validate_one_request

    @functools.wraps(stock_validate)
    def validate_one_request(self: Any, obj: Any, input_ids: Any) -> None:
        hold_points.HOLDS.fail_request(getattr(obj, "lora_path", None))  # test-only; inert unless armed
        validate_request(obj, input_ids, limits())
        stock_validate(self, obj, input_ids)

    replace_attribute(PATCH_SET, TokenizerManager, "_validate_one_request", validate_one_request,
                      why="token ids inside the vocabulary and managed cache keys on every route")
