"""`StagingEnginePort` over one SGLang engine: the runtime Publisher's view of an engine, built on
`EngineLink` (transfer group + managed endpoints). Reconnects when the engine's incarnation changed,
since a group belongs to one incarnation. Maps the client's errors onto the runtime's: a lost reply
is `EngineUnreachable` (unknown outcome), a typed refusal is `EngineRefused`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import httpx

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.sglang_client import ManagedRefusal, SGLangClient, UnknownOutcome
from versioned_lora.adapters.transfer import BucketTransferFailed
from versioned_lora.runtime.interfaces import EngineRefused, EngineUnreachable, ReadyReceipt
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import AdapterState
from versioned_lora.spec.wire import PROTOCOL_MISMATCH, PROTOCOL_VERSION

T = TypeVar("T")


class EngineStaging:
    def __init__(
        self,
        name: str,
        client: SGLangClient,
        probe_input_ids: Sequence[int],
        bucket_deadline_s: float = 30.0,
        device: str = "cpu",
    ) -> None:
        self.name = name
        self.device = device  # where the publisher's buckets live: "cpu" (gloo) or a CUDA device (NCCL)
        self.client = client
        self.probe_input_ids = list(probe_input_ids)
        self.bucket_deadline_s = bucket_deadline_s
        self._link: EngineLink | None = None
        self._lock = asyncio.Lock()

    async def incarnation(self) -> int:
        status = await self._call(self.client.status())
        return int(status["incarnation"])

    async def link(self) -> EngineLink:
        """The transfer link to the engine's current incarnation. A new incarnation is first asked which
        protocol it speaks: one of another version is refused here (`PROTOCOL_MISMATCH`), before any `begin`
        reaches it."""
        async with self._lock:
            status = await self._call(self.client.status())
            current = int(status["incarnation"])
            if self._link is None or self._link.incarnation != current:
                protocol = status.get("protocol")
                speaks = protocol.get("version") if isinstance(protocol, dict) else None
                if speaks != PROTOCOL_VERSION:
                    raise EngineRefused(PROTOCOL_MISMATCH, f"engine {self.name} (incarnation {current}) speaks "
                                        f"managed protocol {speaks!r}, this publisher {PROTOCOL_VERSION}")
                if self._link is not None:
                    self._link.close()
                self._link = await self._call(EngineLink.connect(self.client, device=self.device))
            return self._link

    async def begin(self, candidate: Candidate, attempt_token: str) -> None:
        """`begin` over the link in hand, without asking the engine for its incarnation first (a status
        round trip that cost a loaded engine as much as a bucket). The begin carries the link's
        incarnation; an engine that restarted since refuses it (STALE_INCARNATION, nothing changed) or is
        gone (unreachable): then the link is rebuilt for the current incarnation and `begin` sent once more
        (a replayed begin is answered by the table). Any other outcome is the attempt's."""
        link = self._link or await self.link()
        try:
            await self._call(link.begin(candidate, attempt_token, bucket_deadline_s=self.bucket_deadline_s))
            return
        except (EngineRefused, EngineUnreachable) as failure:
            if isinstance(failure, EngineRefused) and failure.reason != Reason.STALE_INCARNATION:
                raise
            fresh = await self.link()
            if fresh is link:  # same incarnation: not a restart, so the failure is the attempt's
                raise
        await self._call(fresh.begin(candidate, attempt_token, bucket_deadline_s=self.bucket_deadline_s))

    async def _attempt_link(self) -> EngineLink:
        """The link the attempt's `begin` used, without asking the engine for its incarnation again. A
        restart since `begin` still fails the attempt: the calls carry the old incarnation, which the new
        process refuses (or the old one is gone)."""
        return self._link if self._link is not None else await self.link()

    async def transfer_bucket(self, candidate: Candidate, attempt_token: str, index: int) -> None:
        link = await self._attempt_link()
        await self._call(link.transfer_bucket(candidate, attempt_token, index))

    async def end(self, candidate: Candidate, attempt_token: str) -> ReadyReceipt:
        link = await self._attempt_link()
        answer = await self._call(link.end(candidate, attempt_token, self.probe_input_ids))
        result, probe = answer["result"], answer["adapter"]["probe"]
        return ReadyReceipt(
            result["lora_name"],
            result["digest"],
            result["attempt_token"],
            int(result["incarnation"]),
            int(probe["token_id"]),
            float(probe["logprob"]),
        )

    async def cleanup(self, lora_name: str, attempt_token: str, capability: str | None = None) -> None:
        signed: dict[str, Any] = {} if capability is None else {"capability": capability}
        try:
            await self._call(
                self.client.managed("cleanup", lora_name=lora_name, attempt_token=attempt_token, **signed)
            )
        except EngineRefused as refused:
            if refused.reason != Reason.STALE_ATTEMPT:  # the engine holds another attempt: nothing of ours left
                raise

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float, capability: str | None = None) -> bool:
        signed: dict[str, Any] = {} if capability is None else {"capability": capability}
        answer = await self._call(
            self.client.managed(
                "reclaim", lora_name=lora_name, reclaim_id=reclaim_id, wait_s=wait_s, http_timeout_s=wait_s + 60,
                **signed,
            )
        )
        return bool(answer["adapter"]["state"] == AdapterState.UNLOADED)

    def drop_link(self) -> None:
        """Row bucket.lost/bucket.deadline: the send thread may still be inside the group's collective, which
        gloo and NCCL cannot cancel, so the group is poisoned; `begin` of the next attempt joins a new one."""
        self.close()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    async def _call(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except ManagedRefusal as exc:
            if exc.status_code in (409, 400, 401, 403, 413):  # a typed refusal: nothing changed there
                raise EngineRefused(exc.reason, str(exc)) from exc
            raise EngineUnreachable(str(exc)) from exc
        except (UnknownOutcome, httpx.HTTPError, OSError, BucketTransferFailed) as exc:
            # A failed collective: whether the engine stashed the bucket is not known here.
            raise EngineUnreachable(f"{self.name}: {exc}") from exc


def staging_ports(
    clients: dict[str, SGLangClient], probe_input_ids: Sequence[int], **kwargs: Any
) -> dict[str, EngineStaging]:
    return {name: EngineStaging(name, client, probe_input_ids, **kwargs) for name, client in clients.items()}
