"""Which declared fields (`spec.table.FIELDS`) differ between two states, and which entities other than the
located one changed state: the frame test checks that every changed field is one the fired row declares in
`writes`, and every such secondary move one it declares in `also`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeVar

import attrs
from attrs import AttrsInstance
from immutables import Map

from versioned_lora.spec import events as ev
from versioned_lora.spec.model import EngineAdapterState, RegistryState, session_state
from versioned_lora.spec.states import (
    AdapterState,
    DefaultState,
    LeaseState,
    Machine,
    PlacementState,
    ReclaimState,
    VersionState,
)

K = TypeVar("K")
R = TypeVar("R", bound=AttrsInstance)


def _diff_map(before: Map[K, R], after: Map[K, R], prefix: str, out: set[str]) -> None:
    if before is after:
        return
    for key in set(before.keys()) | set(after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if old is None or new is None:
            # A record appearing or disappearing changes its state; a new one also writes every field
            # that is not left at its default (None counts as unset).
            out.add(f"{prefix}.state")
            if new is not None:
                for field in attrs.fields(type(new)):
                    value = getattr(new, field.name)
                    if field.name != "key" and value is not None and value != field.default:
                        out.add(f"{prefix}.{field.name}")
            continue
        for field in attrs.fields(type(new)):
            if getattr(old, field.name) != getattr(new, field.name):
                out.add(f"{prefix}.{field.name}")


def changed_fields(before: RegistryState, after: RegistryState) -> frozenset[str]:
    out: set[str] = set()
    if before.config != after.config:
        out.add("config")
    _diff_map(before.versions, after.versions, "version", out)
    _diff_map(before.placements, after.placements, "placement", out)
    _diff_map(before.sessions, after.sessions, "session", out)
    if before.session_refs != after.session_refs:
        out.add("version.session_refs")
    if before.low_water != after.low_water:
        out.add("shard.low_water")
    if before.default != after.default:
        out.add("default.version")
    if before.default_revision != after.default_revision:
        out.add("default.revision")
    if before.incarnations != after.incarnations:
        out.add("engine.incarnation")
    if before.attempts_issued != after.attempts_issued:
        out.add("counter.attempts")
    if before.lease != after.lease:
        for field in ("holder", "fence", "ttl_s"):
            if getattr(before.lease, field) != getattr(after.lease, field):
                out.add(f"lease.{field}")
    return frozenset(out)


def engine_changed_fields(before: EngineAdapterState, after: EngineAdapterState) -> frozenset[str]:
    out: set[str] = set()
    if before.engine != after.engine:
        out.add("engine")
    if before.incarnation != after.incarnation:
        out.add("process.incarnation")
    _diff_map(before.adapters, after.adapters, "adapter", out)
    return frozenset(out)


# ---------------------------------------------------------------- secondary moves (a row's `also`)

Move = tuple[Machine, str, str]
_CLAIMED = (VersionState.RECLAIMING, VersionState.RECLAIMED)


def _registry_entities(s: RegistryState, versions: Any, sessions: Any) -> dict[tuple[Machine, Hashable], Any]:
    """The state of every registry entity the step may have touched, keyed by (machine, key); the default's is
    its version as well, so that a commit moving it from one version to another shows as SET -> SET."""
    out: dict[tuple[Machine, Hashable], Any] = {}
    for key in versions:
        version = s.versions.get(key)
        out[(Machine.VERSION, key)] = VersionState.UNSEEN if version is None else version.state
        for engine in s.config.engines:
            placement = s.placements.get((key, engine))
            out[(Machine.ATTEMPT, (key, engine))] = PlacementState.UNSEEN if placement is None else placement.state
            out[(Machine.RECLAIM, (key, engine))] = (
                ReclaimState.NOT_CLAIMED if version is None or version.state not in _CLAIMED else
                ReclaimState.CONFIRMED if engine in version.reclaim_confirmed else ReclaimState.PENDING)
    for key in sessions:
        out[(Machine.SESSION, key)] = session_state(s, key)
    out[(Machine.DEFAULT, None)] = (DefaultState.NONE, None) if s.default is None else (DefaultState.SET, s.default)
    out[(Machine.LEASE, None)] = LeaseState.FREE if s.lease.holder is None else LeaseState.HELD
    return out


def _located(event: Any) -> tuple[Machine, Hashable]:
    """The entity whose state selected the row (its own move is the row's source -> target, not an `also`)."""
    if isinstance(event, ev.Reserve | ev.Commit | ev.Abort | ev.ClaimReclaim):
        return (Machine.VERSION, event.version)
    if isinstance(event, ev.RecordPrepared | ev.RecordReady | ev.RecordUnknown | ev.RecordCleaned):
        return (Machine.ATTEMPT, (event.version, event.engine))
    if isinstance(event, ev.OpenSession | ev.BindFirst | ev.BeginClose | ev.CloseAndRelease):
        return (Machine.SESSION, event.session)
    if isinstance(event, ev.ConfirmReclaim):
        return (Machine.RECLAIM, (event.version, event.engine))
    if isinstance(event, ev.EngineRestarted):
        return (Machine.ENGINE, event.engine)
    return (Machine.LEASE, None)


def registry_secondary_moves(before: RegistryState, after: RegistryState, event: Any) -> frozenset[Move]:
    """(machine, source, target) of every registry entity but the located one whose state the step changed."""
    if before is after:
        return frozenset()
    versions = set(before.versions.keys()) | set(after.versions.keys())
    sessions = set(before.sessions.keys()) | set(after.sessions.keys())
    old, new = _registry_entities(before, versions, sessions), _registry_entities(after, versions, sessions)
    located = _located(event)
    moves = set()
    for entity, was in old.items():
        now = new[entity]
        if was != now and entity != located:
            if entity[0] is Machine.DEFAULT:
                was, now = was[0], now[0]
            moves.add((entity[0], str(was), str(now)))
    return frozenset(moves)


def engine_secondary_moves(before: EngineAdapterState, after: EngineAdapterState, event: Any) -> frozenset[Move]:
    """(ADAPTER, source, target) of every managed adapter but the located one (none for a process event)."""
    if before is after:
        return frozenset()
    located = getattr(event, "lora_name", None)
    moves = set()
    for name in set(before.adapters.keys()) | set(after.adapters.keys()):
        was, now = before.adapters.get(name), after.adapters.get(name)
        source = AdapterState.ABSENT if was is None else was.state
        target = AdapterState.ABSENT if now is None else now.state
        if source != target and name != located:
            moves.add((Machine.ADAPTER, str(source), str(target)))
    return frozenset(moves)
