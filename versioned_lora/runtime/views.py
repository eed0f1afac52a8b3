"""Small read-only views of the registry state that cross process boundaries (the whole state, with
its sessions, is too large to ship on every call). Pure functions of a `RegistryState`, and `ViewIndex`: what
the registry keeps as its state changes so that a view costs the same after a thousand publications and with
10^5 sessions as at the start (issue 48)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable, Sequence

import attrs

from versioned_lora.lifecycle import RegistryState, VersionKey, VersionState
from versioned_lora.lifecycle.queries import servable_on
from versioned_lora.spec.events import BeginClose, BindFirst, CloseAndRelease, OpenSession
from versioned_lora.spec.model import session_refs
from versioned_lora.spec.states import PlacementState, SessionState

# Versions in these states are over: they hold no slot and no row of the table moves them again.
ENDED_STATES = frozenset({VersionState.FAILED_CLEAN, VersionState.RECLAIMED})
# How many ended versions the bounded views keep (the most recently ended); `all_versions` ships every one.
RECENT_ENDED = 8
OPEN_SESSION_STATES = frozenset({SessionState.OPEN, SessionState.BOUND, SessionState.FINALIZING})
SESSION_EVENTS = (OpenSession, BindFirst, BeginClose, CloseAndRelease)


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
    # Ended versions (ENDED_STATES) the registry knows but this view leaves out: a bounded view holds every
    # live version and the last RECENT_ENDED ended ones; `publication_view(all_versions=True)` holds them all.
    ended_left_out: int = 0

    def version(self, key: VersionKey) -> VersionView | None:
        return self.versions.get(key)

    def managed_count(self) -> int:
        freed = {VersionState.FAILED_CLEAN, VersionState.RECLAIMED}
        return sum(1 for v in self.versions.values() if v.state not in freed)


def publication_view(state: RegistryState, keys: Iterable[VersionKey] | None = None,
                     ended_left_out: int = 0) -> PublicationView:
    """The versions named by `keys` (default: every version of the state), each with its placements, looked up
    by (version, engine): the cost is that of the versions shown, not of every placement ever recorded."""
    versions = {}
    for key in sorted(state.versions.keys() if keys is None else keys):
        version = state.versions[key]
        placements = {}
        for engine in state.config.engines:
            p = state.placements.get((key, engine))
            if p is not None:
                placements[engine] = PlacementView(p.state, p.attempt_token, p.incarnation)
        versions[key] = VersionView(
            key, version.digest, version.lora_name, version.state, version.attempt_token,
            session_refs(state, key), version.reclaim_id, placements,
        )
    return PublicationView(
        state.default, state.default_revision, tuple(state.config.engines), dict(state.incarnations), versions,
        state.lease.holder, state.lease.fence, ended_left_out,
    )


class ViewIndex:
    """What the bounded views read, kept as the state changes: the live versions (at most the capacity: every
    state but the ended ones holds a slot), the last `recent` versions to end, how many ended in each ended state,
    and the open sessions. `advance` costs O(live versions + the call's events); only `__init__` (start, recovery)
    walks the whole state.

    A version's state moves only through an event that names it, or through a live version's row (a commit
    retires the previous default, a restart touches live placements): so the versions to look at after a call
    are the live ones and the ones its events name. An ended version never moves again."""

    def __init__(self, state: RegistryState, recent: int = RECENT_ENDED) -> None:
        ended = sorted(k for k, v in state.versions.items() if v.state in ENDED_STATES)
        # Recovery does not know the order they ended in: the highest keys stand for the latest.
        self.recent_ended: deque[VersionKey] = deque(ended[-recent:] if recent else (), maxlen=recent)
        self.ended_by_state: Counter[VersionState] = Counter(state.versions[k].state for k in ended)
        self.live: dict[VersionKey, None] = dict.fromkeys(
            sorted(k for k, v in state.versions.items() if v.state not in ENDED_STATES))
        self.open_sessions = sum(1 for s in state.sessions.values() if s.state in OPEN_SESSION_STATES)

    def advance(self, before: RegistryState, after: RegistryState, events: Sequence[object]) -> None:
        if after.versions is not before.versions:
            named = {key for e in events if isinstance(key := getattr(e, "version", None), VersionKey)}
            for key in sorted(named | self.live.keys()):
                version = after.versions.get(key)
                if version is None or version.state not in ENDED_STATES:
                    if version is not None:
                        self.live[key] = None
                    continue
                if key in self.live or key not in before.versions:  # it ended in this call (not a late event)
                    self.live.pop(key, None)
                    self.recent_ended.append(key)
                    self.ended_by_state[version.state] += 1
        if after.sessions is not before.sessions:
            for key in {e.session for e in events if isinstance(e, SESSION_EVENTS)}:
                was, now = before.sessions.get(key), after.sessions.get(key)
                self.open_sessions += ((now is not None and now.state in OPEN_SESSION_STATES)
                                       - (was is not None and was.state in OPEN_SESSION_STATES))

    @property
    def ended_count(self) -> int:
        return sum(self.ended_by_state.values())

    def shown(self) -> list[VersionKey]:
        """The versions a bounded view holds: every live one and the last few ended."""
        return [*self.live, *self.recent_ended]

    def view(self, state: RegistryState, all_versions: bool = False) -> PublicationView:
        if all_versions:
            return publication_view(state)
        return publication_view(state, self.shown(), self.ended_count - len(self.recent_ended))


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
