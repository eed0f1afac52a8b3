"""What both ends of the managed HTTP protocol agree on, in one place: the engine's patch set
(`sglang_patches/`) and the library's side of it (`adapters/`, the CLI, the demo) both import these, so
neither imports the other for a constant. The engine advertises `PROTOCOL_VERSION` in
`/versioned_lora/status` (`protocol`); a publisher checks it before its first `begin` on an engine
incarnation (`adapters.engine_staging`)."""

from __future__ import annotations

import re
from enum import StrEnum

from versioned_lora.spec.reasons import Reason

# Bumped on any change to what the managed endpoints take or answer that a publisher of another version
# would misread.
PROTOCOL_VERSION = 2


class PortRefusal(StrEnum):
    """What the library's engine ports refuse on their own, before a call is sent (`adapters.engine_staging`)."""

    PROTOCOL_MISMATCH = "PROTOCOL_MISMATCH"  # the engine speaks another protocol version: no begin is sent
    # The engine accepts none of the keys the registry signs under (`capabilities.key_id`, both ids in the message):
    # no begin, cleanup or reclaim is sent; the deployment's key files differ (docs/runbook.md, "KEY_MISMATCH").
    KEY_MISMATCH = "KEY_MISMATCH"


PROTOCOL_MISMATCH = PortRefusal.PROTOCOL_MISMATCH
KEY_MISMATCH = PortRefusal.KEY_MISMATCH

# ---- HTTP
MANAGED_PREFIX = "/versioned_lora/"  # POST MANAGED_PREFIX + operation (begin, bucket, end, cleanup, reclaim, ...)
STATUS_PATH = MANAGED_PREFIX + "status"  # GET: incarnation, protocol, managed adapters, patch set
TOKEN_HEADER = "x-versioned-lora-token"  # the managed endpoints' token (TOKEN_ENV on the engine)

# ---- the engine process's environment
TOKEN_ENV = "VERSIONED_LORA_TOKEN"  # the managed endpoints' token
SOURCE_ROOT_ENV = "VERSIONED_LORA_SOURCE_ROOT"  # where a `begin` may read a candidate from disk
PATCHES_ENV = "VERSIONED_LORA_PATCHES"  # which patch set to apply (sglang_patches.mechanism)
EXIT_WITH_PARENT_ENV = "VERSIONED_LORA_EXIT_WITH_PARENT"  # the engine exits when the process that started it does
STAGING_ADDRESS_ENV = "VERSIONED_LORA_STAGING_ADDRESS"  # the HTTP server's channel to the scheduler's stash
STANDBY_FILE_ENV = "VERSIONED_LORA_STANDBY_FILE"  # a warm standby: the file that names the port to serve on
# How the scheduler verifies a stash: "pipelined" (the default: each bucket hashed as it lands) or
# "after-last-bucket" (every hash after the last bucket, on one thread: the verification as it was before,
# kept only as the baseline benchmarks/end_phase.py measures the default against in the same run).
VERIFY_MODE_ENV = "VERSIONED_LORA_VERIFY_MODE"
VERIFY_MODES = ("pipelined", "after-last-bucket")


# ---- transfer groups
# One torch.distributed group per engine incarnation and link: `vlora-<incarnation>-<nonce>`. The engine joins
# only a group named for its own incarnation, read from the name exactly (never as a substring).
_TRANSFER_GROUP = re.compile(r"vlora-(0|[1-9][0-9]{0,20})-([A-Za-z0-9]{1,64})")


def transfer_group_name(incarnation: int, nonce: str) -> str:
    name = f"vlora-{incarnation}-{nonce}"
    if transfer_group_incarnation(name) != incarnation:
        raise ValueError(f"not a transfer group name: {name!r} (the nonce is 1..64 letters and digits)")
    return name


def transfer_group_incarnation(name: str) -> int | None:
    """The incarnation a transfer group is named for; None if `name` is not a transfer group name."""
    match = _TRANSFER_GROUP.fullmatch(name)
    return None if match is None else int(match.group(1))


