"""What `step` and `engine_step` answer. Refusals are values (`Rejected`), never exceptions."""

from __future__ import annotations

import attrs

from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.model import CommitReceipt
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import AdapterState, LeaseState, PlacementState, SessionState, VersionState


@attrs.frozen
class Rejected:
    """An expected refusal. `row` is the table row that explains it."""

    reason: Reason
    row: str


@attrs.frozen
class Reserved:
    version: VersionKey
    lora_name: str
    attempt_token: str
    state: VersionState  # LOADING for a live attempt; a replay reports wherever the version is now


@attrs.frozen
class Recorded:
    version: VersionKey
    engine: str
    state: PlacementState


@attrs.frozen
class Committed:
    receipt: CommitReceipt


@attrs.frozen
class Aborted:
    version: VersionKey
    attempt_token: str
    state: VersionState


@attrs.frozen
class ReclaimClaimed:
    version: VersionKey
    reclaim_id: str
    state: VersionState


@attrs.frozen
class ReclaimConfirmed:
    version: VersionKey
    engine: str
    state: VersionState  # RECLAIMED once every engine confirmed


@attrs.frozen
class SessionStatus:
    session: SessionKey
    state: SessionState
    version: VersionKey | None


@attrs.frozen
class Bound:
    session: SessionKey
    version: VersionKey
    lora_name: str  # what every request of this session carries as lora_path


@attrs.frozen
class Closed:
    session: SessionKey
    released: bool  # True exactly once per bound session


@attrs.frozen
class Restarted:
    engine: str
    incarnation: int


@attrs.frozen
class LeaseGranted:
    """The caller holds the publisher lease under `fence` (its Reserve and Commit carry it) for `ttl_s`
    from now unless it renews."""

    holder: str
    fence: int
    ttl_s: float


@attrs.frozen
class LeaseStatus:
    state: LeaseState
    holder: str | None
    fence: int  # the last fence granted (0: none yet)


@attrs.frozen
class AdapterStatus:
    lora_name: str
    state: AdapterState
    attempt_token: str | None
    incarnation: int
    native_refs: int
    buckets_received: int
    reclaim_id: str | None
    absent: bool


@attrs.frozen
class ReadyLocal:
    """READY_LOCAL: the engine holds exactly this content for this attempt in this incarnation."""

    lora_name: str
    digest: str
    attempt_token: str
    incarnation: int


@attrs.frozen
class ProcessStatus:
    engine: str
    incarnation: int


RegistryResult = (
    Rejected
    | Reserved
    | Recorded
    | Committed
    | Aborted
    | ReclaimClaimed
    | ReclaimConfirmed
    | SessionStatus
    | Bound
    | Closed
    | Restarted
    | LeaseGranted
    | LeaseStatus
)
EngineResult = Rejected | AdapterStatus | ReadyLocal | ProcessStatus
