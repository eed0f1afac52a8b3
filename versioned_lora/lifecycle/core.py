"""The pure core's entry points: initial states, `step`, `engine_step`, and their traced forms."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from immutables import Map

from versioned_lora.lifecycle import engine_rules, registry_rules
from versioned_lora.lifecycle.compile import Dispatcher, Namespace, TransitionsDispatcher
from versioned_lora.lifecycle.effects import EngineEffect, RegistryEffect
from versioned_lora.lifecycle.results import EngineResult, RegistryResult
from versioned_lora.spec.events import EngineEvent, RegistryEvent
from versioned_lora.spec.model import EngineAdapterState, RegistryConfig, RegistryState
from versioned_lora.spec.states import ENGINE_SIDE_MACHINES, REGISTRY_MACHINES
from versioned_lora.spec.table import ROWS, Row

DEFAULT_ENGINES = ("E0", "E1")
DEFAULT_CAPACITY = 2

REGISTRY_NAMESPACE = Namespace(
    machines=REGISTRY_MACHINES,
    locators=registry_rules.LOCATORS,
    guards=registry_rules.GUARDS,
    updates=registry_rules.UPDATES,
    writers=registry_rules.WRITERS,
    effects=registry_rules.EFFECTS,
    results=registry_rules.RESULTS,
    draft=registry_rules.draft_of,
)
ENGINE_NAMESPACE = Namespace(
    machines=ENGINE_SIDE_MACHINES,
    locators=engine_rules.LOCATORS,
    guards=engine_rules.GUARDS,
    updates=engine_rules.UPDATES,
    writers=engine_rules.WRITERS,
    effects=engine_rules.EFFECTS,
    results=engine_rules.RESULTS,
    draft=engine_rules.EngineDraft,
)

RegistryStep = tuple[RegistryState, RegistryResult, tuple[RegistryEffect, ...]]
EngineStep = tuple[EngineAdapterState, EngineResult, tuple[EngineEffect, ...]]


@attrs.frozen
class Fired:
    """A step with the row that fired: what the frame test, coverage counts and model checkers need."""

    row: Row
    state: RegistryState | EngineAdapterState
    result: RegistryResult | EngineResult
    effects: tuple[RegistryEffect | EngineEffect, ...]


class Core:
    """Both dispatchers of both sides, compiled from one tuple of rows (the spec's, or a mutant's)."""

    def __init__(self, rows: tuple[Row, ...] = ROWS) -> None:
        self.rows = rows
        self.registry: Dispatcher[RegistryState] = Dispatcher(rows, REGISTRY_NAMESPACE)
        self.engine: Dispatcher[EngineAdapterState] = Dispatcher(rows, ENGINE_NAMESPACE)
        self._transitions: (
            tuple[TransitionsDispatcher[RegistryState], TransitionsDispatcher[EngineAdapterState]] | None
        )
        self._transitions = None

    def step(self, state: RegistryState, event: RegistryEvent) -> RegistryStep:
        return self.registry.step(state, event)

    def engine_step(self, state: EngineAdapterState, event: EngineEvent) -> EngineStep:
        return self.engine.step(state, event)

    def step_traced(self, state: RegistryState, event: RegistryEvent) -> Fired:
        rule = self.registry.select(state, event)
        return Fired(rule.row, *rule.fire(state, event))

    def engine_step_traced(self, state: EngineAdapterState, event: EngineEvent) -> Fired:
        rule = self.engine.select(state, event)
        return Fired(rule.row, *rule.fire(state, event))

    def fired_row(self, state: RegistryState, event: RegistryEvent) -> Row:
        """The row `step` would fire (raises ProtocolError where `step` would)."""
        return self.registry.select(state, event).row

    def engine_fired_row(self, state: EngineAdapterState, event: EngineEvent) -> Row:
        return self.engine.select(state, event).row

    def transitions_step(self, state: RegistryState, event: RegistryEvent) -> RegistryStep:
        return self._transitions_dispatchers()[0].step(state, event)

    def transitions_engine_step(self, state: EngineAdapterState, event: EngineEvent) -> EngineStep:
        return self._transitions_dispatchers()[1].step(state, event)

    def _transitions_dispatchers(
        self,
    ) -> tuple[TransitionsDispatcher[RegistryState], TransitionsDispatcher[EngineAdapterState]]:
        # Built lazily: configuring a few hundred transitions costs ~50 ms nobody on the hot path needs.
        if self._transitions is None:
            self._transitions = (
                TransitionsDispatcher(self.rows, REGISTRY_NAMESPACE),
                TransitionsDispatcher(self.rows, ENGINE_NAMESPACE),
            )
        return self._transitions


CORE = Core()
step = CORE.registry.step
engine_step = CORE.engine.step
step_traced = CORE.step_traced
engine_step_traced = CORE.engine_step_traced
fired_row = CORE.fired_row
engine_fired_row = CORE.engine_fired_row
transitions_step = CORE.transitions_step
transitions_engine_step = CORE.transitions_engine_step


def initial_state(
    engines: Iterable[str] = DEFAULT_ENGINES,
    capacity: int = DEFAULT_CAPACITY,
    epoch: int = 0,
    incarnations: Mapping[str, int] | None = None,
    id_salt: str = "",
    publisher_lease: bool = False,
) -> RegistryState:
    """An empty registry for a fixed engine set. Incarnation 0 means "not yet reported": the first
    `EngineRestarted` from a freshly started engine moves it to the engine's real incarnation. `id_salt`:
    what keys the registry's reclaim ids (`RegistryState.id_salt`). `publisher_lease`: every Reserve and
    Commit must carry the live publisher lease's fence (`RegistryConfig.publisher_lease`); a deployment's
    registry turns it on (adapters/registry_core.py), the pure tests mostly leave it off."""
    engines = tuple(engines)
    if len(set(engines)) != len(engines) or not engines:
        raise ValueError(f"engines must be distinct and non-empty: {engines!r}")
    if capacity < 1:
        raise ValueError(f"capacity must be positive: {capacity}")
    known = dict(incarnations or {})
    return RegistryState(
        config=RegistryConfig(epoch, engines, capacity, publisher_lease),
        versions=Map(),
        placements=Map(),
        session_refs=Map(),
        sessions=Map(),
        low_water=Map(),
        default=None,
        default_revision=0,
        incarnations=Map({engine: known.get(engine, 0) for engine in engines}),
        attempts_issued=0,
        id_salt=id_salt,
    )


def initial_engine_state(engine: str, incarnation: int) -> EngineAdapterState:
    """A freshly started engine process: every managed adapter ABSENT."""
    return EngineAdapterState(engine, incarnation, Map())
