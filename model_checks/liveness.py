"""Liveness by strongly-connected-component analysis of the whole state graph (small bounds only).

Weak fairness: every action of the environment and the network (deliveries, driver and session
steps, timeouts) that stays enabled is eventually taken; faults are never forced and have finite
budgets, so no fault edge lies on a cycle. A fair run ends in an SCC C where every fair action
enabled in all of C is taken inside C (or in a deadlock). A liveness obligation (spec LIVENESS:
an open attempt, an unreferenced RETIRED/RECLAIMING version) present in every state of such an
SCC can stay open forever: that is the violation reported.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

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
    for scc in _tarjan(len(states), edges):
        result.sccs += 1
        members = set(scc)
        open_everywhere = frozenset.intersection(*(system.obligations(states[n]) for n in scc))
        if not open_everywhere or not _fair_scc(scc, members, edges):
            continue
        for ob in sorted(map(repr, open_everywhere)):
            result.violations.append((ob, len(scc), states[scc[0]]))
    result.seconds = time.perf_counter() - started
    return result


def _fair_scc(scc: list[int], members: set[int], edges: list[list[tuple[int, Any]]]) -> bool:
    """Can a weakly fair run stay in this SCC forever?"""
    inside = any(j in members for n in scc for j, _ in edges[n])
    if not inside:  # a single state without a self-loop: a run stays only if nothing fair is enabled
        return not any(lab is not None for _, lab in edges[scc[0]])
    always = None
    for n in scc:
        enabled = {lab for _, lab in edges[n] if lab is not None}
        always = enabled if always is None else always & enabled
    taken = {lab for n in scc for j, lab in edges[n] if lab is not None and j in members}
    return not (always or set()) - taken


def _tarjan(n: int, edges: list[list[tuple[int, Any]]]) -> list[list[int]]:
    """Iterative Tarjan: SCCs in reverse topological order."""
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        while work:
            v, pos = work.pop()
            if pos == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            recurse = False
            succ = edges[v]
            while pos < len(succ):
                w = succ[pos][0]
                pos += 1
                if index[w] == -1:
                    work.append((v, pos))
                    work.append((w, 0))
                    recurse = True
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out
