"""The TLC/stateright-style report; its last-but-rows line is the one machine-readable summary."""

from __future__ import annotations

from model_checks.bfs import CheckResult
from model_checks.system import System

SUMMARY_PREFIX = "generated="  # the machine-readable line starts with it


def rows_fired(system: System) -> tuple[int, int, list[str]]:
    counts = system.k.row_counts
    never = [system.k.core.rows[i].id for i, n in enumerate(counts) if not n]
    return len(counts) - len(never), len(counts), never


def report_lines(system: System, result: CheckResult) -> list[str]:
    fired, total, never = rows_fired(system)
    k = system.k
    status = "Model checking completed." if result.complete else "Stopped at the depth boundary."
    if result.violation is not None:
        status = "Error: an invariant was violated."
    lines = [
        status,
        f"{result.generated:,} states generated, {result.distinct:,} distinct states found, "
        f"{'0' if result.violation is None else '?'} states left on queue.",
        f"The depth of the complete state graph search is {result.depth}.",
        f"Sub-states: {len(k.reg_states):,} registry, {len(k.eng_states):,} engine; "
        f"cached core steps: {len(k.reg_cache):,} registry, {len(k.eng_cache):,} engine.",
        f"{SUMMARY_PREFIX}{result.generated} distinct={result.distinct} depth={result.depth} sec={result.seconds:.2f} "
        f"states_per_s={result.states_per_s:.0f} rows_fired={fired}/{total} "
        f"violations={int(result.violation is not None)}",
    ]
    lines.append("rows never fired: " + (" ".join(never) if never else "(none)"))
    return lines


def summary_fields(output: str) -> dict[str, str]:
    """The machine-readable line of a report (in a run's output), as its `key=value` fields."""
    line = next(x for x in output.splitlines() if x.startswith(SUMMARY_PREFIX))
    return dict(field.split("=", 1) for field in line.split())

