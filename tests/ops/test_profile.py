"""The command line's connection settings written once (a profile): a flag wins over its environment variable, which
wins over the profile, which wins over the built-in default; a bad profile is a typed error that names the setting.
No engine or cluster: the parser and `settle_connection` only."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from versioned_lora.adapters.ray_registry import REGISTRY_ACTOR_NAME, REGISTRY_NAMESPACE
from versioned_lora.ops.commands import (
    ADDRESS_ENV,
    PROFILE_ENV,
    OperationError,
    add_connection_arguments,
    add_probe_arguments,
    read_profile,
    settle_connection,
    write_profile,
)


def parsed(*argv: str, token: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser, token=token)
    add_probe_arguments(parser)
    args = parser.parse_args(list(argv))
    settle_connection(args)
    return args


def test_a_profile_written_by_the_registry_is_read_back_and_fills_what_no_flag_gave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (ADDRESS_ENV, PROFILE_ENV, "VERSIONED_LORA_REGISTRY", "VERSIONED_LORA_NAMESPACE",
                 "VERSIONED_LORA_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    profile = tmp_path / "deployment.toml"
    write_profile(profile, {"address": "10.0.0.1:6379", "name": "reg", "namespace": None,
                            "token_file": "/secrets/engine.token", "probe_ids": "5,6,7", "probe_top_logit": 24})
    assert read_profile(profile) == {"address": "10.0.0.1:6379", "name": "reg", "token_file": "/secrets/engine.token",
                                     "probe_ids": "5,6,7", "probe_top_logit": 24.0}
    args = parsed("--profile", str(profile))
    assert (args.address, args.name, args.namespace, args.token_file, args.probe_ids, args.probe_top_logit) == (
        "10.0.0.1:6379", "reg", REGISTRY_NAMESPACE, "/secrets/engine.token", "5,6,7", 24.0)
    # An environment variable wins over the profile; a flag over both.
    monkeypatch.setenv(ADDRESS_ENV, "10.0.0.2:6379")
    assert parsed("--profile", str(profile)).address == "10.0.0.2:6379"
    assert parsed("--profile", str(profile), "--address", "10.0.0.3:6379").address == "10.0.0.3:6379"
    # The profile named by the environment; a probe given by flag replaces the profile's whole probe.
    monkeypatch.setenv(PROFILE_ENV, str(profile))
    args = parsed("--probe-file", "mine.txt")
    assert (args.name, args.probe_file, args.probe_ids) == ("reg", "mine.txt", None)


def test_without_a_profile_the_built_in_defaults_hold_and_a_needed_token_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (ADDRESS_ENV, PROFILE_ENV, "VERSIONED_LORA_REGISTRY", "VERSIONED_LORA_NAMESPACE",
                 "VERSIONED_LORA_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    args = parsed(token=False)
    assert (args.address, args.name, args.namespace, args.token_file) == (
        "auto", REGISTRY_ACTOR_NAME, REGISTRY_NAMESPACE, None)
    with pytest.raises(OperationError, match="needs the engines' token"):
        parsed()


@pytest.mark.parametrize(("text", "said"), [
    ("adress = 'x'\n", "unknown setting"),
    ("probe_top_logit = 'high'\n", "probe_top_logit must be a float"),
    ("name = 3\n", "name must be a str"),
    ("name = \n", "cannot read the profile"),
])
def test_a_bad_profile_is_a_typed_error_that_names_the_setting(tmp_path: Path, text: str, said: str) -> None:
    profile = tmp_path / "bad.toml"
    profile.write_text(text)
    with pytest.raises(OperationError, match=said):
        read_profile(profile)
    with pytest.raises(OperationError, match="cannot read the profile"):
        read_profile(tmp_path / "missing.toml")
