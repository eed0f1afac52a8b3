"""What both ends of the managed HTTP protocol agree on, in one place: the engine's patch set
(`sglang_patches/`) and the library's side of it (`adapters/`, the CLI, the demo) both import these, so
neither imports the other for a constant. The engine advertises `PROTOCOL_VERSION` in
`/versioned_lora/status` (`protocol`); a publisher checks it before its first `begin` on an engine
incarnation (`adapters.engine_staging`)."""

from __future__ import annotations

# Bumped on any change to what the managed endpoints take or answer that a publisher of another version
# would misread.
PROTOCOL_VERSION = 2
PROTOCOL_MISMATCH = "PROTOCOL_MISMATCH"  # the typed refusal a publisher raises for an engine of another version

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
TEST_HOLD_POINTS_ENV = "VERSIONED_LORA_TEST_HOLD_POINTS"  # "1": the test-only hold points may be armed
