"""Helpers shared by the runtime tests: a registry actor per test, and publication driven through the
registry port only (the engine side of publishing is issue 8's Publisher)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

from engine_helpers import capability_key_file
from lease_helpers import fence_of
from registry_faults import FaultyRegistryActor

from versioned_lora.adapters.ray_registry import RayRegistry, create_registry_actor
from versioned_lora.lifecycle import (
    ClaimReclaim,
    Commit,
    Committed,
    ReclaimClaimed,
    RecordPrepared,
    RecordReady,
    RegistryState,
    Reserve,
    Reserved,
    VersionKey,
)
from versioned_lora.runtime.interfaces import RegistryPort

ENGINES = ("E0", "E1")
A, B, C = VersionKey(0, "A"), VersionKey(0, "B"), VersionKey(0, "C")


def digest_of(version: VersionKey) -> str:
    return hashlib.sha256(f"content-of-{version.version_id}".encode()).hexdigest()


def new_actor(tmp_path: Path, **kwargs: Any) -> tuple[Any, RayRegistry]:
    """A registry actor with its own name and journal (tests must not share a registry), under the suite's key (a
    registry does not start without one: issue 41); its class the test-only one with fault hooks."""
    kwargs.setdefault("capability_key_file", capability_key_file())
    handle = create_registry_actor(tmp_path / "registry.sqlite", name=f"registry-{uuid.uuid4().hex[:8]}",
                                   actor_class=FaultyRegistryActor, **kwargs)
    return handle, RayRegistry(handle, retry_deadline_s=60.0)


async def publish(registry: RegistryPort, version: VersionKey, revision: int) -> str:
    """Lease, reserve, READY on every engine (incarnation 0), commit: what a Publisher reports to the registry."""
    fence = await fence_of(registry)
    reserved = (await registry.submit(Reserve(version, digest_of(version), fence))).result
    assert isinstance(reserved, Reserved), reserved
    token = reserved.attempt_token
    reports = [kind(version, token, engine, 0, digest_of(version)) for engine in ENGINES
               for kind in (RecordPrepared, RecordReady)]
    await registry.submit_batch(reports)
    committed = (await registry.submit(Commit(version, token, revision, fence))).result
    assert isinstance(committed, Committed), committed
    return token


async def claim(registry: RegistryPort, version: VersionKey) -> ReclaimClaimed:
    result = (await registry.submit(ClaimReclaim(version))).result
    assert isinstance(result, ReclaimClaimed), result
    return result


def refs(state: RegistryState, version: VersionKey) -> int:
    return state.session_refs.get(version, 0)
