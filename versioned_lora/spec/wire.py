"""What both ends of the managed HTTP protocol agree on: the engine's patch set advertises it in
`/versioned_lora/status` (`protocol`), a publisher checks it before its first `begin` on an engine
incarnation (`adapters.engine_staging`)."""

from __future__ import annotations

# Bumped on any change to what the managed endpoints take or answer that a publisher of another version
# would misread.
PROTOCOL_VERSION = 2
PROTOCOL_MISMATCH = "PROTOCOL_MISMATCH"  # the typed refusal a publisher raises for an engine of another version
