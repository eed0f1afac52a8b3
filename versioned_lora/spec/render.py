"""Render the table as Mermaid state diagrams and a markdown table (pure: strings in, strings out).
`python -m versioned_lora.spec.docs` writes them to docs/; a test keeps the committed copies fresh."""

from __future__ import annotations

from versioned_lora.spec.drivers import DRIVER_ROWS, NOT_POSSIBLE, PHASES, Driver, DriverRow, uncovered_driver_pairs
from versioned_lora.spec.events import EVENT_MACHINE
from versioned_lora.spec.states import INITIAL_STATES, PSEUDO_STATES, SAME, WILDCARD, Machine, wildcard_states
from versioned_lora.spec.table import ROWS, Row, uncovered_pairs

GENERATED = "<!-- Generated from versioned_lora/spec/table.py by `python -m versioned_lora.spec.docs`. -->"


def _edges(machine: Machine, rows: tuple[Row, ...]) -> list[tuple[str, str, str]]:
    """(source, target, label) in table order, deduplicated; rows that change nothing are not drawn."""
    edges: list[tuple[str, str, str]] = []
    for row in rows:
        if row.machine is machine and row.changes_state:
            for source in row.expanded_sources():
                target = source if row.target == SAME else row.target
                edges.append((source, target, row.event))
        for also in row.also:
            if also.machine is machine:
                sources = wildcard_states(machine) if also.source == WILDCARD else (also.source,)
                edges += [(source, also.target, f"{row.event} ({row.id})") for source in sources]
    return list(dict.fromkeys(edges))


def render_state_machines(rows: tuple[Row, ...] = ROWS) -> str:
    out = [GENERATED, "", "# State machines", ""]
    out.append(
        "One diagram per machine, drawn from the rows that change state (`also` moves are labelled with the "
        "row that causes them). Dashed states are pseudo-states: what the core reports when there is no "
        "record (an unseen key, another epoch). Refusals and idempotent re-answers change nothing and are "
        "listed in [transition-table.md](transition-table.md)."
    )
    for machine in Machine:
        edges = _edges(machine, rows)
        kept = sum(1 for row in rows if row.machine is machine and not row.changes_state)
        out += ["", f"## {machine.value}", "", "```mermaid", "stateDiagram-v2"]
        out.append(f"    [*] --> {INITIAL_STATES[machine]}")
        out += [f"    {source} --> {target}: {label}" for source, target, label in edges]
        drawn = {s for edge in edges for s in edge[:2]} | {INITIAL_STATES[machine]}
        pseudo = [s for s in PSEUDO_STATES[machine] if s in drawn]
        if pseudo:
            out.append("    classDef pseudo stroke-dasharray: 5 5")
            out += [f"    class {state} pseudo" for state in sorted(pseudo)]
        out += ["```", "", f"Rows that change nothing on this machine: {kept}."]
    return "\n".join(out) + "\n"


def _cell(items: tuple[str, ...] | str) -> str:
    if isinstance(items, str):
        return f"`{items}`" if items else ""
    return " ".join(f"`{item}`" for item in items)


def render_transition_table(rows: tuple[Row, ...] = ROWS) -> str:
    names = {cls.__name__: machine for cls, machine in EVENT_MACHINE.items()}
    out = [GENERATED, "", "# Transition table", ""]
    out.append(
        f"{len(rows)} rows. For a (machine, state, event) the rows are tried top to bottom and the first whose "
        "guards all hold fires. `=` means the state is unchanged; a result in capitals is a refusal "
        "(`Rejected(reason, row)`); rows with no writes change nothing. `*` stands for every non-pseudo state."
    )
    header = "| id | sources | event | guards | target | result | updates | effects | writes |"
    for machine in Machine:
        machine_rows = [row for row in rows if row.machine is machine]
        if not machine_rows:
            continue
        out += ["", f"## {machine.value}", "", header, "|" + " --- |" * 9]
        for row in machine_rows:
            cells = (
                f"`{row.id}`",
                _cell(row.sources),
                _cell(row.event),
                _cell(row.guards),
                _cell(row.target),
                _cell(row.result),
                _cell(row.updates),
                _cell(row.effects),
                _cell(row.writes),
            )
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Pairs with no row", "", "Reaching one of these raises `ProtocolError` (a caller bug):", ""]
    out += [f"- `{machine.value}` `{state}` + `{event}`" for machine, state, event in uncovered_pairs(names, rows)]
    return "\n".join(out) + "\n"


def render_drivers(rows: tuple[DriverRow, ...] = DRIVER_ROWS) -> str:
    """The driver machines (spec/drivers.py): one diagram each, then every row."""
    out = [GENERATED.replace("table.py", "drivers.py"), "", "# Driver machines", ""]
    out.append(
        "What the Publisher's staging, commit/abort/cleanup, the Reclaimer, the SessionBinder and the "
        "RestartSupervisor decide, as rows: the runtime only "
        "executes their commands (`runtime/driver_loop.py`), the model checker runs the same rows "
        "(`model_checks/drivers.py`)."
        " Diagrams draw the rows that move; the table lists every row, including those that change nothing."
    )
    for machine in Driver:
        out += ["", f"## {machine.value}", "", "```mermaid", "stateDiagram-v2", f"    [*] --> {PHASES[machine][0]}"]
        edges = [(source, source if r.target == SAME else r.target, f"{r.input.value} ({r.id})")
                 for r in rows if r.machine is machine and r.target != SAME for source in r.expanded_sources()]
        out += [f"    {source} --> {target}: {label}" for source, target, label in dict.fromkeys(edges)]
        out.append("```")
    out += ["", "## Rows", "", "| id | machine | from | input | to | guards | commands | report | why |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = (f"`{r.id}`", r.machine.value, _cell(r.sources), r.input.value, _cell(r.target), _cell(r.guards),
                 _cell(r.commands), _cell(r.report.value if r.report else ""), r.doc)
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Pairs with no row", "", "Each is one an executor following `driver_loop.py` cannot reach "
            "(reaching one raises `ProtocolError`):", ""]
    out += [f"- {key}: {why}" for key, why in NOT_POSSIBLE.items()]
    out += [""] + [f"- `{m.value}` `{phase}` + `{inp.value}`" for m, phase, inp in uncovered_driver_pairs(rows)]
    return "\n".join(out) + "\n"


def documents(rows: tuple[Row, ...] = ROWS) -> dict[str, str]:
    """File name (under docs/) -> content."""
    return {
        "state-machines.md": render_state_machines(rows),
        "transition-table.md": render_transition_table(rows),
        "drivers.md": render_drivers(),
    }
