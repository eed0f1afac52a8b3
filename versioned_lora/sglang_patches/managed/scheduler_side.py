"""The scheduler-process half of staging: transfer groups and per-attempt stashes.

The server calls the `StashStore` through the staging channel, served by a thread of its own
(`staging_channel`), never by the scheduler's event loop. A verified stash is loaded from its own
tensors: the managed load is SGLang's load-from-tensors request naming the stash instead of carrying
serialized tensors (`install`), so what was verified is exactly what the LoRA manager takes, with no
copy to disk and back.

Nothing here blocks on a peer: joining a group runs in a thread, and a bucket receive is an async collective
(``transfer.start_receive_bucket``) polled by the server. While a publisher is slow or dead, the
scheduler keeps scheduling and decoding; the server enforces the per-bucket deadline and, on a miss,
asks us to drop the group (which releases the pending receive). Stashes hold received bucket
buffers only; serving weights are never touched.

After a load, `read_back_served` reads the loaded adapter back from SGLang's LoRA memory pool (`served_readback`):
the served digest and config the engine's `end` answers with (issue 46, item 1). It only reads the pool.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from versioned_lora.adapters.manifest import Manifest, ManifestError
from versioned_lora.adapters.stash_verifier import StashVerifier
from versioned_lora.adapters.transfer import (
    BucketPlan,
    PendingBucket,
    destroy_transfer_group,
    init_transfer_group,
    received_tensors,
    start_receive_bucket,
)
from versioned_lora.sglang_patches.managed import served_readback, staging_channel
from versioned_lora.sglang_patches.mechanism import replace_attribute
from versioned_lora.spec.wire import VERIFY_MODE_ENV, VERIFY_MODES, EngineRefusal

logger = logging.getLogger(__name__)

PATCH_SET = "managed"
# `LoadLoRAAdapterFromTensorsReqInput.load_format` of a managed load: its one "serialized tensors" entry
# is the attempt token of a verified stash in this process (see `install`).
STASH_LOAD_FORMAT = "versioned_lora_stash"


class StashNotVerified(Exception):
    """A load named a stash that is absent or did not pass verification: nothing is loaded."""


@attrs.define
class Group:
    name: str
    pg: Any = None
    error: str | None = None
    thread: threading.Thread | None = None


@attrs.define
class Stash:
    plan: BucketPlan
    manifest: Manifest
    group: str
    # Hashes each bucket as it lands (on the hashing pool, or the GPU), so the verdict after the last
    # bucket waits only for that bucket's tensors.
    hashing: StashVerifier
    buffers: dict[int, Any] = attrs.field(factory=dict)  # bucket index -> its received bytes
    pending: dict[int, PendingBucket] = attrs.field(factory=dict)
    received: set[int] = attrs.field(factory=set)
    verifier: threading.Thread | None = None
    verdict: dict[str, Any] | None = None
    last_landed_at: float | None = None  # time.monotonic() when the last bucket landed: the verify tail's start

    @property
    def tensors(self) -> dict[str, Any]:
        """The received tensors, as views into the bucket buffers (made on demand: see PendingBucket)."""
        return received_tensors(self.plan, self.buffers)


class StashStore:
    """Everything staging keeps in the scheduler process, keyed by group name and attempt token."""

    def __init__(self, device: str, verify_mode: str = "pipelined") -> None:
        if verify_mode not in VERIFY_MODES:
            raise ValueError(f"{VERIFY_MODE_ENV}={verify_mode!r}: expected one of {VERIFY_MODES}")
        self.device = device
        self.verify_mode = verify_mode
        self.groups: dict[str, Group] = {}
        self.stashes: dict[str, Stash] = {}
        self.collectives = 0  # receives started: a duplicate receive must not add one
        self.abandoned: list[tuple[Group, list[PendingBucket]]] = []
        # The scheduler's LoRAManager (ModelRunner.lora_manager), once the scheduler is built (`install`).
        self.lora_manager: Callable[[], Any] | None = None

    # ---- groups
    def init_group(self, name: str, master_address: str, master_port: int, timeout_s: float) -> dict[str, Any]:
        self.drop_group(name)
        group = Group(name)

        def join() -> None:
            try:
                group.pg = init_transfer_group(
                    master_address=master_address, master_port=master_port, rank=1, group_name=name,
                    device=self.device, timeout=datetime.timedelta(seconds=timeout_s),
                )
            except Exception as exc:  # reported through poll_group
                group.error = f"{type(exc).__name__}: {exc}"

        group.thread = threading.Thread(target=join, name=f"vlora-join-{name}", daemon=True)
        group.thread.start()
        self.groups[name] = group
        return {"group": name}

    def poll_group(self, name: str) -> dict[str, Any]:
        group = self.groups.get(name)
        if group is None:
            return {"state": "ABSENT"}
        if group.error is not None:
            return {"state": "FAILED", "error": group.error}
        return {"state": "READY" if group.pg is not None else "JOINING"}

    def drop_group(self, name: str) -> dict[str, Any]:
        """Abandon a group (a missed deadline, a new group for this name). Never destroyed here while a
        receive is pending: ``destroy_process_group`` then waits inside gloo, holding the GIL, until the
        receive times out (measured: the group's whole timeout, during which decode stopped). The
        abandoned group is reaped once its pending receives have finished or timed out."""
        group = self.groups.pop(name, None)
        pending: list[PendingBucket] = []
        for stash in self.stashes.values():
            if stash.group == name:
                pending += stash.pending.values()
                stash.pending.clear()
        if group is not None and group.pg is not None:
            self.abandoned.append((group, pending))
        return {"dropped": group is not None}

    def reap(self) -> None:
        still: list[tuple[Group, list[PendingBucket]]] = []
        for group, pending in self.abandoned:
            if all(p.done() for p in pending):
                began = time.monotonic()
                destroy_transfer_group(group.pg)
                # The scheduler's decode shares this process's GIL: a slow teardown shows as a decode gap.
                if (spent := time.monotonic() - began) > 0.05:
                    logger.warning("versioned-lora: reaping abandoned transfer group %r took %.3fs", group.name,
                                   spent)
            else:
                still.append((group, pending))
        self.abandoned = still

    # ---- stashes
    def allocate(self, attempt: str, plan_json: str, manifest_json: str, group: str) -> dict[str, Any]:
        if attempt not in self.stashes:
            plan, manifest = BucketPlan.from_json(plan_json), Manifest.from_json(manifest_json)
            hashing = (StashVerifier(manifest, plan) if self.verify_mode == "pipelined"
                       else StashVerifier(manifest, plan, threads=1, pipelined=False))
            hashing.prepare(self.device)
            self.stashes[attempt] = Stash(plan, manifest, group, hashing)
        return {"buckets": len(self.stashes[attempt].plan.buckets)}

    def start_receive(self, attempt: str, index: int) -> dict[str, Any]:
        stash = self.stashes[attempt]
        if index in stash.received or index in stash.pending:
            return {"started": False}
        group = self.groups.get(stash.group)
        if group is None or group.pg is None:
            raise RuntimeError(f"no transfer group {stash.group!r} on this engine incarnation")
        stash.pending[index] = start_receive_bucket(group.pg, stash.plan, index, device=self.device)
        self.collectives += 1
        return {"started": True}

    def poll_receive(self, attempt: str, index: int) -> dict[str, Any]:
        stash = self.stashes[attempt]
        if index in stash.received:
            return {"state": "STASHED"}
        pending = stash.pending.get(index)
        if pending is None:
            return {"state": "NOT_STARTED"}
        if not pending.done():
            return {"state": "PENDING"}
        try:
            flat = pending.result(timeout=datetime.timedelta(seconds=1))
        except Exception as exc:
            stash.pending.pop(index, None)
            return {"state": "FAILED", "error": f"{type(exc).__name__}: {exc}"}
        stash.pending.pop(index, None)
        stash.buffers[index] = flat
        stash.received.add(index)
        stash.hashing.bucket_landed(index, flat)  # returns at once; its errors come back as the verdict
        if len(stash.received) == len(stash.plan.buckets):
            stash.last_landed_at = time.monotonic()
            # The last bucket is in: verify now, while the publisher's `end` is still on its way (the
            # digest checked is the manifest's, which `begin` matched against the declared one).
            self.start_verify(attempt, stash.manifest.digest)
        return {"state": "STASHED"}

    def start_verify(self, attempt: str, digest: str) -> dict[str, Any]:
        """Hashing a large adapter takes seconds: do it in a thread so decode goes on meanwhile."""
        stash = self.stashes[attempt]
        if stash.verdict is None and stash.verifier is None:
            stash.verifier = threading.Thread(
                target=lambda: setattr(stash, "verdict", self._verify(stash, digest)),
                name=f"vlora-verify-{attempt}", daemon=True,
            )
            stash.verifier.start()
        return {"started": True}

    def poll_verify(self, attempt: str) -> dict[str, Any]:
        stash = self.stashes[attempt]
        return {"state": "PENDING"} if stash.verdict is None else {"state": "DONE", **stash.verdict}

    def _verify(self, stash: Stash, digest: str) -> dict[str, Any]:
        """Check the received tensors, as they will be loaded, against the manifest fixed at begin: names,
        shapes, dtypes, per-tensor hashes (computed as each bucket landed), and that the manifest is the
        version reserved (`digest`)."""
        try:
            stash.hashing.finish(digest)
        except Exception as exc:  # whatever stops the check rejects the candidate (a verdict, never a hang)
            detail = str(exc) if isinstance(exc, ManifestError) else f"{type(exc).__name__}: {exc}"
            return {"ok": False, "detail": detail}
        # The tail: last bucket landed -> verified (what a pipelined verifier shortens; None for a verify
        # started before every bucket was in, which only a missing bucket's refusal does).
        landed = stash.last_landed_at
        return {"ok": True, "tail_s": None if landed is None else round(time.monotonic() - landed, 6)}

    def verified(self, attempt: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tensors and PEFT config of a stash that passed verification, for SGLang's LoRA manager.

        The tensors are views into the received buffers, which nothing writes once a bucket is stashed
        (a duplicate receive is refused); the LoRA manager keeps them after `free` drops the stash.
        Called on the scheduler's own thread (the load), beside the channel's: it only reads a stash whose
        buckets are all in and verified, which no call changes before `free`, and `free` follows the load."""
        stash = self.stashes.get(attempt)
        if stash is None or stash.verdict is None or not stash.verdict["ok"]:
            state = "absent" if stash is None else "not verified" if stash.verdict is None else "rejected"
            raise StashNotVerified(f"stash of attempt {attempt!r} is {state}")
        return stash.tensors, stash.manifest.adapter_config()

    def free(self, attempt: str) -> dict[str, Any]:
        return {"freed": self.stashes.pop(attempt, None) is not None}

    def read_back_served(self, lora_id: str, manifest_json: str) -> dict[str, Any]:
        """The served identity of loaded adapter `lora_id`, read from the LoRA memory pool's slot (see
        `served_readback`), or ``{"error": ...}`` saying why it could not be read. Runs on the channel's thread: it
        reads the slot of a pinned adapter, which nothing writes while it is loaded (a pinned uid is never evicted)."""
        try:
            if self.lora_manager is None:
                raise served_readback.ReadBackError("the scheduler has no LoRA manager yet")
            return served_readback.read_back(self.lora_manager(), lora_id, Manifest.from_json(manifest_json))
        except (served_readback.ReadBackError, ManifestError, KeyError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def status(self) -> dict[str, Any]:
        return {
            "collectives": self.collectives,
            "groups": {name: self.poll_group(name)["state"] for name in self.groups},
            "abandoned_groups": len(self.abandoned),
            "stashes": {
                attempt: {"received": sorted(s.received), "pending": sorted(s.pending), "group": s.group,
                          "bytes": sum(flat.numel() for flat in s.buffers.values())}
                for attempt, s in self.stashes.items()
            },
        }


_store: StashStore | None = None


def store() -> StashStore:
    global _store
    if _store is None:
        import torch

        _store = StashStore("cuda" if torch.cuda.is_available() else "cpu",
                            os.environ.get(VERIFY_MODE_ENV, "pipelined"))
    return _store


def install() -> None:
    """Scheduler role: once SGLang's Scheduler is built, serve the staging channel from a thread of its own
    (see `staging_channel` for why staging does not go through the scheduler's event loop)."""
    from sglang.srt.managers.scheduler import Scheduler

    stock_init = Scheduler.init_request_dispatcher

    def init_request_dispatcher(self: Any) -> None:
        # Scheduler.init_request_dispatcher runs once, in Scheduler.__init__, after the model and the
        # LoRA manager exist: a point every scheduler process passes exactly once.
        stock_init(self)
        scheduler = self
        # Scheduler.tp_worker.model_runner.lora_manager: the LoRAManager whose memory pool the kernels read.
        store().lora_manager = lambda: scheduler.tp_worker.model_runner.lora_manager
        _serve_channel()

    replace_attribute(PATCH_SET, Scheduler, "init_request_dispatcher", init_request_dispatcher,
                      why="start the versioned-lora staging channel in the scheduler process")

    from sglang.srt.managers.tp_worker import TpModelWorker

    stock_from_tensors = TpModelWorker.load_lora_adapter_from_tensors

    def load_lora_adapter_from_tensors(self: Any, recv_req: Any) -> Any:
        # TpModelWorker.load_lora_adapter_from_tensors deserializes the request's tensors and hands them
        # to ModelRunner.load_lora_adapter_from_tensors. A managed load names a verified stash of this
        # process instead; its tensors and config go to the same ModelRunner call. Anything else is stock.
        if recv_req.load_format != STASH_LOAD_FORMAT:
            return stock_from_tensors(self, recv_req)
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        try:
            tensors, config = store().verified(bytes(recv_req.serialized_named_tensors[0]).decode())
        except (StashNotVerified, IndexError, UnicodeDecodeError) as exc:
            return LoRAUpdateOutput(success=False, error_message=f"{EngineRefusal.STASH_NOT_VERIFIED}: {exc}")
        return self.model_runner.load_lora_adapter_from_tensors(recv_req.to_ref(), tensors, config, None)

    replace_attribute(PATCH_SET, TpModelWorker, "load_lora_adapter_from_tensors", load_lora_adapter_from_tensors,
                      why="load a managed candidate from its verified stash, not from serialized tensors")


def _serve_channel() -> None:
    from sglang.srt.runtime_context import get_device, get_server_args

    args = get_server_args()
    if (args.tp_size, args.pp_size, args.dp_size) != (1, 1, 1):
        # The transfer group has two ranks: the publisher and this engine's one scheduler.
        raise RuntimeError(
            f"versioned-lora staging needs one scheduler per engine (tp=pp=dp=1), got tp={args.tp_size} "
            f"pp={args.pp_size} dp={args.dp_size}"
        )

    def on_thread_start() -> None:
        import torch

        if torch.cuda.is_available():  # receive buffers on this scheduler's GPU, not on device 0
            torch.cuda.set_device(get_device().gpu_id)

    store()  # built now, so that a bad VERIFY_MODE_ENV stops the engine's start with its message
    staging_channel.serve(dispatch, on_thread_start)


def dispatch(method: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One staging call: reap abandoned groups whose receives have finished, then run the method."""
    if method.startswith("_") or method == "reap":
        raise AttributeError(f"no staging call {method!r}")
    store().reap()
    result: dict[str, Any] = getattr(store(), method)(**payload)
    return result
