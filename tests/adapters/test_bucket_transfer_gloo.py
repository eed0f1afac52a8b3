"""Real bucket transfers over gloo between this process (the publisher, rank 0) and receiver processes that
join like an SGLang engine does (tests/adapters/transfer_peer.py, SGLang's init_custom_process_group)."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from versioned_lora.adapters import transfer
from versioned_lora.adapters.manifest import manifest_from_tensors
from versioned_lora.adapters.snapshot import Snapshot, serving_config_from_peft, snapshot_from_adapter_dir
from versioned_lora.adapters.transfer import BucketPlan, init_transfer_group, send_all
from versioned_lora.fixtures import Fixtures

PEER = Path(__file__).with_name("transfer_peer.py")
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
PROCESS_TIMEOUT_S = 120


class Peer:
    """One receiver process and its work directory."""

    def __init__(self, workdir: Path, snapshot: Snapshot, plan: BucketPlan, name: str, *flags: str,
                 store: Any = None) -> None:
        workdir.mkdir(parents=True)
        (workdir / "manifest.json").write_text(snapshot.manifest.to_json())
        (workdir / "plan.json").write_text(plan.to_json())
        self.workdir, self.group_name, self.store = workdir, name, store
        self.port = transfer.free_port() if store is None else store.port
        cmd = [sys.executable, str(PEER), "--port", str(self.port), "--group-name", name, "--workdir", str(workdir)]
        self.proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def join(self) -> torch.distributed.ProcessGroup:
        """Rank 0 of this peer's private group; blocks until the peer joined."""
        return init_transfer_group(
            master_address="127.0.0.1",
            master_port=self.port,
            rank=0,
            group_name=self.group_name,
            timeout=GROUP_TIMEOUT,
            store=self.store,
        )

    def finish(self) -> dict:
        output, _ = self.proc.communicate(timeout=PROCESS_TIMEOUT_S)
        summary_path = self.workdir / "summary.json"
        assert summary_path.exists(), f"peer wrote no summary (rc={self.proc.returncode}):\n{output[-4000:]}"
        return {**json.loads(summary_path.read_text()), "returncode": self.proc.returncode, "output": output}

    def received(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.workdir / "received.safetensors"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.kill()


def assert_bit_exact(expected: Snapshot, received: dict[str, torch.Tensor]) -> None:
    assert list(received) == list(expected.tensors) or sorted(received) == sorted(expected.tensors)
    for name, tensor in expected.tensors.items():
        got = received[name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def mixed_dtype_snapshot() -> Snapshot:
    """bf16/fp16/fp32/int64 tensors, a 0-d tensor, odd byte counts: exercises alignment and dtype views."""
    gen = torch.Generator().manual_seed(7)
    prefix = "base_model.model.model.layers"
    tensors = {
        f"{prefix}.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 128, generator=gen).to(torch.bfloat16),
        f"{prefix}.0.self_attn.q_proj.lora_B.weight": torch.randn(128, 8, generator=gen).to(torch.bfloat16),
        f"{prefix}.0.self_attn.v_proj.lora_A.weight": torch.randn(8, 128, generator=gen).to(torch.float16),
        f"{prefix}.0.self_attn.v_proj.lora_B.weight": torch.randn(64, 8, generator=gen),
        f"{prefix}.1.self_attn.q_proj.lora_A.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        f"{prefix}.1.self_attn.q_proj.lora_B.weight": torch.randint(-(2**40), 2**40, (7,), generator=gen),
        f"{prefix}.1.self_attn.v_proj.lora_A.weight": torch.tensor(1.5, dtype=torch.float16),
    }
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "task_type": "CAUSAL_LM"}
    # Built without the snapshot builder, whose checks refuse int64 and 0-d tensors and ranks other than the
    # config's: this test is about the transfer's byte layout, alignment and dtype views, not about which
    # tensors a LoRA may hold (tests/adapters/test_snapshot_immutability.py covers the builder).
    frozen = {name: tensor.clone() for name, tensor in tensors.items()}
    return Snapshot(frozen, manifest_from_tensors(frozen, serving_config_from_peft(config, "tiny-qwen3")))


def test_single_receiver_gets_every_bucket_bit_exact_while_sender_is_held(
    fixtures: Fixtures, tmp_path: Path, peers: list[Peer]
) -> None:
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["A"])
    plan = BucketPlan.build(snapshot.manifest, max_bucket_bytes=8192)
    assert len(plan.buckets) >= 3
    peer = Peer(tmp_path / "e0", snapshot, plan, "vlora-test-e0", "--observe-pending-bucket", "1")
    peers.append(peer)
    group = peer.join()

    held: list[int] = []

    def hold_after_first_bucket(i: int) -> None:
        # The hook holds the sender after bucket 0 until the receiver has watched bucket 1 stay pending.
        held.append(i)
        if i == 0:
            deadline = time.monotonic() + 60
            while not (peer.workdir / "observed").exists():
                assert time.monotonic() < deadline, "receiver never observed the pending bucket"
                time.sleep(0.02)

    report = send_all([group], snapshot, plan, on_bucket_done=hold_after_first_bucket)
    transfer.destroy_transfer_group(group)
    summary = peer.finish()

    assert report.ok and report.buckets_done == (len(plan.buckets),), report
    assert held == list(range(len(plan.buckets)))
    assert summary["returncode"] == 0, summary["output"]
    assert summary["verified"] is True, summary.get("error")
    assert not any(summary["pending_polls"]), "bucket 1 completed while the sender was held"
    assert_bit_exact(snapshot, peer.received())


