"""The one protocol error, compiling a (mutated) table, the checking helpers, frame and queries."""

from __future__ import annotations

import attrs
import pytest
from immutables import Map
from lifecycle_driver import Registry
from test_rfc_scenarios import DIGEST, A, B, bind, publish, reserve

from versioned_lora.lifecycle import (
    CORE,
    AcquireRequest,
    BindFirst,
    ConfirmReclaim,
    Core,
    EngineRestarted,
    EventDomain,
    Fired,
    InvariantViolation,
    OpenSession,
    PhysicalUnload,
    ProtocolError,
    RecordReady,
    RegistryState,
    SessionKey,
    SessionState,
    candidate_events,
    changed_fields,
    checked_engine_step,
    checked_step,
    engine_changed_fields,
    engine_step,
    engine_step_violations,
    initial_engine_state,
    initial_state,
    may_dispatch,
    registry_step_violations,
    servable_on,
    step,
    transitions_engine_step,
    transitions_step,
)
from versioned_lora.lifecycle.registry_rules import draft_of, new_bound, new_closed
from versioned_lora.lifecycle.results import Bound, Closed
from versioned_lora.spec import ROWS, ROWS_BY_ID, Reason
from versioned_lora.spec.model import ManagedAdapter
from versioned_lora.spec.states import AdapterState

FOREIGN_ENGINE = RecordReady(A, "attempt@0-1", "E9", 0, DIGEST[A])


@pytest.mark.parametrize("run", [step, transitions_step])
def test_pair_without_row_raises_protocol_error_and_changes_nothing(run: object) -> None:
    r = Registry()
    reserve(r, A)
    before, snapshot = r.state, hash(r.state)
    for event in (FOREIGN_ENGINE, EngineRestarted("E9", 1), ConfirmReclaim(A, "E9", "rid")):
        with pytest.raises(ProtocolError) as info:
            run(before, event)  # type: ignore[operator]
        assert info.value.state == "FOREIGN"
    assert hash(before) == snapshot and before == r.state
    with pytest.raises(ProtocolError, match="not an event"):
        run(before, "BindFirst")  # type: ignore[operator]
    with pytest.raises(ProtocolError, match="not an event"):
        run(before, AcquireRequest("a"))  # type: ignore[operator]  # an engine event on the registry


def test_engine_side_rejects_registry_events() -> None:
    state = initial_engine_state("E0", 0)
    for run in (engine_step, transitions_engine_step):
        with pytest.raises(ProtocolError):
            run(state, BindFirst(SessionKey(0, 0, 0)))  # type: ignore[arg-type]


def test_rows_whose_guards_all_fail_raise_protocol_error() -> None:
    # A mutant table where the session's success row is guarded and the refusal dropped: an unseen
    # key with a default has no row whose guards hold.
    rows = tuple(
        attrs.evolve(row, guards=("no_default",)) if row.id == "bind.first" else row
        for row in ROWS
        if row.id != "bind.no_default"
    )
    mutant = Core(rows)
    r = Registry()
    publish(r, A)
    with pytest.raises(ProtocolError):
        mutant.step(r.state, BindFirst(SessionKey(0, 0, 9)))
    with pytest.raises(ProtocolError):
        mutant.transitions_step(r.state, BindFirst(SessionKey(0, 0, 9)))
    assert mutant.fired_row(r.state, OpenSession(SessionKey(0, 0, 9))).id == "open.unseen"


def test_lookup_and_transitions_agree_on_a_scenario() -> None:
    r = Registry()
    publish(r, A)
    state = r.state
    for event in (BindFirst(SessionKey(0, 0, 1)), OpenSession(SessionKey(0, 0, 2)), FOREIGN_ENGINE):
        try:
            expected = step(state, event)
        except ProtocolError:
            with pytest.raises(ProtocolError):
                transitions_step(state, event)
            continue
        assert transitions_step(state, event) == expected
        state = expected[0]


def test_freeze_builds_the_same_value_as_the_constructor() -> None:
    r = Registry()
    publish(r, A)
    bind(r, 0)
    frozen = draft_of(r.state).freeze()
    assert frozen == r.state and hash(frozen) == hash(r.state)
    assert frozen == RegistryState(*(getattr(r.state, f.name) for f in attrs.fields(RegistryState)))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        frozen.default = None  # type: ignore[misc]


def test_fast_answers_equal_the_attrs_constructed_ones() -> None:
    session = SessionKey(0, 1, 2)
    pairs = [
        (new_bound(session, A, "lora-a"), Bound(session, A, "lora-a")),
        (new_closed(session, True), Closed(session, True)),
        (new_closed(session, False), Closed(session, False)),
    ]
    for fast, constructed in pairs:
        assert fast == constructed and hash(fast) == hash(constructed) and repr(fast) == repr(constructed)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            fast.session = None  # type: ignore[misc]


def test_initial_state_parameters() -> None:
    state = initial_state(engines=("E0", "E1", "E2"), capacity=3, epoch=4, incarnations={"E1": 9})
    assert state.config.engines == ("E0", "E1", "E2") and state.config.capacity == 3 and state.config.epoch == 4
    assert dict(state.incarnations) == {"E0": 0, "E1": 9, "E2": 0}
    for bad in ({"engines": ()}, {"engines": ("E0", "E0")}, {"capacity": 0}):
        with pytest.raises(ValueError):
            initial_state(**bad)  # type: ignore[arg-type]


