"""Several driver machines in one world (model_checks/crowd.py): every scenario under the bounds `make test` checks
(model_checks/suite.py's SMOKE_BOUNDS; every bound of crowd.CHECKS in `make check-deep`) holds every property of the
one-driver checker on every lane, and the interleavings that make a crowd worth checking are reached (a bind landing on
either side of a commit, a claim on either side of a close, a commit and an abort of one attempt in either order, a
zombie's calls meeting the newer attempt), so a composition that ran its lanes one after the other would fail here; and
together the lanes reach registry and engine rows no one-driver world does (crowd.REACHED_TOGETHER, held exact), so
that with the probes every row of the table is reached by a driver world but those no driver makes
(drivers.NO_DRIVER_MAKES)."""

from __future__ import annotations

from collections.abc import Callable

from model_checks.crowd import REACHED_TOGETHER, Crowd, check, merge, scenario, successors, view
from model_checks.drivers import (
    CORE_ROWS_NOT_PROBED,
    CORE_ROWS_NOT_REACHED,
    NO_DRIVER_MAKES,
    A,
    B,
    Budget,
    Checked,
    DriverSystem,
)
from model_checks.suite import Entry
from versioned_lora.lifecycle.drivers import ReclaimState, SendGeneration, SessionState, SettleState, is_done
from versioned_lora.lifecycle.queries import servable_on
from versioned_lora.spec.drivers import DriverOutcome
from versioned_lora.spec.states import VersionState


def test_every_scenario_holds_and_the_crowds_reach_their_rows_together(checked: dict[Entry, Checked]) -> None:
    core: set[str] = set()
    for entry in [entry for entry in checked if entry[0] == "crowd"]:
        result = checked[entry].result
        assert result.violation is None, (entry, result.violation, result.trace)
        assert result.states > 50  # the smallest, zombie_epoch (four drivers one after the other): 67 under a loss
        core |= checked[entry].core_fired
    # Rows no one-driver world reaches (drivers.CORE_ROWS_NOT_REACHED) that the real drivers reach together, held
    # exact: what is left of that list is what no driver world reaches yet.
    assert core & CORE_ROWS_NOT_REACHED == REACHED_TOGETHER, (sorted(core & CORE_ROWS_NOT_REACHED - REACHED_TOGETHER),
                                                              sorted(REACHED_TOGETHER - core))
    # With the probes' rows (test_drivers.py), every row of the table is reached by a driver world but the moves no
    # driver makes.
    assert set(NO_DRIVER_MAKES) == CORE_ROWS_NOT_PROBED - REACHED_TOGETHER


def _reached(name: str, wanted: Callable[[Crowd], bool]) -> bool:
    seen: list[Crowd] = []
    check(name, Budget(drops=0, dups=0, deadlines=0, cancels=0),
          on_state=lambda c: seen.append(c) if wanted(c) else None)
    return bool(seen)


def _lanes(c: Crowd, kind: type) -> list[object]:
    return [lane.driver for lane in c.lanes if isinstance(lane.driver, kind)]


def test_a_bind_lands_on_either_side_of_the_commit() -> None:
    def bound_to(version: object, settle_done: bool) -> Callable[[Crowd], bool]:
        def wanted(c: Crowd) -> bool:
            s = _lanes(c, SessionState)[0]
            settling = _lanes(c, SettleState)[0]
            return getattr(s, "version", None) == version and s.phase == "BOUND" and is_done(settling) is settle_done
        return wanted

    assert _reached("commit_while_binding", bound_to(A, settle_done=True))  # bound before the commit landed
    assert _reached("commit_while_binding", bound_to(B, settle_done=False))  # after, its reply still in flight


def test_a_claim_lands_on_either_side_of_the_close() -> None:
    def reclaim_told(outcome: DriverOutcome) -> Callable[[Crowd], bool]:
        return lambda c: any(r.outcome is outcome for lane in c.lanes if isinstance(lane.driver, ReclaimState)
                             for r in lane.reports)

    assert _reached("reclaim_while_closing", reclaim_told(DriverOutcome.REJECTED))  # A still bound
    assert _reached("reclaim_while_closing", reclaim_told(DriverOutcome.RECLAIMED))  # after the close


