"""The ports the runtime speaks through (DESIGN.md §4): typing Protocols the runtime defines and the
adapters implement. Imports point toward the core: this module imports `lifecycle`, never `adapters`.

* `RegistryPort`: the single-writer registry (a Ray actor in production, an in-process core in tests
  and tools). Every call carries an idempotency key; the same key retried after a lost reply or a
  registry restart is answered from the registry's journal, never applied twice.
* `GenerationBackend`: the engine-facing generate/abort call (SGLang over HTTP in production). It must
  never resend on its own: a lost reply is `OutcomeUnknown`, a certain refusal is `BackendFailure`.
* `SnapshotStorePort`: the versions' bytes by digest, for a rehydrate after their publisher is gone.
* `StagingEnginePort`: one engine's managed staging and reclaim calls, as the Publisher and the
  Reclaimer drive them: a lost reply is `EngineUnreachable`, a typed refusal `EngineRefused`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from versioned_lora.lifecycle import RegistryEffect, RegistryEvent, RegistryResult, VersionKey, VersionState
from versioned_lora.runtime.views import DispatchView, PublicationView
from versioned_lora.spec.model import ENCODED_WHEN_SET

# One registry call applies at most this many events (one journal transaction, one fsync). The bound
# keeps a call's latency and the actor's pause for other callers short; callers with more split.
MAX_BATCH = 256


@attrs.frozen
class RegistryAnswer:
    """What the registry answers for one event: the core's result and the effects the caller must
    carry out (the registry itself never performs I/O beyond its journal)."""

    result: RegistryResult
    effects: tuple[RegistryEffect, ...]
    journal_seq: int | None  # the journal row that holds this call; None if the call changed nothing
    from_journal: bool = False  # True when a retried key was answered from the journal, not re-applied
    # One per effect, aligned with `effects`: the capability an engine needs to carry that effect out
    # (cleanups and reclaims, `versioned_lora.capabilities`), None for the others. Added by the registry
    # when it answers; never journaled (a replayed answer is signed again).
    capabilities: tuple[str | None, ...] = ()
    # The ids of the keys the registry signs under now (`capabilities.key_id`, never a key), the current first:
    # what an engine port compares with the engine's before its first call there (KEY_MISMATCH). Empty: a registry
    # built insecure. Added when it answers, never journaled (encoded only when set, so a row stays as it was).
    key_ids: tuple[str, ...] = attrs.field(default=(), metadata={ENCODED_WHEN_SET: True})

    def capability_of(self, index: int) -> str | None:
        return self.capabilities[index] if index < len(self.capabilities) else None


# ---- errors of the registry port ----


class RegistryError(Exception):
    """Base class of the registry port's errors (expected refusals are `Rejected` results instead)."""


class BatchTooLarge(RegistryError, ValueError):
    """More than MAX_BATCH events in one call; nothing was applied."""

    def __init__(self, size: int) -> None:
        super().__init__(f"batch of {size} events exceeds MAX_BATCH={MAX_BATCH}; split it")
        self.size = size


class IdempotencyKeyReused(RegistryError):
    """The key was already used for different events: a caller bug, never answered from the journal."""


class RegistryUnavailable(RegistryError):
    """The registry did not answer within the caller's deadline (e.g. its actor is restarting). The call
    may or may not have been applied; retrying with the same key is safe and resolves it."""


@runtime_checkable
class RegistryPort(Protocol):
    async def submit(self, event: RegistryEvent, key: str | None = None) -> RegistryAnswer:
        """Apply one event. `key` defaults to a fresh one; pass the same key to retry the same call."""
        ...

    async def submit_batch(
        self, events: Sequence[RegistryEvent], key: str | None = None
    ) -> tuple[RegistryAnswer, ...]:
        """Apply up to MAX_BATCH events atomically, in order, with one journal write (one fsync).
        Raises BatchTooLarge above MAX_BATCH; a ProtocolError (a bug) on any event applies none."""
        ...

    async def version_states(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, VersionState]:
        """Read-only: the current state of each known version (unknown versions are left out)."""
        ...

    async def dispatch_view(self, versions: Collection[VersionKey]) -> Mapping[VersionKey, DispatchView]:
        """Read-only: for each known version, its state and the engines requests for it may go to now
        (unknown versions are left out). What the dispatch gate and the router decide by."""
        ...

    async def state_digest(self) -> str:
        """SHA-256 of the canonical encoding of the registry state (equal states, equal digests, in
        any process)."""
        ...

    async def publication_view(self, all_versions: bool = False) -> PublicationView:
        """Read-only: default, revision, engine incarnations and every live version with its placements, and
        the last few ended ones (`all_versions`: every version) — no sessions — what the Publisher, the
        Reclaimer and routing need to decide."""
        ...

    async def key_ids(self) -> tuple[str, ...]:
        """Read-only: the ids of the keys the registry signs under now (`RegistryAnswer.key_ids`), for an executor
        about to call an engine before any answer of the registry told it (a rehydrate's `begin`)."""
        ...


# ---- the engine-facing port ----


@attrs.frozen
class BackendRequest:
    """One backend generation attempt. `rid` is unique per attempt; `lora_path` is the session's bound,
    immutable lora_name and is never rewritten below the session layer."""

    rid: str
    input_ids: tuple[int, ...]
    lora_path: str
    max_new_tokens: int
    sampling: Mapping[str, Any] = attrs.field(factory=dict)
    # The engines the request may go to (the version is servable there now); empty: any engine.
    engines: frozenset[str] = frozenset()


