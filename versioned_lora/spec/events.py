"""Events: frozen values, each carrying the identities that make it idempotent.

Registry events are what the runtime reports to the single-writer registry; engine events are what
the SGLang patch feeds its own managed-adapter machine. The table names events by class name.
"""

from __future__ import annotations

import attrs

from versioned_lora.spec.identities import SessionKey, VersionKey
from versioned_lora.spec.model import ENCODED_WHEN_SET
from versioned_lora.spec.states import Machine

# A fence of 0 is "no lease": what every Reserve and Commit carried before leases existed (journals of that
# time replay unchanged: the field is encoded only when set).
NO_FENCE = 0

# ---- registry: publication ----


@attrs.frozen
class Reserve:
    """Take a managed slot for `version` with content `digest` and open its publication attempt."""

    version: VersionKey
    digest: str
    fence: int = attrs.field(default=NO_FENCE, metadata={ENCODED_WHEN_SET: True})  # the publisher lease's


@attrs.frozen
class RecordPrepared:
    version: VersionKey
    attempt_token: str
    engine: str
    incarnation: int
    digest: str


@attrs.frozen
class RecordReady:
    """READY_LOCAL from one engine: counts only for this attempt, incarnation and digest."""

    version: VersionKey
    attempt_token: str
    engine: str
    incarnation: int
    digest: str


@attrs.frozen
class RecordUnknown:
    """An engine's answer for this attempt was lost or never came: keep everything, assume nothing."""

    version: VersionKey
    attempt_token: str
    engine: str


@attrs.frozen
class Commit:
    version: VersionKey
    attempt_token: str
    expected_default_revision: int
    fence: int = attrs.field(default=NO_FENCE, metadata={ENCODED_WHEN_SET: True})  # the publisher lease's


@attrs.frozen
class Abort:
    version: VersionKey
    attempt_token: str


@attrs.frozen
class RecordCleaned:
    version: VersionKey
    attempt_token: str
    engine: str


# ---- registry: reclaim ----


@attrs.frozen
class ClaimReclaim:
    version: VersionKey


@attrs.frozen
class ConfirmReclaim:
    """UNLOADED receipt from one engine (also when that incarnation never held the name)."""

    version: VersionKey
    engine: str
    reclaim_id: str


# ---- registry: sessions ----


@attrs.frozen
class OpenSession:
    session: SessionKey


@attrs.frozen
class BindFirst:
    session: SessionKey


@attrs.frozen
class BeginClose:
    session: SessionKey


@attrs.frozen
class CloseAndRelease:
    session: SessionKey


# ---- registry: engines ----


@attrs.frozen
class EngineRestarted:
    engine: str
    incarnation: int


# ---- registry: the publisher lease ----
# One publisher at a time (RFC §3: one publisher per deployment). A publisher acquires the lease, renews it
# while it works, and releases it; the registry's own timer expires a lease its holder stopped renewing; an
# operator who knows the holder is gone takes it over at once. Each grant mints a new fence (a fencing epoch):
# Reserve and Commit carry it, and one that is not the live lease's is refused, so a publisher that lost its
# lease (partitioned, paused, replaced) cannot publish on the strength of an old one.


@attrs.frozen
class AcquireLease:
    holder: str  # who asks (a publisher's name: "trainer", "cli@host:pid"); the same holder again is a replay
    ttl_s: float  # how long the lease lasts without a renewal (the registry's timer, not the caller's clock)


@attrs.frozen
class RenewLease:
    holder: str
    fence: int


@attrs.frozen
class ReleaseLease:
    holder: str
    fence: int


@attrs.frozen
class ExpireLease:
    """The registry's timer for `fence` fired: its holder did not renew within the lease's ttl."""

    fence: int


@attrs.frozen
class TakeOverLease:
    """Crash recovery: end the lease under `fence` now (its holder is known to be gone) and grant it to
    `holder`. Naming the fence makes it deliberate: a take-over of a lease that moved on is refused."""

    holder: str
    fence: int
    ttl_s: float


# ---- engine side (managed adapter x engine) ----


@attrs.frozen
class BeginStaging:
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str
    bucket_count: int


@attrs.frozen
class ReceiveBucket:
    lora_name: str
    attempt_token: str
    incarnation: int
    index: int


@attrs.frozen
class EndStaging:
    """`manifest_ok` is the verdict of the patch's check of the received weights against the manifest."""

    lora_name: str
    attempt_token: str
    incarnation: int
    manifest_ok: bool


