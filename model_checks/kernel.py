"""The bridge between the checker's small-int encoding and the pure core.

Every registry or engine transition the checker takes goes through `Core.step_traced` /
`Core.engine_step_traced` (the table, compiled), once per distinct (sub-state, event): the composed
state stores interned ids of `RegistryState` / `EngineAdapterState` values, and the answers, the
effects (as jobs for the drivers), the fired row and every spec check of that step are cached under
(id, event code). So the composed system's successor function is the table's, by construction; the
cache only avoids recomputing the same step twice.

Event codes are tuples of ints (kind first); see REG_* and ENG_* below.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, cast

from immutables import Map

from model_checks.bounds import Bounds
from model_checks.step_properties import engine_step_problems, registry_step_problems
from versioned_lora.lifecycle import (
    CORE,
    AdapterState,
    Bound,
    CleanupOnEngine,
    Closed,
    Core,
    EngineAdapterState,
    EngineEventDomain,
    EventDomain,
    PhysicalUnload,
    PlacementState,
    ProtocolError,
    ReadyLocal,
    ReclaimOnEngine,
    Recorded,
    RegistryState,
    Rejected,
    Reserved,
    SessionKey,
    SessionState,
    StageOnEngine,
    VersionKey,
    VersionState,
    candidate_engine_events,
    candidate_events,
    engine_step_violations,
    initial_engine_state,
    initial_state,
    lora_name,
    reclaim_id,
    registry_step_violations,
)
from versioned_lora.lifecycle.enabled import FORGED_RECLAIM_ID, LEASE_TTL_S, PUBLISHERS, STALE_TOKEN, AdapterPlan
from versioned_lora.lifecycle.results import Aborted, AdapterStatus, LeaseGranted, SessionStatus
from versioned_lora.spec import LIVENESS, Reason
from versioned_lora.spec import events as ev
from versioned_lora.spec.invariants import engine_violated, violated
from versioned_lora.spec.model import OCCUPYING_STATES

EPOCH = 0
FIRST_INCARNATION = 1
STALE = -1  # the encoded form of STALE_TOKEN

# registry event kinds
(R_RESERVE, R_COMMIT, R_ABORT, R_CLAIM, R_PREPARED, R_READY, R_UNKNOWN, R_CLEANED, R_CONFIRM, R_OPEN, R_BIND,
 R_BEGIN_CLOSE, R_CLOSE, R_RESTARTED, R_ACQUIRE, R_RELEASE, R_EXPIRE, R_TAKEOVER) = range(18)  # fmt: skip
# the publisher lease's holders, by index (the names candidate_events draws from, so probes and actions agree)
HOLDERS = PUBLISHERS
H_PUBLISHER, H_RIVAL = range(2)
# engine event kinds
G_BEGIN, G_BUCKET, G_END, G_CLEANUP, G_ACQUIRE, G_RELEASE, G_RECLAIM, G_FINISH, G_STARTED = range(9)
G_ABORT_REQ = 9  # a session's abort of its own request: the environment turns it into a release if it runs
# job kinds (the drivers' work items, made from the core's effects)
J_STAGE, J_CLEAN, J_RECLAIM, J_NOTIFY = range(4)

VERSION_STATES = tuple(VersionState)
PLACEMENT_STATES = tuple(PlacementState)
SESSION_STATES = tuple(SessionState)
ADAPTER_STATES = tuple(AdapterState)
REASONS = tuple(Reason)
_VS = {s: i for i, s in enumerate(VERSION_STATES)}
_PS = {s: i for i, s in enumerate(PLACEMENT_STATES)}
_SS = {s: i for i, s in enumerate(SESSION_STATES)}
_AS = {s: i for i, s in enumerate(ADAPTER_STATES)}
V_UNSEEN, V_LOADING, V_PUBLISHED, V_RETIRED = (_VS[VersionState.UNSEEN], _VS[VersionState.LOADING],
                                               _VS[VersionState.PUBLISHED], _VS[VersionState.RETIRED])
V_RECLAIMING, V_RECLAIMED, V_ABORTED, V_FAILED_CLEAN = (_VS[VersionState.RECLAIMING], _VS[VersionState.RECLAIMED],
                                                        _VS[VersionState.ABORTED], _VS[VersionState.FAILED_CLEAN])
P_BEGUN, P_PREPARED, P_READY, P_UNKNOWN, P_CLEANING, P_CLEANED = (
    _PS[PlacementState.BEGUN], _PS[PlacementState.PREPARED], _PS[PlacementState.READY], _PS[PlacementState.UNKNOWN],
    _PS[PlacementState.CLEANING], _PS[PlacementState.CLEANED])
S_UNSEEN, S_OPEN, S_BOUND, S_FINALIZING, S_CLOSED, S_COMPACTED = (
    _SS[SessionState.UNSEEN], _SS[SessionState.OPEN], _SS[SessionState.BOUND], _SS[SessionState.FINALIZING],
    _SS[SessionState.CLOSED], _SS[SessionState.COMPACTED])
A_ABSENT, A_STAGING, A_READY, A_UNREGISTERED, A_DRAINING, A_UNLOADED, A_CLEANED = (
    _AS[AdapterState.ABSENT], _AS[AdapterState.STAGING], _AS[AdapterState.READY], _AS[AdapterState.UNREGISTERED],
    _AS[AdapterState.DRAINING], _AS[AdapterState.UNLOADED], _AS[AdapterState.CLEANED])
DISPATCHABLE = frozenset({V_PUBLISHED, V_RETIRED})
OCCUPYING = frozenset(_VS[s] for s in OCCUPYING_STATES)
LOADED_ADAPTER = frozenset({A_STAGING, A_READY, A_UNREGISTERED, A_DRAINING})

OK, NO = 1, 0  # first field of an encoded answer


def token_str(tok: int) -> str:
    return STALE_TOKEN if tok == STALE else f"attempt@{EPOCH}-{tok}"


def token_int(token: str | None) -> int:
    if token is None or token == STALE_TOKEN:
        return STALE
    return int(token.rsplit("-", 1)[1])


class RegView:
    """What the drivers and the cross-cutting invariants read of one registry state (cached per id)."""

    __slots__ = ("default", "incarnations", "lease_fence", "lease_holder", "occupied", "placements", "refs",
                 "revision", "sessions", "vstate", "vtoken")

    def __init__(self, s: RegistryState, k: Kernel) -> None:
        self.vstate = tuple(_VS[s.versions[key].state] if key in s.versions else V_UNSEEN for key in k.keys)
        self.vtoken = tuple(token_int(s.versions[key].attempt_token) if key in s.versions else STALE for key in k.keys)
        self.refs = tuple(s.session_refs.get(key, 0) for key in k.keys)
        self.placements = tuple(
            tuple(
                (_PS[p.state], token_int(p.attempt_token), p.incarnation)
                if (p := s.placements.get((key, e)))
                else None
                for e in k.engine_names
            )
            for key in k.keys
        )
        self.incarnations = tuple(s.incarnations[e] for e in k.engine_names)
        self.revision = s.default_revision
        self.default = -1 if s.default is None else k.keys.index(s.default)
        sessions = []
        for sk in k.session_keys:
            record = s.sessions.get(sk)
            state = _SS[SessionState.COMPACTED] if sk.seq < s.low_water.get(sk.shard, 0) else (
                S_UNSEEN if record is None else _SS[record.state])
            version = -1 if record is None or record.version is None else k.keys.index(record.version)
            sessions.append((state, version))
        self.sessions = tuple(sessions)
        self.occupied = sum(1 for v in self.vstate if v in OCCUPYING)
        self.lease_holder = -1 if s.lease.holder is None else HOLDERS.index(s.lease.holder)
        self.lease_fence = s.lease.fence


class EngView:
    __slots__ = ("adapters", "incarnation")

    def __init__(self, s: EngineAdapterState, k: Kernel) -> None:
        self.incarnation = s.incarnation
        adapters = []
        for name in k.names:
            a = s.adapters.get(name)
            adapters.append((A_ABSENT, 0, STALE) if a is None else (_AS[a.state], a.native_refs,
                                                                     token_int(a.attempt_token)))
        self.adapters = tuple(adapters)


class Transition:
    """One cached core step: where it lands, what it answers, the jobs its effects ask for."""

    __slots__ = ("after", "answer", "jobs", "label", "problems", "row", "unloads")

    def __init__(self, after: int, answer: tuple[int, ...], jobs: tuple[tuple[int, ...], ...], row: int,
                 problems: tuple[str, ...], label: str, unloads: tuple[int, ...] = ()) -> None:
        self.after, self.answer, self.jobs, self.row = after, answer, jobs, row
        self.problems, self.label, self.unloads = problems, label, unloads


class Kernel:
    """Interned sub-states and cached core steps for one (Bounds, Core)."""

    def __init__(self, bounds: Bounds, core: Core = CORE, reference: Core = CORE) -> None:
        self.bounds, self.core, self.reference = bounds, core, reference
        self.engine_names = bounds.engine_names
        self.keys = tuple(VersionKey(EPOCH, vid) for vid in bounds.version_ids)
        self.digests = tuple(bounds.digest(i) for i in range(bounds.versions))
        self.names = tuple(lora_name(k, d) for k, d in zip(self.keys, self.digests, strict=True))
        self.rids = tuple(reclaim_id(k) for k in self.keys)
        self.session_keys = tuple(SessionKey(EPOCH, i, 0) for i in range(bounds.sessions))  # one shard each
        self.row_index = {row.id: i for i, row in enumerate(core.rows)}
        self.row_counts = [0] * len(core.rows)
        self.reg_states: list[RegistryState] = []
        self.reg_ids: dict[RegistryState, int] = {}
        self.reg_views: list[RegView] = []
        self.eng_states: list[EngineAdapterState] = []
        self.eng_ids: dict[EngineAdapterState, int] = {}
        self.eng_views: list[EngView] = []
        self.reg_cache: dict[tuple[int, tuple[int, ...]], Transition] = {}
        self.eng_cache: dict[tuple[int, tuple[int, ...]], Transition] = {}
        self.reg_probe_moves: list[tuple[Transition, ...]] = []
        self.eng_probe_moves: list[tuple[Transition, ...]] = []
        self.reg_problems: list[tuple[str, ...]] = []
        self.eng_problems: list[tuple[str, ...]] = []
        self._obligations: dict[int, frozenset[Hashable]] = {}
        self._perm_cache: dict[tuple[int, tuple[int, ...]], int] = {}

    # ------------------------------------------------------------ initial sub-states

    def initial_registry(self) -> int:
        incarnations = dict.fromkeys(self.engine_names, FIRST_INCARNATION)
        return self.intern_registry(initial_state(self.engine_names, self.bounds.capacity, EPOCH, incarnations,
                                                  publisher_lease=True))

    def initial_engine(self, e: int) -> int:
        return self.intern_engine(initial_engine_state(self.engine_names[e], FIRST_INCARNATION))

    # ------------------------------------------------------------ interning

    def intern_registry(self, s: RegistryState) -> int:
        rid = self.reg_ids.get(s)
        if rid is None:
            rid = self.reg_ids[s] = len(self.reg_states)
            self.reg_states.append(s)
            self.reg_views.append(RegView(s, self))
            self.reg_problems.append(tuple(f"invariant {n}" for n in violated(s)))
            self.reg_probe_moves.append(())
            if self.bounds.probes:
                self.reg_probe_moves[rid] = self._probe_registry(rid)
        return rid

    def intern_engine(self, s: EngineAdapterState) -> int:
        eid = self.eng_ids.get(s)
        if eid is None:
            eid = self.eng_ids[s] = len(self.eng_states)
            self.eng_states.append(s)
            self.eng_views.append(EngView(s, self))
            self.eng_problems.append(tuple(f"engine invariant {n}" for n in engine_violated(s)))
            self.eng_probe_moves.append(())
            if self.bounds.probes:
                self.eng_probe_moves[eid] = self._probe_engine(eid)
        return eid

    # ------------------------------------------------------------ events

    def registry_event(self, code: tuple[int, ...]) -> Any:
        kind = code[0]
        if kind <= R_CONFIRM:
            v = code[1]
            key, digest = self.keys[v], self.digests[v]
            if kind == R_RESERVE:
                return ev.Reserve(key, digest, code[2])
            if kind == R_COMMIT:
                return ev.Commit(key, token_str(code[2]), code[3], code[4])
            if kind == R_ABORT:
                return ev.Abort(key, token_str(code[2]))
            if kind == R_CLAIM:
                return ev.ClaimReclaim(key)
            if kind == R_CONFIRM:
                return ev.ConfirmReclaim(key, self.engine_names[code[2]], self.rids[v])
            engine = self.engine_names[code[3]]
            if kind == R_PREPARED:
                return ev.RecordPrepared(key, token_str(code[2]), engine, code[4], digest)
            if kind == R_READY:
                return ev.RecordReady(key, token_str(code[2]), engine, code[4], digest)
            if kind == R_UNKNOWN:
                return ev.RecordUnknown(key, token_str(code[2]), engine)
            return ev.RecordCleaned(key, token_str(code[2]), engine)
        if kind == R_RESTARTED:
            return ev.EngineRestarted(self.engine_names[code[1]], code[2])
        if kind == R_ACQUIRE:
            return ev.AcquireLease(HOLDERS[code[1]], LEASE_TTL_S)
        if kind == R_RELEASE:
            return ev.ReleaseLease(HOLDERS[code[1]], code[2])
        if kind == R_EXPIRE:
            return ev.ExpireLease(code[1])
        if kind == R_TAKEOVER:
            return ev.TakeOverLease(HOLDERS[code[1]], code[2], LEASE_TTL_S)
        session = self.session_keys[code[1]]
        return {R_OPEN: ev.OpenSession, R_BIND: ev.BindFirst, R_BEGIN_CLOSE: ev.BeginClose,
                R_CLOSE: ev.CloseAndRelease}[kind](session)

    def engine_event(self, code: tuple[int, ...]) -> Any:
        kind = code[0]
        if kind == G_STARTED:
            return ev.EngineStarted(code[1])
        name = self.names[code[1]]
        if kind == G_BEGIN:
            return ev.BeginStaging(name, token_str(code[2]), code[3], self.digests[code[1]], self.bounds.buckets)
        if kind == G_BUCKET:
            return ev.ReceiveBucket(name, token_str(code[2]), code[3], code[4])
        if kind == G_END:
            return ev.EndStaging(name, token_str(code[2]), code[3], bool(code[4]))
        if kind == G_CLEANUP:
            return ev.CleanupAttempt(name, token_str(code[2]))
        if kind == G_ACQUIRE:
            return ev.AcquireRequest(name)
        if kind == G_RELEASE:
            return ev.ReleaseRequest(name)
        if kind == G_RECLAIM:
            return ev.ReclaimAdapter(name, self.rids[code[1]])
        return ev.FinishUnload(name, self.rids[code[1]])

    # ------------------------------------------------------------ cached steps

    def reg_step(self, rid: int, code: tuple[int, ...]) -> Transition:
        t = self.reg_cache.get((rid, code))
        if t is None:
            t = self.reg_cache[(rid, code)] = self._reg_fire(rid, self.registry_event(code))
        return t

    def eng_step(self, eid: int, code: tuple[int, ...]) -> Transition:
        t = self.eng_cache.get((eid, code))
        if t is None:
            t = self.eng_cache[(eid, code)] = self._eng_fire(eid, self.engine_event(code))
        return t

    def _reg_fire(self, rid: int, event: Any) -> Transition:
        before = self.reg_states[rid]
        try:
            fired = self.core.step_traced(before, event)
        except ProtocolError as exc:
            return Transition(rid, (NO, -1), (), -1, (f"ProtocolError: {exc}",), repr(event))
        state = cast(RegistryState, fired.state)  # step_traced's result is typed for both machines
        problems = tuple(registry_step_violations(before, event, fired, self.core)
                         + registry_step_problems(before, event, state, fired.result, fired.effects))
        after = self.intern_registry(state)
        row = self.row_index[fired.row.id]
        self.row_counts[row] += 1
        return Transition(after, self._answer(fired.result), self._jobs(fired.effects), row, problems, repr(event))

    def _eng_fire(self, eid: int, event: Any) -> Transition:
        before = self.eng_states[eid]
        try:
            fired = self.core.engine_step_traced(before, event)
        except ProtocolError as exc:
            return Transition(eid, (NO, -1), (), -1, (f"ProtocolError: {exc}",), repr(event))
        state = cast(EngineAdapterState, fired.state)
        problems = tuple(engine_step_violations(before, event, fired, self.core)
                         + engine_step_problems(before, event, state, fired.result, fired.effects))
        after = self.intern_engine(state)
        row = self.row_index[fired.row.id]
        self.row_counts[row] += 1
        unloads = tuple(self.names.index(x.lora_name) for x in fired.effects if isinstance(x, PhysicalUnload))
        return Transition(after, self._answer(fired.result), (), row, problems, repr(event), unloads)

    def _answer(self, result: Any) -> tuple[int, ...]:
        if isinstance(result, Rejected):
            return (NO, REASONS.index(result.reason))
        if isinstance(result, Reserved):
            return (OK, _VS[result.state], token_int(result.attempt_token))
        if isinstance(result, Aborted):
            return (OK, _VS[result.state])
        if isinstance(result, Recorded):
            return (OK, _PS[result.state])
        if isinstance(result, Bound):
            return (OK, self.keys.index(result.version))
        if isinstance(result, Closed):
            return (OK, int(result.released))
        if isinstance(result, SessionStatus):
            return (OK, _SS[result.state])
        if isinstance(result, AdapterStatus):
            return (OK, _AS[result.state])
        if isinstance(result, ReadyLocal):
            return (OK, A_READY)
        if isinstance(result, LeaseGranted):
            return (OK, result.fence)
        return (OK,)

    def _jobs(self, effects: tuple[Any, ...]) -> tuple[tuple[int, ...], ...]:
        """Effects the drivers execute, as job keys. ReclaimEligible/CapacityFreed are notifications:
        the drivers read the registry instead (equivalent to a subscription that loses nothing)."""
        jobs = []
        for x in effects:
            if isinstance(x, StageOnEngine):
                jobs.append((J_STAGE, self.engine_names.index(x.engine), self.keys.index(x.version),
                             token_int(x.attempt_token), x.incarnation))
            elif isinstance(x, CleanupOnEngine):
                jobs.append((J_CLEAN, self.engine_names.index(x.engine), self.keys.index(x.version),
                             token_int(x.attempt_token), 0))
            elif isinstance(x, ReclaimOnEngine):
                jobs.append((J_RECLAIM, self.engine_names.index(x.engine), self.keys.index(x.version), STALE, 0))
        return tuple(jobs)

    # ------------------------------------------------------------ probes: late, duplicated, stale, forged

    def _probe_registry(self, rid: int) -> tuple[Transition, ...]:
        """Every stale/forged/other-epoch/duplicate message the spec answers without a change is a
        self-loop: it is fired here once per registry state (so its row counts as fired and its
        checks run). Under a mutated table, a probe that now changes the state although the
        reference table's row does not is a real transition and is explored."""
        state = self.reg_states[rid]
        domain = EventDomain(tuple(zip(self.keys, self.digests, strict=True)), self.session_keys, faulty=True,
                             max_incarnation=0)
        return self._probe(state, candidate_events(state, domain), registry=True)

    def _probe_engine(self, eid: int) -> tuple[Transition, ...]:
        state = self.eng_states[eid]
        tokens = {a.attempt_token for a in state.adapters.values() if a.attempt_token} | {STALE_TOKEN}
        domain = EngineEventDomain(
            tuple(AdapterPlan(n, d, self.bounds.buckets) for n, d in zip(self.names, self.digests, strict=True)),
            tuple(sorted(tokens)), (*self.rids, FORGED_RECLAIM_ID), max_incarnation=0)
        return self._probe(state, candidate_engine_events(state, domain), registry=False)

    def _probe(self, state: Any, events: tuple[Any, ...], registry: bool) -> tuple[Transition, ...]:
        moves = []
        for event in events:
            try:
                ref_row = (self.reference.fired_row if registry else self.reference.engine_fired_row)(state, event)
            except ProtocolError:
                continue  # not a message the spec answers here: not something a probe may send
            if ref_row.changes_state:
                continue  # an honest action (reserve, acquire...): the drivers decide when to send it
            try:
                fired = (self.core.step_traced if registry else self.core.engine_step_traced)(state, event)
            except ProtocolError:
                fired = None
            if fired is not None and fired.state is state and not fired.row.changes_state:
                self.row_counts[self.row_index[fired.row.id]] += 1  # a self-loop: the state's checks already ran
                step_props = registry_step_problems if registry else engine_step_problems
                if not step_props(state, event, state, fired.result, fired.effects):  # type: ignore[arg-type]
                    continue  # (its answer and effects are checked too: a wrong receipt is a violation)
            fire = self._reg_fire if registry else self._eng_fire
            sid = (self.reg_ids if registry else self.eng_ids)[state]
            t = fire(sid, event)
            if t.after != sid or t.problems:
                moves.append(t)
        return tuple(moves)

    # ------------------------------------------------------------ liveness obligations

    def obligations(self, rid: int) -> frozenset[Hashable]:
        got = self._obligations.get(rid)
        if got is None:
            s = self.reg_states[rid]
            got = self._obligations[rid] = frozenset(
                (lv.name, ob) for lv in LIVENESS for ob in lv.obligations(s))
        return got

    # ------------------------------------------------------------ symmetry: sessions renamed

    def permute_registry(self, rid: int, perm: tuple[int, ...]) -> int:
        """The registry state with session i renamed to perm[i] (one shard per session)."""
        key = (rid, perm)
        got = self._perm_cache.get(key)
        if got is None:
            s = self.reg_states[rid]
            sessions = Map({SessionKey(k.epoch, perm[k.shard], k.seq): r for k, r in s.sessions.items()})
            low_water = Map({perm[shard]: mark for shard, mark in s.low_water.items()})
            import attrs

            got = self._perm_cache[key] = self.intern_registry(attrs.evolve(s, sessions=sessions, low_water=low_water))
        return got
