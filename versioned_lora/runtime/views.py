"""Small read-only views of the registry state that cross process boundaries (the whole state, with
its sessions, is too large to ship on every call). Pure functions of a `RegistryState`."""

from __future__ import annotations

from collections.abc import Collection

import attrs

from versioned_lora.lifecycle import RegistryState, VersionKey, VersionState
from versioned_lora.lifecycle.queries import servable_on
from versioned_lora.spec.model import session_refs
from versioned_lora.spec.states import PlacementState


@attrs.frozen
class PlacementView:
    state: PlacementState
    attempt_token: str | None
    incarnation: int


@attrs.frozen
class VersionView:
    key: VersionKey
    digest: str
    lora_name: str
    state: VersionState
    attempt_token: str
    session_refs: int
    reclaim_id: str | None
    placements: dict[str, PlacementView]


@attrs.frozen
class PublicationView:
    default: VersionKey | None
    default_revision: int
    engines: tuple[str, ...]
    incarnations: dict[str, int]
    versions: dict[VersionKey, VersionView]
    lease_holder: str | None = None  # the publisher lease's holder (None: free)
    lease_fence: int = 0  # its live fence when held, the last one granted when free (0: never granted)

    def version(self, key: VersionKey) -> VersionView | None:
        return self.versions.get(key)

    def managed_count(self) -> int:
        freed = {VersionState.FAILED_CLEAN, VersionState.RECLAIMED}
        return sum(1 for v in self.versions.values() if v.state not in freed)


def publication_view(state: RegistryState) -> PublicationView:
    versions = {}
    for key, version in state.versions.items():
        placements = {
            engine: PlacementView(p.state, p.attempt_token, p.incarnation)
            for (placed, engine), p in state.placements.items()
            if placed == key
        }
        versions[key] = VersionView(
            key, version.digest, version.lora_name, version.state, version.attempt_token,
            session_refs(state, key), version.reclaim_id, placements,
        )
    return PublicationView(
        state.default, state.default_revision, tuple(state.config.engines), dict(state.incarnations), versions,
        state.lease.holder, state.lease.fence,
    )


@attrs.frozen
class DispatchView:
    """Where requests for one version may go now: its state, and the engines it is servable on
    (`lifecycle.queries.servable_on`: dispatchable, and READY there in the engine's current incarnation).
    Empty `engines` means nothing may be dispatched for it."""

    state: VersionState
    engines: frozenset[str]


def dispatch_view(state: RegistryState, versions: Collection[VersionKey]) -> dict[VersionKey, DispatchView]:
    """Known versions only (unknown ones are left out)."""
    return {
        version: DispatchView(
            state.versions[version].state,
            frozenset(engine for engine in state.config.engines if servable_on(state, version, engine)),
        )
        for version in versions
        if version in state.versions
    }