def test_a_commit_and_an_abort_of_one_attempt_land_in_either_order() -> None:
    """Two real settle drivers of B's one attempt (a publisher committing it, a recovering one aborting it): both
    orders are reached, and in neither is a committed B cleaned (every property holds on every crowd: the scenario
    test above)."""
    def ended(state: VersionState) -> Callable[[Crowd], bool]:
        return lambda c: c.shared.registry.versions[B].state is state and all(is_done(lane.driver) for lane in c.lanes)

    assert _reached("abort_while_committing", ended(VersionState.PUBLISHED))  # the commit landed first
    assert _reached("abort_while_committing", ended(VersionState.FAILED_CLEAN))  # the abort did, and cleaned


def test_a_lane_sees_the_shared_world_and_only_its_own_traffic() -> None:
    system = DriverSystem()
    start = scenario("commit_while_binding", Budget())
    after = next(c for label, c in successors(system, start) if label.startswith("L1 "))
    assert after.lanes[0] == start.lanes[0]  # lane 1's step moved nothing of lane 0
    w = view(after, 1)
    assert w.crowded and w.driver is after.lanes[1].driver
    assert merge(after, 1, w) == after  # a view merged back unchanged is the same crowd
    assert view(after, 0).net == after.lanes[0].net



def test_a_view_read_before_a_restart_is_adopted_is_refused_by_the_engine_and_redispatched() -> None:
    """The window the one-driver checker cannot reach: the session reads the dispatch view (E0 and E1), the
    supervisor's report of E0's restart is adopted, and then the generation is sent with the older view. E0
    holds nothing at its new incarnation and refuses; the session re-dispatches the same binding
    (generate.redispatch) to where a fresh view says, and no engine serves a version it does not hold."""
    system = DriverSystem()
    stale: list[Crowd] = []

    def sent_after_adoption(c: Crowd) -> None:
        registry = c.shared.registry
        adopted = registry.incarnations["E0"] == 2 and not servable_on(registry, A, "E0")
        if adopted and any(kind == "req" and isinstance(m, SendGeneration) and "E0" in m.engines
                           for lane in c.lanes for kind, m in lane.net):
            stale.append(c)

    result = check("rehydrate_while_generating", Budget(drops=0, dups=0, deadlines=0, cancels=0), system=system,
                   on_state=sent_after_adoption)
    assert result.violation is None, (result.violation, result.trace)
    assert stale and system.fired.get("generate.redispatch", 0) > 0


def test_a_zombie_stage_driver_meets_the_newer_attempt_and_never_stages_over_it() -> None:
    """zombie_stage: B's first attempt's stage driver runs on (its publisher stalled past its lease) while the new
    holder aborts and cleans that attempt, then stages B again. Reached: the new attempt STAGED on both engines with
    the zombie's begin, bucket or end refused on E0 (it ends STAGE_FAILED) -- and in every reachable world E0 holds
    B only under the newest attempt the registry placed there, or under none (every property holds: the scenario
    test above)."""
    def newest_staged_zombie_refused(c: Crowd) -> bool:
        zombie, new = c.lanes[0], c.lanes[2]
        return (any(r.outcome is DriverOutcome.STAGED for r in new.reports)
                and any(r.outcome is DriverOutcome.STAGE_FAILED for r in zombie.reports))

    def zombie_holds_e0(c: Crowd) -> bool:
        registry, engine = c.shared.registry, c.shared.engines[0]
        adapter = engine.adapters.get(registry.versions[B].lora_name)
        first = c.lanes[0].driver.attempt_token
        return (registry.versions[B].attempt_token != first and adapter is not None
                and adapter.attempt_token == first and adapter.state.name in ("STAGING", "READY"))

    assert _reached("zombie_stage", newest_staged_zombie_refused)
    # The zombie's begin may land before the recovery's cleanup; after the cleanup it holds nothing, so once the
    # registry placed the newer attempt no engine still stages or serves the old one.
    assert not _reached("zombie_stage", zombie_holds_e0)


