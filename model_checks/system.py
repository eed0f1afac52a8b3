"""The composed system: the registry and every engine (both through the core, see kernel.py) plus a
hand-written environment: sessions, the publisher, the reclaimer, the restart supervisor, the jobs
that carry out the core's effects, and the network.

A state is a tuple of small ints (hashable, cheap to fingerprint):

    (reg, engs, sess, pub, rec, jobs, running, net, budget)

reg      interned RegistryState id
engs     interned EngineAdapterState id per engine
sess     per session (phase, version, engine, turns_left, aborts_left)
pub      publisher (epoch, version index, phase, attempt token)
rec      bitmask of versions the reclaimer has claimed
jobs     sorted (kind, engine, version, token, incarnation, pos): effects being carried out
running  sorted (engine, session, version): generation requests an engine has acquired a ref for
net      sorted multiset of in-flight messages (reordering falls out of the multiset)
budget   (drops, dups, crashes, failures) left

What the model abstracts (and why it is sound for these properties): one shard per session (the
session key's seq is always 0, so sessions are interchangeable); buckets are a count (content is
the core's `manifest_ok` verdict); a timeout fires only when the request and its reply are both
gone from the network (a spurious timeout is the same as a duplicate, which the dup budget covers);
ReclaimEligible / CapacityFreed notifications are replaced by the drivers reading the registry
(a subscription that never loses a notification); an engine's `wait_for_unload` returning is the
engine-internal FinishUnload step; generation replies are matched by engine, not request id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mypy_extensions import mypyc_attr

from model_checks.bounds import Bounds
from model_checks.kernel import (
    A_DRAINING,
    A_READY,
    A_STAGING,
    A_UNREGISTERED,
    DISPATCHABLE,
    G_ABORT_REQ,
    G_ACQUIRE,
    G_BEGIN,
    G_BUCKET,
    G_CLEANUP,
    G_END,
    G_FINISH,
    G_RECLAIM,
    G_RELEASE,
    G_STARTED,
    H_PUBLISHER,
    H_RIVAL,
    J_CLEAN,
    J_NOTIFY,
    J_RECLAIM,
    J_STAGE,
    LOADED_ADAPTER,
    NO,
    OK,
    P_READY,
    R_ABORT,
    R_ACQUIRE,
    R_BEGIN_CLOSE,
    R_BIND,
    R_CLAIM,
    R_CLEANED,
    R_CLOSE,
    R_COMMIT,
    R_CONFIRM,
    R_EXPIRE,
    R_OPEN,
    R_PREPARED,
    R_READY,
    R_RELEASE,
    R_RESERVE,
    R_RESTARTED,
    R_TAKEOVER,
    R_UNKNOWN,
    REASONS,
    S_BOUND,
    S_FINALIZING,
    V_ABORTED,
    V_FAILED_CLEAN,
    V_LOADING,
    V_RECLAIMED,
    V_RECLAIMING,
    V_RETIRED,
    V_UNSEEN,
    Kernel,
    Transition,
)
from versioned_lora.lifecycle import CORE, Core
from versioned_lora.spec import Reason

REG, ENGS, SESS, PUB, REC, JOBS, RUN, NET, BUD = range(9)
M_REG, M_ENG = range(2)
C_SESSION, C_PUB, C_JOB, C_REC, C_SUP = range(5)
# session phases
SP_IDLE, SP_OPENING, SP_OPENED, SP_BINDING, SP_BOUND, SP_GENERATING, SP_FINALIZING, SP_CLOSING, SP_CLOSED = range(9)
SESSION_PHASES = ("IDLE", "OPENING", "OPENED", "BINDING", "BOUND", "GENERATING", "FINALIZING", "CLOSING", "CLOSED")
LIVE_BOUND = frozenset({SP_BOUND, SP_GENERATING})  # bound and may still dispatch
# publisher phases
PP_IDLE, PP_RESERVING, PP_STAGING, PP_COMMITTING, PP_ABORTING, PP_CLEANING, PP_RECOVER, PP_DONE, PP_LEASING = range(9)
PUBLISHER_PHASES = ("IDLE", "RESERVING", "STAGING", "COMMITTING", "ABORTING", "CLEANING", "RECOVER", "DONE",
                    "LEASING")
DROPS, DUPS, CRASHES, FAILURES, LEASE_FAULTS = range(5)
NOT_LEASE_HOLDER = REASONS.index(Reason.NOT_LEASE_HOLDER)
NOT_READY = REASONS.index(Reason.NOT_READY)
STALE_INCARNATION = REASONS.index(Reason.STALE_INCARNATION)

# Environment-model mutations used to show the checker finds protocol bugs (tests/model_checks).
PLANTED_BUGS = {
    "release_on_abort": "a temporary abort also calls close_and_release (the session ref is released) "
                        "and the session resumes with its binding",
}

State = tuple[Any, ...]
Successor = tuple[tuple[Any, ...], State, tuple[str, ...]]


# Compiled by mypyc (model_checks/native.py); tests subclass it to plant an unsound reduction.
@mypyc_attr(allow_interpreted_subclasses=True)
class System:
    """stateright's Model: `init_states`, `successors` (actions + next_state), `properties`."""

    def __init__(self, bounds: Bounds, core: Core = CORE) -> None:
        self.bounds = bounds
        self.k = Kernel(bounds, core)
        self.E, self.V, self.S, self.B = bounds.engines, bounds.versions, bounds.sessions, bounds.buckets
        self.bug = bounds.planted_bug
        self._renamed: dict[tuple[Any, Any], tuple[Any, ...]] = {}  # (message, perm) -> _rename(message, perm)
        if self.bug and self.bug not in PLANTED_BUGS:
            raise ValueError(f"unknown planted bug {self.bug!r}; known: {sorted(PLANTED_BUGS)}")

    # ================================================================ initial states

    def init_states(self) -> list[State]:
        k, b = self.k, self.bounds
        session = (SP_IDLE, -1, -1, b.turns, b.session_aborts)
        state: State = (k.initial_registry(), tuple(k.initial_engine(e) for e in range(self.E)),
                        (session,) * self.S, (0, 0, PP_IDLE, -1, 0), 0, (), (), (),
                        (b.drops, b.dups, b.crashes, b.failures, b.lease_faults))
        if b.bootstrapped:
            state = self.bootstrap(state)
        return [state]

    def bootstrap(self, state: State) -> State:
        """Run the fault-free publication of the first version (A) to completion: RFC §3.4's starting
        point "default=A, A READY and pinned on both engines". Taken through `successors`, so the
        start is a reachable state of the full model."""
        preference = ("pub", "deliver", "job")
        for _ in range(500):
            if state[PUB][1] >= 1 and not state[JOBS] and not state[NET]:
                return state
            moves = [m for m in self.successors(state)
                     if m[0][0] in preference and not m[2] and m[1][BUD] == state[BUD] and m[0] != ("pub", "abort")]
            moves.sort(key=lambda m: (preference.index(m[0][0]), repr(m[0])))
            state = moves[0][1]
        raise RuntimeError("bootstrap did not converge")

    # ================================================================ successors

    def successors(self, st: State) -> list[Successor]:
        out: list[Successor] = []
        self._network(st, out)
        self._sessions(st, out)
        self._publisher(st, out)
        self._reclaimer(st, out)
        self._jobs(st, out)
        self._engines(st, out)
        self._faults(st, out)
        self._probes(st, out)
        return out

    # ================================================================ partial-order reduction

    def ample(self, st: State) -> list[Successor] | None:
        """An ample set for `st` (a proper subset of `successors(st)`), or None: expand fully.

        Used by the BFS when `bounds.por` is on; safety only (liveness.py and simulate.py always
        use `successors`). Only two action classes are ever taken as ample, each only when it is
        enabled; every other state is expanded fully. The conditions, and why each holds:

        C0 (non-empty iff something is enabled): a class is returned only when its action is
        enabled, and its successors are exactly the ones `successors` builds for it.

        C1 (independence along every path): the class's component is written by no other action
        and read by no other action in a way that can tell the before and after states apart;
        no other action can enable or disable it; it does not disable any other action.

        C2 (invisibility): neither class changes anything an invariant or a step check reads
        (`state_problems`, `_unload_problems`, the dispatch check, the kernel's step checks, which
        depend only on the registry/engine sub-state and the event), calls no core step (so
        `row_counts` and the kernel's cached step checks are those of the full search) and reports
        no problems itself. A violation at a state t reached by a path that avoids the ample action
        `a` is then also at a(t), and a transition problem of a later action `b` is the same after `a`.

        C3 (no ignoring): every ample edge strictly decreases mu(s) = (sessions in GENERATING) +
        (1 if the publisher is not DONE), and no ample action raises the other term. So no cycle of
        the reduced graph consists of reduced states only: every cycle holds a fully expanded
        state. mu is invariant under renaming sessions, so this also holds on the quotient that
        symmetry explores (the ample choice is made on the canonical representative, and both
        classes and all invariants are symmetric in the sessions).

        Class 1, ("pub", "done"): the publisher is IDLE with every version behind it. Its only
        enabled action is "done" (IDLE -> DONE). Nothing else writes PUB in either phase: a late
        publisher reply matches no phase (RESERVING/COMMITTING/ABORTING) and leaves PUB alone; a
        publisher crash is enabled in neither phase. IDLE(vi >= V) and DONE answer every other
        action alike (`_publisher_reply` falls through in both), and no invariant reads PUB. Nothing
        can disable "done".

        Class 2, a session's local steps after it lost its request: session i is GENERATING, none of
        its messages (request or reply) is in flight, and no request of it is running. Its enabled
        actions are then exactly "timeout_retry" (-> BOUND, engine -1) and, with aborts left,
        "abort" (-> BOUND, aborts - 1, an abort request to its engine that will find nothing
        running); both are taken (the ample set is all of session i's actions). Only session i
        creates messages with its client and running entries for it (a duplicate needs one in
        flight), so no other action can enable, disable or observe these steps: deliveries and
        replies to other clients, crashes (an engine crash removes only running entries, none is
        session i's; a registry crash removes only registry-bound messages, and the abort request is
        engine-bound), drops/dups/bad manifests of other messages all commute with them. Both keep
        the session in LIVE_BOUND with the same version, which is all `state_problems` and
        `_unload_problems` read of a session. Excluded under the planted bug `release_on_abort`:
        there the abort also sends a registry-bound close, which a registry crash can remove, so it
        does not commute with that crash.

        Considered and not taken (each is dependent on some other action that can be enabled at the
        same time): every registry or engine delivery and every session call (they change core
        sub-states, and their fault variants - lost, lose_reply, dup - share the drop/dup budgets
        with every other message's drop/dup, so while a budget is left any ample set containing them
        must contain every fault action); dispatch (reads the registry's placements and vstate,
        which registry deliveries change); the reclaimer's claim and the publisher's recover and
        retry_version (read the registry; an engine crash disables retry_version); job and publisher
        retries (a registry crash removes what they send; a publisher abort or crash removes stage
        jobs; a restart notice replaces a stage job)."""
        epoch, vi, phase, _tok, fence = st[PUB]
        if phase == PP_IDLE and vi >= self.V:
            return [(("pub", "done"), _replace(st, PUB, (epoch, vi, PP_DONE, -1, fence)), ())]
        sess = st[SESS]
        for i, s in enumerate(sess):
            if s[0] != SP_GENERATING:
                continue
            _phase, v, _e, turns, aborts = s
            client = (C_SESSION, i)
            if self._in_flight(st[NET], client) or any(r[1] == i for r in st[RUN]):
                continue
            if aborts > 0 and self.bug == "release_on_abort":
                continue
            out: list[Successor] = []
            if aborts > 0:
                self._abort(st, i, s, out)
            out.append((("session", i, "timeout_retry"),
                        _replace(st, SESS, _replace(sess, i, (SP_BOUND, v, -1, turns, aborts))), ()))
            return out
        return None

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _net_add(net: tuple[Any, ...], *msgs: Any) -> tuple[Any, ...]:
        return tuple(sorted(net + msgs))

    @staticmethod
    def _with(st: State, **parts: Any) -> State:
        s = list(st)
        for name, value in parts.items():
            s[_PART[name]] = value
        return tuple(s)

    def _in_flight(self, net: tuple[Any, ...], client: tuple[int, ...]) -> bool:
        """A request from `client` or a reply to it is still in the network."""
        return any((m[1] if m[0] == M_REG else m[2]) == client for m in net)

    def _reg_call(self, client: tuple[int, ...] | None, code: tuple[int, ...]) -> tuple[Any, ...]:
        return (M_REG, client, code)

    def _eng_call(self, e: int, client: tuple[int, ...] | None, code: tuple[int, ...]) -> tuple[Any, ...]:
        return (M_ENG, e, client, code)

    # ---------------------------------------------------------------- network: delivery

    def _network(self, st: State, out: list[Successor]) -> None:
        net = st[NET]
        lose = st[BUD][DROPS] > 0
        for i, m in enumerate(net):
            if i and net[i - 1] == m:
                continue  # identical copies deliver alike
            rest = net[:i] + net[i + 1 :]
            if m[0] == M_REG:
                self._deliver_registry(st, m, rest, out, lose)
            else:
                self._deliver_engine(st, m, rest, out, lose)

    def _deliver_registry(self, st: State, m: Any, rest: tuple[Any, ...], out: list[Successor], lose: bool) -> None:
        """The registry steps; its reply reaches the caller in the same step (the caller's reaction is
        local to it, so fusing it loses no interleaving), or is lost (a drop, `lose_reply`)."""
        client, code = m[1], m[2]
        t = self.k.reg_step(st[REG], code)
        if t.row < 0:  # ProtocolError: a pair no row covers; the step is not taken
            out.append((("deliver", m), st, t.problems))
            return
        base = (t.after, st[1], st[2], st[3], st[4], st[5], st[6], rest, st[8])  # reg=t.after, net=rest
        out.append((("deliver", m), self._reply(base, client, code, t.answer, t.jobs), t.problems))
        if lose:
            out.append((("deliver_lose_reply", m), (*base[:8], _spend(st[BUD], DROPS)), t.problems))

    def _deliver_engine(self, st: State, m: Any, rest: tuple[Any, ...], out: list[Successor], lose: bool) -> None:
        e, client, code = m[1], m[2], m[3]
        engs = st[ENGS]
        label = ("deliver", m)
        if code[0] == G_ABORT_REQ:  # a session's temporary abort: ends its request if it is running here
            s, v = client[1], code[1]
            running = st[RUN]
            if (e, s, v) not in running:
                out.append((label, self._with(st, net=rest), ()))
                return
            t = self.k.eng_step(engs[e], (G_RELEASE, v))
            new_engs = (*engs[:e], t.after, *engs[e + 1:])
            out.append((label, self._with(st, engs=new_engs, run=_remove(running, (e, s, v)), net=rest),
                        t.problems + self._unload_problems(st, e, t)))
            return
        t = self.k.eng_step(engs[e], code)
        if t.row < 0:
            out.append((label, st, t.problems))
            return
        new_engs = (*engs[:e], t.after, *engs[e + 1:])
        problems = t.problems + self._unload_problems(st, e, t)
        base = self._with(st, engs=new_engs, net=rest)
        if code[0] == G_ACQUIRE:  # a generation request: on success it runs; the reply comes when it finishes
            if t.answer[0] == OK:
                out.append((label, self._with(base, run=tuple(sorted((*st[RUN], (e, client[1], code[1]))))),
                            problems))
            else:
                out.append((label, self._session_reply(base, client[1], code, (NO, e)), problems))
            return
        out.append((label, self._reply(base, client, code, t.answer, ()), problems))
        if lose:
            out.append((("deliver_lose_reply", m), self._with(base, bud=_spend(st[BUD], DROPS)), problems))

    def _unload_problems(self, st: State, e: int, t: Transition) -> tuple[str, ...]:
        """Cross-cutting: nothing is physically unloaded while a session may still use the version
        (registry session refs, or a live bound session in the environment) or a request holds it."""
        if not t.unloads:
            return ()
        problems: list[str] = []
        view = self.k.reg_views[st[REG]]
        for v in t.unloads:
            if view.refs[v]:
                problems.append(f"cross invariant unload_only_when_unreferenced: {self.k.names[v]} unloaded on "
                                f"E{e} with session_refs={view.refs[v]}")
            if any(ph in LIVE_BOUND and sv == v for ph, sv, *_ in st[SESS]):
                problems.append(f"cross invariant unload_only_when_unreferenced: {self.k.names[v]} unloaded on "
                                f"E{e} while a live session is bound to it")
            if any(re == e and rv == v for re, _, rv in st[RUN]):
                problems.append(f"cross invariant unload_only_when_unreferenced: {self.k.names[v]} unloaded on "
                                f"E{e} while a request holds it")
        return tuple(problems)

    # ---------------------------------------------------------------- replies reach their caller

    def _reply(self, st: State, client: tuple[Any, ...], code: tuple[int, ...], answer: tuple[int, ...],
               jobs: tuple[Any, ...]) -> State:
        kind = client[0]
        if kind == C_SESSION:
            nxt = self._session_reply(st, client[1], code, answer)
        elif kind == C_PUB:
            nxt = self._publisher_reply(st, client[1], code, answer, jobs)
        elif kind == C_JOB:
            nxt = self._job_reply(st, client, code, answer, jobs)
        else:  # the reclaimer: its claim's effects are reclaim jobs
            nxt = self._with(st, jobs=self._add_jobs(st[JOBS], jobs))
        return self._start_jobs(nxt)

    def _restage_jobs(self, st: State, e: int) -> tuple[tuple[int, ...], ...]:
        """What restart.new asked for, read back from the registry (its reply was lost)."""
        view = self.k.reg_views[st[REG]]
        jobs = []
        for v in range(self.V):
            p = view.placements[v][e]
            if p is not None and p[0] in _RESTAGE and p[2] == view.incarnations[e]:
                jobs.append((J_STAGE, e, v, p[1], p[2]))
        return tuple(jobs)

    def _start_jobs(self, st: State) -> State:
        """Unstarted jobs send their first request (in the step that created them or that finished
        their driver's previous job). Each driver (publisher: stage and cleanup; reclaimer; restart
        supervisor) runs one job at a time, in job order, unless `concurrent_jobs`: a driver that
        awaits each call in turn. With concurrent jobs the E0 and E1 pipelines interleave freely."""
        unstarted = [j for j in st[JOBS] if j[5] == _JOB_UNSTARTED]
        if not unstarted:
            return st
        if self.bounds.concurrent_jobs:
            for job in unstarted:
                st = self._advance(st, job, 0)
            return st
        busy = {_DRIVER[j[0]] for j in st[JOBS] if j[5] != _JOB_UNSTARTED}
        for job in unstarted:
            if _DRIVER[job[0]] not in busy:
                busy.add(_DRIVER[job[0]])
                st = self._advance(st, job, 0)
        return st

    @staticmethod
    def _add_jobs(jobs: tuple[Any, ...], new: tuple[tuple[int, ...], ...]) -> tuple[Any, ...]:
        """Jobs are keyed by (kind, engine, version, token): a duplicate effect does not start a second
        worker; a stage of the same attempt for a newer incarnation replaces the old one."""
        if not new:
            return jobs
        by_key = {j[:4]: j for j in jobs}
        for n in new:
            old = by_key.get(n[:4])
            if old is None or (n[0] == J_STAGE and n[4] > old[4]):
                by_key[n[:4]] = (*n, _JOB_UNSTARTED)
        return tuple(sorted(by_key.values()))

    # ================================================================ sessions

    def _sessions(self, st: State, out: list[Successor]) -> None:
        net, view = st[NET], self.k.reg_views[st[REG]]
        for i, s in enumerate(st[SESS]):
            phase, v, e, turns, aborts = s
            client = (C_SESSION, i)
            if phase == SP_IDLE:
                self._session_send(st, i, (SP_OPENING, v, e, turns, aborts), (R_OPEN, i), "open", out)
                self._session_send(st, i, (SP_FINALIZING, v, e, turns, aborts), (R_BEGIN_CLOSE, i), "close_early",
                                   out)
            elif phase == SP_OPENED:
                if view.default >= 0:  # binding before the bootstrap answers NO_PUBLISHED_VERSION (a probe)
                    self._session_send(st, i, (SP_BINDING, v, e, turns, aborts), (R_BIND, i), "bind", out)
            elif phase == SP_BOUND:
                if turns > 0:
                    for eng in range(self.E):
                        if _servable(view, v, eng):  # the router's view: READY there, current incarnation
                            self._dispatch(st, i, s, eng, out)
                else:
                    self._session_send(st, i, (SP_FINALIZING, v, e, turns, aborts), (R_BEGIN_CLOSE, i), "close",
                                       out)
                    # A session that ends abruptly (its agent died) skips begin_close: close_and_release
                    # on a BOUND record (DESIGN §3: close may arrive in any live state).
                    self._session_send(st, i, (SP_CLOSING, v, e, turns, aborts), (R_CLOSE, i), "close_now", out)
            elif phase == SP_GENERATING:
                if aborts > 0:
                    self._abort(st, i, s, out)
                if not self._in_flight(net, client) and (e, i, v) not in st[RUN]:
                    sess = _replace(st[SESS], i, (SP_BOUND, v, -1, turns, aborts))
                    out.append((("session", i, "timeout_retry"), self._with(st, sess=sess), ()))
            elif phase in _SESSION_CALLS and not self._in_flight(net, client):
                # timeout: the call or its reply was lost; retry with the same idempotency key (the session key).
                # (With atomic calls this is also how the close that follows begin_close is sent.)
                self._session_send(st, i, s, (_SESSION_CALLS[phase], i), "call" if phase == SP_CLOSING else "retry",
                                   out)

    def _session_send(self, st: State, i: int, new: tuple[int, ...], code: tuple[int, ...], what: str,
                      out: list[Successor]) -> None:
        msg = self._reg_call((C_SESSION, i), code)
        st1 = (st[0], st[1], _replace(st[SESS], i, new), *st[3:])
        label = ("session", i, what)
        if not self.bounds.atomic_sessions:
            out.append((label, self._with(st1, net=self._net_add(st[NET], msg)), ()))
            return
        # An atomic call: delivered in the step that sends it, unless a fault intervenes (the request
        # is lost, its reply is lost, or a duplicate stays behind to arrive late).
        budget = st[BUD]
        calls: list[Successor] = []
        self._deliver_registry(st1, msg, st1[NET], calls, budget[DROPS] > 0)
        for sub, nxt, problems in calls:
            out.append(((*label, "lose_reply") if sub[0] == "deliver_lose_reply" else label, nxt, problems))
        if budget[DROPS]:
            out.append(((*label, "lost"), self._with(st1, bud=_spend(budget, DROPS)), ()))
        if budget[DUPS] and calls and calls[0][0][0] == "deliver":
            nxt = calls[0][1]
            out.append(((*label, "dup"), self._with(nxt, net=self._net_add(nxt[NET], msg),
                                                     bud=_spend(nxt[BUD], DUPS)), calls[0][2]))

    def _dispatch(self, st: State, i: int, s: tuple[int, ...], eng: int, out: list[Successor]) -> None:
        _phase, v, _e, turns, aborts = s
        problems: tuple[str, ...] = ()
        vstate = self.k.reg_views[st[REG]].vstate[v]
        if vstate not in DISPATCHABLE:
            problems = (f"cross invariant no_dispatch_once_reclaiming: session {i} dispatched "
                        f"{self.k.names[v]} while it is {_vname(vstate)}",)
        msg = self._eng_call(eng, (C_SESSION, i), (G_ACQUIRE, v))
        nxt = self._with(st, sess=_replace(st[SESS], i, (SP_GENERATING, v, eng, turns, aborts)),
                         net=self._net_add(st[NET], msg))
        out.append((("session", i, "generate", eng), nxt, problems))

    def _abort(self, st: State, i: int, s: tuple[int, ...], out: list[Successor]) -> None:
        """Temporary abort: the request is aborted on the engine; the binding and the session ref stay."""
        _phase, v, e, turns, aborts = s
        msgs: tuple[Any, ...] = (self._eng_call(e, (C_SESSION, i), (G_ABORT_REQ, v)),)
        if self.bug == "release_on_abort":
            msgs += (self._reg_call((C_SESSION, -1 - i), (R_CLOSE, i)),)  # the planted bug
        nxt = self._with(st, sess=_replace(st[SESS], i, (SP_BOUND, v, -1, turns, aborts - 1)),
                         net=self._net_add(st[NET], *msgs))
        out.append((("session", i, "abort"), nxt, ()))

    def _session_reply(self, st: State, i: int, code: tuple[int, ...], answer: tuple[int, ...]) -> State:
        rest = st[NET]
        if i < 0:
            return st
        phase, v, e, turns, aborts = st[SESS][i]
        kind = code[0]
        new = None
        if kind == G_ACQUIRE:
            if phase == SP_GENERATING and answer[1] == e:
                # done: a tool turn follows (or the session closes); refused: retry, maybe on another engine
                new = (SP_BOUND, v, -1, turns - 1 if answer[0] == OK else turns, aborts)
        elif kind == R_OPEN and phase == SP_OPENING:
            new = (SP_OPENED, v, e, turns, aborts)
        elif kind == R_BIND and phase == SP_BINDING:
            new = (SP_BOUND, answer[1], e, turns, aborts) if answer[0] == OK else (SP_OPENED, v, e, turns, aborts)
        elif kind == R_BEGIN_CLOSE and phase == SP_FINALIZING:
            # the binding task is done and no request of ours is pending: release the ref exactly once
            sess = _replace(st[SESS], i, (SP_CLOSING, v, e, turns, aborts))
            if self.bounds.atomic_sessions:
                return self._with(st, sess=sess)  # the close is the session's next call
            return self._with(st, sess=sess, net=self._net_add(rest, self._reg_call((C_SESSION, i), (R_CLOSE, i))))
        elif kind == R_CLOSE and phase == SP_CLOSING:
            new = (SP_CLOSED, -1, -1, 0, 0)
        if new is None:
            return st  # a late or duplicate reply (the message is already out of `st`'s network)
        return (st[0], st[1], _replace(st[SESS], i, new), *st[3:])

    # ================================================================ publisher

    def _publisher(self, st: State, out: list[Successor]) -> None:
        """pub = (epoch, version index, phase, attempt token, fence): `fence` is the publisher lease's fence the
        publisher holds (0: none; it acquires before it reserves), `epoch` counts publisher crashes."""
        epoch, vi, phase, tok, fence = st[PUB]
        view, net, budget = self.k.reg_views[st[REG]], st[NET], st[BUD]
        client = (C_PUB, epoch)
        if phase == PP_IDLE:
            if vi >= self.V:
                out.append((("pub", "done"), self._with(st, pub=(epoch, vi, PP_DONE, -1, fence)), ()))
            elif not fence:
                self._pub_send(st, (epoch, vi, PP_LEASING, -1, 0), (R_ACQUIRE, H_PUBLISHER), "acquire", out)
            elif view.occupied < self.bounds.capacity and not _pending(view):
                self._pub_send(st, (epoch, vi, PP_RESERVING, -1, fence), (R_RESERVE, vi, fence), "reserve", out)
        elif phase == PP_STAGING:
            staging = any(j[0] == J_STAGE and j[2] == vi and j[3] == tok for j in st[JOBS])
            ready = all(p is not None and p[0] == P_READY and p[1] == tok and p[2] == view.incarnations[e]
                        for e, p in enumerate(view.placements[vi]))
            if not staging and ready:
                self._pub_send(st, (epoch, vi, PP_COMMITTING, tok, fence), (R_COMMIT, vi, tok, view.revision, fence),
                               "commit", out)
            if budget[FAILURES] > 0 or (not staging and not ready):  # a missed deadline (or stuck): abort
                jobs = tuple(j for j in st[JOBS] if not (j[0] == J_STAGE and j[2] == vi and j[3] == tok))
                nb = budget if not staging and not ready else _spend(budget, FAILURES)
                nxt = self._with(st, pub=(epoch, vi, PP_ABORTING, tok, fence), jobs=jobs, bud=nb,
                                 net=self._net_add(net, self._reg_call(client, (R_ABORT, vi, tok))))
                out.append((("pub", "abort"), nxt, ()))
        elif phase == PP_CLEANING:
            if view.vstate[vi] == V_FAILED_CLEAN:
                if self._registry_knows_incarnations(st):
                    out.append((("pub", "retry_version"), self._with(st, pub=(epoch, vi, PP_IDLE, -1, fence)), ()))
            elif not any(j[0] == J_CLEAN and j[2] == vi for j in st[JOBS]) and not self._in_flight(net, client):
                # cleanups not confirmed and nobody working on them: re-issue (abort.replay re-emits them)
                self._pub_send(st, (epoch, vi, PP_ABORTING, tok, fence), (R_ABORT, vi, tok), "abort_again", out)
        elif phase == PP_RECOVER:
            self._recover(st, out)
        elif phase in _PUB_CALLS and not self._in_flight(net, client):
            code = {PP_RESERVING: (R_RESERVE, vi, fence), PP_ABORTING: (R_ABORT, vi, tok),
                    PP_LEASING: (R_ACQUIRE, H_PUBLISHER)}.get(phase) or (R_COMMIT, vi, tok, self._commit_revision(st),
                                                                     fence)
            out.append((("pub", "retry"), self._with(st, net=self._net_add(net, self._reg_call(client, code))), ()))

    def _registry_knows_incarnations(self, st: State) -> bool:
        """Guard on `retry_version`, the only way the model reserves one version again.

        The real `Publisher.publish` (versioned_lora/runtime/publisher.py) makes exactly one attempt:
        on any refusal, STALE_INCARNATION included, it calls `abort_and_clean` and returns
        FAILED_CLEAN (or UNKNOWN). It never reserves again by itself. So `retry_version` stands for
        a caller that calls `publish` again. The runtime's way to tell the registry about a restarted
        engine is `Publisher.sync_incarnations` (read each engine's `incarnation()`, submit
        EngineRestarted; the demo runs it before it publishes). So the retry is modelled after the
        registry knows every engine's current incarnation. Here the EngineRestarted comes from the
        restart supervisor's notice, the same event that weak fairness delivers.

        Without this guard the model's caller retried while the notice was still in flight. The
        registry staged against the old incarnation, the engine refused, the abort cost no budget,
        and each round minted a fresh attempt token: an unbounded counter, so no crash bound with a
        version left to publish could finish. Only retries are guarded. The first reserve, the stale
        refusal, the free abort and its cleanup are all still explored while the notice is in
        flight, and every invariant is still checked after every step."""
        engs, known = st[ENGS], self.k.reg_views[st[REG]].incarnations
        return all(self.k.eng_views[engs[e]].incarnation == known[e] for e in range(self.E))

    def _commit_revision(self, st: State) -> int:
        """The revision the lost commit carried: the registry's, unless that commit already landed."""
        view = self.k.reg_views[st[REG]]
        vi = st[PUB][1]
        return view.revision - 1 if view.default == vi else view.revision

    def _pub_send(self, st: State, pub: tuple[int, ...], code: tuple[int, ...], what: str,
                  out: list[Successor]) -> None:
        msg = self._reg_call((C_PUB, pub[0]), code)
        out.append((("pub", what), self._with(st, pub=pub, net=self._net_add(st[NET], msg)), ()))

    def _recover(self, st: State, out: list[Successor]) -> None:
        """A fresh publisher after a crash: finish (abort and clean) a pending attempt, else go on with
        the first version not yet committed."""
        epoch, fence = st[PUB][0], st[PUB][4]
        view = self.k.reg_views[st[REG]]
        for v in range(self.V):
            if view.vstate[v] in (V_LOADING, V_ABORTED):
                self._pub_send(st, (epoch, v, PP_ABORTING, view.vtoken[v], fence), (R_ABORT, v, view.vtoken[v]),
                               "recover_abort", out)
                return
        vi = next((v for v in range(self.V) if view.vstate[v] in (V_UNSEEN, V_FAILED_CLEAN)), self.V)
        out.append((("pub", "recover"), self._with(st, pub=(epoch, vi, PP_IDLE, -1, fence)), ()))

    def _publisher_reply(self, st: State, epoch: int, code: tuple[int, ...], answer: tuple[int, ...],
                         jobs: tuple[Any, ...]) -> State:
        rest = st[NET]
        p_epoch, vi, phase, tok, fence = st[PUB]
        if epoch != p_epoch:
            return self._with(st, net=rest)  # a reply to the crashed publisher
        kind = code[0]
        view = self.k.reg_views[st[REG]]
        lost_lease = answer[0] == NO and answer[1] == NOT_LEASE_HOLDER
        if kind == R_ACQUIRE and phase == PP_LEASING:
            # Granted: the fence its reserve and commit carry. Refused (another holds it): try again later.
            return self._with(st, pub=(epoch, vi, PP_IDLE, -1, answer[1] if answer[0] == OK else 0), net=rest)
        if kind == R_RESERVE and phase == PP_RESERVING:
            if answer[0] == NO:
                return self._with(st, pub=(epoch, vi, PP_IDLE, -1, 0 if lost_lease else fence), net=rest)
            state, tok = answer[1], answer[2]
            if state == V_LOADING:
                if not jobs:  # a replayed reserve carries no effects: stage from the registry's placements
                    jobs = tuple((J_STAGE, e, vi, p[1], p[2]) for e, p in enumerate(view.placements[vi])
                                 if p is not None and p[0] in _RESTAGE and p[1] == tok)
                return self._with(st, pub=(epoch, vi, PP_STAGING, tok, fence), jobs=self._add_jobs(st[JOBS], jobs),
                                  net=rest)
            if state in (V_ABORTED,):
                return self._with(st, pub=(epoch, vi, PP_ABORTING, tok, fence), net=self._net_add(
                    rest, self._reg_call((C_PUB, epoch), (R_ABORT, vi, tok))))
            return self._with(st, pub=(epoch, vi + 1, PP_IDLE, -1, fence), net=rest)  # already committed
        if kind == R_COMMIT and phase == PP_COMMITTING:
            if answer[0] == OK:
                return self._with(st, pub=(epoch, vi + 1, PP_IDLE, -1, fence), net=rest)
            if lost_lease:  # certainly not committed, and never will be under this fence: abort (settle's
                # commit.refused row), then acquire again before the next reserve
                jobs = tuple(j for j in st[JOBS] if not (j[0] == J_STAGE and j[2] == vi and j[3] == tok))
                return self._with(st, pub=(epoch, vi, PP_ABORTING, tok, 0), jobs=jobs, net=self._net_add(
                    rest, self._reg_call((C_PUB, epoch), (R_ABORT, vi, tok))))
            return self._with(st, pub=(epoch, vi, PP_STAGING, tok, fence), net=rest)
        if kind == R_ABORT and phase == PP_ABORTING:
            if answer[0] == OK:
                return self._with(st, pub=(epoch, vi, PP_CLEANING, tok, fence), jobs=self._add_jobs(st[JOBS], jobs),
                                  net=rest)
            return self._with(st, pub=(epoch, vi + 1, PP_IDLE, -1, fence), net=rest)  # the commit had landed
        return self._with(st, net=rest)

    # ================================================================ reclaimer

    def _reclaimer(self, st: State, out: list[Successor]) -> None:
        view, rec, net = self.k.reg_views[st[REG]], st[REC], st[NET]
        for v in range(self.V):
            client = (C_REC, v)
            if not rec >> v & 1:
                if view.vstate[v] == V_RETIRED and view.refs[v] == 0:  # what ReclaimEligible announces
                    claim = self._reg_call(client, (R_CLAIM, v))
                    nxt = self._with(st, rec=rec | 1 << v, net=self._net_add(net, claim))
                    out.append((("reclaimer", "claim", v), nxt, ()))
            elif view.vstate[v] in (V_RETIRED, V_RECLAIMING) and not self._in_flight(net, client) and not any(
                j[0] == J_RECLAIM and j[2] == v for j in st[JOBS]
            ):
                nxt = self._with(st, net=self._net_add(net, self._reg_call(client, (R_CLAIM, v))))
                out.append((("reclaimer", "retry_claim", v), nxt, ()))

    # ================================================================ jobs: the effects, carried out

    def _jobs(self, st: State, out: list[Successor]) -> None:
        net = st[NET]
        for job in st[JOBS]:
            kind, e, v, _tok, _inc, pos = job
            client = (C_JOB, *job)
            if pos == _JOB_UNSTARTED:
                continue
            if kind == J_RECLAIM and pos == 2:
                # SGLang's wait_for_unload returned (or the name is gone): ask again for the receipt
                state = self.k.eng_views[st[ENGS][e]].adapters[v][0]
                if state not in (A_UNREGISTERED, A_DRAINING):
                    self._job_send(st, job, 0, self._eng_call(e, None, (G_RECLAIM, v)), "poll", out)
                continue
            if self._in_flight(net, client):
                continue
            # timeout: neither the request nor its reply is in the network
            if kind == J_STAGE and pos in _STAGE_ENGINE_POS[self.B]:
                # an engine outcome we cannot confirm: record it as UNKNOWN (keep everything), then retry
                self._job_send(st, job, 10 + pos, self._job_request(job, 10 + pos, 1), "record_unknown", out)
            else:
                self._job_send(st, job, pos, self._job_request(job, pos, 1), "retry", out)

    def _job_request(self, job: tuple[int, ...], pos: int, manifest_ok: int) -> tuple[Any, ...]:
        kind, e, v, tok, inc, _ = job
        if kind == J_STAGE:
            b = self.B
            if pos >= 10:
                return self._reg_call(None, (R_UNKNOWN, v, tok, e))
            if pos == 0:
                return self._eng_call(e, None, (G_BEGIN, v, tok, inc))
            if pos == 1:
                return self._reg_call(None, (R_PREPARED, v, tok, e, inc))
            if pos < 2 + b:
                return self._eng_call(e, None, (G_BUCKET, v, tok, inc, pos - 2))
            if pos == 2 + b:
                return self._eng_call(e, None, (G_END, v, tok, inc, manifest_ok))
            return self._reg_call(None, (R_READY, v, tok, e, inc))
        if kind == J_CLEAN:
            return self._eng_call(e, None, (G_CLEANUP, v, tok)) if pos == 0 else self._reg_call(None, (R_CLEANED, v,
                                                                                                        tok, e))
        if kind == J_RECLAIM:
            return self._eng_call(e, None, (G_RECLAIM, v)) if pos == 0 else self._reg_call(None, (R_CONFIRM, v, e))
        return self._reg_call(None, (R_RESTARTED, e, inc))  # J_NOTIFY

    def _job_send(self, st: State, job: tuple[int, ...], pos: int, msg: tuple[Any, ...], what: str,
                  out: list[Successor], budget: tuple[int, ...] | None = None) -> None:
        new_job = (*job[:5], pos)
        client = (C_JOB, *new_job)
        msg = (M_REG, client, msg[2]) if msg[0] == M_REG else (M_ENG, msg[1], client, msg[3])
        jobs = tuple(sorted((*_remove(st[JOBS], job), new_job)))
        nxt = self._with(st, jobs=jobs, net=self._net_add(st[NET], msg))
        if budget is not None:
            nxt = self._with(nxt, bud=budget)
        out.append((("job", _JOB_NAMES[job[0]], *job[1:5], what), nxt, ()))

    def _job_reply(self, st: State, client: tuple[Any, ...], code: tuple[int, ...], answer: tuple[int, ...],
                   effects: tuple[Any, ...]) -> State:
        rest = st[NET]
        job = client[1:]
        jobs = st[JOBS]
        if job not in jobs:
            return self._with(st, net=rest)  # the job moved on, finished or died with its publisher
        kind, e, _v, _tok, _inc, pos = job
        base = self._with(st, net=rest)
        rest_jobs = _remove(jobs, job)
        if kind == J_NOTIFY:  # the registry adopted the restart: carry out the recovery it asks for
            if answer[0] == NO and answer[1] == STALE_INCARNATION:
                effects = self._restage_jobs(st, e)  # a retry after the first reply was lost
            return self._start_jobs(self._with(base, jobs=self._add_jobs(rest_jobs, effects)))
        if kind == J_STAGE and pos >= 10:  # RecordUnknown acknowledged: retry the engine call, same key
            return self._advance(base, job, pos - 10)
        if answer[0] == NO:
            return self._with(base, jobs=rest_jobs)  # refused (stale, cleaned, reclaimed...): this job stops
        if kind == J_STAGE:
            return self._advance(base, job, pos + 1) if pos < 3 + self.B else self._with(base, jobs=rest_jobs)
        if kind == J_CLEAN:
            return self._advance(base, job, 1) if pos == 0 else self._with(base, jobs=rest_jobs)
        # J_RECLAIM
        if pos == 1:
            return self._with(base, jobs=rest_jobs)
        if answer[1] in (A_UNREGISTERED, A_DRAINING):  # wait for SGLang's refcount to drain
            return self._with(base, jobs=tuple(sorted((*rest_jobs, (*job[:5], 2)))))
        return self._advance(base, job, 1)

    def _advance(self, st: State, job: tuple[int, ...], pos: int) -> State:
        """Move the job to `pos` and send its request there (an `end` always claims a good manifest;
        the failing check is the `bad_manifest` fault)."""
        new_job = (*job[:5], pos)
        msg = self._job_request(new_job, pos, 1)
        client = (C_JOB, *new_job)
        msg = (M_REG, client, msg[2]) if msg[0] == M_REG else (M_ENG, msg[1], client, msg[3])
        jobs = tuple(sorted((*_remove(st[JOBS], job), new_job)))
        return self._with(st, jobs=jobs, net=self._net_add(st[NET], msg))

    # ================================================================ engines: internal steps

    def _engines(self, st: State, out: list[Successor]) -> None:
        engs = st[ENGS]
        running = st[RUN]
        for idx, r in enumerate(running):
            if idx and running[idx - 1] == r:
                continue
            e, s, v = r
            t = self.k.eng_step(engs[e], (G_RELEASE, v))  # the request finished: SGLang releases its ref
            nxt = self._session_reply(self._with(st, engs=(*engs[:e], t.after, *engs[e + 1:]),
                                                 run=_remove(running, r)), s, (G_ACQUIRE, v), (OK, e))
            out.append((("engine", e, "finish_request", s, v), nxt, t.problems + self._unload_problems(st, e, t)))
        for e in range(self.E):
            ev = self.k.eng_views[engs[e]]
            for v in range(self.V):
                if ev.adapters[v][0] == A_UNREGISTERED:  # wait_for_unload returned: the one physical unload
                    t = self.k.eng_step(engs[e], (G_FINISH, v))
                    nxt = self._with(st, engs=(*engs[:e], t.after, *engs[e + 1:]))
                    out.append((("engine", e, "unload", v), nxt, t.problems + self._unload_problems(st, e, t)))

    # ================================================================ faults

    def _faults(self, st: State, out: list[Successor]) -> None:
        net, budget = st[NET], st[BUD]
        if budget[DROPS]:
            nb = _spend(budget, DROPS)
            for i, m in enumerate(net):
                if not (i and net[i - 1] == m):
                    out.append((("drop", m), self._with(st, net=net[:i] + net[i + 1 :], bud=nb), ()))
        if budget[DUPS]:
            nb = _spend(budget, DUPS)
            for i, m in enumerate(net):
                if not (i and net[i - 1] == m):
                    out.append((("dup", m), self._with(st, net=self._net_add(net, m), bud=nb), ()))
        if budget[FAILURES]:
            self._bad_manifest(st, out)
        self._lease(st, out)
        if not budget[CRASHES]:
            return
        nb = _spend(budget, CRASHES)
        engs = st[ENGS]
        for e in range(self.E):
            inc = self.k.eng_views[engs[e]].incarnation + 1
            t = self.k.eng_step(engs[e], (G_STARTED, inc))
            notify = (J_NOTIFY, e, -1, -1, inc, 0)
            jobs = tuple(sorted((*st[JOBS], notify)))
            msg = (M_REG, (C_JOB, *notify), (R_RESTARTED, e, inc))
            running = tuple(r for r in st[RUN] if r[0] != e)  # its requests died with the process
            nxt = self._with(st, engs=(*engs[:e], t.after, *engs[e + 1:]), run=running, jobs=jobs,
                             net=self._net_add(net, msg), bud=nb)
            out.append((("crash", "engine", e), nxt, t.problems))
        if any(m[0] == M_REG for m in net):  # the actor restarts from its journal: only its mailbox is lost
            out.append((("crash", "registry"), self._with(st, net=tuple(m for m in net if m[0] != M_REG), bud=nb),
                        ()))
        epoch, vi, phase, _tok, _fence = st[PUB]
        if phase in (PP_RESERVING, PP_STAGING, PP_COMMITTING, PP_ABORTING, PP_CLEANING):
            jobs = tuple(j for j in st[JOBS] if not (j[0] in (J_STAGE, J_CLEAN) and j[2] == vi))
            nxt = self._with(st, pub=(epoch + 1, vi, PP_RECOVER, -1, 0), jobs=jobs, bud=nb)
            out.append((("crash", "publisher"), nxt, ()))

    def _lease(self, st: State, out: list[Successor]) -> None:
        """The publisher lease's other actors, stepping the registry directly (its own timer; an operator's call
        on the registry's node). Faults, each costing one lease fault: the timer expires the lease early (the
        publisher stalled past its ttl), a rival takes it over (`publish --take-over`), live or not. Fair: a
        rival that holds the lease releases it (its publication is not modelled), so the publisher gets it back."""
        view = self.k.reg_views[st[REG]]
        holder, fence = view.lease_holder, view.lease_fence
        if holder == H_RIVAL:
            self._lease_step(st, (R_RELEASE, H_RIVAL, fence), ("lease", "rival_release"), st[BUD], out)
        if not st[BUD][LEASE_FAULTS] or not fence:
            return
        nb = _spend(st[BUD], LEASE_FAULTS)
        if holder == H_PUBLISHER:
            self._lease_step(st, (R_EXPIRE, fence), ("fault", "lease_expire"), nb, out)
        if holder != H_RIVAL:
            self._lease_step(st, (R_TAKEOVER, H_RIVAL, fence), ("fault", "rival_take_over"), nb, out)

    def _lease_step(self, st: State, code: tuple[int, ...], label: tuple[Any, ...], budget: tuple[int, ...],
                    out: list[Successor]) -> None:
        t = self.k.reg_step(st[REG], code)
        out.append((label, self._with(st, reg=t.after, bud=budget), t.problems))

    def _bad_manifest(self, st: State, out: list[Successor]) -> None:
        """A stage job's `end` whose manifest check fails on the engine (costs one publisher failure)."""
        for m in st[NET]:
            if m[0] == M_ENG and m[3][0] == G_END and m[3][4] == 1:
                bad = (M_ENG, m[1], m[2], (*m[3][:4], 0))
                net = list(st[NET])
                net.remove(m)
                nxt = self._with(st, net=tuple(sorted((*net, bad))), bud=_spend(st[BUD], FAILURES))
                out.append((("fault", "bad_manifest", m), nxt, ()))

    # ================================================================ probes (late/stale/forged messages)

    def _probes(self, st: State, out: list[Successor]) -> None:
        """Probe messages the reference table answers without a change are self-loops (fired once
        per sub-state in kernel.py). Only a mutated table makes them move: then they are explored."""
        k = self.k
        for t in k.reg_probe_moves[st[REG]]:
            out.append((("probe", "registry", t.label), self._with(st, reg=t.after), t.problems))
        engs = st[ENGS]
        for e in range(self.E):
            for t in k.eng_probe_moves[engs[e]]:
                out.append((("probe", f"E{e}", t.label), self._with(st, engs=(*engs[:e], t.after, *engs[e + 1:])),
                            t.problems + self._unload_problems(st, e, t)))

    # ================================================================ properties

    def state_problems(self, st: State) -> tuple[str, ...]:
        """Every invariant of one composed state: the registry's and each engine's (spec), then the
        cross-cutting ones that relate them to each other and to the environment."""
        k = self.k
        problems = list(k.reg_problems[st[REG]])
        view = k.reg_views[st[REG]]
        evs = [k.eng_views[x] for x in st[ENGS]]
        for x in st[ENGS]:
            problems += k.eng_problems[x]
        for i, (phase, v, _e, _t, _a) in enumerate(st[SESS]):
            if phase in LIVE_BOUND:
                rs, rv = view.sessions[i]
                if rs not in (S_BOUND, S_FINALIZING) or rv != v:
                    problems.append(f"cross invariant live_session_holds_its_ref: session {i} is bound to "
                                    f"{k.keys[v].version_id} and may dispatch, but the registry has it "
                                    f"{_sname(rs)}/{'-' if rv < 0 else k.keys[rv].version_id}")
        for v in range(self.V):
            vs = view.vstate[v]
            if vs == V_RECLAIMED:
                for e, ev in enumerate(evs):
                    if ev.adapters[v][0] in LOADED_ADAPTER:
                        problems.append(f"cross invariant reclaimed_means_unloaded_everywhere: {k.names[v]} is "
                                        f"{_aname(ev.adapters[v][0])} on E{e}")
            elif vs == V_FAILED_CLEAN:
                for e, ev in enumerate(evs):
                    if ev.adapters[v][0] in (A_STAGING, A_READY):
                        problems.append(f"cross invariant failed_clean_means_nothing_loaded: {k.names[v]} is "
                                        f"{_aname(ev.adapters[v][0])} on E{e}")
        for e, ev in enumerate(evs):
            loaded = sum(1 for a in ev.adapters if a[0] in LOADED_ADAPTER)
            if loaded > self.bounds.capacity:
                problems.append(f"cross invariant engine_slots_within_capacity: E{e} holds {loaded} managed adapters")
        return tuple(problems)

    def obligations(self, st: State) -> frozenset[Any]:
        return self.k.obligations(st[REG])

    # ================================================================ symmetry

    def canonical(self, st: State) -> State:
        """Sessions are interchangeable (one shard each, same budgets): sort them by everything that
        mentions them and rename. Equal signatures mean a swap leaves the state unchanged, so the
        sorted relabelling is a canonical representative.

        The signature is built lazily (this runs once per generated successor, so it is the checker's
        hottest function): first (environment tuple, registry record) per session; only when two
        sessions tie on that do their in-flight messages and running requests join the key. Whether
        a tie exists is the same for every member of an orbit, so the result is still canonical."""
        n = self.S
        if n < 2:
            return st
        sess = st[SESS]
        records = self.k.reg_views[st[REG]].sessions
        keys: list[tuple[Any, ...]] = [(sess[i], records[i]) for i in range(n)]
        net, running = st[NET], st[RUN]
        # Fast path: most successors change one session of an already sorted state, so the order holds.
        ordered, tied = True, None
        prev = keys[0]
        for i in range(1, n):
            key = keys[i]
            if key < prev:
                ordered = False
                break
            if key == prev:
                tied = {i - 1, i} if tied is None else tied | {i - 1, i}
            prev = key
        if ordered:
            if tied is None or not (net or running):
                return st  # sorted, and sessions that tie have nothing else that could tell them apart
            if not (any(_session_of(m) in tied for m in net) or any(r[1] in tied for r in running)):
                # Sessions that tie have no messages and no requests: their full signatures tie too,
                # so the slow path below would keep this order (its sort is stable). Same result.
                return st
        if len(set(keys)) < n and (net or running):
            msgs: list[list[Any]] = [[] for _ in range(n)]
            for m in net:
                i = _session_of(m)
                if i >= 0:
                    msgs[i].append(self._rename(m, None))
            runs: list[list[Any]] = [[] for _ in range(n)]
            for r in running:
                runs[r[1]].append((r[0], r[2]))
            keys = [(*keys[i], sorted(msgs[i]), runs[i]) for i in range(n)]  # runs are sorted already
        order = sorted(range(n), key=keys.__getitem__)
        if all(order[i] == i for i in range(n)):
            return st
        perm = [0] * n
        for new, old in enumerate(order):
            perm[old] = new
        perm_t = tuple(perm)
        reg = self.k.permute_registry(st[REG], perm_t)
        new_sess = tuple(sess[old] for old in order)
        new_net = tuple(sorted([self._rename(m, perm_t) for m in st[NET]]))
        new_run = tuple(sorted((r[0], perm_t[r[1]], r[2]) for r in st[RUN]))
        return (reg, st[ENGS], new_sess, st[PUB], st[REC], st[JOBS], new_run, new_net, st[BUD])

    def _rename(self, m: tuple[Any, ...], perm: tuple[int, ...] | None) -> tuple[Any, ...]:
        """`_rename`, memoised: the messages and permutations are few and recur in every level."""
        key = (m, perm)
        r = self._renamed.get(key)
        if r is None:
            r = self._renamed[key] = _rename(m, perm)
        return r

    # ================================================================ printing

    def describe(self, st: State) -> str:
        k = self.k
        view = k.reg_views[st[REG]]
        versions = " ".join(f"{k.keys[v].version_id}={_vname(view.vstate[v])}(refs={view.refs[v]})"
                            for v in range(self.V) if view.vstate[v] != V_UNSEEN)
        engines = " ".join(
            f"E{e}@{k.eng_views[x].incarnation}:[" + ",".join(
                f"{k.keys[v].version_id}={_aname(a[0])}/{a[1]}" for v, a in enumerate(k.eng_views[x].adapters)
                if a[0] != 0) + "]" for e, x in enumerate(st[ENGS]))
        sessions = " ".join(f"s{i}={SESSION_PHASES[p]}" + (f"({k.keys[v].version_id})" if v >= 0 else "")
                            for i, (p, v, *_r) in enumerate(st[SESS]))
        epoch, vi, phase, _tok, fence = st[PUB]
        pub = f"pub#{epoch}={PUBLISHER_PHASES[phase]}({'ABCD'[vi] if vi < self.V else '-'},fence={fence})"
        return (f"registry[{versions or '-'} default_rev={view.revision}] {engines} {sessions} {pub} "
                f"jobs={len(st[JOBS])} running={len(st[RUN])} net={len(st[NET])} budget={st[BUD]}")


