"""Issue 41, the engine-side executor (`ManagedEngine._carry_out`) on an injected SGLang: a tokenizer manager and a
staging source that fail or hold on demand (doubles of SGLang, hence `injected`; the same paths on real engines:
tests/e2e/test_effect_outcomes.py). The executor feeds each load's and unload's outcome back as an input and runs the
effects of the row it fires, in the row's order, none skipped because an earlier one failed."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import pytest

from versioned_lora.sglang_patches.managed.engine_side import LoadedInstance, ManagedEngine, ProtocolRefusal
from versioned_lora.sglang_patches.managed.staging import StockLoads, Verdict
from versioned_lora.spec.events import BeginStaging, EndStaging, LoadDone
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.states import AdapterState

NAME, TOKEN, RID = "relax_policy_lora@1-B-0123456789ab", "attempt-1", "reclaim-1"


@attrs.define
class Output:
    success: bool
    error_message: str | None = None


@attrs.define
class Ref:
    lora_id: str


class Registry:
    def __init__(self) -> None:
        self._registry: dict[str, Ref] = {}
        self._counters: dict[str, Any] = {}

    async def unregister(self, name: str) -> str:
        return self._registry.pop(name).lora_id

    async def wait_for_unload(self, lora_id: str) -> None:
        self._counters.pop(lora_id, None)


class TokenizerManager:
    def __init__(self, unload_failures: int = 0) -> None:
        self.lora_registry = Registry()
        self.lora_update_lock = asyncio.Lock()
        self.lora_ref_cache: dict[str, Any] = {}
        self.unload_failures = unload_failures
        self.unloads: list[str] = []

    async def update_lora_adapter_communicator(self, request: Any) -> list[Output]:
        self.unloads.append(request.lora_name)
        if self.unload_failures:
            self.unload_failures -= 1
            return [Output(False, "injected: the scheduler could not unload it")]
        return [Output(True)]


class Source:
    def __init__(self, tm: TokenizerManager, load_ok: bool = True) -> None:
        self.lora_name, self.attempt_token, self.incarnation, self.digest, self.bucket_count = NAME, TOKEN, 1, "d", 0
        self.tm, self.load_ok = tm, load_ok
        self.freed = False
        self.manifest: Any = None  # no manifest: the read-back after a probe reports none (nothing here reads it)
        self.may_load = asyncio.Event()
        self.may_load.set()
        self.loading = asyncio.Event()

    async def allocate(self) -> None:
        return None

    async def verify(self) -> Verdict:
        return Verdict(True)

    async def load(self, stock: StockLoads) -> Output:
        assert not self.freed, "the stash was freed before the load that reads it"
        self.loading.set()
        await self.may_load.wait()
        if not self.load_ok:
            return Output(False, "injected: not enough memory")
        self.tm.lora_registry._registry[NAME] = Ref("lora-id-1")
        return Output(True)

    async def free(self) -> None:
        self.freed = True


def _engine(tm: TokenizerManager) -> ManagedEngine:
    async def never(_: Any) -> Any:
        raise AssertionError("the executor loads through the staging source")

    return ManagedEngine(tm, 1, StockLoads(never, never))


def test_injected_failed_load_frees_the_stash_and_the_end_is_refused_typed() -> None:
    async def body() -> None:
        tm = TokenizerManager()
        engine, source = _engine(tm), Source(tm, load_ok=False)
        await engine.begin(source)  # type: ignore[arg-type]
        with pytest.raises(ProtocolRefusal) as refused:
            await engine.end(NAME, TOKEN, 1, [1, 2])
        assert refused.value.rejected.reason is Reason.LOAD_FAILED and "not enough memory" in str(refused.value)
        assert source.freed and engine.sources == {} and NAME not in engine.loaded
        assert engine.state.adapters[NAME].state is AdapterState.CLEANED and engine.staging_reservations() == 0
        assert await engine.cleanup(NAME, TOKEN) is not None  # the registry's cleanup then completes

    asyncio.run(body())


def test_injected_load_finishing_after_cleanup_is_unloaded_at_once() -> None:
    async def body() -> None:
        tm = TokenizerManager()
        engine, source = _engine(tm), Source(tm)
        source.may_load.clear()
        await engine.begin(source)  # type: ignore[arg-type]
        end = asyncio.create_task(engine.end(NAME, TOKEN, 1, [1, 2]))
        await source.loading.wait()
        with pytest.raises(ProtocolRefusal) as in_use:  # the cleanup comes while the end's load runs
            await engine.cleanup(NAME, TOKEN)
        assert in_use.value.rejected.reason is Reason.IN_USE
        source.may_load.set()
        with pytest.raises(ProtocolRefusal) as stale:
            await end
        assert stale.value.rejected.reason is Reason.STALE_ATTEMPT  # cleanup came first
        assert tm.unloads == [NAME] and NAME not in tm.lora_registry._registry and NAME not in engine.loaded
        assert source.freed and engine.state.adapters[NAME].state is AdapterState.CLEANED
        await engine.cleanup(NAME, TOKEN)  # asked again: clean

    asyncio.run(body())


def test_injected_failed_unload_stays_accounted_until_the_resent_reclaim_retries_it() -> None:
    async def body() -> None:
        tm = TokenizerManager(unload_failures=1)
        engine = _engine(tm)
        for event in (BeginStaging(NAME, TOKEN, 1, "d", 0), EndStaging(NAME, TOKEN, 1, True), LoadDone(NAME, TOKEN)):
            engine.step(event)
        tm.lora_registry._registry[NAME] = Ref("lora-id-1")
        engine.loaded[NAME] = LoadedInstance(lora_id="lora-id-1", loaded_at=0.0)
        await engine.reclaim(NAME, RID, wait_s=5)
        adapter = engine.adapter(NAME)
        assert adapter is not None and adapter.state is AdapterState.UNLOAD_FAILED
        assert NAME in engine.loaded and engine.staging_reservations() == 1  # still pinned in SGLang: accounted
        assert engine.status()["managed"][0]["pinned"] and "could not unload" in engine.status()["managed"][0]["error"]
        await engine.reclaim(NAME, RID, wait_s=0)  # the same reclaim again: the row retries the unload, inline
        adapter = engine.adapter(NAME)
        assert adapter is not None and adapter.state is AdapterState.UNLOADED and NAME not in engine.loaded
        assert tm.unloads == [NAME, NAME] and engine.staging_reservations() == 0
        assert engine.reclaim_receipts[NAME]["reclaim_id"] == RID

    asyncio.run(body())
