"""`python -m model_checks [suite] [--jobs J]`: the checker's suite, CHECKER_BOUNDS (model_checks/suite.py);
`python -m model_checks drivers [--drops N ...]`: every one-driver scenario under one budget (model_checks/drivers.py);
`python -m model_checks crowd [--drops N ...]`: every crowd scenario under one budget (model_checks/crowd.py)."""

from __future__ import annotations

import sys

from model_checks import crowd, drivers, suite

COMMANDS = {"suite": suite.main, "drivers": drivers.main, "crowd": crowd.main}


def main(argv: list[str]) -> int:
    name = argv[0] if argv and argv[0] in COMMANDS else "suite"
    return COMMANDS[name](argv[1:] if argv and argv[0] in COMMANDS else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