def test_a_zombie_commit_is_refused_before_and_after_the_newer_attempt_is_committed() -> None:
    """zombie_settle: the stalled publisher commits its replaced attempt while the newer one stages and is committed.
    Both orders are reached -- the newer attempt committed with the zombie's commit landing before it and after it
    (refused both times, then its abort refused too) -- and B is never committed under the zombie's attempt."""
    def newer_committed(after_the_zombie: bool) -> Callable[[Crowd], bool]:
        def wanted(c: Crowd) -> bool:
            version = c.shared.registry.versions[B]
            zombie, newer = c.lanes[0], c.lanes[2]
            return (version.state is VersionState.PUBLISHED and version.attempt_token == newer.driver.attempt_token
                    and is_done(zombie.driver) is after_the_zombie)
        return wanted

    def committed_as_the_zombie(c: Crowd) -> bool:
        version = c.shared.registry.versions[B]
        return version.state is VersionState.PUBLISHED and version.attempt_token == c.lanes[0].driver.attempt_token

    assert _reached("zombie_settle", newer_committed(after_the_zombie=True))
    assert _reached("zombie_settle", newer_committed(after_the_zombie=False))
    assert not _reached("zombie_settle", committed_as_the_zombie)


def test_a_previous_epochs_process_is_refused_at_every_registry_call() -> None:
    """zombie_epoch: the drivers of an epoch-0 process, one after the other, end without changing the epoch-1
    registry in any reachable world; the publication is told REJECTED at reserve and the stage STAGE_FAILED at its
    PREPARED, and every driver reports."""
    start = scenario("zombie_epoch", Budget(drops=0, dups=0, deadlines=0, cancels=0))

    def ended_with_nothing_changed(c: Crowd) -> bool:
        told = [tuple(r.outcome for r in lane.reports) for lane in c.lanes]
        return (all(is_done(lane.driver) and lane.reports for lane in c.lanes)
                and told[:2] == [(DriverOutcome.REJECTED,), (DriverOutcome.STAGE_FAILED,)]
                and c.shared.registry == start.shared.registry)

    def registry_changed(c: Crowd) -> bool:
        return c.shared.registry != start.shared.registry

    assert _reached("zombie_epoch", ended_with_nothing_changed)
    assert not _reached("zombie_epoch", registry_changed)


def test_a_zombie_cleanup_of_its_own_attempt_never_cleans_the_newer_one() -> None:
    """zombie_abort: the stalled publisher aborts and cleans its own attempt while the new holder has done the same
    and staged B again. Reached: the newer attempt STAGED on both engines while the zombie's cleanup on some engine
    was refused (its sub-machine UNCONFIRMED); never reached: an engine that cleaned the newer attempt."""
    def staged_beside_a_refused_cleanup(c: Crowd) -> bool:
        zombie, newer = c.lanes[0].driver, c.lanes[2]
        return (any(r.outcome is DriverOutcome.STAGED for r in newer.reports)
                and any(e.phase == "UNCONFIRMED" for e in zombie.engines.values()))

    def newer_cleaned(c: Crowd) -> bool:
        token = c.lanes[2].driver.attempt_token
        return bool(token) and any(token in a.cleaned_attempts for e in c.shared.engines for a in e.adapters.values())

    seen = {"staged": False, "cleaned": False}

    def note(c: Crowd) -> None:  # one search for both (each is 14,096 states)
        seen["staged"] |= staged_beside_a_refused_cleanup(c)
        seen["cleaned"] |= newer_cleaned(c)

    check("zombie_abort", Budget(drops=0, dups=0, deadlines=0, cancels=0), on_state=note)
    assert seen == {"staged": True, "cleaned": False}
