"""The engine side of a bucket transfer, run as its own process by test_bucket_transfer_gloo.py.

It joins the two-rank group exactly as SGLang's `/init_weights_update_group` does (rank 1, SGLang's
`init_custom_process_group` on a `tcp://` address built by `NetworkAddress.to_tcp`), then receives the
buckets with the library's receiver half, verifies them against the manifest and writes them out for the
test to compare bit for bit. Flags inject the behaviours the tests need: hold, die, deadline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from safetensors.torch import save_file
from sglang.srt.utils.common import init_custom_process_group
from sglang.srt.utils.network import NetworkAddress

from versioned_lora.adapters.manifest import Manifest, ManifestError, verify_tensors
from versioned_lora.adapters.transfer import (
    BucketPlan,
    BucketTransferFailed,
    destroy_transfer_group,
    received_tensors,
    start_receive_bucket,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--group-name", required=True)
    parser.add_argument("--workdir", type=Path, required=True, help="holds manifest.json and plan.json; gets results")
    parser.add_argument("--group-timeout-s", type=float, default=60.0)
    parser.add_argument("--observe-pending-bucket", type=int, default=-1, help="poll this bucket while held")
    parser.add_argument("--die-after-bucket", type=int, default=-1)
    parser.add_argument("--deadline-bucket", type=int, default=-1, help="give up on this bucket after --deadline-s")
    parser.add_argument("--deadline-s", type=float, default=1.0)
    args = parser.parse_args()

    manifest = Manifest.from_json((args.workdir / "manifest.json").read_bytes())
    plan = BucketPlan.from_json((args.workdir / "plan.json").read_bytes())
    plan.check_describes(manifest)
    summary: dict[str, object] = {"pid": os.getpid()}

    group = init_custom_process_group(
        backend="gloo",
        init_method=NetworkAddress("127.0.0.1", args.port).to_tcp(),
        world_size=2,
        rank=1,
        group_name=args.group_name,
        timeout=datetime.timedelta(seconds=args.group_timeout_s),
    )
    buffers: dict = {}
    for i in range(len(plan.buckets)):
        pending = start_receive_bucket(group, plan, i, device="cpu")
        if i == args.observe_pending_bucket:
            # The sender is held after bucket i-1: the receive must stay pending while this process keeps
            # running (a scheduler would keep decoding here), and only then is the sender released.
            polls = []
            for _ in range(10):
                polls.append(pending.done())
                time.sleep(0.05)
            summary["pending_polls"] = polls
            (args.workdir / "observed").write_text("ok")
        if i == args.deadline_bucket:
            start = time.monotonic()
            try:
                pending.result(timeout=datetime.timedelta(seconds=args.deadline_s))
                summary["deadline"] = "bucket arrived"
            except BucketTransferFailed as exc:
                summary["deadline"] = "missed"
                summary["deadline_error"] = str(exc)
            summary["deadline_elapsed_s"] = time.monotonic() - start
            start = time.monotonic()
            destroy_transfer_group(group)  # abandons the pending receive
            summary["destroy_s"] = time.monotonic() - start
            summary["buckets_received"] = i
            (args.workdir / "summary.json").write_text(json.dumps(summary))
            return 0
        buffers[i] = pending.result()
        if i == args.die_after_bucket:
            (args.workdir / "summary.json").write_text(json.dumps({**summary, "died_after": i}))
            os._exit(3)  # like a crash: no cleanup, the socket just closes

    stash = received_tensors(plan, buffers)
    try:
        verify_tensors(manifest, stash, expected_digest=manifest.digest)
        summary["verified"] = True
    except ManifestError as exc:
        summary["verified"] = False
        summary["error"] = str(exc)
    save_file(stash, str(args.workdir / "received.safetensors"))
    summary["buckets_received"] = len(plan.buckets)
    (args.workdir / "summary.json").write_text(json.dumps(summary))
    destroy_transfer_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
