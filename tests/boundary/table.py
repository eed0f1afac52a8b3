"""The committed table of bad inputs (issue 19): endpoint x field x fault, each with the typed refusal it must get.

A row names the endpoint, the field at fault and the fault; `base` is a valid request of that endpoint (built in
conftest.py against the live engines and registry), `set` the fields it overrides (`DROP` removes one), `raw` a
body sent as bytes instead. `$NAME` strings are filled in from the context: `$M` the managed version READY on E0,
`$M_ATTEMPT` its attempt token, `$M_LORA_ID` its engine-local lora_id, `$INC` E0's incarnation, `$FRESH` a
valid name for a new candidate, `$GROUP` a group name of this incarnation.

`reason` is the typed reason the answer must carry, `names` what its message or `field` must name (the field
unless given). Endpoints: the managed ones (`begin`, `receive_bucket`, `end`, `cleanup`, `reclaim`,
`init_group`), `generate` (/generate), `route` (a serving route other than /generate, sent to `$PATH`),
`reserve` (the Ray registry actor's Reserve), `snapshot` (the snapshot builder, before any reserve).
"""

from __future__ import annotations

import dataclasses
from typing import Any

DROP = object()
DEEP = 5000  # nesting levels: past orjson's and any recursive decoder's limit


@dataclasses.dataclass(frozen=True)
class Row:
    endpoint: str
    field: str
    fault: str
    reason: str
    base: str = ""
    set: dict[str, Any] = dataclasses.field(default_factory=dict)
    raw: bytes | None = None
    headers: dict[str, str] | None = None  # None: the right token
    names: str | None = None
    setup: str | None = None  # a context step run before the "before" snapshot, undone after "after"

    @property
    def id(self) -> str:
        return f"{self.endpoint}-{self.field}-{self.fault}"


