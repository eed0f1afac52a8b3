"""Symmetry: `System.canonical` picks one representative per orbit. Every permutation of the
sessions of a reachable state has the same canonical form, and the canonical form is in the orbit
(a renaming of the state). Checked on states with messages and running requests in flight, where
the lazy signature and the fast paths of `canonical` matter."""

from __future__ import annotations

import itertools
from typing import Any

from model_checks.bfs import check
from model_checks.bounds import Bounds
from model_checks.system import NET, REG, RUN, SESS, System


def _permute(system: System, st: Any, perm: tuple[int, ...]) -> Any:
    """Rename session i to perm[i] everywhere: registry records, session tuples, messages, requests."""
    order = sorted(range(len(perm)), key=perm.__getitem__)  # order[new] = old
    reg = system.k.permute_registry(st[REG], perm)
    sess = tuple(st[SESS][old] for old in order)
    net = tuple(sorted(system._rename(m, perm) for m in st[NET]))
    run = tuple(sorted((r[0], perm[r[1]], r[2]) for r in st[RUN]))
    return (reg, st[1], sess, st[3], st[4], st[5], run, net, st[8])


def test_canonical_form_is_the_same_for_every_renaming_of_the_sessions() -> None:
    bounds = Bounds(engines=1, versions=2, sessions=3, drops=0, dups=1, crashes=0, failures=0, bootstrapped=True,
                    symmetry=False, por=False, max_depth=9)
    system = System(bounds)
    states: list[Any] = []
    check(system, visit=states.append)
    perms = list(itertools.permutations(range(3)))
    sample = states[::7]
    for st in sample:
        canon = system.canonical(st)
        assert any(_permute(system, st, p) == canon for p in perms)
        for p in perms:
            assert system.canonical(_permute(system, st, p)) == canon, (st, p)
    # Every combination was checked: neither, messages only, running requests only, both in flight.
    assert {(bool(st[NET]), bool(st[RUN])) for st in sample} == {(False, False), (True, False), (False, True),
                                                                (True, True)}
