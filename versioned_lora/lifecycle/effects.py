"""Effects: what the runtime (registry side) or the SGLang patch (engine side) must carry out after a
step. They are values; the pure core never performs them. Every one is idempotent on the engine
(keyed by attempt token or reclaim id), so re-issuing one after a lost reply is safe."""

from __future__ import annotations

import attrs

from versioned_lora.spec.identities import VersionKey

# ---- registry side: executed by the runtime's Publisher / Reclaimer ----


@attrs.frozen
class StageOnEngine:
    """Run begin/buckets/end of this attempt on `engine` (a publication, or a rehydrate after a restart)."""

    engine: str
    version: VersionKey
    lora_name: str
    attempt_token: str
    incarnation: int
    digest: str


@attrs.frozen
class CleanupOnEngine:
    engine: str
    version: VersionKey
    lora_name: str
    attempt_token: str


@attrs.frozen
class ReclaimOnEngine:
    """Unregister the exact name, wait for SGLang's refcount to drain, unload once; confirm with the id."""

    engine: str
    version: VersionKey
    lora_name: str
    reclaim_id: str


@attrs.frozen
class ReclaimEligible:
    """The version is RETIRED and no session holds it: the Reclaimer may claim it."""

    version: VersionKey


@attrs.frozen
class CapacityFreed:
    """The version's managed slot is free (FAILED_CLEAN or RECLAIMED): a waiting reserve may retry."""

    version: VersionKey


@attrs.frozen
class ArmLeaseTimer:
    """(Re)start the registry's timer for the lease under `fence`: `ExpireLease(fence)` once `ttl_s` pass
    without another arming. Executed by the registry's own process (adapters/registry_core.py), not the caller."""

    fence: int
    ttl_s: float


# ---- engine side: executed by the SGLang patch ----


@attrs.frozen
class AllocateStash:
    lora_name: str
    attempt_token: str
    bucket_count: int


@attrs.frozen
class StashBucket:
    """Run the collective for bucket `index` into the attempt's stash (never into serving weights)."""

    lora_name: str
    attempt_token: str
    index: int


@attrs.frozen
class LoadPinned:
    lora_name: str
    attempt_token: str


@attrs.frozen
class FreeStash:
    lora_name: str
    attempt_token: str | None


@attrs.frozen
class Unregister:
    lora_name: str


@attrs.frozen
class AwaitUnload:
    lora_name: str


@attrs.frozen
class PhysicalUnload:
    lora_name: str


RegistryEffect = StageOnEngine | CleanupOnEngine | ReclaimOnEngine | ReclaimEligible | CapacityFreed | ArmLeaseTimer
EngineEffect = AllocateStash | StashBucket | LoadPinned | FreeStash | Unregister | AwaitUnload | PhysicalUnload
