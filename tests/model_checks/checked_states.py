"""Test helper: see every state the checker checks (the BFS checks each distinct state once)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model_checks.system import System


def on_each_checked_state(system: System, keep: Callable[[Any], None]) -> None:
    """Make `system` hand each state it checks to `keep`, then check it as before."""
    problems = system.state_problems

    def record(st: Any) -> tuple[str, ...]:
        keep(st)
        return problems(st)

    system.state_problems = record  # type: ignore[method-assign]
