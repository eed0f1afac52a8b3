"""Walks over the driver checker's worlds (drivers.py, crowd.py): a trace taken again, and seeded random runs.

A check's trace is the labels of the actions from its scenario's start to the world where it found a violation
(`CheckResult.trace`, a shortest one: the search is breadth first). `replay` takes those actions again, one at a time,
from a fresh start and with a fresh checker, and judges the world it ends in as the search judges a world. So a
violation is shown by its trace, not by the search's memory of it. A liveness violation's trace ends in the cycle it
names; the replay shows that cycle's first world reached, not the cycle.

`simulate` walks from the start at random, for depths a breadth-first search does not reach: at each world it picks
one of the successors with `random.Random(seed)`. Successors come in a fixed order (a world's network, timers and
requests are sorted), so a seed replays byte for byte: `digest` is a SHA-256 over every label taken.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

Successors = Callable[[Any], Iterator[tuple[str, Any]]]


def judge(world: Any, successors: Successors, problems: Callable[[Any], list[str]],
          stuck: Callable[[Any], list[str]]) -> tuple[list[tuple[str, Any]], list[str]]:
    """A world's successors and what is wrong with it, as `drivers.search` finds it: its problems, an exception its
    successors raise (a ProtocolError, a step a table let through), or, where nothing can happen, `stuck`'s."""
    found = problems(world)
    succ: list[tuple[str, Any]] = []
    try:
        succ = list(successors(world))
    except Exception as exc:
        found.append(f"{type(exc).__name__}: {exc}")
    if not succ and not found:
        found = stuck(world)
    return succ, found


def replay(start: Any, labels: Sequence[str], successors: Successors, problems: Callable[[Any], list[str]],
           stuck: Callable[[Any], list[str]]) -> tuple[bool, list[str]]:
    """(every action of `labels` was enabled in turn, what is wrong with the world they end in)."""
    world = start
    for label in labels:
        taken = [nxt for lab, nxt in successors(world) if lab == label]
        if not taken:
            return False, [f"not enabled: {label}"]
        world = taken[0]
    return True, judge(world, successors, problems, stuck)[1]


@attrs.define
class Simulation:
    runs: int = 0
    steps: int = 0
    digest: str = ""  # SHA-256 over every label taken: equal digests, identical runs
    violation: str | None = None
    trace: tuple[str, ...] = ()


def simulate(start: Any, successors: Successors, problems: Callable[[Any], list[str]],
             stuck: Callable[[Any], list[str]], seed: int, runs: int, depth: int) -> Simulation:
    """`runs` random walks of at most `depth` actions from `start`; stops at the first world with a problem."""
    rng = random.Random(seed)
    sha = hashlib.sha256()
    result = Simulation()
    for _ in range(runs):
        result.runs += 1
        world, trace = start, []
        for taken in range(depth + 1):  # every world reached is judged, the last one after `depth` actions
            succ, found = judge(world, successors, problems, stuck)
            if found:
                result.violation, result.trace = found[0], tuple(trace)
                result.digest = sha.hexdigest()
                return result
            if not succ or taken == depth:
                break
            label, world = succ[rng.randrange(len(succ))]
            sha.update(label.encode())
            trace.append(label)
            result.steps += 1
    result.digest = sha.hexdigest()
    return result
