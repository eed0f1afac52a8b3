"""Read-only questions the runtime asks the registry state (no transitions here)."""

from __future__ import annotations

from versioned_lora.spec.identities import VersionKey
from versioned_lora.spec.model import (
    DISPATCHABLE_STATES,
    RegistryState,
    Version,
    occupied_slots,
    pending_versions,
    session_refs,
)
from versioned_lora.spec.states import PlacementState

__all__ = ["default_version", "may_dispatch", "occupied_slots", "pending_attempt", "servable_on", "session_refs"]


def may_dispatch(state: RegistryState, version: VersionKey) -> bool:
    """Requests may be sent for `version`: it is PUBLISHED or RETIRED; never once RECLAIMING."""
    record = state.versions.get(version)
    return record is not None and record.state in DISPATCHABLE_STATES


def servable_on(state: RegistryState, version: VersionKey, engine: str) -> bool:
    """`may_dispatch`, and READY on `engine` in its current incarnation (a restarted engine gets no
    requests for a version before its rehydrate attempt is READY)."""
    placement = state.placements.get((version, engine))
    return (
        may_dispatch(state, version)
        and placement is not None
        and placement.state is PlacementState.READY
        and placement.incarnation == state.incarnations[engine]
    )


def pending_attempt(state: RegistryState) -> Version | None:
    """The one attempt that is LOADING or ABORTED-not-clean, if any (what a recovering publisher finishes)."""
    pending = pending_versions(state)
    return pending[0] if pending else None


def default_version(state: RegistryState) -> Version | None:
    return None if state.default is None else state.versions[state.default]