# ---- refusal codes
class EngineRefusal(StrEnum):
    """Every code a managed engine refuses with besides the table's own reasons (`spec.reasons.Reason`, which
    the engine-side rows answer): the input checks at its boundary and the failures of its I/O. The engine
    raises and counts only these two enums (a test holds `sglang_patches/` to it), so a caller can match a
    code without a string of its own and the `reason` label of the engine's refusal counter is bounded."""

    # the request itself (HTTP 400 unless said): nothing was read from it, nothing changed
    MALFORMED_REQUEST = "MALFORMED_REQUEST"  # a field of the wrong type, range or shape
    UNKNOWN_FIELD = "UNKNOWN_FIELD"  # a field the endpoint does not take
    BODY_TOO_LARGE = "BODY_TOO_LARGE"  # 413, refused before the body is read
    UNAUTHORIZED = "UNAUTHORIZED"  # 401: bad or missing token
    TOKEN_OUT_OF_VOCAB = "TOKEN_OUT_OF_VOCAB"  # a token id outside the model's vocabulary
    CACHE_KEY_REFUSED = "CACHE_KEY_REFUSED"  # a field that would name a managed version's KV namespace
    ROUTE_NOT_SERVED = "ROUTE_NOT_SERVED"  # 404: a generation route other than /generate
    MANAGED_ADAPTER = "MANAGED_ADAPTER"  # SGLang's own load/unload naming a managed version
    NOT_MANAGED = "NOT_MANAGED"  # a managed call for a name outside the managed namespace
    INVALID_NAME = "INVALID_NAME"  # a managed name that does not parse
    NAME_DIGEST_MISMATCH = "NAME_DIGEST_MISMATCH"  # the name's digest part is not the declared digest's
    CAPABILITY_MISSING = "CAPABILITY_MISSING"  # 403: a call that needs the registry's capability came without
    CAPABILITY_INVALID = "CAPABILITY_INVALID"  # 403: a capability that is not the registry's for this call
    HOLD_POINTS_DISABLED = "HOLD_POINTS_DISABLED"  # 403: test-only hold points on an engine started without
    # the candidate: refused at `begin`, nothing staged
    SOURCE_PATH_REFUSED = "SOURCE_PATH_REFUSED"  # a disk source outside the engine's source root
    UNSUPPORTED_MANIFEST = "UNSUPPORTED_MANIFEST"  # a manifest version or hash kind this engine does not know
    MALFORMED_MANIFEST = "MALFORMED_MANIFEST"
    DIGEST_MISMATCH = "DIGEST_MISMATCH"  # the manifest's digest is not the declared one
    BUCKET_TOO_LARGE = "BUCKET_TOO_LARGE"
    PLAN_MISMATCH = "PLAN_MISMATCH"  # the publisher's bucket plan differs from the one rebuilt here
    UNSUPPORTED_ADAPTER = "UNSUPPORTED_ADAPTER"  # rank, target modules or dtypes this engine cannot serve
    NO_FREE_SLOT = "NO_FREE_SLOT"  # 409: every managed slot of this engine is taken
    PROBE_NOT_FINITE = "PROBE_NOT_FINITE"  # the loaded candidate's probe logprob is not finite
    # the engine's own I/O: the call failed there (5xx), typed
    GROUP_FAILED = "GROUP_FAILED"  # 502: the transfer group did not form
    BUCKET_DEADLINE = "BUCKET_DEADLINE"  # 504: a bucket's bytes did not arrive in time
    BUCKET_FAILED = "BUCKET_FAILED"  # 502: a bucket's collective failed
    STASH_NOT_VERIFIED = "STASH_NOT_VERIFIED"  # a stash load of an attempt whose stash was not verified
    SCHEDULER_CALL_FAILED = "SCHEDULER_CALL_FAILED"  # 500: the staging channel to the scheduler failed
    INTERNAL_ERROR = "INTERNAL_ERROR"  # 500: anything else; the engine keeps serving


EngineCode = Reason | EngineRefusal
# What the engine's refusal counter may label a refusal with: every code, and OTHER for anything else.
ENGINE_CODES = frozenset(map(str, Reason)) | frozenset(map(str, EngineRefusal))
OTHER_CODE = "OTHER"
