"""h2-style product tests: every (state, event) pair, on states reached by the core itself.

For each pair: if a row covers it, the step lands in a legal state (all invariants, step invariants
and the frame condition hold) and a row that declares no writes leaves the state identical; if no row
covers it, the one `ProtocolError` is raised and the state is unchanged. The compiled lookup and the
`transitions` machine, built from the same table, agree on every pair.
"""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle_driver import digest_of, session, version

from versioned_lora.lifecycle import (
    CORE,
    AdapterPlan,
    ClaimReclaim,
    EngineAdapterState,
    EngineEvent,
    EngineEventDomain,
    EngineRestarted,
    EventDomain,
    ProtocolError,
    RecordReady,
    RegistryEvent,
    RegistryState,
    candidate_engine_events,
    candidate_events,
    checked_engine_step,
    checked_step,
    enabled_engine_events,
    enabled_events,
    initial_engine_state,
    initial_state,
    successors,
)
from versioned_lora.spec import ROWS, Machine

VERSIONS = tuple((version(v), digest_of(v)) for v in ("A", "B", "C"))
DOMAIN = EventDomain(versions=VERSIONS, sessions=(session(0), session(1), session(2, shard=1)), max_incarnation=2)
# Small enough for the breadth-first search to reach commits, swaps and reclaims within its bound. Without the
# publisher lease's events (a registry that never granted one: unfenced publication); the lease has its own
# exhaustive search below (test_every_lease_pair_reached_by_breadth_first_search).
SMALL_DOMAIN = EventDomain(versions=VERSIONS[:2], sessions=(session(0),), max_incarnation=1, lease=False)
LEASE_DOMAIN = EventDomain(versions=VERSIONS[:1], sessions=(), max_incarnation=1, max_fence=3)
LEASE_ROWS = {row.id for row in ROWS if row.machine is Machine.LEASE} | {"reserve.no_lease", "commit.no_lease"}
ENGINE_DOMAIN = EngineEventDomain(
    adapters=(AdapterPlan("a", "da", 2), AdapterPlan("b", "db", 1)),
    attempt_tokens=("t1", "t2"),
    reclaim_ids=("rid", "forged"),
    max_incarnation=2,
)
BEYOND_THE_BFS_BOUND = {
    "commit.swap", "claim.retired", "claim.in_use", "claim.replay", "claim.replay_done", "confirm.one",
    "confirm.last", "confirm.replay", "confirm.forged", "prepared.reclaiming", "ready.reclaiming",
    "reserve.over_capacity",
}  # fmt: skip
# Run without the coverage tracer (pytest-cov's no_cover): the breadth-first searches step the core a few million
# times, about 2.4x slower under the tracer, and the rest of tests/lifecycle already reaches 100% statement and
# branch coverage without them (checked 2026-12-07: `-k 'not breadth_first'` keeps lifecycle/ at 100%).
WITHOUT_TRACER = pytest.mark.no_cover
FOREIGN_EVENTS: tuple[RegistryEvent, ...] = (
    RecordReady(VERSIONS[0][0], "attempt@0-1", "E9", 0, VERSIONS[0][1]),
    EngineRestarted("E9", 1),
)


def _registry_pair(state: RegistryState, event: RegistryEvent, fired_counts: Counter[str]) -> RegistryState:
    snapshot = hash(state)
    try:
        fired = checked_step(state, event)  # raises InvariantViolation on any broken invariant or frame
    except ProtocolError:
        assert hash(state) == snapshot
        raise
    fired_counts[fired.row.id] += 1
    if not fired.row.changes_state:
        assert fired.state is state
    assert CORE.transitions_step(state, event) == CORE.step(state, event)
    assert isinstance(fired.state, RegistryState)
    return fired.state


def _breadth_first(start: RegistryState, domain: EventDomain, bound: int, fired: Counter[str],
                   foreign: tuple[RegistryEvent, ...] = ()) -> bool:
    """Every candidate event of `domain` on the first `bound` states reachable from `start`, breadth first,
    each pair checked (`foreign` events must raise ProtocolError in every state). True if the bound stopped
    the search (states were left unexpanded), False if it ran dry."""
    seen = {start}
    frontier = deque([start])
    expanded = 0
    while frontier and expanded < bound:
        state = frontier.popleft()
        expanded += 1
        for event in foreign:
            with pytest.raises(ProtocolError):
                _registry_pair(state, event, fired)
        for event in candidate_events(state, domain):
            after = _registry_pair(state, event, fired)
            if after not in seen:
                seen.add(after)
                frontier.append(after)
    return expanded == bound and len(frontier) > 0


@WITHOUT_TRACER
def test_every_pair_reached_by_breadth_first_search() -> None:
    """Every candidate event on the first 2000 states reachable from the initial one, breadth first; an
    engine the registry does not know (FOREIGN_EVENTS) has no row in any state."""
    fired: Counter[str] = Counter()
    bounded = _breadth_first(initial_state(engines=("E0", "E1"), capacity=2), SMALL_DOMAIN, 2000, fired,
                             FOREIGN_EVENTS)
    # The bound stopped the search (it did not run dry), and the rows fired are exactly the registry rows
    # but those beyond it: each needs a second version committed over the first (swap, then retire,
    # claim, confirm) or, over_capacity, a third version SMALL_DOMAIN does not have.
    assert bounded
    registry_rows = {row.id for row in ROWS if row.machine not in (Machine.ADAPTER, Machine.PROCESS)}
    assert registry_rows - set(fired) == BEYOND_THE_BFS_BOUND | LEASE_ROWS


