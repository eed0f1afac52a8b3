"""The table is well formed: names resolve, sources and targets are states of their machine, the
frame declarations use known fields, wildcards only on rows that change nothing, every
(machine, state, event) list ends with an unguarded row, and only FOREIGN pairs lack rows."""

from __future__ import annotations

from collections import defaultdict

from versioned_lora.lifecycle import engine_rules, registry_rules
from versioned_lora.spec import (
    ENGINE_SIDE_MACHINES,
    EVENT_MACHINE,
    EVENT_TYPES,
    FIELDS,
    PSEUDO_STATES,
    ROWS,
    ROWS_BY_ID,
    SAME,
    STATES,
    WILDCARD,
    Machine,
    Reason,
    covered_pairs,
    rows_for,
    uncovered_pairs,
)
from versioned_lora.spec.identities import SessionKey, VersionKey, attempt_token, lora_name, reclaim_id


def _namespace(machine: Machine) -> object:
    return engine_rules if machine in ENGINE_SIDE_MACHINES else registry_rules


def test_row_ids_are_unique_and_grouped() -> None:
    assert len(ROWS_BY_ID) == len(ROWS)
    assert all(row.id.count(".") == 1 for row in ROWS)


def test_every_name_resolves_and_every_function_is_used() -> None:
    used: dict[str, set[str]] = defaultdict(set)
    for row in ROWS:
        ns = _namespace(row.machine)
        for kind, names in (("GUARDS", row.guards), ("UPDATES", row.updates), ("EFFECTS", row.effects)):
            for name in names:
                assert name in getattr(ns, kind), (row.id, kind, name)
                used[f"{ns.__name__}.{kind}"].add(name)
        if row.is_refusal:
            assert Reason(row.result)
        else:
            assert row.result in ns.RESULTS, (row.id, row.result)  # type: ignore[attr-defined]
            used[f"{ns.__name__}.RESULTS"].add(row.result)
    for ns in (registry_rules, engine_rules):
        for kind in ("GUARDS", "UPDATES", "EFFECTS", "RESULTS"):
            assert set(getattr(ns, kind)) == used[f"{ns.__name__}.{kind}"], (ns.__name__, kind)


def test_sources_targets_and_events_belong_to_the_row_machine() -> None:
    for row in ROWS:
        assert EVENT_MACHINE[EVENT_TYPES[row.event]] is row.machine, row.id
        for source in row.sources:
            assert source == WILDCARD or source in STATES[row.machine], (row.id, source)
        assert row.target == SAME or row.target in STATES[row.machine], row.id
        assert row.target not in PSEUDO_STATES[row.machine], row.id
        for move in row.also:
            assert move.source == WILDCARD or move.source in STATES[move.machine]
            assert move.target in STATES[move.machine]


def test_frame_declarations() -> None:
    for row in ROWS:
        assert set(row.writes) <= FIELDS, row.id
        if not row.changes_state:
            assert row.target == SAME and not row.updates and not row.also, row.id
        if row.sources == (WILDCARD,):
            assert not row.changes_state, f"{row.id}: wildcard sources only on rows that change nothing"
        if row.target != SAME:
            assert row.changes_state, row.id


def test_every_candidate_list_ends_unguarded() -> None:
    """So every covered (state, event) pair has an answer: the guards only pick among rows."""
    lists: dict[tuple[Machine, str, str], list[tuple[str, tuple[str, ...]]]] = defaultdict(list)
    for row in ROWS:
        for source in row.expanded_sources():
            lists[(row.machine, source, row.event)].append((row.id, row.guards))
    for key, rows in lists.items():
        assert rows[-1][1] == (), (key, rows)
        assert all(guards for _, guards in rows[:-1]), (key, rows)  # an unguarded row shadows what follows


def test_only_foreign_engines_have_no_row() -> None:
    names = {cls.__name__: machine for cls, machine in EVENT_MACHINE.items()}
    missing = uncovered_pairs(names)
    assert missing and {state for _, state, _ in missing} == {"FOREIGN"}
    assert len(covered_pairs()) + len(missing) == sum(len(STATES[m]) for m in names.values())


def test_machines_have_rows() -> None:
    for machine in Machine:
        if machine is not Machine.DEFAULT:
            assert rows_for(machine), machine
    assert any(move.machine is Machine.DEFAULT for row in ROWS for move in row.also)


def test_identities() -> None:
    key = VersionKey(3, "step-120")
    digest = "0123456789abcdef" * 4
    assert lora_name(key, digest) == "relax_policy_lora@3-step-120-0123456789ab"
    assert reclaim_id(key) == reclaim_id(VersionKey(3, "step-120")) != reclaim_id(VersionKey(4, "step-120"))
    assert attempt_token(3, 7) == "attempt@3-7"
    assert SessionKey(1, 2, 3) < SessionKey(1, 2, 4)
