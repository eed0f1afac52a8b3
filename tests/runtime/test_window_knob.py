"""A window of K versions has one knob (issue 46, item 4): the registry's capacity K. The engines' loaded-adapter
slots are derived from it in one place (K + 1: K pinned managed versions and one for the stock path), and the
command line passes K through (`versioned-lora engine --capacity K`, `versioned-lora demo --capacity K`)."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from versioned_lora.adapters.engine_process import EngineConfig, loaded_adapter_slots, managed_lora_args
from versioned_lora.lifecycle.core import DEFAULT_CAPACITY


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("capacity", [1, 2, 3, 5])
def test_the_engines_slots_are_derived_from_the_registry_capacity(capacity: int) -> None:
    assert loaded_adapter_slots(capacity) == capacity + 1
    command = EngineConfig(model_dir=Path("/model"), port=1, capacity=capacity).command()
    # SGLang bounds pinned adapters by max_loras_per_batch - 1 and holds max_loaded_loras: both are K + 1.
    assert flag(command, "--max-loaded-loras") == flag(command, "--max-loras-per-batch") == str(capacity + 1)
    assert command.count("--max-loaded-loras") == 1 and tuple(managed_lora_args(capacity)) == tuple(
        command[command.index("--enable-lora"):command.index("--enable-lora") + len(managed_lora_args(capacity))])


def test_the_default_is_the_registrys_and_a_window_is_at_least_one() -> None:
    assert EngineConfig(model_dir=Path("/model"), port=1).capacity == DEFAULT_CAPACITY == 2
    assert flag(EngineConfig(model_dir=Path("/model"), port=1).command(), "--max-loaded-loras") == "3"
    with pytest.raises(ValueError):
        loaded_adapter_slots(0)


def test_the_command_line_takes_the_capacity() -> None:
    from versioned_lora import cli
    from versioned_lora.demo import add_arguments

    demo = argparse.ArgumentParser()
    add_arguments(demo)
    assert demo.parse_args([]).capacity == 2 and demo.parse_args(["--capacity", "3"]).capacity == 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["engine", "--help"])
    assert "--capacity K" in out.getvalue() and "K + 1 loaded-adapter slots" in " ".join(out.getvalue().split())
