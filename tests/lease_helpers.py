"""The publisher lease for tests that stand where the one publisher stands and call the registry by hand
(reserve, commit): they take the lease under a Publisher's default holder name, so a Publisher in the same
test shares it (the holder asking again keeps the same fence: row lease.acquire_replay)."""

from __future__ import annotations

import uuid

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import AcquireLease, LeaseGranted
from versioned_lora.runtime.interfaces import RegistryPort
from versioned_lora.runtime.publisher import DEFAULT_HOLDER

TTL_S = 600.0  # longer than any test: only a test of expiry sees one


def fence(core: RegistryCore, holder: str = DEFAULT_HOLDER) -> int:
    granted = core.submit(f"lease:{uuid.uuid4().hex}", AcquireLease(holder, TTL_S)).result
    assert isinstance(granted, LeaseGranted), granted
    return granted.fence


async def fence_of(registry: RegistryPort, holder: str = DEFAULT_HOLDER) -> int:
    granted = (await registry.submit(AcquireLease(holder, TTL_S))).result
    assert isinstance(granted, LeaseGranted), granted
    return granted.fence
