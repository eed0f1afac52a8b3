"""Model checking. The checker's suite, CHECKER_BOUNDS (`python -m model_checks.suite`), steps the real driver machines
against the real registry and engine tables (drivers.py, crowd.py); system.py is the composed model with its
hand-written environment (explicit-state checker, seeded simulation, liveness by SCC: `python -m model_checks --help`);
stateful.py builds the Hypothesis state machines from the same table. Importing the package imports none of them."""

from model_checks import native

native.check_fresh()  # before a compiled module is imported: never run a stale build
