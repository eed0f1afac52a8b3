"""`StagingEnginePort` over one SGLang engine: the runtime Publisher's view of an engine, built on
`EngineLink` (transfer group + managed endpoints). Reconnects when the engine's incarnation changed,
since a group belongs to one incarnation. Maps the client's errors onto the runtime's: a lost reply
is `EngineUnreachable` (unknown outcome), a typed refusal is `EngineRefused`. Before its first `begin`, cleanup or
reclaim on an engine incarnation it compares the registry's key ids with the engine's (`KEY_MISMATCH`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import httpx

from versioned_lora.adapters.engine_link import Candidate, EngineLink
from versioned_lora.adapters.sglang_client import ManagedRefusal, SGLangClient, UnknownOutcome
from versioned_lora.adapters.transfer import BucketTransferFailed
from versioned_lora.runtime.interfaces import EngineRefused, EngineUnreachable, ReadyReceipt, ServedIdentity
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import AdapterState
from versioned_lora.spec.wire import KEY_MISMATCH, PROTOCOL_MISMATCH, PROTOCOL_VERSION

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
        self._registry_key_ids: tuple[str, ...] | None = None  # None: no registry answer seen yet
        self._key_checked: tuple[int, tuple[str, ...]] | None = None  # (incarnation, registry key ids) that matched

    def expect_registry_keys(self, key_ids: tuple[str, ...]) -> None:
        self._registry_key_ids = tuple(key_ids)

    def _check_key(self, status: dict[str, Any]) -> None:
        """One key per deployment (issue 41): the engine must accept a key the registry signs under, else nothing
        the registry orders there can be carried out (a cleanup or reclaim would be refused 403, a stash would keep
        its slot). Refused here, typed, before the call is sent; both ids named, never a key."""
        incarnation = int(status["incarnation"])
        registry = self._registry_key_ids
        protocol = status.get("protocol")
        advertised = protocol.get("key_ids") if isinstance(protocol, dict) else None
        engine = tuple(str(i) for i in advertised) if isinstance(advertised, list) else ()
        if registry is not None and set(registry) & set(engine):
            self._key_checked = (incarnation, registry)
            return
        said = "none (a registry built insecure)" if registry == () else (
            "unknown (no registry answer yet)" if registry is None else ", ".join(registry))
        raise EngineRefused(KEY_MISMATCH, f"engine {self.name} (incarnation {incarnation}) accepts capability key ids "
                            f"{', '.join(engine) or 'none'}; the registry signs under {said}: the registry and the "
                            f"engines must be given the same key file (docs/runbook.md, 'KEY_MISMATCH')")

    async def _require_same_key(self, incarnation: int | None = None) -> None:
        """Before a call to an engine incarnation: compare the keys, unless this incarnation was already checked
        against the registry's current key ids (a `begin` on the link in hand costs no status round trip)."""
        if incarnation is not None and self._key_checked == (incarnation, self._registry_key_ids):
            return
        self._check_key(await self._call(self.client.status()))

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
        await self._require_same_key(link.incarnation)
        try:
            await self._call(link.begin(candidate, attempt_token, bucket_deadline_s=self.bucket_deadline_s))
            return
        except (EngineRefused, EngineUnreachable) as failure:
            if isinstance(failure, EngineRefused) and failure.reason != Reason.STALE_INCARNATION:
                raise
            fresh = await self.link()
            if fresh is link:  # same incarnation: not a restart, so the failure is the attempt's
                raise
        await self._require_same_key(fresh.incarnation)
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
        served, served_error = _served(answer["adapter"].get("served"))
        return ReadyReceipt(
            result["lora_name"],
            result["digest"],
            result["attempt_token"],
            int(result["incarnation"]),
            int(probe["token_id"]),
            float(probe["logprob"]),
            tuple(float(x) for x in probe["scores"]),
            served,
            served_error,
        )

    async def cleanup(self, lora_name: str, attempt_token: str, capability: str | None = None) -> None:
        signed: dict[str, Any] = {} if capability is None else {"capability": capability}
        await self._require_same_key()  # a cleanup names no incarnation: the engine's own status says which it is
        try:
            await self._call(
                self.client.managed("cleanup", lora_name=lora_name, attempt_token=attempt_token, **signed)
            )
        except EngineRefused as refused:
            if refused.reason != Reason.STALE_ATTEMPT:  # the engine holds another attempt: nothing of ours left
                raise

    async def reclaim(self, lora_name: str, reclaim_id: str, wait_s: float, capability: str | None = None) -> bool:
        signed: dict[str, Any] = {} if capability is None else {"capability": capability}
        await self._require_same_key()
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


def _served(raw: Any) -> tuple[ServedIdentity | None, str]:
    """The engine's read-back of its LoRA pool, as the receipt carries it: the identity, or None and why (the engine
    said it could not read back, or answered without one: an engine that predates the read-back)."""
    if not isinstance(raw, dict):
        return None, "the engine's `end` answer carries no served digest"
    if "error" in raw:
        return None, str(raw["error"])
    try:
        return ServedIdentity(str(raw["dtype"]), str(raw["digest"]), str(raw["config"])), ""
    except KeyError as exc:
        return None, f"the engine's served answer lacks {exc}"


def staging_ports(
    clients: dict[str, SGLangClient], probe_input_ids: Sequence[int], **kwargs: Any
) -> dict[str, EngineStaging]:
    return {name: EngineStaging(name, client, probe_input_ids, **kwargs) for name, client in clients.items()}
