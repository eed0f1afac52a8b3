"""system.py's parameters (stateright's `within_boundary` lives here too): sizes and fault budgets of the composed
model with its hand-written environment. The checker's suite, CHECKER_BOUNDS, is model_checks/suite.py's."""

from __future__ import annotations

import hashlib

import attrs


@attrs.frozen
class Bounds:
    """Sizes of the composed system and its finite fault budgets.

    `crashes` is one budget shared by engine crash/restart, registry actor crash and publisher crash;
    `lease_faults` is the budget of publisher-lease faults: the registry's timer expiring the lease early
    (the publisher stalled past its ttl) and a rival taking it over (an operator's `publish --take-over`);
    `failures` is the publisher's budget of failed attempts (a missed deadline that aborts, or a
    manifest that does not verify at `end`); `turns` is how many generations one session runs
    (every generation after the first is a tool turn); `session_aborts` bounds temporary aborts per
    session; `max_depth` (0 = none) is the boundary on the BFS depth.
    """

    engines: int = 2
    versions: int = 3
    sessions: int = 3
    drops: int = 1
    dups: int = 1
    crashes: int = 1
    failures: int = 1
    buckets: int = 1
    turns: int = 1
    session_aborts: int = 1
    capacity: int = 2
    symmetry: bool = True
    bootstrapped: bool = False  # start from "A published and READY on every engine" (RFC §3.4)
    atomic_sessions: bool = True  # a session's registry call is delivered in the step that sends it (faults aside)
    concurrent_jobs: bool = False  # drivers run their engine jobs concurrently (else one at a time)
    probes: bool = True  # stale/forged/late messages answered by no-op rows (see kernel.probe_*)
    max_depth: int = 0
    planted_bug: str = ""  # "" or a name from system.PLANTED_BUGS (an environment-model mutation)
    por: bool = True  # partial-order reduction in the safety BFS (System.ample); off: every state fully expanded
    lease_faults: int = 0

    def __attrs_post_init__(self) -> None:
        if not (1 <= self.engines <= 4 and 1 <= self.versions <= 4 and 0 <= self.sessions <= 4):
            raise ValueError(f"bounds out of range: {self}")

    @property
    def engine_names(self) -> tuple[str, ...]:
        return tuple(f"E{i}" for i in range(self.engines))

    @property
    def version_ids(self) -> tuple[str, ...]:
        return tuple("ABCD"[: self.versions])

    def digest(self, version: int) -> str:
        return hashlib.sha256(f"content-of-{self.version_ids[version]}".encode()).hexdigest()

    def describe(self) -> str:
        flags = [f"{k}={v}" for k, v in attrs.asdict(self).items()]
        return " ".join(flags)


# A bound aimed at one deep state: an engine crash while the retired A still has a session ref, so
# the restart gives A a rehydrate attempt; the session closes and A is claimed while that rehydrate is
# still STAGING, so A's reclaim meets it (row reclaim.staging, first reached at depth 21). Used by
# scripts/mutate_spec.py: no other checker bound has a crash and a retired version at once.
# Why a depth bound: only for speed. Since the publisher's retry of a failed version waits until the
# registry knows every engine's current incarnation (System._registry_knows_incarnations), this bound
# is finite: 38,038 states, depth 42, about 2.7 s. Before that guard it was infinite: each retry while
# the restart notice was in flight minted a fresh attempt token. Depth 28 (~29k states, under 2 s)
# leaves room for mutants whose path to that state is a few steps longer.
RECLAIM_WHILE_REHYDRATING = Bounds(engines=1, versions=2, sessions=1, drops=0, dups=0, crashes=1, failures=0,
                                   bootstrapped=True, max_depth=28, concurrent_jobs=True)

LEASE_FAULTS = Bounds(engines=1, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=0, bootstrapped=True,
                      lease_faults=2, concurrent_jobs=True)

# The composed system's suite of complete bounds, for system.py's hand-written environment (the checker's own suite,
# CHECKER_BOUNDS, steps the real driver machines: model_checks/suite.py). scripts/mutate_spec.py runs every core mutant
# through each, and together they fire every row of the reference table (test_checker.py): the publication/reclaim path
# with a lost message, the abort path, an engine crash while A is served (restart, rehydrate), a drain with two
# requests, and a reclaim that meets a rehydrate still staging. Every one runs the engine jobs of a driver
# concurrently, as the runtime does (the Publisher stages, cleans and the Reclaimer unloads on every engine at once):
# the E0 and E1 pipelines interleave freely. Distinct states, serial jobs -> concurrent
# (model_checks/results/2026-12-04-concurrent-jobs.txt): 41,431 -> 178,579; 47,424 -> 378,076; 16 -> 16; 10,009 ->
# 10,009; 21,702 -> 23,577; 22,871 -> 59,642 (depth 28); 31,275 -> 31,275.
SYSTEM_BOUNDS = (
    Bounds(engines=2, versions=3, sessions=1, drops=1, dups=0, crashes=0, failures=0, bootstrapped=True,
           concurrent_jobs=True),
    Bounds(engines=2, versions=2, sessions=1, drops=0, dups=0, crashes=0, failures=1, bootstrapped=True,
           concurrent_jobs=True),
    Bounds(engines=2, versions=1, sessions=0, drops=0, dups=0, crashes=1, failures=0, bootstrapped=True,
           concurrent_jobs=True),
    # one engine and a duplicated generate request: an adapter drains with two requests on it
    Bounds(engines=1, versions=2, sessions=1, drops=0, dups=1, crashes=0, failures=0, bootstrapped=True,
           concurrent_jobs=True),
    # a free slot while an attempt is pending (capacity 3); two failed attempts (a cleanup overtakes a begin)
    Bounds(engines=1, versions=3, sessions=0, drops=0, dups=0, crashes=0, failures=2, capacity=3, bootstrapped=True,
           concurrent_jobs=True),
    # an engine crash while a retired version still has a session ref, then its claim (row reclaim.staging);
    # depth-bounded for speed (see RECLAIM_WHILE_REHYDRATING above)
    RECLAIM_WHILE_REHYDRATING,
    # the publisher lease: two lease faults (the registry's timer expiring it early, a rival taking it over,
    # live or free) around the publication of B with a session bound to A: every lease row, and the commit
    # and reserve of a publisher that lost its lease refused (31,275 states, about 3 s compiled)
    LEASE_FAULTS,
)