@WITHOUT_TRACER
def test_every_lease_pair_reached_by_breadth_first_search() -> None:
    """The publisher lease with one version, two engines, both holders and every fault, from a registry that
    requires the lease: every candidate event on the first 3000 states, breadth first (the space is infinite:
    each retry of a cleaned attempt mints a token), every pair checked, and every lease row fired, with the
    refusals of a Reserve and a Commit under a fence that is not live."""
    fired: Counter[str] = Counter()
    _breadth_first(initial_state(engines=("E0", "E1"), capacity=2, publisher_lease=True), LEASE_DOMAIN, 3000,
                   fired)
    assert LEASE_ROWS - set(fired) == set(), sorted(LEASE_ROWS - set(fired))
    assert fired["commit.bootstrap"] and fired["reserve.new"]  # the holder still publishes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_walks_over_every_event(data: st.DataObject) -> None:
    """Long walks, mostly over enabled events (so deep states are reached), probing every candidate."""
    state = initial_state(engines=("E0", "E1"), capacity=data.draw(st.integers(1, 3)))
    fired: Counter[str] = Counter()
    for _ in range(data.draw(st.integers(10, 60))):
        probe = data.draw(st.sampled_from(candidate_events(state, DOMAIN) + FOREIGN_EVENTS))
        if probe in FOREIGN_EVENTS:
            with pytest.raises(ProtocolError):
                _registry_pair(state, probe, fired)
        else:
            _registry_pair(state, probe, fired)
        enabled = enabled_events(state, DOMAIN)
        if not enabled:
            break
        state = _registry_pair(state, data.draw(st.sampled_from(enabled)), fired)


def test_successors_are_the_enabled_events_stepped() -> None:
    state = initial_state()
    for event, (after, _, _) in successors(state, DOMAIN):
        assert CORE.fired_row(state, event).changes_state and after != state


def test_deep_scripted_walk_fires_every_registry_row() -> None:
    """A seeded walk biased toward progress, checking all pairs along the way, fires every registry row."""
    import random

    rng = random.Random(3)
    fired: Counter[str] = Counter()

    def domain(state: RegistryState) -> EventDomain:
        # Sessions slide with the low-water mark, so fresh sessions keep arriving as old ones close.
        mark = state.low_water.get(0, 0)
        return EventDomain(versions=VERSIONS, sessions=tuple(session(mark + i) for i in range(3)), lease=False)

    for capacity in (1, 2, 3):
        state = initial_state(capacity=capacity)
        for i in range(1500):
            candidates = candidate_events(state, domain(state))
            probes = candidates if i % 25 == 0 else rng.sample(candidates, 8)  # every pair, now and then
            for probe in (*probes, *(ClaimReclaim(v) for v, _ in VERSIONS)):
                _registry_pair(state, probe, fired)
            enabled = enabled_events(state, domain(state))
            if not enabled or rng.random() < 0.02:  # quiescent (everything closed and reclaimed), or a fresh start
                state = initial_state(capacity=capacity)
                continue
            state = _registry_pair(state, rng.choice(enabled), fired)
    # ClaimReclaim is always a candidate; the walk must have claimed and reclaimed at least once.
    assert fired["claim.retired"] and fired["confirm.last"]
    registry_rows = {row.id for row in ROWS if row.machine not in (Machine.ADAPTER, Machine.PROCESS)} - LEASE_ROWS
    assert registry_rows - set(fired) == set(), sorted(registry_rows - set(fired))
    assert ClaimReclaim(VERSIONS[0][0]) in candidate_events(state, DOMAIN)


# ---------------------------------------------------------------- engine side


def _engine_pair(state: EngineAdapterState, event: EngineEvent, fired_counts: Counter[str]) -> EngineAdapterState:
    fired = checked_engine_step(state, event)
    fired_counts[fired.row.id] += 1
    if not fired.row.changes_state:
        assert fired.state is state
    assert CORE.transitions_engine_step(state, event) == CORE.engine.step(state, event)
    assert isinstance(fired.state, EngineAdapterState)
    return fired.state


@WITHOUT_TRACER
def test_every_engine_pair_reached_by_breadth_first_search() -> None:
    start = initial_engine_state("E0", 0)
    seen = {start}
    frontier = deque([start])
    fired: Counter[str] = Counter()
    small = EngineEventDomain(
        (AdapterPlan("a", "da", 1),), ("t1", "t2"), reclaim_ids=("rid", "forged"), max_incarnation=1
    )
    while frontier and len(seen) < 3000:
        state = frontier.popleft()
        for event in candidate_engine_events(state, small):
            after = _engine_pair(state, event, fired)
            if after not in seen:
                seen.add(after)
                frontier.append(after)
    engine_rows = {row.id for row in ROWS if row.machine in (Machine.ADAPTER, Machine.PROCESS)}
    assert engine_rows - set(fired) == set(), sorted(engine_rows - set(fired))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_engine_random_walks(data: st.DataObject) -> None:
    state = initial_engine_state("E0", 0)
    fired: Counter[str] = Counter()
    for _ in range(data.draw(st.integers(5, 40))):
        state = _engine_pair(state, data.draw(st.sampled_from(candidate_engine_events(state, ENGINE_DOMAIN))), fired)
        assert set(enabled_engine_events(state, ENGINE_DOMAIN)) <= set(candidate_engine_events(state, ENGINE_DOMAIN))
