"""Why a request was refused. These are results, never exceptions: every one of them is an expected
answer to a late, duplicated, stale or premature message (DESIGN.md §3)."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    VERSION_CONFLICT = "VERSION_CONFLICT"  # same key, other digest (forever within the epoch)
    CAPACITY_ERROR = "CAPACITY_ERROR"  # every managed slot is taken; refused before any transfer
    PUBLICATION_IN_PROGRESS = "PUBLICATION_IN_PROGRESS"  # one pending attempt (or its cleanup) at a time
    STALE_ATTEMPT = "STALE_ATTEMPT"  # the token is not the live attempt's (late, cleaned or committed)
    STALE_INCARNATION = "STALE_INCARNATION"  # the message comes from (or is meant for) an older process
    NO_PUBLISHED_VERSION = "NO_PUBLISHED_VERSION"  # bind before the bootstrap commit
    SESSION_CLOSED = "SESSION_CLOSED"  # the session is finalizing or closed
    NOT_RECLAIMABLE = "NOT_RECLAIMABLE"  # not RETIRED with zero session refs, or a forged reclaim id
    UNKNOWN_VERSION = "UNKNOWN_VERSION"  # no such version in this epoch
    REVISION_MISMATCH = "REVISION_MISMATCH"  # commit's expected_default_revision is not the current one
    NOT_READY = "NOT_READY"  # commit before every target engine is READY in its current incarnation
    LEASE_HELD = "LEASE_HELD"  # another publisher holds the publisher lease (acquire, or take over a fence not live)
    NOT_LEASE_HOLDER = "NOT_LEASE_HOLDER"  # reserve, commit or renew without the live lease's fence (lost, expired)
    VERSION_UNAVAILABLE = "VERSION_UNAVAILABLE"  # engine side: the exact name is not servable here
    INCOMPLETE_TRANSFER = "INCOMPLETE_TRANSFER"  # engine side: end before every bucket arrived
    MANIFEST_MISMATCH = "MANIFEST_MISMATCH"  # engine side: the received weights do not match the manifest
    BAD_BUCKET = "BAD_BUCKET"  # engine side: a bucket out of order or out of range
    IN_USE = "IN_USE"  # engine side: native refcount > 0, or a load of the name still runs: ask again later
    LOAD_FAILED = "LOAD_FAILED"  # engine side: SGLang's load failed; the stash is freed, the attempt cleaned there
    UNLOAD_FAILED = "UNLOAD_FAILED"  # engine side: SGLang's unload failed; still loaded and accounted, retried
