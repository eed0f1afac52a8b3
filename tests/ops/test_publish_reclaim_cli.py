"""`versioned-lora publish` and `versioned-lora reclaim` from a child process against a live deployment (real
Ray registry actor, the session's two real engines): each runs to its outcome and exits with the documented
code (README, "Operating it"; `versioned_lora.ops.commands.Exit`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from engine_helpers import run
from ops_helpers import cli, connection_args
from safetensors.torch import load_file, save_file
from test_publication_e2e import deployed

from versioned_lora.adapters.engine_link import Candidate
from versioned_lora.adapters.snapshot import snapshot_from_adapter_dir
from versioned_lora.lifecycle import VersionKey
from versioned_lora.ops.commands import Exit
from versioned_lora.spec.identities import lora_name
from versioned_lora.spec.states import VersionState

BUCKET_BYTES = 8192  # the fixture adapters are ~28 KB: several buckets, so the per-bucket display shows


def other_base_model(model_dir: Path, into: Path) -> Path:
    """A copy of the fixture model with its output rows reversed: a real model whose forward differs, so the
    probe check of a publication against it fails on every engine (they serve the fixture model)."""
    shutil.copytree(model_dir, into)
    weights = load_file(str(into / "model.safetensors"))
    weights["lm_head.weight"] = torch.flip(weights["lm_head.weight"], dims=[0]).contiguous()
    save_file(weights, str(into / "model.safetensors"))
    return into


def test_publish_and_reclaim_run_to_their_outcomes_and_exit_with_the_documented_codes(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            conn = connection_args(d, tmp_path)

            async def publish(adapter: str, version_id: str, *extra: str):  # type: ignore[no-untyped-def]
                return await cli("publish", str(fixtures.adapters[adapter]), "--version-id", version_id,
                                 "--bucket-bytes", str(BUCKET_BYTES), *conn, *extra)

            snapshot_a = snapshot_from_adapter_dir(fixtures.adapters["A"])
            buckets = Candidate.build("x", snapshot_a, BUCKET_BYTES).bucket_count
            assert buckets >= 3
            published = await publish("A", "A")
            assert published.code == Exit.OK == 0, published.stdout + published.stderr
            receipt = published.receipt()
            assert (receipt["status"], receipt["default_revision"], receipt["exit"]) == ("COMMITTED", 1, 0)
            assert receipt["lora_name"] == lora_name(VersionKey(d.epoch, "A"), snapshot_a.digest)
            phases = [phase for phase, _ in receipt["phases"]]
            assert phases == ["reserve", "begin", *(f"bucket_{i}" for i in range(buckets)), "end", "commit"]
            for index in range(buckets):  # one progress line per bucket
                assert f"bucket {index}/{buckets}" in published.stdout, published.stdout
            view = await d.registry.publication_view()
            assert view.default == VersionKey(d.epoch, "A") and view.default_revision == 1

            assert (await publish("B", "B")).code == Exit.OK
            begins = {e: a["managed_begin"] for e, a in (await d.audit()).items()}
            refused = await publish("C", "C")
            assert refused.code == Exit.REJECTED_CAPACITY == 3, refused.stdout + refused.stderr
            assert (refused.receipt()["status"], refused.receipt()["reason"]) == ("REJECTED", "CAPACITY_ERROR")
            assert {e: a["managed_begin"] for e, a in (await d.audit()).items()} == begins  # no begin was sent

            unloads = {e: a["physical_unload"] for e, a in (await d.audit()).items()}
            reclaimed = await cli("reclaim", *conn)  # A: RETIRED with no session refs
            assert reclaimed.code == Exit.OK, reclaimed.stdout + reclaimed.stderr
            (outcome,) = reclaimed.receipt()["reclaims"]
            assert (outcome["version_id"], outcome["status"], outcome["confirmed"]) == ("A", "RECLAIMED",
                                                                                      ["E0", "E1"])
            assert {e: a["physical_unload"] - unloads[e] for e, a in (await d.audit()).items()} == {"E0": 1, "E1": 1}
            states = await d.registry.version_states([VersionKey(d.epoch, "A"), VersionKey(d.epoch, "B")])
            assert list(states.values()) == [VersionState.RECLAIMED, VersionState.PUBLISHED]

            nothing = await cli("reclaim", *conn)
            assert nothing.code == Exit.OK and nothing.receipt()["reclaims"] == [], nothing.stdout
            default = await cli("reclaim", "--version", "B", *conn)
            assert default.code == Exit.REJECTED == 4, default.stdout + default.stderr
            assert [(o["status"], o["reason"]) for o in default.receipt()["reclaims"]] == [
                ("REJECTED", "NOT_RECLAIMABLE")]

            # A probe that differs from the reference forward (the reference runs another base model): the
            # attempt is aborted and cleaned on both engines.
            other = other_base_model(fixtures.model_dir, tmp_path / "other-model")
            failed = await publish("C", "D", "--reference-model", str(other))
            assert failed.code == Exit.FAILED_CLEAN == 5, failed.stdout + failed.stderr
            assert failed.receipt()["status"] == "FAILED_CLEAN" and "PROBE_MISMATCH" in failed.receipt()["detail"]
            view = await d.registry.publication_view()
            assert view.versions[VersionKey(d.epoch, "D")].state is VersionState.FAILED_CLEAN
            assert view.managed_count() == 1 and view.default == VersionKey(d.epoch, "B")

            before = await d.registry.state_digest()
            missing = await cli("publish", str(tmp_path / "no-such-adapter"), "--version-id", "E", *conn)
            assert missing.code == Exit.ERROR == 1 and "SnapshotError" in missing.stderr, missing.stderr
            bad_id = await publish("C", "bad id")
            assert bad_id.code == Exit.ERROR and "InvalidIdentity" in bad_id.stderr, bad_id.stderr
            assert await d.registry.state_digest() == before  # refused before any call reached the registry

    run(body())