def test_queries() -> None:
    r = Registry()
    assert not may_dispatch(r.state, A) and not servable_on(r.state, A, "E0")
    token = reserve(r, A)
    assert not may_dispatch(r.state, A) and not servable_on(r.state, A, "E0")
    r(RecordReady(A, token, "E0", 0, DIGEST[A]))
    assert not servable_on(r.state, A, "E0")  # READY but not committed
    publish(Registry(), B)


def test_checking_reports_every_kind_of_violation() -> None:
    r = Registry()
    publish(r, A)
    before = r.state
    event = OpenSession(SessionKey(0, 0, 0))
    # A forged outcome: the row says "open the session" but the state shows it BOUND with no ref,
    # the default dropped, and a field no row of this kind declares.
    bad = attrs.evolve(
        before,
        sessions=before.sessions.set(SessionKey(0, 0, 0), attrs.evolve(_record(SessionState.BOUND), version=A)),
        default=None,
        attempts_issued=before.attempts_issued + 5,
    )
    problems = registry_step_violations(before, event, Fired(ROWS_BY_ID["open.unseen"], bad, None, ()))  # type: ignore[arg-type]
    text = "; ".join(problems)
    assert "invariant session_refs_match_bindings" in text
    assert "step invariant retired_never_default_again" in text
    assert "frame: row open.unseen wrote undeclared fields" in text and "counter.attempts" in text
    assert "targets OPEN but the entity is BOUND" in text
    problems = registry_step_violations(before, event, Fired(ROWS_BY_ID["open.late"], bad, None, ()))  # type: ignore[arg-type]
    assert any("declares no writes but changed the state" in p for p in problems)
    stray = draft_of(before)
    stray.sesions = Map()  # type: ignore[attr-defined]  # a misspelt field, as an update could write it
    problems = registry_step_violations(before, event, Fired(ROWS_BY_ID["open.late"], stray.freeze(), None, ()))  # type: ignore[arg-type]
    assert problems == ["row open.late left attributes that are not fields: ['sesions']"]
    assert "config" in changed_fields(before, attrs.evolve(before, config=attrs.evolve(before.config, capacity=9)))


def _record(state: SessionState) -> object:
    from versioned_lora.spec.model import SessionRecord

    return SessionRecord(state, None)


def test_engine_checking_reports_unload_while_referenced() -> None:
    before = initial_engine_state("E0", 0)
    before = attrs.evolve(before, adapters=Map({"a": ManagedAdapter(AdapterState.READY, "t", "d", native_refs=2)}))
    after = attrs.evolve(before, adapters=Map({"a": ManagedAdapter(AdapterState.UNLOADED, "t", "d", native_refs=2)}))
    fired = Fired(ROWS_BY_ID["end.verified"], after, None, (PhysicalUnload("a"),))  # type: ignore[arg-type]
    problems = engine_step_violations(before, AcquireRequest("a"), fired)  # type: ignore[arg-type]
    text = "; ".join(problems)
    assert "unloads a while it is referenced" in text
    assert "engine invariant" in text and "engine step invariant nothing_unloaded_while_referenced" in text
    assert "targets LOADING but the adapter is UNLOADED" in text
    assert "engine" in engine_changed_fields(before, attrs.evolve(before, engine="E1"))
    gone = attrs.evolve(before, adapters=Map())
    assert "adapter.state" in engine_changed_fields(before, gone)


def test_checked_steps_raise_on_a_broken_row() -> None:
    # A mutant whose bind forgets to declare the session-ref write: the frame check catches it.
    rows = tuple(
        attrs.evolve(row, writes=("session.state", "session.version")) if row.id == "bind.first" else row
        for row in ROWS
    )
    mutant = Core(rows)
    r = Registry()
    publish(r, A)
    with pytest.raises(InvariantViolation, match=r"version\.session_refs"):
        checked_step(r.state, BindFirst(SessionKey(0, 0, 0)), mutant)
    rows = tuple(attrs.evolve(row, writes=("adapter.state",)) if row.id == "acquire.ready" else row for row in ROWS)
    engine = initial_engine_state("E0", 0)
    engine = attrs.evolve(engine, adapters=Map({"a": ManagedAdapter(AdapterState.READY, "t", "d")}))
    with pytest.raises(InvariantViolation, match=r"adapter\.native_refs"):
        checked_engine_step(engine, AcquireRequest("a"), Core(rows))


def test_refusal_results_name_their_row() -> None:
    r = Registry()
    result = r(BindFirst(SessionKey(0, 0, 0)))
    assert result.reason is Reason.NO_PUBLISHED_VERSION and result.row == "bind.no_default"  # type: ignore[union-attr]
    assert CORE.fired_row(r.state, BindFirst(SessionKey(0, 0, 0))).id == "bind.no_default"


def test_core_methods_and_select_errors() -> None:
    state = initial_state()
    assert CORE.step(state, OpenSession(SessionKey(0, 0, 0)))[0] != state
    engine = initial_engine_state("E0", 0)
    assert CORE.engine_step(engine, AcquireRequest("a"))[0] is engine
    assert CORE.engine_fired_row(engine, AcquireRequest("a")).id == "acquire.unavailable"
    with pytest.raises(ProtocolError, match="not an event"):
        CORE.fired_row(state, "x")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        CORE.fired_row(state, FOREIGN_ENGINE)


def test_candidate_events_without_faults_and_at_the_restart_bound() -> None:
    domain = EventDomain(versions=((A, DIGEST[A]),), sessions=(SessionKey(0, 0, 0),), faulty=False, max_incarnation=0)
    events = candidate_events(initial_state(), domain)
    assert not any(isinstance(e, EngineRestarted) for e in events)
    assert all(getattr(e, "version", A) == A for e in events)
