"""`/generate` refusals made before the managed gate runs are typed too (issue 41, item 10): FastAPI's parse of the
body (not an object, wrong types, NaN/Infinity literals, fractional ids, nesting past the decoder), and SGLang's own
checks (duplicate rids in a batch, `top_k` 0) answer 400 ``{"error": {"reason", "field", "message"}}`` like every
other refusal of a managed engine (`managed/generate_envelope.py`). On the session's real engine E0; nothing is
served or changed by any of them."""

from __future__ import annotations

import httpx
import pytest

from versioned_lora.sglang_patches.managed.generate_envelope import (
    BODY,
    validation_field,
    validation_message,
    value_error_field,
)
from versioned_lora.spec.wire import ENGINE_CODES

PROMPT = b"[10, 11, 12]"
# (case, raw body, the field the refusal must name). Reason: MALFORMED_REQUEST, but where the managed gate's own
# reason applies (an id outside the vocabulary).
CASES = [
    # FastAPI's JSON decoder refuses NaN/Infinity literals as not JSON: a position, no field.
    ("nan_in_ids", b'{"input_ids": [1, NaN, 3]}', BODY),
    ("infinity_in_ids", b'{"input_ids": [Infinity]}', BODY),
    ("fractional_id", b'{"input_ids": [1.5, 2]}', "input_ids"),
    ("ids_a_string", b'{"input_ids": "abc"}', "input_ids"),
    ("sampling_params_a_number", b'{"input_ids": ' + PROMPT + b', "sampling_params": 7}', "sampling_params"),
    ("stream_an_object", b'{"input_ids": ' + PROMPT + b', "stream": {"a": 1}}', "stream"),
    ("body_a_list", b"[1, 2, 3]", BODY),
    ("body_a_string", b'"generate"', BODY),
    ("body_nan", b"NaN", BODY),
    ("not_json", b'{"input_ids": [1, 2', BODY),
    ("deep_nesting", b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", BODY),
    ("duplicate_rids_in_batch", b'{"input_ids": [[10, 11], [12, 13]], "rid": ["same", "same"], '
                                b'"sampling_params": {"max_new_tokens": 1}}', "rid"),
    ("top_k_zero", b'{"input_ids": ' + PROMPT + b', "sampling_params": {"top_k": 0, "max_new_tokens": 1}}',
     "sampling_params.top_k"),
    ("temperature_infinity", b'{"input_ids": ' + PROMPT + b', "sampling_params": {"temperature": Infinity}}', None),
    ("id_out_of_int64", b'{"input_ids": [1180591620717411303424]}', "input_ids"),
]


@pytest.mark.parametrize(("case", "raw", "field"), CASES, ids=[case for case, _, _ in CASES])
def test_a_generate_refused_before_the_managed_gate_is_typed(engines, case: str, raw: bytes,  # type: ignore[no-untyped-def]
                                                             field: str | None) -> None:
    with httpx.Client(base_url=engines.e0.url, timeout=120.0) as client:
        response = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (case, response.status_code, response.text[:500])
        error = response.json()["error"]
        assert error["reason"] in ENGINE_CODES and error["message"], (case, error)
        assert "File " not in error["message"] and len(error["message"]) < 2000, (case, error)  # no echo, no paths
        assert error["field"] == field if field is not None else error["field"], (case, error)
        assert client.get("/health").status_code == 200


def test_the_field_is_read_from_pydantic_locations_and_sglang_messages() -> None:
    assert validation_field([{"loc": ("body", "input_ids", "list[int]", 1)}]) == "input_ids"
    assert validation_field([{"loc": ("body", "sampling_params", "temperature")}]) == "sampling_params.temperature"
    assert validation_field([{"loc": ("body",)}]) == BODY == validation_field([]) == validation_field(None)
    assert value_error_field("top_k must be -1 (disable) or at least 1, got 0.") == "sampling_params.top_k"
    assert value_error_field("Duplicate request IDs detected within the request: ['a']") == "rid"
    assert value_error_field("Duplicate request ID detected: a") == "rid"
    assert value_error_field("something else must be right") == BODY
    message = validation_message([{"loc": ("body", "input_ids"), "msg": "Input should be a list", "input": "x" * 9}])
    assert message == "the body does not parse: body.input_ids: Input should be a list"
