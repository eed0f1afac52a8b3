"""`python -m model_checks [check] --engines 2 --versions 3 --sessions 3 --drops 1 --dups 1 --crashes 1`
`python -m model_checks simulate --seed 7 --runs 200 --depth 400 ...`
`python -m model_checks liveness --engines 2 --versions 2 --sessions 1 ...`
`python -m model_checks replay TRACE.json`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from model_checks import trace as traces
from model_checks.bfs import check
from model_checks.bounds import Bounds
from model_checks.liveness import check_liveness
from model_checks.report import report_lines
from model_checks.simulate import simulate
from model_checks.system import System


def _bounds_args(p: argparse.ArgumentParser) -> None:
    defaults = Bounds()
    for field in attrs.fields(Bounds):
        name = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument(name, type=type(default), default=default)


def _bounds(ns: argparse.Namespace) -> Bounds:
    return Bounds(**{f.name: getattr(ns, f.name) for f in attrs.fields(Bounds)})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv.insert(0, "check")
    parser = argparse.ArgumentParser(prog="python -m model_checks")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="exhaustive BFS")
    _bounds_args(c)
    c.add_argument("--trace-out", type=Path, default=Path("model_checks_trace.json"))
    c.add_argument("--no-progress", action="store_true")
    s = sub.add_parser("simulate", help="seeded random simulation")
    _bounds_args(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--runs", type=int, default=100)
    s.add_argument("--depth", type=int, default=300)
    s.add_argument("--trace-out", type=Path, default=Path("model_checks_trace.json"))
    lv = sub.add_parser("liveness", help="SCC analysis of the full graph (small bounds)")
    _bounds_args(lv)
    r = sub.add_parser("replay", help="re-run a saved trace against the core")
    r.add_argument("trace", type=Path)
    ns = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    if ns.command == "replay":
        return _replay(ns.trace, console)
    bounds = _bounds(ns)
    system = System(bounds)
    if ns.command == "simulate":
        return _simulate(system, ns, console)
    if ns.command == "liveness":
        return _liveness(system, console)
    return _check(system, ns, console)


def _check(system: System, ns: argparse.Namespace, console: Console) -> int:
    console.print(f"Checking {system.bounds.describe()}")
    if ns.no_progress:
        result = check(system)
    else:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("BFS", total=None)

            def tick(depth: int, distinct: int, frontier: int) -> None:
                progress.update(task, description=f"depth {depth}: {distinct:,} distinct, frontier {frontier:,}")

            result = check(system, tick)
    if result.violation is not None:
        doc = traces.trace_document(system, result.violation.trace, result.violation.problems)
        traces.print_trace(doc, console.print)
        traces.save(doc, ns.trace_out)
        console.print(f"Trace saved to {ns.trace_out}; replay: python -m model_checks replay {ns.trace_out}")
    for line in report_lines(system, result):
        console.print(line)
    return 1 if result.violation else 0


def _simulate(system: System, ns: argparse.Namespace, console: Console) -> int:
    res = simulate(system, ns.seed, ns.runs, ns.depth)
    if res.violation is not None:
        problems, steps = res.violation
        doc = traces.trace_document(system, steps, problems)
        traces.print_trace(doc, console.print)
        traces.save(doc, ns.trace_out)
    fired = sum(1 for n in system.k.row_counts if n)
    console.print(f"simulate seed={ns.seed} runs={res.runs} steps={res.steps} max_depth={res.max_depth} "
                  f"rows_fired={fired}/{len(system.k.row_counts)} violations={int(res.violation is not None)} "
                  f"digest={res.digest[:16]}")
    return 1 if res.violation else 0


def _liveness(system: System, console: Console) -> int:
    res = check_liveness(system)
    console.print(f"Liveness {system.bounds.describe()}")
    for ob, size, state in res.violations:
        console.print(f"  LIVENESS VIOLATION: {ob} open in every state of a fair SCC of {size} states, e.g. "
                      f"{system.describe(state)}")
    console.print(f"states={res.states} edges={res.edges} sccs={res.sccs} sec={res.seconds:.1f} "
                  f"violations={len(res.violations)}")
    return 1 if res.violations else 0


def _replay(path: Path, console: Console) -> int:
    ok, log, problems = traces.replay(path)
    for line in log:
        console.print(line)
    for p in problems:
        console.print(f"  VIOLATION (reproduced): {p}")
    console.print(f"replay {'ok' if ok else 'FAILED'}: {len(log) - 1} steps, violations={len(problems)}")
    return 0 if ok and problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
