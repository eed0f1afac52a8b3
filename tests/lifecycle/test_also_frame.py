"""The frame check covers a row's `also`: every entity other than the located one that a step moves must be a
move the row declares (the diagrams draw them from `also`). The reference table passes it on every step the
product tests and the Hypothesis machine take; a row stripped of one declared move is caught on its first step."""

from __future__ import annotations

import attrs
import pytest

from versioned_lora.lifecycle import (
    CORE,
    Commit,
    Core,
    EngineStarted,
    InvariantViolation,
    RecordReady,
    RegistryState,
    Reserve,
    VersionKey,
    checked_engine_step,
    checked_step,
    engine_step,
    initial_engine_state,
    initial_state,
)
from versioned_lora.spec import ROWS
from versioned_lora.spec.events import BeginStaging

A, B = VersionKey(0, "A"), VersionKey(0, "B")
DIGEST = {A: "a" * 64, B: "b" * 64}


def without_also(row_id: str, keep: int = 0) -> Core:
    """The table with row `row_id` declaring only its first `keep` moves."""
    return Core(tuple(attrs.evolve(r, also=r.also[:keep]) if r.id == row_id else r for r in ROWS))


def published(state: RegistryState, version: VersionKey, core: Core = CORE) -> RegistryState:
    state = checked_step(state, Reserve(version, DIGEST[version]), core).state  # type: ignore[assignment]
    token = state.versions[version].attempt_token
    for engine in state.config.engines:
        state = checked_step(state, RecordReady(version, token, engine, 0, DIGEST[version]), core).state  # type: ignore[assignment]
    return state


def test_a_swap_that_does_not_declare_retiring_the_old_default_is_a_frame_violation() -> None:
    state = published(initial_state(), A)
    state = checked_step(state, Commit(A, state.versions[A].attempt_token, 0)).state  # type: ignore[assignment]
    state = published(state, B)
    commit = Commit(B, state.versions[B].attempt_token, 1)
    checked_step(state, commit)  # the reference row declares both moves
    swap = next(r for r in ROWS if r.id == "commit.swap")
    assert [(m.machine.value, m.source, m.target) for m in swap.also] == [("default", "SET", "SET"),
                                                                           ("version", "PUBLISHED", "RETIRED")]
    with pytest.raises(InvariantViolation, match=r"commit.swap moved version PUBLISHED -> RETIRED, not declared"):
        checked_step(state, commit, without_also("commit.swap", keep=1))
    with pytest.raises(InvariantViolation, match=r"commit.swap moved default SET -> SET, not declared"):
        checked_step(state, commit, without_also("commit.swap"))


def test_a_new_process_that_does_not_declare_forgetting_its_adapters_is_a_frame_violation() -> None:
    engine = initial_engine_state("E0", 1)
    engine = engine_step(engine, BeginStaging("relax_policy_lora@0-A-aaaaaaaaaaaa", "t1", 1, "a" * 64, 1))[0]
    checked_engine_step(engine, EngineStarted(2))
    with pytest.raises(InvariantViolation, match=r"started.new moved adapter STAGING -> ABSENT, not declared"):
        checked_engine_step(engine, EngineStarted(2), without_also("started.new"))
