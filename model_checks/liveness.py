"""Liveness of the composed system (system.py) by strongly-connected-component analysis of the whole state
graph (small bounds only); the fairness argument is fairness.py's.

Weak fairness: every action of the environment and the network (deliveries, driver and session
steps, timeouts) that stays enabled is eventually taken; faults are never forced and have finite
budgets, so no fault edge lies on a cycle. A liveness obligation (spec LIVENESS: an open attempt, an
unreferenced RETIRED/RECLAIMING version) present in every state of a component a fair run can stay in
is the violation reported.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from model_checks.fairness import fair_run_stays, tarjan
from model_checks.system import State, System

UNFAIR = frozenset({"drop", "dup", "crash", "fault", "probe"})


@attrs.define
class LivenessResult:
    states: int = 0
    edges: int = 0
    sccs: int = 0
    seconds: float = 0.0
    violations: list[tuple[str, int, State]] = attrs.field(factory=list)  # (obligation, scc size, a state in it)


def _fair(label: tuple[Any, ...]) -> bool:
    head = label[0]
    if head in UNFAIR or head == "deliver_lose_reply":
        return False
    return not (head == "session" and len(label) > 3 and label[-1] in ("lost", "dup", "lose_reply"))


def check_liveness(system: System) -> LivenessResult:
    started = time.perf_counter()
    canonical = system.canonical if system.bounds.symmetry else (lambda s: s)
    index: dict[State, int] = {}
    states: list[State] = []
    edges: list[list[tuple[int, Any]]] = []
    for init in system.init_states():
        c = canonical(init)
        index[c] = 0
        states.append(c)
        edges.append([])
    i = 0
    while i < len(states):
        for label, s2, _ in system.successors(states[i]):
            c = canonical(s2)
            j = index.get(c)
            if j is None:
                j = index[c] = len(states)
                states.append(c)
                edges.append([])
            edges[i].append((j, label if _fair(label) else None))
        i += 1
    result = LivenessResult(states=len(states), edges=sum(map(len, edges)))
    for scc in tarjan(len(states), edges):
        result.sccs += 1
        members = set(scc)
        open_everywhere = frozenset.intersection(*(system.obligations(states[n]) for n in scc))
        if not open_everywhere or not fair_run_stays(scc, members, edges):
            continue
        for ob in sorted(map(repr, open_everywhere)):
            result.violations.append((ob, len(scc), states[scc[0]]))
    result.seconds = time.perf_counter() - started
    return result
