"""The snapshot store: real safetensors files on disk, written once by digest and verified on every read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from versioned_lora.adapters.manifest import HASH_SHA256, PUBLISHED_HASH_KIND
from versioned_lora.adapters.snapshot import ADAPTER_WEIGHTS_FILE, MANIFEST_FILE, Snapshot, snapshot_from_adapter_dir
from versioned_lora.adapters.snapshot_store import SnapshotCorrupt, SnapshotMissing, SnapshotStore
from versioned_lora.fixtures import Fixtures


def adapter(fixtures: Fixtures, label: str, hash_kind: str = PUBLISHED_HASH_KIND) -> Snapshot:
    return snapshot_from_adapter_dir(fixtures.adapters[label], hash_kind=hash_kind)


def assert_same(read: Snapshot, written: Snapshot) -> None:
    assert read.manifest.to_json_bytes() == written.manifest.to_json_bytes()
    assert list(read.tensors) == list(written.tensors)
    for name, tensor in written.tensors.items():
        got = read.tensors[name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("hash_kind", [PUBLISHED_HASH_KIND, HASH_SHA256], ids=["v2", "v1"])
def test_a_snapshot_reads_back_bit_exact_under_the_manifest_it_was_published_with(
    fixtures: Fixtures, tmp_path: Path, hash_kind: str
) -> None:
    store = SnapshotStore(tmp_path / "store")
    written = adapter(fixtures, "A", hash_kind)
    assert not store.holds(written.digest)
    store.put(written)
    assert store.holds(written.digest) and store.digests() == {written.digest}
    read = store.get(written.digest)
    assert read.manifest.hash_kind == hash_kind  # a v1 version is read back as v1: the same digest
    assert_same(read, written)


def test_writing_a_digest_again_changes_nothing(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    written = adapter(fixtures, "A")
    path = store.put(written)
    weights = (path / ADAPTER_WEIGHTS_FILE).stat()
    assert store.put(adapter(fixtures, "A")) == path
    after = (path / ADAPTER_WEIGHTS_FILE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)


def test_a_candidate_from_the_store_is_the_version_as_published(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", max_bucket_bytes=8192)
    written = adapter(fixtures, "B")
    store.put(written)
    candidate = store.candidate(written.digest, "relax_policy_lora@1-B-abc")
    assert (candidate.lora_name, candidate.digest, candidate.max_bucket_bytes) == (
        "relax_policy_lora@1-B-abc", written.digest, 8192)
    assert candidate.bucket_count >= 2
    assert_same(candidate.snapshot, written)


def test_a_byte_changed_on_disk_is_refused_on_read(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    written = adapter(fixtures, "A")
    weights = store.put(written) / ADAPTER_WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte: the file still parses, the hash differs
    weights.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="ManifestMismatch"):
        store.get(written.digest)


def test_a_truncated_file_is_refused_on_read(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    written = adapter(fixtures, "A")
    weights = store.put(written) / ADAPTER_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SnapshotCorrupt):
        store.get(written.digest)


def test_an_entry_holding_another_versions_manifest_is_refused(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    a, b = adapter(fixtures, "A"), adapter(fixtures, "B")
    store.put(a)
    store.put(b)
    (store.path(a.digest) / MANIFEST_FILE).write_bytes(b.manifest.to_json_bytes())
    with pytest.raises(SnapshotCorrupt, match="digest"):
        store.get(a.digest)


def test_a_digest_never_written_is_missing_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(SnapshotMissing):
        store.get("0" * 64)
    for bad in ("../etc", "A" * 64, "0" * 63, ""):
        with pytest.raises(ValueError, match="not a snapshot digest"):
            store.get(bad)


def test_retain_removes_exactly_the_digests_not_named(fixtures: Fixtures, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    a, b = adapter(fixtures, "A"), adapter(fixtures, "B")
    store.put(a)
    store.put(b)
    assert store.retain([b.digest]) == [a.digest]
    assert store.digests() == {b.digest}
    assert_same(store.get(b.digest), b)