@attrs.frozen
class BackendResponse:
    rid: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "abort" (a temporarily aborted request returns its partial output)
    cached_tokens: int = 0


class OutcomeUnknown(Exception):
    """The backend may or may not have accepted the request (timeout, lost connection). Never resent
    automatically; the agentic layer must resolve it (e.g. abort the rid) before a new attempt."""


class BackendFailure(Exception):
    """The backend certainly refused or failed the request (an HTTP error status, a refused version):
    the agentic layer may retry with a new attempt. `engine` is the engine that answered; `reason` the
    engine's refusal code when it gave one (e.g. `Reason.VERSION_UNAVAILABLE`)."""

    def __init__(
        self, message: str, status_code: int | None = None, *, engine: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.engine = engine
        self.reason = reason


@runtime_checkable
class GenerationBackend(Protocol):
    async def generate(self, request: BackendRequest) -> BackendResponse:
        """Send once. Raises OutcomeUnknown or BackendFailure; never retries."""
        ...

    async def abort(self, rid: str) -> None:
        """Ask the engine to end `rid` (a no-op for a finished or unknown rid)."""
        ...


# ---- the engine's staging port (Publisher, Reclaimer) ----

CandidateT_contra = TypeVar("CandidateT_contra", contravariant=True)


@attrs.frozen
class ServedIdentity:
    """A version as an engine serves it (adapters/served.py): the served digest, the hash of its tensors in the LoRA
    pool's `dtype` with the pool's stacking and padding undone, and `config`, the rank, alpha, scaling and target
    modules the engine applies them with (canonical JSON, so two compare as strings)."""

    dtype: str
    digest: str
    config: str


class CandidatePort(Protocol):
    """One version as shipped: the adapters' `Candidate` (name, frozen snapshot, bucket plan)."""

    @property
    def lora_name(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def bucket_count(self) -> int: ...

    def served_identity(self) -> ServedIdentity:
        """The snapshot as an engine must serve it: every engine's read-back of its own pool must equal this."""
        ...


@attrs.frozen
class ReadyReceipt:
    """What an engine's `end` answered: READY_LOCAL plus the probe: the greedy next token with its logprob, and
    `probe_scores`, the candidate's logprob of each probe token after the ones before it (teacher-forced), which
    the probe checks compare (`adapters/probe_check.py`); and `served`, what the engine read back from its LoRA
    memory pool after the load (None when it could not: `served_error` says why), which the publisher requires to
    equal the candidate's `served_identity` (`runtime/served_check.py`)."""

    lora_name: str
    digest: str
    attempt_token: str
    incarnation: int
    probe_token: int
    probe_logprob: float
    probe_scores: tuple[float, ...] = ()
    served: ServedIdentity | None = None
    served_error: str = ""


class EngineUnreachable(Exception):
    """The engine did not answer (lost reply, dead process): the outcome is unknown."""


class EngineRefused(Exception):
    """The engine certainly refused (a typed error): nothing changed there."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class StagingEnginePort(Protocol[CandidateT_contra]):
    """One engine as the Publisher and the Reclaimer see it (implemented by `adapters.engine_staging`),
    generic in the candidate type it ships (the adapters' `Candidate`)."""

    name: str

    async def incarnation(self) -> int: ...

    async def begin(self, candidate: CandidateT_contra, attempt_token: str) -> None: ...

    async def transfer_bucket(self, candidate: CandidateT_contra, attempt_token: str, index: int) -> None: ...

    async def end(self, candidate: CandidateT_contra, attempt_token: str) -> ReadyReceipt: ...

    def drop_link(self) -> None:
        """Never use the current transfer group again (a bucket whose outcome is unknown may have left a
        collective half done in it); the next staging call joins a new one."""

    # `capability`: the registry's signed word for this exact call (`RegistryAnswer.capabilities`); engines
    # started with a capability key refuse a cleanup or reclaim without a valid one.
    async def cleanup(self, lora_name: str, attempt_token: str, capability: str | None = None) -> None: ...

    def expect_registry_keys(self, key_ids: tuple[str, ...]) -> None:
        """The registry's key ids, as its latest answer gave them (`RegistryAnswer.key_ids`): before its first
        `begin`, cleanup or reclaim on an engine incarnation the port compares them with the engine's and refuses
        a mismatch, `EngineRefused(KEY_MISMATCH)`, before the call is sent. The executor tells it before every
        engine call."""

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float, capability: str | None = None) -> bool: ...


ProbeCheck = Callable[[Any, ReadyReceipt], bool]  # (candidate, an engine's `end` receipt) -> the probe passes


class SnapshotStorePort(Protocol):
    """Every committed version's bytes by digest, after the process that published it is gone (implemented by
    `adapters.snapshot_store.SnapshotStore`). The Publisher writes each candidate before its commit is sent and
    reads a version back to rehydrate it; reading verifies the bytes (a corrupt entry is refused, typed)."""

    def put_candidate(self, candidate: Any) -> None: ...

    def holds(self, digest: str) -> bool: ...

    def candidate(self, digest: str, lora_name: str) -> Any: ...
