"""The name grammar (spec/identities.py) and where it is enforced without an engine: every name the code
generates parses back to its parts; names, version ids and digests outside it are refused naming the part; the
in-process registry refuses such a Reserve with nothing taken and nothing journaled (the Ray actor: table.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import fresh_name
from lease_helpers import fence

from versioned_lora.adapters.registry_core import RegistryCore
from versioned_lora.lifecycle import Reserve, Reserved, VersionKey
from versioned_lora.spec.identities import (
    LORA_NAME_MAX_LEN,
    InvalidIdentity,
    LoraNameParts,
    check_lora_name,
    check_version_identity,
    lora_name,
    parse_lora_name,
)

# The registries built here serve no real engine: keyless, and said so (insecure=True; issue 41).

DIGEST = "0123456789abcdef" * 4
# The version ids the code and tests generate: the demo's and tests' labels, uuid-suffixed test labels, the GPU
# harness's "gv<label>-<run_id>", the spec test's "step-120", the benchmark's "fixed".
# Ids with a random part are pinned to one example each (parametrize ids stay stable); `fresh_name` is checked
# separately.
GENERATED_IDS = ["A", "B", "C", "Z", "step-120", "fixed", "v-1a2b3c4d", "gvA-0f1e2d3c", "s0a1b2c3d", "big0a1b2c",
                 "never", "x" * 64]


def test_fresh_test_names_are_inside_the_grammar() -> None:
    for label in ("v", "bnd", "conf", "baseline-A", "ck"):
        name = lora_name(VersionKey(1, fresh_name(label)), DIGEST)
        assert parse_lora_name(name).version_id.startswith(label)


@pytest.mark.parametrize("version_id", GENERATED_IDS)
@pytest.mark.parametrize("epoch", [0, 1, 830328699, 2**31 - 1, 2**63 - 1])
def test_generated_names_parse_back(epoch: int, version_id: str) -> None:
    name = lora_name(VersionKey(epoch, version_id), DIGEST)
    assert len(name) <= LORA_NAME_MAX_LEN
    assert parse_lora_name(name) == LoraNameParts(epoch, version_id, DIGEST[:12])
    assert check_lora_name(name, DIGEST).version_id == version_id
    check_version_identity(VersionKey(epoch, version_id), DIGEST)


@pytest.mark.parametrize(("name", "part"), [
    ("relax_policy_lora@../../../../tmp/evil", "name"),
    ("relax_policy_lora@1-$(touch x);rm -rf ~|`id`-0123456789ab", "version_id"),
    ("relax_policy_lora@" + "a" * 10_000, "length"),
    ("relax_policy_lora@830328699--1-111111111111", "version_id"),
    ("relax_policy_lora@01-A-0123456789ab", "epoch"),
    ("relax_policy_lora@-1-A-0123456789ab", "epoch"),
    ("relax_policy_lora@99999999999999999999-A-0123456789ab", "epoch"),
    ("relax_policy_lora@1-A-0123456789AB", "digest"),
    ("relax_policy_lora@1-A-0123456789a", "digest"),
    ("relax_policy_lora@1-A", "name"),
    ("relax_policy_lora@1--0123456789ab", "version_id"),
    ("relax_policy_lora@1-.hidden-0123456789ab", "version_id"),
    ("relax_policy_lora@1-a/b-0123456789ab", "version_id"),
    ("relax_policy_lora@1-a\nb-0123456789ab", "version_id"),
    ("other@1-A-0123456789ab", "prefix"),
    (5, "type"),
    (None, "type"),
])
def test_names_outside_the_grammar_are_refused_naming_the_part(name: object, part: str) -> None:
    with pytest.raises(InvalidIdentity) as refused:
        parse_lora_name(name)
    assert refused.value.part == part


def test_digest_part_must_be_the_manifest_digest() -> None:
    name = lora_name(VersionKey(1, "A"), DIGEST)
    with pytest.raises(InvalidIdentity, match="disagrees") as refused:
        check_lora_name(name, "f" * 64)
    assert refused.value.part == "digest"


@pytest.mark.parametrize(("version", "digest", "part"), [
    (VersionKey(0, -1), DIGEST, "version_id"),  # type: ignore[arg-type]
    (VersionKey(0, 10**30), DIGEST, "version_id"),  # type: ignore[arg-type]
    (VersionKey(-1, "A"), DIGEST, "epoch"),
    (VersionKey(True, "A"), DIGEST, "epoch"),
    (VersionKey(2**63, "A"), DIGEST, "epoch"),
    (VersionKey(0, "A"), "1" * 63 + "g", "digest"),
    (VersionKey(0, "A"), DIGEST.upper(), "digest"),
    (VersionKey(0, "A"), 5, "digest"),
    (("A",), DIGEST, "version"),
])
def test_in_process_registry_refuses_reserve_outside_the_grammar(tmp_path: Path, version: object, digest: object,
                                                                part: str) -> None:
    core = RegistryCore(tmp_path / "registry.sqlite", insecure=True)
    before, seq = core.state_digest(), core.journal_stats()
    with pytest.raises(InvalidIdentity) as refused:
        core.submit("k1", Reserve(version, digest))  # type: ignore[arg-type]
    assert refused.value.part == part
    # A refused event in a batch refuses the whole call: nothing before it is applied either.
    with pytest.raises(InvalidIdentity):
        core.submit_batch("k2", [Reserve(VersionKey(0, "A"), DIGEST), Reserve(version, digest)])  # type: ignore[arg-type]
    assert (core.state_digest(), core.journal_stats()) == (before, seq)
    assert isinstance(core.submit("k3", Reserve(VersionKey(0, "A"), DIGEST, fence(core))).result, Reserved)
    core.close()
