"""Turn the table into a step function.

Two dispatchers are built from the same rows and measured by `scripts/bench_core.py`:

* `Dispatcher` (the one `step` uses): a dict `{event type: (locator, {source state: rules})}`
  compiled once; a step is one locator call, two dict lookups and the guards of the candidate rows.
* `TransitionsDispatcher`: one `transitions.Machine` per machine kind, configured from the same rows
  (auto_transitions off, conditions = the rows' guards, internal transitions for SAME targets); it
  only selects the row, firing is shared. It is kept to show the table is the single source and to
  compare; it is an order of magnitude slower.

A (state, event) pair with no row, or whose rows' guards all fail, raises `ProtocolError`; the
state is an immutable value, so nothing has changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs
import transitions

from versioned_lora.lifecycle.errors import ProtocolError
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.spec.events import EVENT_MACHINE, EVENT_TYPES
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import INITIAL_STATES, SAME, STATES, Machine
from versioned_lora.spec.table import Row

S = TypeVar("S")  # RegistryState or EngineAdapterState
Fire = Callable[[Any, Any], tuple[Any, Any, tuple[Any, ...]]]


@attrs.frozen
class Namespace:
    """The named functions one side of the table (registry or engine) resolves its rows against."""

    machines: frozenset[Machine]
    locators: Mapping[type, Callable[[Any, Any], str]]
    guards: Mapping[str, Callable[[Any, Any], bool]]
    updates: Mapping[str, Callable[[Any, Any], None]]
    writers: Mapping[Machine, Callable[[Any, Any, Any], None]]
    effects: Mapping[str, Callable[[Any, Any, Any], tuple[Any, ...]]]
    results: Mapping[str, Callable[[Any, Any, Any, str], Any]]
    draft: Callable[[Any], Any]


class Rule:
    """One row, resolved: its guard functions and a `fire` closure that computes the step."""

    __slots__ = ("fire", "guards", "row")

    def __init__(self, row: Row, ns: Namespace) -> None:
        self.row = row
        self.guards: tuple[Callable[[Any, Any], bool], ...] = tuple(ns.guards[name] for name in row.guards)
        self.fire: Fire = _make_fire(row, ns)


def _make_fire(row: Row, ns: Namespace) -> Fire:
    row_id = row.id
    effect_fns = tuple(ns.effects[name] for name in row.effects)
    result: Callable[[Any, Any, Any, str], Any]
    if row.is_refusal:
        refusal = Rejected(Reason(row.result), row_id)  # one value per row, built once

        def refuse(b: Any, a: Any, e: Any, r: str) -> Any:
            return refusal

        result = refuse
    else:
        result = ns.results[row.result]

    effects: Callable[[Any, Any, Any], tuple[Any, ...]]
    if len(effect_fns) == 1:  # most rows with effects have one: call it directly, no generator per step
        effects = effect_fns[0]
    else:

        def effects(b: Any, a: Any, e: Any) -> tuple[Any, ...]:
            return tuple(x for fn in effect_fns for x in fn(b, a, e))

    if not row.changes_state:
        if not effect_fns:

            def answer(state: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
                return state, result(state, state, event, row_id), ()

            return answer

        def answer_with_effects(state: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
            return state, result(state, state, event, row_id), effects(state, state, event)

        return answer_with_effects

    updates = tuple(ns.updates[name] for name in row.updates)
    writer = None if row.target == SAME else ns.writers[row.machine]
    target = row.target if row.target == SAME else _state_enum(row.machine, row.target)
    make_draft = ns.draft

    # Two copies of the same body (with and without effects): one call less on the hot path.
    if not effect_fns:

        def move(state: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
            draft = make_draft(state)
            for update in updates:
                update(draft, event)
            if writer is not None:
                writer(draft, event, target)
            after = draft.freeze()
            return after, result(state, after, event, row_id), ()

        return move

    def move_with_effects(state: Any, event: Any) -> tuple[Any, Any, tuple[Any, ...]]:
        draft = make_draft(state)
        for update in updates:
            update(draft, event)
        if writer is not None:
            writer(draft, event, target)
        after = draft.freeze()
        return after, result(state, after, event, row_id), effects(state, after, event)

    return move_with_effects


def _state_enum(machine: Machine, name: str) -> str:
    (member,) = (s for s in STATES[machine] if s == name)  # the StrEnum member, so writers can use `is`
    return member


def compile_rules(rows: tuple[Row, ...], ns: Namespace) -> dict[type, dict[str, tuple[Rule, ...]]]:
    """{event type: {source state: rules in table order}}, wildcards expanded in place."""
    table: dict[type, dict[str, list[Rule]]] = {}
    for row in rows:
        if row.machine not in ns.machines:
            continue
        rule = Rule(row, ns)
        by_state = table.setdefault(EVENT_TYPES[row.event], {})
        for source in row.expanded_sources():
            by_state.setdefault(source, []).append(rule)
    return {etype: {s: tuple(rules) for s, rules in by_state.items()} for etype, by_state in table.items()}


def _no_row(state_name: str, event: object) -> ProtocolError:
    machine = EVENT_MACHINE.get(type(event))
    return ProtocolError(
        f"no row covers {type(event).__name__} in {machine}:{state_name} ({event!r})",
        machine=None if machine is None else str(machine),
        state=state_name,
    )


def _not_an_event(event: object) -> ProtocolError:
    return ProtocolError(f"{type(event).__name__} is not an event of this machine: {event!r}")


class Dispatcher(Generic[S]):
    """The compiled lookup: `step` is the hot path, `select` tells which row would fire."""

    def __init__(self, rows: tuple[Row, ...], ns: Namespace) -> None:
        self.rows = rows
        rules = compile_rules(rows, ns)
        self.table: dict[type, tuple[Callable[[Any, Any], str], dict[str, tuple[Rule, ...]]]] = {
            etype: (ns.locators[etype], by_state) for etype, by_state in rules.items()
        }
        self.step = self._make_step()

    def select(self, state: S, event: object) -> Rule:
        try:
            locate, by_state = self.table[type(event)]
        except KeyError:
            raise _not_an_event(event) from None
        source = locate(state, event)
        for rule in by_state.get(source, ()):
            if all(guard(state, event) for guard in rule.guards):
                return rule
        raise _no_row(source, event)

    def _make_step(self) -> Callable[[S, Any], tuple[S, Any, tuple[Any, ...]]]:
        table = self.table

        # `select` inlined: this is the path the benchmark's 200k ops/s goal is about.
        def step(state: S, event: Any) -> tuple[S, Any, tuple[Any, ...]]:
            entry = table.get(type(event))
            if entry is None:
                raise _not_an_event(event)
            source = entry[0](state, event)
            for rule in entry[1].get(source, ()):
                for guard in rule.guards:
                    if not guard(state, event):
                        break
                else:
                    return rule.fire(state, event)
            raise _no_row(source, event)

        return step


class _Carrier:
    """The model object a `transitions.Machine` moves; reset before every trigger."""

    state: str
    fired: Rule | None = None


def _note_fired(carrier: _Carrier, rule: Rule, *args: Any) -> None:
    carrier.fired = rule


class TransitionsDispatcher(Generic[S]):
    """The same rows run through the `transitions` library (see module docstring)."""

    def __init__(self, rows: tuple[Row, ...], ns: Namespace) -> None:
        self.locators = ns.locators
        self.machines: dict[Machine, tuple[_Carrier, transitions.Machine]] = {}
        for etype, by_state in compile_rules(rows, ns).items():
            carrier, machine = self._machine_for(EVENT_MACHINE[etype])
            for source, rules in by_state.items():
                for rule in rules:
                    machine.add_transition(
                        trigger=etype.__name__,
                        source=source,
                        dest=None if rule.row.target == SAME else rule.row.target,
                        conditions=list(rule.guards),
                        after=functools.partial(_note_fired, carrier, rule),
                    )

    def _machine_for(self, kind: Machine) -> tuple[_Carrier, transitions.Machine]:
        if kind not in self.machines:
            carrier = _Carrier()
            machine = transitions.Machine(
                model=carrier, states=list(STATES[kind]), initial=INITIAL_STATES[kind], auto_transitions=False
            )
            self.machines[kind] = (carrier, machine)
        return self.machines[kind]

    def step(self, state: S, event: Any) -> tuple[S, Any, tuple[Any, ...]]:
        locate = self.locators.get(type(event))
        if locate is None:
            raise _not_an_event(event)
        source = locate(state, event)
        carrier, machine = self.machines[EVENT_MACHINE[type(event)]]
        carrier.fired = None
        machine.set_state(source, model=carrier)
        try:
            machine.events[type(event).__name__].trigger(carrier, state, event)
        except transitions.MachineError:
            raise _no_row(source, event) from None
        if carrier.fired is None:  # every candidate row's guards failed
            raise _no_row(source, event)
        return carrier.fired.fire(state, event)