def test_a_receiver_joins_a_rank_zero_that_listened_first_on_a_port_the_kernel_chose(
    tmp_path: Path, peers: list[Peer]
) -> None:
    """The publisher's way (EngineLink.connect): rank 0's store listens before the engine is asked to join, so
    no other socket can take the port in between; the receiver joins over tcp:// as SGLang does."""
    store = transfer.listen_for_transfer_group("127.0.0.1", 2, GROUP_TIMEOUT)
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass  # already listening: nothing was asked to join yet
    snapshot = mixed_dtype_snapshot()
    plan = BucketPlan.build(snapshot.manifest, max_bucket_bytes=2100)
    peer = Peer(tmp_path / "e0", snapshot, plan, "vlora-test-listened", store=store)
    peers.append(peer)
    group = peer.join()
    report = send_all([group], snapshot, plan)
    transfer.destroy_transfer_group(group)
    summary = peer.finish()
    assert report.ok, report
    assert summary["returncode"] == 0 and summary["verified"] is True, summary["output"]
    assert_bit_exact(snapshot, peer.received())


def test_two_receivers_in_two_groups_both_reconstruct(tmp_path: Path, peers: list[Peer]) -> None:
    snapshot = mixed_dtype_snapshot()
    plan = BucketPlan.build(snapshot.manifest, max_bucket_bytes=2100)
    assert len(plan.buckets) >= 3
    for name in ("e0", "e1"):
        peers.append(Peer(tmp_path / name, snapshot, plan, f"vlora-test-two-{name}"))
    groups = [peer.join() for peer in peers]

    report = send_all(groups, snapshot, plan)
    for group in groups:
        transfer.destroy_transfer_group(group)

    assert report.ok and report.buckets_done == (len(plan.buckets),) * 2, report
    for peer in peers:
        summary = peer.finish()
        assert summary["returncode"] == 0, summary["output"]
        assert summary["verified"] is True, summary.get("error")
        assert_bit_exact(snapshot, peer.received())


def test_a_dead_receiver_does_not_break_the_other_groups_transfer(
    fixtures: Fixtures, tmp_path: Path, peers: list[Peer]
) -> None:
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["B"])
    plan = BucketPlan.build(snapshot.manifest, max_bucket_bytes=8192)
    survivor = Peer(tmp_path / "e0", snapshot, plan, "vlora-test-dead-e0")
    victim = Peer(tmp_path / "e1", snapshot, plan, "vlora-test-dead-e1", "--die-after-bucket", "0")
    peers.extend([survivor, victim])
    groups = [survivor.join(), victim.join()]

    def wait_for_victim_exit(i: int) -> None:
        if i == 0:
            victim.proc.wait(timeout=PROCESS_TIMEOUT_S)

    report = send_all(groups, snapshot, plan, on_bucket_done=wait_for_victim_exit)
    for group in groups:
        transfer.destroy_transfer_group(group)

    assert report.buckets_done == (len(plan.buckets), 1), report
    assert set(report.failures) == {1}
    with pytest.raises(transfer.BucketTransferFailed):
        report.raise_for_failures()
    assert victim.finish()["returncode"] == 3
    summary = survivor.finish()
    assert summary["verified"] is True, summary.get("error")
    assert_bit_exact(snapshot, survivor.received())


def test_receiver_abandons_a_stalled_bucket_at_its_deadline(
    fixtures: Fixtures, tmp_path: Path, peers: list[Peer]
) -> None:
    """The publisher stops after bucket 0; the receiver gives up on bucket 1 after its 1 s deadline and tears
    the group down, and the publisher's late sends then fail at once instead of hanging. The publisher joins
    with the library's no-SGLang path, which must interoperate with SGLang's function on the engine side.

    gloo keeps the abandoned receive's worker thread blocked until the group's own timeout, so the peer
    process only exits after that (5 s here): the engine must create its group with a short timeout."""
    snapshot = snapshot_from_adapter_dir(fixtures.adapters["C"])
    plan = BucketPlan.build(snapshot.manifest, max_bucket_bytes=8192)
    flags = ("--deadline-bucket", "1", "--deadline-s", "1.0", "--group-timeout-s", "5")
    peer = Peer(tmp_path / "e0", snapshot, plan, "vlora-test-deadline", *flags)
    peers.append(peer)
    group = transfer._init_custom_process_group_without_sglang(
        backend="gloo",
        init_method=transfer.tcp_init_method("127.0.0.1", peer.port),
        world_size=2,
        rank=0,
        group_name=peer.group_name,
        timeout=GROUP_TIMEOUT,
    )
    released_at: list[float] = []

    def stall_until_receiver_gave_up(i: int) -> None:
        if i == 0:
            deadline = time.monotonic() + PROCESS_TIMEOUT_S
            while not (peer.workdir / "summary.json").exists():
                assert time.monotonic() < deadline and peer.proc.poll() is None, "receiver never gave up"
                time.sleep(0.02)
            released_at.append(time.monotonic())

    report = send_all([group], snapshot, plan, on_bucket_done=stall_until_receiver_gave_up)
    late_send_s = time.monotonic() - released_at[0]
    transfer.destroy_transfer_group(group)
    summary = peer.finish()

    assert summary["returncode"] == 0, summary["output"]
    assert summary["deadline"] == "missed"
    assert 0.9 <= summary["deadline_elapsed_s"] < 3.0, summary
    assert summary["destroy_s"] < 1.0, summary
    # A gloo send completes once its bytes are in the socket, so the send of bucket 1 may still "succeed"
    # after the receiver gave up on it; the next one fails. Receipt is only proven by the receiver.
    assert 1 <= report.buckets_done[0] <= 2 and set(report.failures) == {0}, report
    # gloo words it "Connection closed by peer" or "Read error ... reset", depending on timing.
    assert isinstance(report.failures[0], transfer.BucketTransferFailed), report.failures[0]
    assert late_send_s < 5.0, f"the late send took {late_send_s:.1f} s instead of failing at once"
