"""Counterexample traces: numbered printing, JSON save/load, and replay against the core.

A trace is the list of action labels from the initial state. Replay builds a fresh `System` (fresh
kernel: every registry and engine step recomputed by `lifecycle.step`/`engine_step`), takes the
labels one by one (each must be enabled), and reports the problems of the last step again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from model_checks.bounds import Bounds
from model_checks.system import M_REG, REG, State, System


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple | list):
        return [_jsonable(y) for y in x]
    return x


def _tupled(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tupled(y) for y in x)
    return x


def core_step_of(system: System, before: State, label: tuple[Any, ...]) -> str:
    """The core event (and row) a delivery label runs, for humans reading the trace."""
    if label[0] in ("deliver", "deliver_lose_reply") and label[1][0] == M_REG:
        t = system.k.reg_step(before[REG], label[1][2])
        row = system.k.core.rows[t.row].id if t.row >= 0 else "NO ROW"
        return f"{t.label} -> {row}"
    if label[0] in ("deliver", "deliver_lose_reply"):
        return f"engine E{label[1][1]} event {label[1][3]}"
    return ""


def trace_document(system: System, steps: list[tuple[Any, State]], problems: tuple[str, ...]) -> dict[str, Any]:
    out = []
    for n, (label, state) in enumerate(steps):
        before = steps[n - 1][1] if n else None
        out.append({"n": n, "action": _jsonable(label), "state": system.describe(state),
                    "core": core_step_of(system, before, label) if before is not None and label else ""})
    return {"bounds": attrs.asdict(system.bounds), "violation": list(problems), "steps": out}


def print_trace(doc: dict[str, Any], echo: Any = print) -> None:
    echo(f"Counterexample ({len(doc['steps']) - 1} steps):")
    for step in doc["steps"]:
        action = "Init" if step["action"] is None else " ".join(map(str, step["action"]))
        echo(f"{step['n']:>3}: {action}")
        if step["core"]:
            echo(f"       core: {step['core']}")
        echo(f"       {step['state']}")
    for problem in doc["violation"]:
        echo(f"  VIOLATION: {problem}")


def save(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def replay(path: Path) -> tuple[bool, list[str], tuple[str, ...]]:
    """Re-run a saved trace against a fresh core. Returns (every step enabled, log, problems found)."""
    doc = json.loads(path.read_text())
    bounds = Bounds(**doc["bounds"])
    system = System(bounds)
    state = system.init_states()[0]
    log = [f"  0: Init  {system.describe(state)}"]
    problems: tuple[str, ...] = system.state_problems(state)
    for step in doc["steps"][1:]:
        label = _tupled(step["action"])
        match = [(s2, p) for lab, s2, p in system.successors(state) if lab == label]
        if not match:
            log.append(f"{step['n']:>3}: {label} is NOT enabled")
            return False, log, ()
        s2, step_problems = match[0]
        log.append(f"{step['n']:>3}: {' '.join(map(str, label))}  {core_step_of(system, state, label)}")
        state = s2
        problems = tuple(step_problems) + system.state_problems(state)
    return True, log, problems
