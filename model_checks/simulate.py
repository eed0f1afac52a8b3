"""Seeded random simulation over the same system, for depths the BFS cannot reach.

Each run starts at the initial state and picks uniformly among the successors with
`random.Random(seed)`; successors come in a deterministic order (the system builds them from sorted
tuples), so a seed replays byte for byte. Every step is checked like in the BFS.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import attrs

from model_checks.system import State, System


@attrs.define
class SimulationResult:
    runs: int = 0
    steps: int = 0
    max_depth: int = 0
    digest: str = ""  # SHA-256 over every label taken: equal digests = byte-for-byte identical runs
    violation: tuple[tuple[str, ...], list[tuple[Any, State]]] | None = None


def simulate(system: System, seed: int, runs: int, depth: int) -> SimulationResult:
    rng = random.Random(seed)
    result = SimulationResult()
    sha = hashlib.sha256()
    for _ in range(runs):
        state = system.init_states()[0]
        trace: list[tuple[Any, State]] = [(None, state)]
        result.runs += 1
        for _ in range(depth):
            succs = system.successors(state)
            if not succs:
                break
            label, state, problems = succs[rng.randrange(len(succs))]
            sha.update(repr(label).encode())
            trace.append((label, state))
            result.steps += 1
            problems = tuple(problems) + system.state_problems(state)
            if problems:
                result.violation = (problems, trace)
                result.digest = sha.hexdigest()
                return result
        result.max_depth = max(result.max_depth, len(trace) - 1)
    result.digest = sha.hexdigest()
    return result
