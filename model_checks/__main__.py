"""`python -m model_checks [suite] [--jobs J]`: the checker's suite, CHECKER_BOUNDS (model_checks/suite.py);
`python -m model_checks drivers [--drops N ...]`: every one-driver scenario under one budget (model_checks/drivers.py);
`python -m model_checks crowd [--drops N ...]`: every crowd scenario under one budget (model_checks/crowd.py)."""

from __future__ import annotations

import sys

from model_checks import crowd, drivers, suite

COMMANDS = {"suite": suite.main, "drivers": drivers.main, "crowd": crowd.main}


def main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return suite.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