# ---------------------------------------------------------------- small pure helpers

_PART = {"reg": REG, "engs": ENGS, "sess": SESS, "pub": PUB, "rec": REC, "jobs": JOBS, "run": RUN, "net": NET,
         "bud": BUD}
_SESSION_CALLS = {SP_OPENING: R_OPEN, SP_BINDING: R_BIND, SP_FINALIZING: R_BEGIN_CLOSE, SP_CLOSING: R_CLOSE}
_PUB_CALLS = frozenset({PP_RESERVING, PP_COMMITTING, PP_ABORTING, PP_LEASING})
_JOB_UNSTARTED = -1
_DRIVER = {J_STAGE: 0, J_CLEAN: 0, J_RECLAIM: 1, J_NOTIFY: 2}
_JOB_NAMES = {J_STAGE: "stage", J_CLEAN: "cleanup", J_RECLAIM: "reclaim", J_NOTIFY: "notify_restart"}
_RESTAGE = frozenset({0, 1, 2, 3}) - {P_READY}


def _servable(view: Any, v: int, e: int) -> bool:
    p = view.placements[v][e]
    return p is not None and p[0] == P_READY and p[2] == view.incarnations[e]


def _pending(view: Any) -> bool:
    return any(s in (V_LOADING, V_ABORTED) for s in view.vstate)


