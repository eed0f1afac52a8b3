"""The engine side of the protocol inside SGLang's server process.

`ManagedEngine` owns this engine's managed-adapter state — a value of the spec table's engine-side
machine (`lifecycle.engine_step`) — and carries out the effects each step answers against SGLang's
`TokenizerManager`: load pinned, unregister, `wait_for_unload`, physical unload, stash handling.
No state changes here except through `engine_step`; this module only performs I/O.

Everything runs on the server's single asyncio loop. A step is synchronous, so reading the state
and stepping it cannot interleave with another coroutine; the awaits happen only while carrying out
effects, and each effect is idempotent per attempt token or reclaim id.

What SGLang does with an effect that can fail is not decided here (issue 41): a load reports `LoadDone` or
`LoadFailed`, a physical unload `UnloadDone` or `UnloadFailed`, as inputs of the table, and the row each fires
says what follows (its effects run next, in the row's order). Every effect of a row runs, whatever an earlier one
did; a call is answered with the first refusal among the rows it fired, else the last row's result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import attrs

from versioned_lora.adapters.manifest import Manifest
from versioned_lora.lifecycle import engine_step, initial_engine_state
from versioned_lora.lifecycle.effects import (
    AllocateStash,
    AwaitUnload,
    EngineEffect,
    FreeStash,
    LoadPinned,
    PhysicalUnload,
    StashBucket,
    Unregister,
)
from versioned_lora.lifecycle.results import Rejected
from versioned_lora.sglang_patches.managed import audit, faults, hold_points, staging_channel
from versioned_lora.sglang_patches.managed.staging import StagingSource, StockLoads
from versioned_lora.spec.events import (
    AcquireRequest,
    BeginStaging,
    CleanupAttempt,
    EndStaging,
    EngineEvent,
    FinishUnload,
    LoadDone,
    LoadFailed,
    ReceiveBucket,
    ReclaimAdapter,
    ReleaseRequest,
    UnloadDone,
    UnloadFailed,
)
from versioned_lora.spec.model import SLOT_HOLDING_ADAPTER_STATES, ManagedAdapter
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import AdapterState
from versioned_lora.spec.wire import EngineRefusal

logger = logging.getLogger(__name__)

# The engine-side machine names its engine; inside one SGLang process there is only itself.
SELF = "self"


class ProtocolRefusal(Exception):
    """An expected refusal from the table (a `Rejected` result), returned to the caller as a typed
    error; nothing changed."""

    def __init__(self, rejected: Rejected, detail: str = "") -> None:
        super().__init__(f"{rejected.reason}: {detail or rejected.row}")
        self.rejected = rejected


class CandidateRefused(Exception):
    """The engine refused a candidate it had loaded (its probe came back non-finite) and cleaned it again;
    typed for the caller (`code`)."""

    def __init__(self, code: EngineRefusal, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@attrs.define
class LoadedInstance:
    lora_id: str
    loaded_at: float
    probe: dict[str, Any] | None = None
    # What the scheduler read back from its LoRA memory pool after the probe (`scheduler_side.read_back_served`):
    # dtype, served digest, config; or {"error": ...}. The publisher decides on it, never this engine.
    served: dict[str, Any] | None = None
    # Where the `end` that loaded it spent its time (seconds): `verify_wait_s` waiting for the verdict,
    # `verify_tail_s` the scheduler's last bucket landed -> verified, `load_s`, `probe_s`, `served_s` (the read-back).
    # Diagnostics for the status view and benchmarks/end_phase.py; nothing decides on them.
    end_parts: dict[str, float | None] = attrs.field(factory=dict)


class ManagedEngine:
    def __init__(self, tokenizer_manager: Any, incarnation: int, stock_loads: StockLoads) -> None:
        self.tm = tokenizer_manager
        self.incarnation = incarnation
        self.state = initial_engine_state(SELF, incarnation)
        self._stock_loads = stock_loads  # SGLang's loads as they were before our guards
        self.loaded: dict[str, LoadedInstance] = {}
        self.names_by_lora_id: dict[str, str] = {}
        self.sources: dict[tuple[str, str], StagingSource] = {}
        self._reclaims: dict[str, asyncio.Task[None]] = {}
        self.reclaim_receipts: dict[str, dict[str, Any]] = {}
        # What SGLang said when a load or a physical unload failed (the refusal's message, the status view).
        self.errors: dict[str, str] = {}

    # ---------------------------------------------------------------- the only state change
    def step(self, event: EngineEvent) -> tuple[Any, tuple[EngineEffect, ...]]:
        self.state, result, effects = engine_step(self.state, event)
        return result, tuple(effects)

    def step_or_refuse(self, event: EngineEvent) -> tuple[Any, tuple[EngineEffect, ...]]:
        result, effects = self.step(event)
        if isinstance(result, Rejected):
            raise ProtocolRefusal(result)
        return result, effects

    def adapter(self, name: str) -> ManagedAdapter | None:
        return self.state.adapters.get(name)

    def unavailable_state(self, name: str) -> str | None:
        """None if the table would let a request acquire `name` now, else the state to show. The guard in
        front of SGLang's own lookup asks the very row the acquire itself steps (`acquire.ready` or
        `acquire.unavailable`), by a dry run of the pure step: the state is not changed."""
        _state, result, _effects = engine_step(self.state, AcquireRequest(name))
        if not isinstance(result, Rejected):
            return None
        adapter = self.adapter(name)
        return "not loaded" if adapter is None else str(adapter.state)

    # ---------------------------------------------------------------- native refcount mirror
    def on_acquired(self, name: str) -> Rejected | None:
        result, _ = self.step(AcquireRequest(name))
        return result if isinstance(result, Rejected) else None

    def on_released(self, lora_id: str) -> None:
        name = self.names_by_lora_id.get(lora_id)
        if name is not None:
            self.step(ReleaseRequest(name))

    # ---------------------------------------------------------------- staging
    @staticmethod
    def begin_event(source: StagingSource) -> BeginStaging:
        return BeginStaging(source.lora_name, source.attempt_token, source.incarnation, source.digest,
                            source.bucket_count)

    def opens_stash(self, source: StagingSource) -> bool:
        """Whether the table would open a new stash for this begin (`AllocateStash`: `begin.absent`,
        `begin.new_after_cleanup`): only such a begin needs a free slot. Any other begin is the table's to
        answer (a replay, STALE_ATTEMPT, STALE_INCARNATION) whatever the slots. A dry run of the pure step: the
        state is not changed."""
        _state, _result, effects = engine_step(self.state, self.begin_event(source))
        return any(isinstance(effect, AllocateStash) for effect in effects)

    async def begin(self, source: StagingSource) -> Any:
        result, effects = self.step_or_refuse(self.begin_event(source))
        for effect in effects:
            if isinstance(effect, AllocateStash):
                self.sources[(source.lora_name, source.attempt_token)] = source
                await source.allocate()
        return result

    def staging_reservations(self) -> int:
        """Managed adapters that hold or will hold a pinned slot on this engine."""
        return sum(1 for adapter in self.state.adapters.values() if adapter.state in SLOT_HOLDING_ADAPTER_STATES)

    async def receive_bucket(self, name: str, attempt_token: str, incarnation: int, index: int) -> Any:
        result, effects = self.step_or_refuse(ReceiveBucket(name, attempt_token, incarnation, index))
        for effect in effects:
            if isinstance(effect, StashBucket):
                await self.sources[(name, attempt_token)].stash_bucket(index)
        return result

    async def end(self, name: str, attempt_token: str, incarnation: int, probe_input_ids: list[int]) -> Any:
        source = self.sources.get((name, attempt_token))
        manifest = source.manifest if source is not None else None  # the stash is freed by the load's row
        began = time.monotonic()
        verdict = await source.verify() if source is not None else None
        verified = time.monotonic()
        # A rejected manifest is a refusal that still changes state (STAGING -> CLEANED, stash freed):
        # run the row's effects first, then answer with the verdict's detail.
        manifest_ok = verdict is None or verdict.ok
        result = await self._run(EndStaging(name, attempt_token, incarnation, manifest_ok=manifest_ok), attempt_token)
        loaded = time.monotonic()
        if isinstance(result, Rejected):
            detail = self.errors.get(name, "") if result.reason is Reason.LOAD_FAILED else ""
            raise ProtocolRefusal(result, verdict.detail if verdict is not None and not verdict.ok else detail)
        instance = self.loaded.get(name)
        if instance is not None and instance.probe is None:
            probe = await self._probe(name, probe_input_ids)
            probed = time.monotonic()
            instance.end_parts = {
                "verify_wait_s": round(verified - began, 6),
                "verify_tail_s": verdict.tail_s if verdict is not None else None,
                "load_s": round(loaded - verified, 6),
                "probe_s": round(probed - loaded, 6),
            }
            if not all(math.isfinite(x) for x in (probe["logprob"], *probe["scores"])):
                await self._refuse_candidate(name, attempt_token, probe)
            # After the probe: its batch is what brought the weights into the pool (see served_readback).
            instance.served = await self._read_back(instance.lora_id, manifest)
            instance.end_parts["served_s"] = round(time.monotonic() - probed, 6)
            instance.probe = probe
        return result

    async def _refuse_candidate(self, name: str, attempt_token: str, probe: dict[str, Any]) -> None:
        """A candidate whose probe is not finite (NaN/Inf weights that passed the manifest, which checks bytes,
        not values) is never READY to anyone: clean it through the table's cleanup row, then refuse."""
        # The probe's native reference is released by a task SGLang schedules (_release_lora_once).
        for _ in range(200):
            adapter = self.adapter(name)
            if adapter is None or adapter.native_refs == 0:
                break
            await asyncio.sleep(0.01)
        result = await self._run(CleanupAttempt(name, attempt_token), attempt_token)
        if isinstance(result, Rejected):
            raise ProtocolRefusal(result)
        raise CandidateRefused(EngineRefusal.PROBE_NOT_FINITE, f"probe of {name!r} gave logprob {probe['logprob']} "
                               f"(token {probe['token_id']}), scores {probe['scores']}; the candidate was cleaned")

    async def cleanup(self, name: str, attempt_token: str) -> Any:
        result = await self._run(CleanupAttempt(name, attempt_token), attempt_token)
        if isinstance(result, Rejected):
            raise ProtocolRefusal(result, self.errors.get(name, "") if result.reason is Reason.UNLOAD_FAILED else "")
        return result

    # ---------------------------------------------------------------- reclaim
    async def reclaim(self, name: str, reclaim_id: str, wait_s: float) -> Any:
        result = await self._run(ReclaimAdapter(name, reclaim_id), None)
        if isinstance(result, Rejected):
            raise ProtocolRefusal(result)
        self._note_receipt(name, reclaim_id)  # a retried unload (reclaim.retry_unload) ran inline
        task = self._reclaims.get(name)
        if task is not None and wait_s > 0:
            await asyncio.wait({task}, timeout=wait_s)
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return result

    async def _drain_then_unload(self, name: str, reclaim_id: str) -> None:
        instance = self.loaded.get(name)
        if instance is not None:
            # SGLang's LoRARegistry.wait_for_unload: returns once the native request counter of this
            # lora_id reaches zero (every in-flight request released it), then drops the counter.
            await self.tm.lora_registry.wait_for_unload(instance.lora_id)
        result = await self._run(FinishUnload(name, reclaim_id), None)
        if isinstance(result, Rejected):
            raise ProtocolRefusal(result)
        self._note_receipt(name, reclaim_id)

    def _note_receipt(self, name: str, reclaim_id: str) -> None:
        """The status view's receipt of a physical unload, once the table says UNLOADED (an absent name has none)."""
        adapter = self.adapter(name)
        if adapter is not None and adapter.state is AdapterState.UNLOADED and not adapter.absent \
                and name not in self.reclaim_receipts:
            self.reclaim_receipts[name] = {"lora_name": name, "reclaim_id": reclaim_id, "unloaded_at": time.time()}

    @staticmethod
    def _retrieve(task: asyncio.Task[None]) -> None:
        """Every task of the patch has its exception retrieved, and logged, whether or not a caller waits for it
        (a reclaim with wait_s=0 does not)."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("versioned-lora reclaim task failed", exc_info=task.exception())

    # ---------------------------------------------------------------- effects
    async def _run(self, event: EngineEvent, attempt_token: str | None) -> Any:
        """Step `event`, carry out its row's effects (and those of the rows their outcomes fire). The answer: the
        first refusal among the rows fired (an end whose load came after its cleanup stays refused however the
        unload that follows ends), else the last row's result."""
        result, effects = self.step(event)
        last = await self._carry_out(effects, attempt_token)
        return result if last is None or isinstance(result, Rejected) else last

    async def _carry_out(self, effects: tuple[EngineEffect, ...], attempt_token: str | None) -> Any:
        """Carry out `effects` in the table's order. An effect whose outcome is an input (a load, a physical unload)
        reports it, and the effects of the row that input fires run next, before the rest. None is skipped because
        an earlier one failed. Returns the first refusal among the outcomes' rows, else the last one's result (None if
        there was none)."""
        queue = list(effects)
        last: Any = None
        while queue:
            effect = queue.pop(0)
            outcome = await self._execute(effect, attempt_token)
            if outcome is not None:
                result, more = self.step(outcome)
                last = last if isinstance(last, Rejected) else result
                queue[:0] = more
        return last

    async def _execute(
        self, effect: EngineEffect, attempt_token: str | None
    ) -> LoadDone | LoadFailed | UnloadDone | UnloadFailed | None:
        if isinstance(effect, LoadPinned):
            return await self._load_pinned(effect.lora_name, effect.attempt_token)
        if isinstance(effect, PhysicalUnload):
            return await self._physical_unload(effect.lora_name)
        if not isinstance(effect, FreeStash | Unregister | AwaitUnload):
            raise AssertionError(f"effect {effect!r} has no executor here")
        try:
            if isinstance(effect, FreeStash):
                key = (effect.lora_name, effect.attempt_token or attempt_token or "")
                source = self.sources.pop(key, None)
                if source is not None:
                    await source.free()
            elif isinstance(effect, Unregister):
                await self._unregister(effect.lora_name)
            else:
                adapter = self.adapter(effect.lora_name)
                reclaim_id = adapter.reclaim_id if adapter is not None else None
                task = asyncio.create_task(self._drain_then_unload(effect.lora_name, reclaim_id or ""))
                task.add_done_callback(self._retrieve)
                self._reclaims[effect.lora_name] = task
        except Exception:  # no row awaits their outcome: logged, and the row's other effects still run
            logger.exception("versioned-lora effect %r failed", effect)
        return None

    async def _load_pinned(self, name: str, attempt_token: str) -> LoadDone | LoadFailed:
        # SGLang's stock load (not our guard): a fresh LoRARef, so a new lora_id and a cold KV namespace;
        # pinned, so LRU eviction never picks it. Its outcome is the table's input (rows loaded.*, load_failed.*).
        await hold_points.HOLDS.reach("load", name)
        try:
            if faults.trip(faults.FAIL_LOAD, name):  # test-only: answered as SGLang's failed load, nothing loaded
                error: str | None = f"injected failure (test-only fault {faults.FAIL_LOAD}) for {name!r}"
            else:
                # TokenizerManager.load_lora_adapter (the stock one), through the stash's load.
                output = await self.sources[(name, attempt_token)].load(self._stock_loads)
                error = None if output.success else str(output.error_message or "load failed")
        except Exception as exc:  # a failed load however it fails: nothing of it is served
            logger.exception("versioned-lora load of %s failed", name)
            error = f"{type(exc).__name__}: {exc}"
        if error is not None or name not in self.tm.lora_registry._registry:
            self.errors[name] = error or "SGLang's registry does not name the loaded adapter"
            audit.COUNTS["load_failed"] += 1
            return LoadFailed(name, attempt_token)
        lora_id = self.tm.lora_registry._registry[name].lora_id
        self.loaded[name] = LoadedInstance(lora_id=lora_id, loaded_at=time.time())
        self.names_by_lora_id[lora_id] = name
        audit.COUNTS["physical_load"] += 1
        return LoadDone(name, attempt_token)

    async def _unregister(self, name: str) -> None:
        # LoRARegistry.unregister: new requests for the exact name fail from now on; the name also
        # leaves lora_ref_cache so TokenizerManager._resolve_lora_path can never reload it.
        async with self.tm.lora_update_lock:
            if name in self.tm.lora_registry._registry:
                await self.tm.lora_registry.unregister(name)
            self.tm.lora_ref_cache.pop(name, None)

    async def _physical_unload(self, name: str) -> UnloadDone | UnloadFailed:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        # Kept until SGLang confirms: a failed unload leaves the weights loaded and pinned, and accounted here.
        instance = self.loaded.get(name)
        if instance is None:
            return UnloadDone(name)  # nothing of it was loaded in this process
        try:
            if instance.lora_id in self.tm.lora_registry._counters:
                await self.tm.lora_registry.wait_for_unload(instance.lora_id)
            await hold_points.HOLDS.reach("unload", name)
            if faults.trip(faults.FAIL_UNLOAD, name):  # test-only: answered as SGLang's failed unload
                failed = [f"injected failure (test-only fault {faults.FAIL_UNLOAD}) for {name!r}"]
            else:
                async with self.tm.lora_update_lock:
                    # TokenizerManager.update_lora_adapter_communicator: the scheduler drops the weights of
                    # this lora_id (LoRAManager.unload_lora_adapter) and frees its memory-pool slot.
                    results = await self.tm.update_lora_adapter_communicator(
                        UnloadLoRAAdapterReqInput(lora_name=name, lora_id=instance.lora_id)
                    )
                failed = [str(r.error_message) for r in results if not r.success]
        except Exception as exc:  # an unload that raised failed as much as one that answered failure
            logger.exception("versioned-lora unload of %s failed", name)
            failed = [f"{type(exc).__name__}: {exc}"]
        if failed:
            self.errors[name] = "; ".join(failed)
            audit.COUNTS["unload_failed"] += 1
            return UnloadFailed(name)
        self.loaded.pop(name, None)
        self.errors.pop(name, None)
        audit.COUNTS["physical_unload"] += 1
        return UnloadDone(name)

    async def _probe(self, name: str, input_ids: list[int]) -> dict[str, Any]:
        """An exact-version probe through the ordinary request path, in one prefill: the candidate's logprob of
        each probe token after the tokens before it (`scores`, teacher-forced: no token is chosen, so no near-tie
        between two tokens decides anything), and the greedy next token with its logprob."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = GenerateReqInput(
            input_ids=list(input_ids),
            lora_path=name,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,  # input_token_logprobs for the whole probe (the first token's is None)
        )
        await hold_points.HOLDS.reach("probe", name)
        output = await self.tm.generate_request(request, None).__anext__()
        meta = output["meta_info"]
        first = meta["output_token_logprobs"][0]
        scores = [_finite_or_nan(entry[0]) for entry in meta["input_token_logprobs"][1:]]
        return {"token_id": int(first[1]), "logprob": _finite_or_nan(first[0]), "scores": scores,
                "cached_tokens": meta.get("cached_tokens", 0)}

    @staticmethod
    async def _read_back(lora_id: str, manifest: Manifest | None) -> dict[str, Any]:
        """The scheduler's read-back of `lora_id` from its LoRA memory pool, or why there is none: reported as it is
        (the publisher's served check reads it), never decided on here."""
        if manifest is None:
            return {"error": "no manifest: the candidate's stash was gone before the load"}
        try:
            return await staging_channel.call("read_back_served", lora_id=lora_id, manifest_json=manifest.to_json())
        except Exception as exc:  # a read-back that failed certifies nothing: said so, for the publisher to refuse
            return {"error": f"{type(exc).__name__}: {exc}"}

    # ---------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        counters = dict(self.tm.lora_registry._counters)
        adapters = []
        for name, adapter in self.state.adapters.items():
            instance = self.loaded.get(name)
            task = self._reclaims.get(name)
            adapters.append(
                {
                    "name": name,
                    "state": str(adapter.state),
                    "attempt_token": adapter.attempt_token,
                    "digest": adapter.digest,
                    "buckets_received": adapter.buckets_received,
                    "bucket_count": adapter.bucket_count,
                    "lora_id": instance.lora_id if instance else None,
                    "pinned": instance is not None,
                    "native_refcount": (
                        counters[instance.lora_id].value() if instance and instance.lora_id in counters else 0
                    ),
                    "mirrored_refcount": adapter.native_refs,
                    "reclaim_id": adapter.reclaim_id,
                    "reclaim_running": task is not None and not task.done(),
                    "reclaim_receipt": self.reclaim_receipts.get(name),
                    "absent": adapter.absent,
                    "probe": instance.probe if instance else None,
                    "served": instance.served if instance else None,
                    "end_parts": instance.end_parts if instance else None,
                    "error": self.errors.get(name),
                }
            )
        return {"incarnation": self.incarnation, "managed": adapters}


def _finite_or_nan(value: Any) -> float:
    """A logprob as a float; a non-finite one may come back as NaN or, once through a JSON layer, as None: both are
    not finite."""
    return float(value) if isinstance(value, int | float) else math.nan