def _rows() -> list[Row]:
    rows: list[Row] = []

    def add(endpoint: str, field: str, fault: str, reason: str, base: str = "", **kw: Any) -> None:
        rows.append(Row(endpoint, field, fault, reason, base or endpoint, **kw))

    # ---- names (grammar of spec/identities.py), at begin: each went STAGING before
    p = "relax_policy_lora@"
    add("begin", "lora_name", "path_traversal", "INVALID_NAME", set={"lora_name": p + "../../../../tmp/evil"})
    add("begin", "lora_name", "shell_metachars", "INVALID_NAME",
        set={"lora_name": p + "1-$(touch /tmp/x);rm -rf ~|`id`-0123456789ab"})
    add("begin", "lora_name", "ten_thousand_chars", "INVALID_NAME", set={"lora_name": p + "a" * 10_000})
    add("begin", "lora_name", "digest_part_disagrees", "NAME_DIGEST_MISMATCH",
        set={"lora_name": "$FRESH_OTHER_DIGEST"})
    add("begin", "lora_name", "negative_version_id", "INVALID_NAME", set={"lora_name": p + "1--1-$DIGEST12"})
    add("begin", "lora_name", "leading_zero_epoch", "INVALID_NAME", set={"lora_name": p + "01-A-$DIGEST12"})
    add("begin", "lora_name", "uppercase_digest_part", "INVALID_NAME", set={"lora_name": "$FRESH_UPPER"})
    add("begin", "lora_name", "not_managed", "NOT_MANAGED", set={"lora_name": "plain-name"})
    add("begin", "lora_name", "integer", "MALFORMED_REQUEST", set={"lora_name": 7})
    add("begin", "lora_name", "missing", "MALFORMED_REQUEST", set={"lora_name": DROP})
    add("reclaim", "lora_name", "path_traversal", "INVALID_NAME", set={"lora_name": "relax_policy_lora@../../x"})
    add("end", "lora_name", "newline", "INVALID_NAME", set={"lora_name": "relax_policy_lora@1-A\nB-$DIGEST12"})
    # ---- begin's other fields
    add("begin", "manifest", "not_json", "MALFORMED_MANIFEST", set={"manifest": "{not json"})
    add("begin", "manifest", "wrong_shape", "MALFORMED_MANIFEST", set={"manifest": '{"tensors": 3}'})
    add("begin", "manifest", "object_not_string", "MALFORMED_REQUEST", set={"manifest": {"tensors": []}})
    add("begin", "digest", "not_hex", "MALFORMED_REQUEST", set={"digest": "z" * 64})
    add("begin", "digest", "other_digest", "DIGEST_MISMATCH", set={"digest": "f" * 64})
    add("begin", "attempt_token", "shell_metachars", "MALFORMED_REQUEST", set={"attempt_token": "a;rm -rf /"})
    add("begin", "attempt_token", "too_long", "MALFORMED_REQUEST", set={"attempt_token": "a" * 257})
    add("begin", "incarnation", "string", "MALFORMED_REQUEST", set={"incarnation": "1"})
    add("begin", "incarnation", "negative", "MALFORMED_REQUEST", set={"incarnation": -1})
    add("begin", "incarnation", "bool", "MALFORMED_REQUEST", set={"incarnation": True})
    add("begin", "incarnation", "float", "MALFORMED_REQUEST", set={"incarnation": 1.5})
    add("begin", "extra_field", "unknown", "UNKNOWN_FIELD", set={"surprise": 1}, names="surprise")
    add("begin", "source_path", "outside_root", "SOURCE_PATH_REFUSED", set={"source_path": "/etc"})
    add("begin", "source_path", "dotdot_escape", "SOURCE_PATH_REFUSED", set={"source_path": "$ROOT/../../../etc"})
    add("begin", "source_path", "symlink_escape", "SOURCE_PATH_REFUSED", set={"source_path": "$ESCAPE_LINK"},
        setup="escape_link")
    add("begin", "source_path", "file_link_escape", "SOURCE_PATH_REFUSED", set={"source_path": "$ESCAPE_FILE_DIR"},
        setup="escape_file_link")
    add("begin", "source_path", "missing_dir", "SOURCE_PATH_REFUSED", set={"source_path": "$ROOT/no-such-dir"})
    add("begin", "source_path", "integer", "MALFORMED_REQUEST", set={"source_path": 5})
    add("begin", "manifest", "rank_above_max", "UNSUPPORTED_ADAPTER", set={"$CANDIDATE": "rank16"}, names="rank")
    add("begin", "manifest", "module_not_served", "UNSUPPORTED_ADAPTER", set={"$CANDIDATE": "k_proj"}, names="k_proj")
    add("begin", "manifest", "dtype_not_supported", "UNSUPPORTED_ADAPTER", set={"$CANDIDATE": "float64"},
        names="float64")
    add("begin", "slot", "no_free_slot", "NO_FREE_SLOT", setup="fill_slots", names="slot")
    add("begin", "max_bucket_bytes", "zero", "BUCKET_TOO_LARGE", base="begin_dist", set={"max_bucket_bytes": 0})
    add("begin", "max_bucket_bytes", "huge", "BUCKET_TOO_LARGE", base="begin_dist", set={"max_bucket_bytes": 2**40})
    add("begin", "max_bucket_bytes", "string", "MALFORMED_REQUEST", base="begin_dist", set={"max_bucket_bytes": "1"})
    add("begin", "plan_digest", "other", "PLAN_MISMATCH", base="begin_dist", set={"plan_digest": "0" * 64})
    add("begin", "group_name", "bad_charset", "MALFORMED_REQUEST", base="begin_dist", set={"group_name": "g g"})
    add("begin", "bucket_deadline_s", "negative", "MALFORMED_REQUEST", base="begin_dist",
        set={"bucket_deadline_s": -1})
    add("begin", "bucket_deadline_s", "huge", "MALFORMED_REQUEST", base="begin_dist", set={"bucket_deadline_s": 1e300})
    # ---- whole bodies
    add("begin", "body", "json_list", "MALFORMED_REQUEST", raw=b"[1, 2]", names="object")
    add("begin", "body", "json_string", "MALFORMED_REQUEST", raw=b'"begin"', names="object")
    add("end", "body", "json_null", "MALFORMED_REQUEST", raw=b"null", names="object")
    add("cleanup", "body", "json_number", "MALFORMED_REQUEST", raw=b"42", names="object")
    add("reclaim", "body", "not_utf8", "MALFORMED_REQUEST", raw=b'{"lora_name": "\xff\xfe"}', names="utf-8")
    add("reclaim", "body", "nan_literal", "MALFORMED_REQUEST", raw=b'{"lora_name": "$M", "wait_s": NaN}',
        names="column")
    add("end", "body", "infinity_literal", "MALFORMED_REQUEST", raw=b'{"probe_input_ids": [Infinity]}', names="column")
    add("receive_bucket", "body", "deep_nesting", "MALFORMED_REQUEST", raw=b"[" * DEEP + b"]" * DEEP,
        names="depth")
    add("begin", "body", "too_large", "BODY_TOO_LARGE", raw=b'{"x": "' + b"a" * (17 * 1024 * 1024) + b'"}',
        names="bytes")
    # orjson reads an integer past 64 bits as a float: the field check refuses 1e30 seconds.
    add("reclaim", "wait_s", "integer_past_64_bits", "MALFORMED_REQUEST",
        raw=b'{"lora_name": "$M", "reclaim_id": "r", "wait_s": 1' + b"0" * 30 + b"}")
    # ---- the token
    add("begin", "token", "missing", "UNAUTHORIZED", headers={}, names="token")
    add("reclaim", "token", "wrong", "UNAUTHORIZED", headers={"x-versioned-lora-token": "x" * 16}, names="token")
    add("cleanup", "token", "prefix_of_right", "UNAUTHORIZED", headers={"x-versioned-lora-token": "$TOKEN_PREFIX"},
        names="token")
    add("init_group", "token", "non_ascii", "UNAUTHORIZED", headers={"x-versioned-lora-token": "\u00e9" * 16},
        names="token")
    # ---- end (probe)
    add("end", "probe_input_ids", "out_of_vocab", "TOKEN_OUT_OF_VOCAB", set={"probe_input_ids": [600, 700]})
    add("end", "probe_input_ids", "negative", "TOKEN_OUT_OF_VOCAB", set={"probe_input_ids": [-1]})
    add("end", "probe_input_ids", "empty", "MALFORMED_REQUEST", set={"probe_input_ids": []})
    add("end", "probe_input_ids", "too_long", "MALFORMED_REQUEST", set={"probe_input_ids": [1] * 5000})
    add("end", "probe_input_ids", "strings", "MALFORMED_REQUEST", set={"probe_input_ids": ["1"]})
    add("end", "probe_input_ids", "floats", "MALFORMED_REQUEST", set={"probe_input_ids": [1.0]})
    add("end", "probe_input_ids", "bools", "MALFORMED_REQUEST", set={"probe_input_ids": [True]})
    add("end", "probe_input_ids", "nested", "MALFORMED_REQUEST", set={"probe_input_ids": [[1]]})
    add("end", "incarnation", "huge", "MALFORMED_REQUEST", set={"incarnation": 2**63})
    # ---- receive_bucket
    add("receive_bucket", "index", "negative", "MALFORMED_REQUEST", set={"index": -1})
    add("receive_bucket", "index", "huge", "MALFORMED_REQUEST", set={"index": 2**40})
    add("receive_bucket", "index", "string", "MALFORMED_REQUEST", set={"index": "0"})
    add("receive_bucket", "index", "null", "MALFORMED_REQUEST", set={"index": None})
    # ---- cleanup
    add("cleanup", "attempt_token", "object", "MALFORMED_REQUEST", set={"attempt_token": {"a": 1}})
    add("cleanup", "attempt_token", "empty", "MALFORMED_REQUEST", set={"attempt_token": ""})
    # ---- reclaim
    add("reclaim", "wait_s", "negative", "MALFORMED_REQUEST", set={"wait_s": -1})
    add("reclaim", "wait_s", "above_600", "MALFORMED_REQUEST", set={"wait_s": 601})
    add("reclaim", "wait_s", "bool", "MALFORMED_REQUEST", set={"wait_s": True})
    add("reclaim", "wait_s", "string", "MALFORMED_REQUEST", set={"wait_s": "1"})
    add("reclaim", "reclaim_id", "shell_metachars", "MALFORMED_REQUEST", set={"reclaim_id": "$(id)"})
    add("reclaim", "reclaim_id", "missing", "MALFORMED_REQUEST", set={"reclaim_id": DROP})
    # ---- init_group
    add("init_group", "master_port", "zero", "MALFORMED_REQUEST", set={"master_port": 0})
    add("init_group", "master_port", "above_65535", "MALFORMED_REQUEST", set={"master_port": 70000})
    add("init_group", "master_address", "shell_metachars", "MALFORMED_REQUEST", set={"master_address": "a b;rm"})
    add("init_group", "timeout_s", "zero", "MALFORMED_REQUEST", set={"timeout_s": 0})
    add("init_group", "timeout_s", "huge", "MALFORMED_REQUEST", set={"timeout_s": 1e12})
    add("init_group", "group_name", "other_incarnation", "STALE_INCARNATION", set={"group_name": "vlora-1-x"})
    # This incarnation's digits inside another's: the incarnation is read from the name, not found in it.
    add("init_group", "group_name", "incarnation_as_substring", "STALE_INCARNATION",
        set={"group_name": "vlora-$INC7-x"})
    add("init_group", "group_name", "not_a_group_name", "MALFORMED_REQUEST", set={"group_name": "x-$INC-x"})
    # ---- /generate
    add("generate", "input_ids", "out_of_vocab", "TOKEN_OUT_OF_VOCAB", base="generate_base",
        set={"input_ids": [600, 700]})
    add("generate", "input_ids", "out_of_vocab_managed", "TOKEN_OUT_OF_VOCAB", set={"input_ids": [1, 2, 512]})
    add("generate", "input_ids", "negative", "TOKEN_OUT_OF_VOCAB", set={"input_ids": [-3]})
    add("generate", "input_ids", "batch_out_of_vocab", "TOKEN_OUT_OF_VOCAB", base="generate_base",
        set={"input_ids": [[1, 2], [9999]]})
    add("generate", "input_ids", "empty", "MALFORMED_REQUEST", set={"input_ids": []})
    add("generate", "input_ids", "longer_than_context", "MALFORMED_REQUEST", set={"input_ids": [1] * 2100})
    add("generate", "input_ids", "floats", "MALFORMED_REQUEST", set={"input_ids": [1.0, 2.0]})
    add("generate", "input_embeds", "not_allowed", "UNKNOWN_FIELD", set={"input_embeds": [[0.5] * 128]})
    add("generate", "custom_logit_processor", "not_allowed", "UNKNOWN_FIELD",
        set={"custom_logit_processor": '{"callable": "x"}'})
    add("generate", "text", "not_allowed", "UNKNOWN_FIELD", set={"text": "hello"})
    add("generate", "return_hidden_states", "not_allowed", "UNKNOWN_FIELD", set={"return_hidden_states": True})
    add("generate", "image_data", "not_allowed", "UNKNOWN_FIELD", set={"image_data": "http://x/y.png"})
    add("generate", "sampling_params.max_new_tokens", "negative", "MALFORMED_REQUEST",
        set={"sampling_params": {"max_new_tokens": -1}}, names="max_new_tokens")
    add("generate", "sampling_params.max_new_tokens", "huge", "MALFORMED_REQUEST",
        set={"sampling_params": {"max_new_tokens": 10**9}}, names="max_new_tokens")
    add("generate", "sampling_params.temperature", "negative", "MALFORMED_REQUEST",
        set={"sampling_params": {"temperature": -1.0}}, names="temperature")
    add("generate", "sampling_params.top_p", "zero", "MALFORMED_REQUEST", set={"sampling_params": {"top_p": 0}},
        names="top_p")
    add("generate", "sampling_params.stop_token_ids", "out_of_vocab", "TOKEN_OUT_OF_VOCAB",
        set={"sampling_params": {"stop_token_ids": [600]}}, names="stop_token_ids")
    add("generate", "sampling_params.regex", "not_allowed", "UNKNOWN_FIELD", set={"sampling_params": {"regex": "a+"}},
        names="regex")
    add("generate", "top_logprobs_num", "huge", "MALFORMED_REQUEST", set={"top_logprobs_num": 10**6})
    add("generate", "rid", "with_space", "MALFORMED_REQUEST", set={"rid": "a b"})
    add("generate", "lora_path", "ten_thousand_chars", "MALFORMED_REQUEST", set={"lora_path": "x" * 10_000})
    add("generate", "priority", "huge", "MALFORMED_REQUEST", set={"priority": 2**40})
    add("generate", "stream", "string", "MALFORMED_REQUEST", set={"stream": "yes"})
    # ---- cache keys (upstream SGLang #24638)
    add("generate", "extra_key", "on_managed_request", "CACHE_KEY_REFUSED", set={"extra_key": "mine"})
    add("generate", "cache_salt", "on_managed_request", "CACHE_KEY_REFUSED", set={"cache_salt": "mine"})
    add("generate", "extra_key", "base_request_names_managed_lora_id", "CACHE_KEY_REFUSED", base="generate_base",
        set={"extra_key": "$M_LORA_ID"})
    add("generate", "extra_key", "base_request_embeds_managed_lora_id", "CACHE_KEY_REFUSED", base="generate_base",
        set={"extra_key": "x$M_LORA_ID|ns"})
    # ---- the test-only hold points (managed/hold_points.py; the suite's engines have them)
    add("test_hold", "point", "unknown", "MALFORMED_REQUEST", set={"point": "nowhere"})
    add("test_hold", "point", "integer", "MALFORMED_REQUEST", set={"point": 3})
    add("test_hold", "lora_name", "not_managed", "NOT_MANAGED", set={"lora_name": "plain-name"})
    add("test_hold", "release", "string", "MALFORMED_REQUEST", set={"release": "yes"})
    add("test_hold", "extra", "unknown_field", "UNKNOWN_FIELD", set={"extra": 1})
    add("test_hold", "token", "missing", "UNAUTHORIZED", headers={}, names="token")
    # ---- serving routes other than /generate (managed/route_gate.py): refused before a handler reads the body;
    # the out-of-vocabulary completion crashed nothing before either (the tokenizer manager checks token ids)
    for fault, path, body in (
        ("v1_completions", "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}),
        ("v1_completions_managed_extra_key", "/v1/completions",
         {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "extra_key": "$M_LORA_ID"}),
        ("v1_completions_out_of_vocab", "/v1/completions", {"model": "m", "prompt": [600, 700], "max_tokens": 2}),
        ("v1_chat_completions", "/v1/chat/completions",
         {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("v1_responses", "/v1/responses", {"model": "m", "input": "hi"}),
        ("v1_score", "/v1/score", {"model": "m", "query": "a", "items": ["b"]}),
        ("v1_messages", "/v1/messages",
         {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        ("v1_not_a_route", "/v1/not-a-route", {}),
        ("encode", "/encode", {"input_ids": [1, 2, 3]}),
        ("classify", "/classify", {"input_ids": [1, 2, 3]}),
        ("invocations", "/invocations", {"input_ids": [1, 2, 3]}),
        ("vertex_predict", "/vertex_generate", {"instances": [{"input_ids": [1, 2, 3]}]}),
        ("ollama_generate", "/api/generate", {"model": "m", "prompt": "hi"}),
        ("ollama_chat", "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ):
        add("route", "path", fault, "ROUTE_NOT_SERVED", base="route", set={"$PATH": path, **body}, names="path")
    # ---- the registry's Reserve (Ray actor), before anything is taken
    add("reserve", "version_id", "negative_int", "INVALID_IDENTITY", set={"version_id": -1})
    add("reserve", "version_id", "int_10e30", "INVALID_IDENTITY", set={"version_id": 10**30})
    add("reserve", "version_id", "empty", "INVALID_IDENTITY", set={"version_id": ""})
    add("reserve", "version_id", "path_traversal", "INVALID_IDENTITY", set={"version_id": "../x"})
    add("reserve", "version_id", "too_long", "INVALID_IDENTITY", set={"version_id": "v" * 65})
    add("reserve", "digest", "not_hex", "INVALID_IDENTITY", set={"digest": "1" * 63 + "g"})
    add("reserve", "digest", "uppercase", "INVALID_IDENTITY", set={"digest": "A" * 64})
    add("reserve", "digest", "short", "INVALID_IDENTITY", set={"digest": "1" * 12})
    add("reserve", "epoch", "negative", "INVALID_IDENTITY", set={"epoch": -1})
    # ---- the snapshot builder (what a publisher gets before any reserve)
    add("snapshot", "tensor", "nan", "SNAPSHOT_REFUSED", set={"fault": "nan"}, names="lora_A")
    add("snapshot", "tensor", "inf", "SNAPSHOT_REFUSED", set={"fault": "inf"}, names="lora_B")
    add("snapshot", "tensor", "int_dtype", "SNAPSHOT_REFUSED", set={"fault": "int32"}, names="int32")
    add("snapshot", "tensor", "float64_dtype", "SNAPSHOT_REFUSED", set={"fault": "float64"}, names="float64")
    add("snapshot", "tensor", "rank_not_config", "SNAPSHOT_REFUSED", set={"fault": "rank"}, names="rank")
    add("snapshot", "tensor", "three_dimensional", "SNAPSHOT_REFUSED", set={"fault": "3d"}, names="2-D")
    add("snapshot", "tensor", "none_at_all", "SNAPSHOT_REFUSED", set={"fault": "empty"}, names="no tensors")
    return rows


ROWS = _rows()
assert len({row.id for row in ROWS}) == len(ROWS), "row ids must be unique"
