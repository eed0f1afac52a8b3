"""Weak fairness over an explored state graph: can a fair run stay forever where something is still owed?

Used by the driver checker's search (drivers.search), for one-driver worlds and crowds alike.
A graph is `edges[i] = [(j, label or None)]`; None marks an unfair edge (a fault: a loss, a duplicate, an early
deadline, a crash), which a run is never forced to take, and whose finite budget keeps it off every cycle.

Weak fairness: an action that stays enabled is eventually taken. A fair run ends in a strongly connected
component C where every fair action enabled in all of C is taken inside C (or in a state with no fair action at
all). An obligation present in every state of such a component can stay open forever: that is a liveness
violation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

Edges = list[list[tuple[int, Any]]]
Owed = frozenset[Hashable]


def open_forever(edges: Edges, owed: Callable[[int], Owed]) -> list[tuple[Owed, list[int]]]:
    """Each component a weakly fair run can stay in forever, with what is owed in all of its states (when
    something is); `owed(i)` is what state i still owes. Components come in reverse topological order."""
    found = []
    for scc in tarjan(len(edges), edges):
        members = set(scc)
        if len(scc) == 1 and all(j != scc[0] for j, _ in edges[scc[0]]) and any(
                label is not None for _, label in edges[scc[0]]):
            continue  # a state that a fair action leaves for good
        still_owed = frozenset.intersection(*(owed(n) for n in scc))
        if still_owed and fair_run_stays(scc, members, edges):
            found.append((still_owed, scc))
    return found


def fair_run_stays(scc: Sequence[int], members: set[int], edges: Edges) -> bool:
    """Can a weakly fair run stay in this component forever?"""
    inside = any(j in members for n in scc for j, _ in edges[n])
    if not inside:  # a single state without a self-loop: a run stays only if nothing fair is enabled
        return not any(label is not None for _, label in edges[scc[0]])
    always: set[Any] | None = None
    for n in scc:
        enabled = {label for _, label in edges[n] if label is not None}
        always = enabled if always is None else always & enabled
    taken = {label for n in scc for j, label in edges[n] if label is not None and j in members}
    return not (always or set()) - taken


def tarjan(n: int, edges: Edges) -> list[list[int]]:
    """Iterative Tarjan: the strongly connected components, in reverse topological order."""
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
