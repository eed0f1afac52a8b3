"""Test harness: drives the core through `checked_step`, so every step of every core test checks all
invariants, the step invariants and the frame condition (the fired row declares every changed field); and
`run_driver`, which steps a driver machine of `lifecycle.drivers` through a script of inputs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from versioned_lora.lifecycle import (
    EngineAdapterState,
    EngineEffect,
    EngineEvent,
    EngineResult,
    Fired,
    RegistryEffect,
    RegistryEvent,
    RegistryResult,
    RegistryState,
    SessionKey,
    VersionKey,
    checked_engine_step,
    checked_step,
    initial_engine_state,
    initial_state,
)
from versioned_lora.lifecycle.drivers import DRIVERS

EPOCH = 0


def digest_of(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def version(name: str) -> VersionKey:
    return VersionKey(EPOCH, name)


def session(seq: int, shard: int = 0) -> SessionKey:
    return SessionKey(EPOCH, shard, seq)


class Registry:
    """A registry under test: `registry(event)` steps it and returns the result."""

    def __init__(self, engines: Iterable[str] = ("E0", "E1"), capacity: int = 2) -> None:
        self.state: RegistryState = initial_state(engines=engines, capacity=capacity, epoch=EPOCH)
        self.effects: tuple[RegistryEffect, ...] = ()
        self.rows: list[str] = []

    def __call__(self, event: RegistryEvent) -> RegistryResult:
        fired: Fired = checked_step(self.state, event)
        assert isinstance(fired.state, RegistryState)
        self.state = fired.state
        self.effects = fired.effects  # type: ignore[assignment]
        self.rows.append(fired.row.id)
        return fired.result  # type: ignore[return-value]

    @property
    def row(self) -> str:
        return self.rows[-1]


class Engine:
    """One engine's managed-adapter machine under test."""

    def __init__(self, name: str = "E0", incarnation: int = 0) -> None:
        self.state: EngineAdapterState = initial_engine_state(name, incarnation)
        self.effects: tuple[EngineEffect, ...] = ()
        self.rows: list[str] = []

    def __call__(self, event: EngineEvent) -> EngineResult:
        fired = checked_engine_step(self.state, event)
        assert isinstance(fired.state, EngineAdapterState)
        self.state = fired.state
        self.effects = fired.effects  # type: ignore[assignment]
        self.rows.append(fired.row.id)
        return fired.result  # type: ignore[return-value]

    @property
    def row(self) -> str:
        return self.rows[-1]


def run_driver(state: Any, *inputs: Any) -> tuple[Any, list[str], list[Any]]:
    """Step a driver through `inputs`: its last state, every row that fired and every command, in order."""
    fired: list[str] = []
    commands: list[Any] = []
    for inp in inputs:
        step = DRIVERS.step(state, inp)
        state, fired, commands = step.state, fired + list(step.fired), commands + list(step.commands)
    return state, fired, commands
