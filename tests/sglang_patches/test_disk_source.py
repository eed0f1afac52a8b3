"""A managed begin staged from a PEFT directory (`DiskSource`) verifies that directory under its manifest's own
hash kind: a v2 manifest (every new publication's) and a v1 manifest are both accepted for the bytes they
describe, and altered bytes are refused under either. No engine: the engine's verify step is this call."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from versioned_lora.adapters.manifest import V2_HASH
from versioned_lora.adapters.snapshot import ADAPTER_WEIGHTS_FILE, snapshot_from_adapter_dir
from versioned_lora.sglang_patches.managed.staging import DiskSource, Verdict


def verify(path: Path, kind: str, source_dir: Path) -> Verdict:
    snapshot = snapshot_from_adapter_dir(path, hash_kind=kind)
    source = DiskSource(lora_name="relax_policy_lora@1-v-0", attempt_token="attempt", incarnation=0,
                        digest=snapshot.digest, manifest=snapshot.manifest, path=source_dir)  # fmt: skip

    async def run() -> Verdict:
        try:
            return await source.verify()
        finally:
            await source.free()

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["sha256", V2_HASH])
def test_a_directory_verifies_under_its_manifest_s_hash_kind(fixtures, kind: str) -> None:
    verdict = verify(fixtures.adapters["B"], kind, fixtures.adapters["B"])
    assert verdict == Verdict(True), verdict


@pytest.mark.parametrize("kind", ["sha256", V2_HASH])
def test_altered_bytes_in_the_directory_are_refused(fixtures, tmp_path: Path, kind: str) -> None:
    altered = tmp_path / "altered"
    shutil.copytree(fixtures.adapters["B"], altered)
    tensors = load_file(str(altered / ADAPTER_WEIGHTS_FILE))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(1.0, dtype=tensors[name].dtype)
    save_file(tensors, str(altered / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    verdict = verify(fixtures.adapters["B"], kind, altered)  # the manifest of B, the bytes of the altered copy
    assert not verdict.ok and "does not match the manifest" in verdict.detail and name in verdict.detail, verdict