@attrs.frozen
class CleanupAttempt:
    lora_name: str
    attempt_token: str


@attrs.frozen
class AcquireRequest:
    lora_name: str


@attrs.frozen
class ReleaseRequest:
    lora_name: str


@attrs.frozen
class ReclaimAdapter:
    lora_name: str
    reclaim_id: str


@attrs.frozen
class FinishUnload:
    """SGLang's `wait_for_unload` returned for this name: the physical unload may run (once)."""

    lora_name: str
    reclaim_id: str


# ---- engine side: the outcomes of its own effects (issue 41) ----
# What SGLang answered when the engine carried out an effect that can fail is an input like any other: the executor
# reports it and a row decides (a failed load frees its stash, a load that finishes after cleanup began is unloaded,
# a failed unload stays accounted). An executor decides nothing.


@attrs.frozen
class LoadDone:
    """SGLang's load of this attempt (`LoadPinned`) succeeded: the adapter is registered and pinned there."""

    lora_name: str
    attempt_token: str


@attrs.frozen
class LoadFailed:
    """SGLang's load of this attempt (`LoadPinned`) failed: nothing of it is loaded."""

    lora_name: str
    attempt_token: str


@attrs.frozen
class UnloadDone:
    """SGLang's physical unload of this name (`PhysicalUnload`) succeeded: its weights and its slot are freed."""

    lora_name: str


@attrs.frozen
class UnloadFailed:
    """SGLang's physical unload of this name (`PhysicalUnload`) failed: its weights stay loaded and pinned."""

    lora_name: str


@attrs.frozen
class EngineStarted:
    incarnation: int


RegistryEvent = (
    Reserve
    | RecordPrepared
    | RecordReady
    | RecordUnknown
    | Commit
    | Abort
    | RecordCleaned
    | ClaimReclaim
    | ConfirmReclaim
    | OpenSession
    | BindFirst
    | BeginClose
    | CloseAndRelease
    | EngineRestarted
    | AcquireLease
    | RenewLease
    | ReleaseLease
    | ExpireLease
    | TakeOverLease
)
EngineEvent = (
    BeginStaging
    | ReceiveBucket
    | EndStaging
    | CleanupAttempt
    | AcquireRequest
    | ReleaseRequest
    | ReclaimAdapter
    | FinishUnload
    | LoadDone
    | LoadFailed
    | UnloadDone
    | UnloadFailed
    | EngineStarted
)

# Which machine each event is located on: the machine whose state selects the row.
EVENT_MACHINE: dict[type, Machine] = {
    Reserve: Machine.VERSION,
    Commit: Machine.VERSION,
    Abort: Machine.VERSION,
    ClaimReclaim: Machine.VERSION,
    RecordPrepared: Machine.ATTEMPT,
    RecordReady: Machine.ATTEMPT,
    RecordUnknown: Machine.ATTEMPT,
    RecordCleaned: Machine.ATTEMPT,
    OpenSession: Machine.SESSION,
    BindFirst: Machine.SESSION,
    BeginClose: Machine.SESSION,
    CloseAndRelease: Machine.SESSION,
    ConfirmReclaim: Machine.RECLAIM,
    EngineRestarted: Machine.ENGINE,
    AcquireLease: Machine.LEASE,
    RenewLease: Machine.LEASE,
    ReleaseLease: Machine.LEASE,
    ExpireLease: Machine.LEASE,
    TakeOverLease: Machine.LEASE,
    BeginStaging: Machine.ADAPTER,
    ReceiveBucket: Machine.ADAPTER,
    EndStaging: Machine.ADAPTER,
    CleanupAttempt: Machine.ADAPTER,
    AcquireRequest: Machine.ADAPTER,
    ReleaseRequest: Machine.ADAPTER,
    ReclaimAdapter: Machine.ADAPTER,
    FinishUnload: Machine.ADAPTER,
    LoadDone: Machine.ADAPTER,
    LoadFailed: Machine.ADAPTER,
    UnloadDone: Machine.ADAPTER,
    UnloadFailed: Machine.ADAPTER,
    EngineStarted: Machine.PROCESS,
}
EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in EVENT_MACHINE}
REGISTRY_EVENT_TYPES: tuple[type, ...] = tuple(
    c for c, m in EVENT_MACHINE.items() if m not in (Machine.ADAPTER, Machine.PROCESS)
)
ENGINE_EVENT_TYPES: tuple[type, ...] = tuple(
    c for c, m in EVENT_MACHINE.items() if m in (Machine.ADAPTER, Machine.PROCESS)
)
