"""Explicit-state model checking of the composed system (registry + engines through the spec table,
plus a hand-written environment), seeded simulation, liveness by SCC analysis, and the
Hypothesis state machines built from the same table. Run `python -m model_checks --help`."""

from model_checks import native

native.check_fresh()  # before the compiled modules are imported: never run a stale build

from model_checks.bfs import CheckResult, check  # noqa: E402
from model_checks.bounds import Bounds  # noqa: E402
from model_checks.system import PLANTED_BUGS, System  # noqa: E402

__all__ = ["PLANTED_BUGS", "Bounds", "CheckResult", "System", "check"]
