"""Model checking. The checker's suite, CHECKER_BOUNDS (`python -m model_checks`, suite.py), steps the real driver
machines against the real registry and engine tables (drivers.py: a world of one driver; crowd.py: several drivers,
other processes among them), with liveness by strongly connected components under weak fairness (fairness.py), and
traces that replay and seeded simulation (walks.py); stateful.py builds the Hypothesis state machines from the same
table. Importing the package imports none of them."""
