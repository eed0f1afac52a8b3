"""Hypothesis state machines whose rules come from the table: one rule per row.

A row's rule is enabled (its precondition) when some candidate event fires that row in the current
state; the rule draws one such event (events carry data: versions, tokens, incarnations, reclaim
ids, drawn from the candidates, including stale and forged ones) and steps the core with every
check (`checked_step`: invariants, step invariants, frame condition). The registry and two engines
are driven together, so engine rows see the registry's real attempt tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from versioned_lora.lifecycle import (
    CORE,
    Core,
    EngineAdapterState,
    EngineEventDomain,
    EventDomain,
    ProtocolError,
    RegistryState,
    SessionKey,
    VersionKey,
    candidate_engine_events,
    candidate_events,
    checked_engine_step,
    checked_step,
    initial_engine_state,
    initial_state,
    lora_name,
    reclaim_id,
)
from versioned_lora.lifecycle.enabled import FORGED_RECLAIM_ID, STALE_TOKEN, AdapterPlan
from versioned_lora.spec import events as ev
from versioned_lora.spec.invariants import engine_violated, violated

ENGINES = ("E0", "E1")
VERSIONS = tuple((VersionKey(0, v), f"{v}" * 64) for v in "ABC")
SESSIONS = tuple(SessionKey(0, shard, seq) for shard in (0, 1) for seq in (0, 1))
MAX_INCARNATION = 3


def _engine_domain(registry: RegistryState) -> EngineEventDomain:
    tokens = {v.attempt_token for v in registry.versions.values()}
    tokens |= {p.attempt_token for p in registry.placements.values() if p.attempt_token}
    plans = tuple(AdapterPlan(lora_name(k, d), d, 2) for k, d in VERSIONS)
    rids = (*(reclaim_id(k) for k, _ in VERSIONS), FORGED_RECLAIM_ID)
    return EngineEventDomain(plans, tuple(sorted(tokens | {STALE_TOKEN})), rids, MAX_INCARNATION)


def _publish(version: int) -> list[Any]:
    key, digest = VERSIONS[version]
    name = lora_name(key, digest)

    def token(m: Any) -> str:
        return str(m.registry.versions[key].attempt_token)

    steps: list[Any] = [lambda m: (None, ev.Reserve(key, digest))]
    for e in ENGINES:
        steps += [
            lambda m, e=e: (e, ev.BeginStaging(name, token(m), 1, digest, 2)),
            lambda m, e=e: (None, ev.RecordPrepared(key, token(m), e, 1, digest)),
            lambda m, e=e: (e, ev.ReceiveBucket(name, token(m), 1, 0)),
            lambda m, e=e: (e, ev.ReceiveBucket(name, token(m), 1, 1)),
            lambda m, e=e: (e, ev.EndStaging(name, token(m), 1, True)),
            lambda m, e=e: (None, ev.RecordReady(key, token(m), e, 1, digest)),
        ]
    steps.append(lambda m: (None, ev.Commit(key, token(m), m.registry.default_revision)))
    return steps


def _happy_path() -> tuple[Any, ...]:
    a_key, a_digest = VERSIONS[0]
    a_name = lora_name(a_key, a_digest)
    steps = _publish(0)
    steps += [lambda m, s=s: (None, ev.BindFirst(s)) for s in SESSIONS[:2]]
    steps += [lambda m, e=e: (e, ev.AcquireRequest(a_name)) for e in ENGINES]
    steps += _publish(1)
    steps += [lambda m, s=s: (None, ev.BeginClose(s)) for s in SESSIONS[:2]]
    steps += [lambda m, s=s: (None, ev.CloseAndRelease(s)) for s in SESSIONS[:2]]
    steps.append(lambda m: (None, ev.ClaimReclaim(a_key)))
    for e in ENGINES:
        steps += [lambda m, e=e: (e, ev.ReclaimAdapter(a_name, reclaim_id(a_key))),
                  lambda m, e=e: (e, ev.ReleaseRequest(a_name)),
                  lambda m, e=e: (e, ev.FinishUnload(a_name, reclaim_id(a_key))),
                  lambda m, e=e: (None, ev.ConfirmReclaim(a_key, e, reclaim_id(a_key)))]
    # then a failed publication of C: a manifest that does not verify on E0, abort, cleanup, retry
    c_key, c_digest = VERSIONS[2]
    c_name = lora_name(c_key, c_digest)

    def c_token(m: Any) -> str:
        return str(m.registry.versions[c_key].attempt_token)

    steps += [
        lambda m: (None, ev.Reserve(c_key, c_digest)),
        lambda m: ("E0", ev.BeginStaging(c_name, c_token(m), 1, c_digest, 2)),
        lambda m: ("E0", ev.ReceiveBucket(c_name, c_token(m), 1, 0)),
        lambda m: ("E0", ev.ReceiveBucket(c_name, c_token(m), 1, 1)),
        lambda m: ("E0", ev.EndStaging(c_name, c_token(m), 1, False)),
        lambda m: (None, ev.Abort(c_key, c_token(m))),
        lambda m: ("E1", ev.CleanupAttempt(c_name, c_token(m))),
        lambda m: (None, ev.RecordCleaned(c_key, c_token(m), "E0")),
        lambda m: (None, ev.RecordCleaned(c_key, c_token(m), "E1")),
        lambda m: (None, ev.Reserve(c_key, c_digest)),
        lambda m: ("E0", ev.BeginStaging(c_name, c_token(m), 1, c_digest, 2)),
    ]
    return tuple(steps)


HAPPY_PATH = _happy_path()


def build_machine(core: Core = CORE, counts: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A RuleBasedStateMachine class for `core` (the spec's, or a mutant's); fired rows go to `counts`."""
    fired = counts if counts is not None else Counter()
    rows = core.rows

    class TableMachine(RuleBasedStateMachine):
        @initialize(prefix=st.sampled_from(range(len(HAPPY_PATH) + 1)))
        def start(self, prefix: int) -> None:
            """Start from a random point of the RFC's happy path (A published, B published, A reclaimed),
            so that random rules reach deep states; every prefix step is itself checked."""
            self.registry: RegistryState = initial_state(ENGINES, 2, 0, dict.fromkeys(ENGINES, 1))
            self.engines: dict[str, EngineAdapterState] = {e: initial_engine_state(e, 1) for e in ENGINES}
            self._options: dict[str, list[tuple[str | None, Any]]] | None = None
            for make in HAPPY_PATH[:prefix]:
                where, event = make(self)
                self.fire(where, event)

        def options(self) -> dict[str, list[tuple[str | None, Any]]]:
            """row id -> the candidate events (and the engine, for engine rows) that fire it now."""
            if self._options is None:
                out: dict[str, list[tuple[str | None, Any]]] = {}
                domain = EventDomain(VERSIONS, SESSIONS, faulty=True, max_incarnation=MAX_INCARNATION)
                for event in candidate_events(self.registry, domain):
                    try:
                        out.setdefault(core.fired_row(self.registry, event).id, []).append((None, event))
                    except ProtocolError:
                        out.setdefault("<no row>", []).append((None, event))
                edomain = _engine_domain(self.registry)
                for name, engine in self.engines.items():
                    for event in candidate_engine_events(engine, edomain):
                        try:
                            out.setdefault(core.engine_fired_row(engine, event).id, []).append((name, event))
                        except ProtocolError:
                            out.setdefault("<no row>", []).append((name, event))
                self._options = out
            return self._options

        def fire(self, where: str | None, event: Any) -> None:
            self._options = None
            if where is None:
                f = checked_step(self.registry, event, core)
                self.registry = f.state  # type: ignore[assignment]
            else:
                f = checked_engine_step(self.engines[where], event, core)
                self.engines[where] = f.state  # type: ignore[assignment]
            fired[f.row.id] += 1

        @precondition(lambda self: "<no row>" in self.options())
        @rule(data=st.data())
        def uncovered_pair(self, data: st.DataObject) -> None:
            where, event = data.draw(st.sampled_from(self.options()["<no row>"]))
            self.fire(where, event)  # raises ProtocolError: a pair the table must cover

        @invariant()
        def spec_invariants(self) -> None:
            if hasattr(self, "registry"):
                assert not violated(self.registry), violated(self.registry)
                for engine in self.engines.values():
                    assert not engine_violated(engine), engine_violated(engine)

    for row in rows:
        _add_row_rule(TableMachine, row.id)
    TableMachine.__name__ = TableMachine.__qualname__ = "TableMachine"
    return TableMachine


def _add_row_rule(cls: type, row_id: str) -> None:
    def has_row(self: Any) -> bool:
        return row_id in self.options()

    def fire_row(self: Any, data: st.DataObject) -> None:
        where, event = data.draw(st.sampled_from(self.options()[row_id]), label=row_id)
        self.fire(where, event)

    fire_row.__name__ = "row_" + row_id.replace(".", "_")
    setattr(cls, fire_row.__name__, precondition(has_row)(rule(data=st.data())(fire_row)))
