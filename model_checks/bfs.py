"""Explicit-state breadth-first search with fingerprints (TLC style).

The visited set maps a 64-bit fingerprint (Python's hash of the canonical all-int tuple: stable
across runs, since no str is hashed) to its parent's fingerprint; the first violation found is at
minimal depth, and its trace is rebuilt by walking forward from the initial state, re-generating
successors and matching fingerprints (so no states or labels are stored per visited state).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model_checks.system import State, System

NO_PARENT = -1  # hash() of a tuple is never -1


# dataclasses, not attrs: this module is compiled by mypyc (see model_checks/native.py), which
# compiles dataclasses natively and does not know attrs' field declarations.
@dataclass
class Violation:
    problems: tuple[str, ...]
    trace: list[tuple[tuple[Any, ...] | None, State]]  # (label that led here, state); first label is None


@dataclass
class CheckResult:
    generated: int = 0
    distinct: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = True
    violation: Violation | None = None
    fingerprints: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def states_per_s(self) -> float:
        return self.distinct / self.seconds if self.seconds > 0 else 0.0


def check(system: System, progress: Callable[[int, int, int], None] | None = None,
          visit: Callable[[State], None] | None = None) -> CheckResult:
    """BFS over every reachable state within the bounds; stops at the first violation.

    `progress(depth, distinct, frontier)` is called after each level; `visit(state)` with each
    distinct (canonical) state as it is checked, before its invariants (tests use it to see every
    state the search covers)."""
    # The search allocates millions of small tuples that live until the end; CPython's cyclic GC
    # would re-traverse all of them at every generation-2 pass (measured: 2-3x the whole run).
    # States are acyclic tuples of ints, so nothing here needs the cycle collector.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(system, progress, visit)
    finally:
        if was_enabled:
            gc.enable()


def _search(system: System, progress: Callable[[int, int, int], None] | None,
            visit: Callable[[State], None] | None) -> CheckResult:
    sym = system.bounds.symmetry
    canonical = system.canonical if sym else (lambda s: s)
    max_depth = system.bounds.max_depth
    result = CheckResult()
    visited = result.fingerprints
    started = time.perf_counter()
    frontier: list[tuple[State, int]] = []  # (state, its fingerprint: the parent of its successors)
    for init in system.init_states():
        c = canonical(init)
        fp = hash(c)
        if fp not in visited:
            visited[fp] = NO_PARENT
            frontier.append((c, fp))
            if visit is not None:
                visit(c)
            problems = system.state_problems(c)
            if problems:
                result.violation = Violation(problems, [(None, init)])
                return _finish(result, started)
    depth = 0
    successors, state_problems = system.successors, system.state_problems
    ample = system.ample if system.bounds.por else (lambda s: None)
    generated = 0
    while frontier:
        depth += 1
        if max_depth and depth > max_depth:
            result.complete = False
            break
        nxt: list[tuple[State, int]] = []
        append = nxt.append
        # Concrete (pre-symmetry) fingerprints met at this level: interleavings that commute reach the
        # same concrete state many times, and recognising it costs one hash instead of a
        # canonicalisation. Reset per level: across levels the visited set catches repeats anyway.
        raw_seen: set[int] = set()
        for st, parent in frontier:
            succs = ample(st) or successors(st)
            generated += len(succs)
            for label, s2, problems in succs:
                if problems:
                    result.generated = generated
                    result.violation = Violation(problems, _trace(system, visited, parent, label))
                    result.depth = depth
                    return _finish(result, started)
                if sym:
                    raw = hash(s2)
                    if raw in raw_seen:
                        continue
                    raw_seen.add(raw)
                    c = canonical(s2)
                    fp = raw if c is s2 else hash(c)
                else:
                    c = s2
                    fp = hash(c)
                if fp in visited:
                    continue
                visited[fp] = parent
                if visit is not None:
                    visit(c)
                problems = state_problems(c)
                if problems:
                    result.generated = generated
                    result.violation = Violation(problems, _trace(system, visited, parent, label))
                    result.depth = depth
                    return _finish(result, started)
                append((c, fp))
        frontier = nxt
        if frontier:
            result.depth = depth
        if progress is not None:
            progress(depth, len(visited), len(frontier))
    result.generated = generated
    return _finish(result, started)


def _finish(result: CheckResult, started: float) -> CheckResult:
    result.distinct = len(result.fingerprints)
    result.seconds = time.perf_counter() - started
    return result


def _trace(system: System, visited: dict[int, int], parent: int, last: tuple[Any, ...]) -> list[Any]:
    """Shortest trace: the fingerprint chain back to an initial state, replayed forward on concrete
    (not canonical) states, then the violating step `last`."""
    chain = []
    fp = parent
    while fp != NO_PARENT:
        chain.append(fp)
        fp = visited[fp]
    chain.reverse()
    canonical = system.canonical if system.bounds.symmetry else (lambda s: s)
    inits = [s for s in system.init_states() if hash(canonical(s)) == chain[0]]
    state = inits[0]
    steps: list[tuple[tuple[Any, ...] | None, State]] = [(None, state)]
    for want in chain[1:]:
        for label, s2, _ in system.successors(state):
            if hash(canonical(s2)) == want:
                steps.append((label, s2))
                state = s2
                break
        else:
            raise RuntimeError("trace reconstruction lost the path (fingerprint collision?)")
    for label, s2, _ in system.successors(state):
        if label == last:
            steps.append((label, s2))
            break
    return steps
