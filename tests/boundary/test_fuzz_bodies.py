"""Hypothesis fuzzing of every managed endpoint's body on a real engine (issue 19): random JSON values of wrong
types, huge and negative numbers, deep nesting, non-UTF-8 bytes, NaN/Infinity literals. Never a 5xx, never an
unhealthy engine, never a state change. Bounded in examples (FUZZ_EXAMPLES per endpoint) so it runs in
about two minutes (it took 3.5 with 30 on a host at load average 5-12)."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import Boundary, log_text_since
from engine_helpers import TEST_TOKEN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from versioned_lora.spec.wire import TOKEN_HEADER

FUZZ_EXAMPLES = 20  # per endpoint: 120 bodies, about two minutes on a loaded 2-core host
FIELDS = {
    "begin": ("lora_name", "attempt_token", "incarnation", "digest", "manifest", "source_path", "max_bucket_bytes",
              "plan_digest", "group_name", "bucket_deadline_s"),
    "receive_bucket": ("lora_name", "attempt_token", "incarnation", "index"),
    "end": ("lora_name", "attempt_token", "incarnation", "probe_input_ids"),
    "cleanup": ("lora_name", "attempt_token"),
    "reclaim": ("lora_name", "reclaim_id", "wait_s"),
    "init_group": ("group_name", "master_address", "master_port", "timeout_s"),
}

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
    | st.sampled_from(["relax_policy_lora@", "relax_policy_lora@1-A-", "../../etc", "$(id)", "\u0000", "-1"])
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    keyed = st.fixed_dictionaries({}, optional={name: json_values for name in FIELDS[endpoint]})
    literals = st.sampled_from([b'{"wait_s": NaN}', b'{"index": Infinity}', b'{"incarnation": -Infinity}',
                                b'{"probe_input_ids": [NaN]}', b"NaN", b"Infinity"])
    return st.one_of(
        keyed.map(lambda body: json.dumps(body).encode()),
        json_values.map(lambda value: json.dumps(value).encode()),  # any JSON, objects or not
        st.binary(max_size=64),  # mostly not UTF-8, mostly not JSON
        literals,
        st.integers(min_value=10, max_value=4000).map(lambda depth: b"[" * depth + b"]" * depth),
        st.integers(min_value=10, max_value=4000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    )


@pytest.mark.parametrize("endpoint", sorted(FIELDS))
def test_fuzz_managed_body(boundary: Boundary, endpoint: str) -> None:
    before = boundary.status()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=_bodies(endpoint))
    def one(body: bytes) -> None:
        with httpx.Client(base_url=boundary.url, timeout=60.0) as client:
            response = client.post(f"/versioned_lora/{endpoint}", content=body,
                                   headers={"content-type": "application/json", TOKEN_HEADER: TEST_TOKEN})
            assert response.status_code < 500, (body[:200], response.text[:500])
            assert response.status_code >= 400, (body[:200], response.text[:500])  # no random body is valid
            assert response.json()["error"]["reason"], response.text[:500]
            assert client.get("/health").status_code == 200
        assert boundary.status() == before, body[:200]

    one()
    assert boundary.serving() == boundary.baseline
    assert "Task exception was never retrieved" not in log_text_since(boundary.log_offsets)
