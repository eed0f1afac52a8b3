"""Which declared fields (`spec.table.FIELDS`) differ between two states: the frame test checks that
every changed field is one the fired row declares in `writes`."""

from __future__ import annotations

from typing import TypeVar

import attrs
from attrs import AttrsInstance
from immutables import Map

from versioned_lora.spec.model import EngineAdapterState, RegistryState

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
