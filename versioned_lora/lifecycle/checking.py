"""Check one step against the spec: invariants, step invariants, the frame condition, and that rows
which declare no writes changed nothing. Used after every step by the tests (`checked_step`) and by
the model checker (`registry_step_violations`)."""

from __future__ import annotations

import attrs

from versioned_lora.lifecycle.core import CORE, Core, Fired
from versioned_lora.lifecycle.effects import PhysicalUnload
from versioned_lora.lifecycle.frame import (
    changed_fields,
    engine_changed_fields,
    engine_secondary_moves,
    registry_secondary_moves,
)
from versioned_lora.spec.events import EngineEvent, RegistryEvent
from versioned_lora.spec.invariants import engine_violated, engine_violated_by_step, violated, violated_by_step
from versioned_lora.spec.model import EngineAdapterState, RegistryState
from versioned_lora.spec.states import SAME, WILDCARD, Machine, SessionState
from versioned_lora.spec.table import Row

_STATE_FIELDS = frozenset(field.name for field in attrs.fields(RegistryState))


class InvariantViolation(AssertionError):
    pass


def _frame_violations(row: Row, changed: frozenset[str], unchanged: bool) -> list[str]:
    problems = []
    undeclared = changed - frozenset(row.writes)
    if undeclared:
        problems.append(f"frame: row {row.id} wrote undeclared fields {sorted(undeclared)}")
    if not row.changes_state and not unchanged:
        problems.append(f"row {row.id} declares no writes but changed the state")
    return problems


def _also_violations(row: Row, moves: frozenset[tuple[Machine, str, str]]) -> list[str]:
    """Every entity other than the located one that changed state must be a move the row declares in `also`
    (the diagrams draw those moves; a row that moves something it does not declare is a frame violation)."""
    undeclared = sorted(
        (machine.value, source, target) for machine, source, target in moves
        if not any(m.machine is machine and m.source in (source, WILDCARD) and m.target == target for m in row.also)
    )
    return [f"frame: row {row.id} moved {m} {a} -> {b}, not declared in its `also`" for m, a, b in undeclared]


def _target_reached(row: Row, landed: str) -> bool:
    if row.target == SAME:
        return True
    # A close at the mark compacts the tombstone away at once: CLOSED shows as COMPACTED.
    return landed == row.target or (row.target == SessionState.CLOSED and landed == SessionState.COMPACTED)


def registry_step_violations(
    before: RegistryState, event: RegistryEvent, fired: Fired, core: Core = CORE
) -> list[str]:
    after = fired.state
    assert isinstance(after, RegistryState)
    problems = [f"invariant {name}" for name in violated(after)]
    problems += [f"step invariant {name}" for name in violated_by_step(before, after)]
    problems += _frame_violations(fired.row, changed_fields(before, after), after == before)
    problems += _also_violations(fired.row, registry_secondary_moves(before, after, event))
    # A draft becomes the state by retyping (registry_rules.RegistryDraft): an update that wrote an attribute
    # RegistryState does not have would leave it in the state, unseen by equality and hashing.
    strays = vars(after).keys() - _STATE_FIELDS
    if strays:
        problems.append(f"row {fired.row.id} left attributes that are not fields: {sorted(strays)}")
    landed = core.registry.table[type(event)][0](after, event)
    if not _target_reached(fired.row, landed):
        problems.append(f"row {fired.row.id} targets {fired.row.target} but the entity is {landed}")
    return problems


def engine_step_violations(
    before: EngineAdapterState, event: EngineEvent, fired: Fired, core: Core = CORE
) -> list[str]:
    after = fired.state
    assert isinstance(after, EngineAdapterState)
    problems = [f"engine invariant {name}" for name in engine_violated(after)]
    problems += [f"engine step invariant {name}" for name in engine_violated_by_step(before, after)]
    problems += _frame_violations(fired.row, engine_changed_fields(before, after), after == before)
    problems += _also_violations(fired.row, engine_secondary_moves(before, after, event))
    landed = core.engine.table[type(event)][0](after, event)
    if not _target_reached(fired.row, landed):
        problems.append(f"row {fired.row.id} targets {fired.row.target} but the adapter is {landed}")
    for effect in fired.effects:
        # Nothing is physically unloaded while SGLang's refcount for the name is above zero.
        if isinstance(effect, PhysicalUnload) and before.adapters[effect.lora_name].native_refs:
            problems.append(f"row {fired.row.id} unloads {effect.lora_name} while it is referenced")
    return problems


def checked_step(state: RegistryState, event: RegistryEvent, core: Core = CORE) -> Fired:
    """`step_traced` plus every check; raises InvariantViolation with all problems found."""
    fired = core.step_traced(state, event)
    problems = registry_step_violations(state, event, fired, core)
    if problems:
        raise InvariantViolation(f"{event!r} via {fired.row.id}: " + "; ".join(problems))
    return fired


def checked_engine_step(state: EngineAdapterState, event: EngineEvent, core: Core = CORE) -> Fired:
    fired = core.engine_step_traced(state, event)
    problems = engine_step_violations(state, event, fired, core)
    if problems:
        raise InvariantViolation(f"{event!r} via {fired.row.id}: " + "; ".join(problems))
    return fired