def _replace(t: tuple[Any, ...], i: int, x: Any) -> tuple[Any, ...]:
    return (*t[:i], x, *t[i + 1:])


def _remove(t: tuple[Any, ...], x: Any) -> tuple[Any, ...]:
    i = t.index(x)
    return t[:i] + t[i + 1 :]


def _spend(budget: tuple[int, ...], which: int) -> tuple[int, ...]:
    return (*budget[:which], budget[which] - 1, *budget[which + 1:])


def _session_of(m: tuple[Any, ...]) -> int:
    """The session a message belongs to (-1: none)."""
    client = m[2] if m[0] == M_ENG else m[1]
    if client is None or client[0] != C_SESSION:
        return -1
    i: int = client[1]
    return i if i >= 0 else -1 - i


def _strip(m: tuple[Any, ...]) -> tuple[Any, ...]:
    return _rename(m, None)


def _rename(m: tuple[Any, ...], perm: tuple[int, ...] | None) -> tuple[Any, ...]:
    """The message with its session renamed by `perm` (None: to a placeholder, for signatures)."""
    i = _session_of(m)
    if i < 0:
        return m
    j = -9 if perm is None else perm[i]

    def client(c: tuple[int, ...]) -> tuple[int, ...]:
        return (C_SESSION, j if c[1] >= 0 else -1 - j)

    def code(c: tuple[int, ...]) -> tuple[int, ...]:
        return (c[0], j) if c[0] in (R_OPEN, R_BIND, R_BEGIN_CLOSE, R_CLOSE) else c

    if m[0] == M_REG:
        return (M_REG, client(m[1]), code(m[2]))
    return (M_ENG, m[1], client(m[2]), m[3])


def _vname(i: int) -> str:
    from model_checks.kernel import VERSION_STATES

    return str(VERSION_STATES[i])


def _sname(i: int) -> str:
    from model_checks.kernel import SESSION_STATES

    return str(SESSION_STATES[i])


def _aname(i: int) -> str:
    from model_checks.kernel import ADAPTER_STATES

    return str(ADAPTER_STATES[i])


_STAGE_ENGINE_POS: dict[int, frozenset[int]] = {b: frozenset({0, *range(2, 3 + b)}) for b in range(0, 9)}


def iter_labels(succs: list[Successor]) -> Iterator[tuple[Any, ...]]:
    for label, _, _ in succs:
        yield label
