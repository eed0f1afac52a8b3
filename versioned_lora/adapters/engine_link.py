"""The publisher's side of one engine: its transfer group and the staged-publication calls.

One `EngineLink` per engine incarnation: it owns the two-rank torch.distributed group (rank 0 here,
rank 1 in the engine's scheduler) and speaks the managed endpoints through `SGLangClient`. A bucket
is sent and confirmed together: the engine's ``receive_bucket`` answers only once the bucket is in
its stash, so a completed local send is never mistaken for delivery.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from versioned_lora.adapters.served import DEFAULT_SERVED_DTYPE, expected_served_config, served_record
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot
from versioned_lora.adapters.transfer import (
    BucketPlan,
    BucketTransferFailed,
    destroy_transfer_group,
    init_transfer_group,
    listen_for_transfer_group,
    pack_bucket,
    packed_buckets,
    send_bucket,
)
from versioned_lora.runtime.interfaces import ServedIdentity
from versioned_lora.spec.wire import transfer_group_name


@attrs.frozen
class Candidate:
    """One version as the publisher ships it: name, frozen snapshot, bucket plan."""

    lora_name: str
    snapshot: Snapshot
    plan: BucketPlan
    max_bucket_bytes: int

    @classmethod
    def build(cls, lora_name: str, snapshot: Snapshot, max_bucket_bytes: int) -> Candidate:
        return cls(lora_name, snapshot, BucketPlan.build(snapshot.manifest, max_bucket_bytes), max_bucket_bytes)

    @property
    def digest(self) -> str:
        return self.snapshot.digest

    @property
    def bucket_count(self) -> int:
        return len(self.plan.buckets)

    def served_identity(self) -> ServedIdentity:
        """The snapshot as an engine must serve it: its manifest's served record, and the config the manifest means
        (adapters/served.py). A manifest without a record (v1, or a v2 version published before records existed) has
        it computed from the snapshot's tensors, in the default pool dtype, under the manifest's own hash kind (the
        one the engine hashes its read-back with)."""
        manifest = self.snapshot.manifest
        record = manifest.served or served_record(self.snapshot.tensors, DEFAULT_SERVED_DTYPE, manifest.hash_kind,
                                                  known={t.name: t.sha256 for t in manifest.tensors})
        return ServedIdentity(record.dtype, record.digest, expected_served_config(manifest.serving_config))


class EngineLink:
    def __init__(
        self, client: SGLangClient, incarnation: int, group: Any, group_name: str, device: str = "cpu"
    ) -> None:
        self.client = client
        self.incarnation = incarnation
        self.group = group
        self.group_name = group_name
        self.device = device
        # A group's collectives pair up by their order on each side, and the engine posts a bucket's receive
        # when its `receive_bucket` request is handled. Two buckets in flight on one group (two attempts staged
        # at once on this engine: rehydrates after a restart, a publication beside them) could be posted there
        # in the other order than sent here; gloo then receives one bucket's bytes into a buffer sized for
        # another and aborts the engine process (`gloo::EnforceNotMet`, "Received data size doesn't match
        # expected size", seen in CI at b9822d6). So one bucket at a time per group.
        self._one_bucket = asyncio.Lock()
        # Why the group may be out of step (a send started whose receive was refused or lost): no later bucket
        # goes over it. The driver drops the link on such a bucket (rows bucket.refused/lost/deadline); this
        # closes the window between the failure and that drop, in which another attempt's bucket could go.
        self.poisoned: str | None = None

    @classmethod
    async def connect(
        cls, client: SGLangClient, master_address: str = "127.0.0.1", timeout_s: float = 120.0, device: str = "cpu"
    ) -> EngineLink:
        """Form this engine's transfer group for its current incarnation (both ranks join at once).

        `device` is where this side's buckets live, and picks the backend: "cpu" joins with gloo, a CUDA
        device with NCCL. It must match the engine's side, which uses NCCL whenever its scheduler sees a GPU."""
        incarnation = int((await client.status())["incarnation"])
        group_name = transfer_group_name(incarnation, uuid.uuid4().hex[:8])
        timeout = datetime.timedelta(seconds=timeout_s)
        store = await asyncio.to_thread(listen_for_transfer_group, master_address, 2, timeout)
        publisher_side = asyncio.ensure_future(asyncio.to_thread(
            init_transfer_group, master_address=master_address, master_port=store.port, rank=0,
            group_name=group_name, device=device, timeout=timeout, store=store,
        ))
        engine_side = asyncio.ensure_future(client.managed(
            "init_group", group_name=group_name, master_address=master_address, master_port=store.port,
            timeout_s=timeout_s, http_timeout_s=timeout_s + 30,
        ))
        try:
            # Whichever side fails first ends the join at once: the other would only wait out its timeout.
            await asyncio.wait((publisher_side, engine_side), return_when=asyncio.FIRST_EXCEPTION)
            for side in (publisher_side, engine_side):
                if side.done() and (failure := side.exception()) is not None:
                    raise failure
            group = publisher_side.result()
        except BaseException:
            engine_side.cancel()
            publisher_side.cancel()  # a thread still joining ends at its own timeout; its group is never used
            if publisher_side.done() and not publisher_side.cancelled() and publisher_side.exception() is None:
                destroy_transfer_group(publisher_side.result())
            raise
        return cls(client, incarnation, group, group_name, device)

    def _identity(self, candidate: Candidate, attempt_token: str) -> dict[str, Any]:
        return {"lora_name": candidate.lora_name, "attempt_token": attempt_token, "incarnation": self.incarnation}

    async def begin(self, candidate: Candidate, attempt_token: str, bucket_deadline_s: float = 30.0) -> dict[str, Any]:
        return await self.client.managed(
            "begin",
            **self._identity(candidate, attempt_token),
            digest=candidate.snapshot.digest,
            manifest=candidate.snapshot.manifest.to_json(),
            group_name=self.group_name,
            max_bucket_bytes=candidate.max_bucket_bytes,
            plan_digest=candidate.plan.digest(),
            bucket_deadline_s=bucket_deadline_s,
        )

    async def transfer_bucket(
        self, candidate: Candidate, attempt_token: str, index: int, tensors: Any = None, http_timeout_s: float = 120.0
    ) -> dict[str, Any]:
        """Send bucket `index` and return the engine's confirmation that it is stashed.

        `tensors` overrides what is packed (tests use it to send altered bytes under a fixed manifest).
        Otherwise the snapshot's packed buckets are used (`packed_buckets`: packed once on this link's device,
        then shared by every engine and retry that sends the same snapshot).
        """
        # Packing copies the whole snapshot (hundreds of MB at real sizes): on a thread, so the caller's event loop
        # (a trainer's, or a rollout client's in the same process) keeps running meanwhile.
        if tensors is None:
            buckets = await asyncio.to_thread(packed_buckets, candidate.snapshot, candidate.plan, self.device)
            flat = buckets[index]
        else:
            flat = await asyncio.to_thread(pack_bucket, tensors, candidate.plan, index, self.device, check=False)
        async with self._one_bucket:
            if self.poisoned is not None:
                raise BucketTransferFailed(f"group {self.group_name} is out of step ({self.poisoned}): not used again")
            confirm = asyncio.create_task(
                self.client.managed(
                    "receive_bucket",
                    **self._identity(candidate, attempt_token),
                    index=index,
                    http_timeout_s=http_timeout_s,
                )
            )
            send = asyncio.create_task(asyncio.to_thread(send_bucket, self.group, flat))
            try:
                answer = await confirm
                await send
            except BaseException as failure:
                # Refused, lost, or the send itself failed: the send may still wait in the group for a receive
                # the engine never posted, so the group is out of step. The send's own failure (a peer gone, a
                # dropped group) is not the news, and must not surface later as an exception nobody retrieved.
                self.poisoned = f"bucket {index} of {attempt_token}: {type(failure).__name__}"
                send.add_done_callback(lambda task: task.cancelled() or task.exception())
                raise
        return answer

    async def receive_bucket_again(self, candidate: Candidate, attempt_token: str, index: int) -> dict[str, Any]:
        """A duplicate receive (a retried request): must answer without a second collective."""
        return await self.client.managed("receive_bucket", **self._identity(candidate, attempt_token), index=index)

    async def end(self, candidate: Candidate, attempt_token: str, probe_input_ids: Sequence[int]) -> dict[str, Any]:
        return await self.client.managed(
            "end",
            **self._identity(candidate, attempt_token),
            probe_input_ids=list(probe_input_ids),
            http_timeout_s=600,
        )

    async def cleanup(self, lora_name: str, attempt_token: str) -> dict[str, Any]:
        return await self.client.managed("cleanup", lora_name=lora_name, attempt_token=attempt_token)

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        return await self.client.managed(
            "reclaim", lora_name=lora_name, reclaim_id=reclaim_id, wait_s=wait_s, http_timeout_s=wait_s + 60
        )

    def close(self) -> None:
        if self.group is not None:
            destroy_transfer_group(self.group)
            self.group = None
