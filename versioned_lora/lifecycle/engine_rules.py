"""The engine side's named guards, updates, writer, effects and results: the managed-adapter machine
the SGLang patch drives inside each engine process (`engine_step`). Same conventions as
`registry_rules`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from immutables import Map

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
from versioned_lora.lifecycle.results import AdapterStatus, EngineResult, ProcessStatus, ReadyLocal
from versioned_lora.spec.events import (
    AcquireRequest,
    BeginStaging,
    CleanupAttempt,
    EndStaging,
    EngineStarted,
    FinishUnload,
    LoadDone,
    LoadFailed,
    ReceiveBucket,
    ReclaimAdapter,
    ReleaseRequest,
    UnloadDone,
    UnloadFailed,
)
from versioned_lora.spec.model import EngineAdapterState, ManagedAdapter
from versioned_lora.spec.states import AdapterState, Machine, ProcessState

AdapterEvent = (
    BeginStaging
    | ReceiveBucket
    | EndStaging
    | CleanupAttempt
    | AcquireRequest
    | ReleaseRequest
    | ReclaimAdapter
    | FinishUnload
    | LoadDone
    | LoadFailed
    | UnloadDone
    | UnloadFailed
)
_ABSENT = ManagedAdapter(AdapterState.ABSENT)


class EngineDraft:
    __slots__ = ("adapters", "engine", "incarnation")

    def __init__(self, s: EngineAdapterState) -> None:
        self.engine: str = s.engine
        self.incarnation: int = s.incarnation
        self.adapters: Map[str, ManagedAdapter] = s.adapters

    def freeze(self) -> EngineAdapterState:
        return EngineAdapterState(self.engine, self.incarnation, self.adapters)

    def adapter(self, name: str) -> ManagedAdapter:
        return self.adapters.get(name, _ABSENT)

    def put(self, name: str, adapter: ManagedAdapter) -> None:
        self.adapters = self.adapters.set(name, adapter)


# ================================================================ locators


def locate_adapter(s: EngineAdapterState, e: AdapterEvent) -> str:
    adapter = s.adapters.get(e.lora_name)
    return AdapterState.ABSENT if adapter is None else adapter.state


def locate_process(s: EngineAdapterState, e: EngineStarted) -> str:
    return ProcessState.UP


LOCATORS: dict[type, Callable[[EngineAdapterState, Any], str]] = {
    BeginStaging: locate_adapter,
    ReceiveBucket: locate_adapter,
    EndStaging: locate_adapter,
    CleanupAttempt: locate_adapter,
    AcquireRequest: locate_adapter,
    ReleaseRequest: locate_adapter,
    ReclaimAdapter: locate_adapter,
    FinishUnload: locate_adapter,
    LoadDone: locate_adapter,
    LoadFailed: locate_adapter,
    UnloadDone: locate_adapter,
    UnloadFailed: locate_adapter,
    EngineStarted: locate_process,
}

# ================================================================ guards
# The located adapter record exists unless the source is ABSENT (no record is ever stored as ABSENT).


def engine_incarnation_stale(s: EngineAdapterState, e: BeginStaging | ReceiveBucket | EndStaging) -> bool:
    return e.incarnation != s.incarnation


def attempt_was_cleaned(s: EngineAdapterState, e: BeginStaging | CleanupAttempt) -> bool:
    return e.attempt_token in s.adapters[e.lora_name].cleaned_attempts


def same_attempt(s: EngineAdapterState, e: BeginStaging) -> bool:
    return s.adapters[e.lora_name].attempt_token == e.attempt_token


def adapter_attempt_mismatch(
    s: EngineAdapterState, e: ReceiveBucket | EndStaging | CleanupAttempt | LoadDone | LoadFailed
) -> bool:
    return s.adapters.get(e.lora_name, _ABSENT).attempt_token != e.attempt_token


def bucket_is_next(s: EngineAdapterState, e: ReceiveBucket) -> bool:
    adapter = s.adapters[e.lora_name]
    return e.index == adapter.buckets_received < adapter.bucket_count


def bucket_received(s: EngineAdapterState, e: ReceiveBucket) -> bool:
    return 0 <= e.index < s.adapters[e.lora_name].buckets_received


def buckets_missing(s: EngineAdapterState, e: EndStaging) -> bool:
    adapter = s.adapters[e.lora_name]
    return adapter.buckets_received < adapter.bucket_count


def manifest_rejected(s: EngineAdapterState, e: EndStaging) -> bool:
    return not e.manifest_ok


def native_refs_positive(s: EngineAdapterState, e: CleanupAttempt | ReleaseRequest | ReclaimAdapter) -> bool:
    return s.adapters[e.lora_name].native_refs > 0


def last_native_ref(s: EngineAdapterState, e: ReleaseRequest) -> bool:
    return s.adapters[e.lora_name].native_refs == 1


def engine_reclaim_id_mismatch(s: EngineAdapterState, e: ReclaimAdapter | FinishUnload) -> bool:
    return s.adapters[e.lora_name].reclaim_id != e.reclaim_id


def process_incarnation_not_newer(s: EngineAdapterState, e: EngineStarted) -> bool:
    return e.incarnation <= s.incarnation


GUARDS: dict[str, Callable[[EngineAdapterState, Any], bool]] = {
    f.__name__: f
    for f in (
        engine_incarnation_stale,
        attempt_was_cleaned,
        same_attempt,
        adapter_attempt_mismatch,
        bucket_is_next,
        bucket_received,
        buckets_missing,
        manifest_rejected,
        native_refs_positive,
        last_native_ref,
        engine_reclaim_id_mismatch,
        process_incarnation_not_newer,
    )
}

# ================================================================ updates


def open_stash(d: EngineDraft, e: BeginStaging) -> None:
    cleaned = d.adapter(e.lora_name).cleaned_attempts  # survives: late messages of cleaned attempts stay dead
    d.put(
        e.lora_name,
        ManagedAdapter(AdapterState.STAGING, e.attempt_token, e.digest, e.bucket_count, 0, cleaned_attempts=cleaned),
    )


def count_bucket(d: EngineDraft, e: ReceiveBucket) -> None:
    adapter = d.adapter(e.lora_name)
    d.put(e.lora_name, attrs.evolve(adapter, buckets_received=adapter.buckets_received + 1))


def remember_cleaned_attempt(d: EngineDraft, e: CleanupAttempt | EndStaging | LoadFailed) -> None:
    adapter = d.adapter(e.lora_name)
    d.put(e.lora_name, attrs.evolve(adapter, cleaned_attempts=adapter.cleaned_attempts | {e.attempt_token}))


def take_native_ref(d: EngineDraft, e: AcquireRequest) -> None:
    adapter = d.adapter(e.lora_name)
    d.put(e.lora_name, attrs.evolve(adapter, native_refs=adapter.native_refs + 1))


def drop_native_ref(d: EngineDraft, e: ReleaseRequest) -> None:
    adapter = d.adapter(e.lora_name)
    d.put(e.lora_name, attrs.evolve(adapter, native_refs=adapter.native_refs - 1))


def note_reclaim_id(d: EngineDraft, e: ReclaimAdapter) -> None:
    d.put(e.lora_name, attrs.evolve(d.adapter(e.lora_name), reclaim_id=e.reclaim_id))


def mark_absent(d: EngineDraft, e: ReclaimAdapter) -> None:
    d.put(e.lora_name, attrs.evolve(d.adapter(e.lora_name), absent=True))


def forget_all_adapters(d: EngineDraft, e: EngineStarted) -> None:
    d.incarnation = e.incarnation
    d.adapters = Map()


UPDATES: dict[str, Callable[[EngineDraft, Any], None]] = {
    f.__name__: f
    for f in (
        open_stash,
        count_bucket,
        remember_cleaned_attempt,
        take_native_ref,
        drop_native_ref,
        note_reclaim_id,
        mark_absent,
        forget_all_adapters,
    )
}


def write_adapter(d: EngineDraft, e: AdapterEvent, target: AdapterState) -> None:
    d.put(e.lora_name, attrs.evolve(d.adapter(e.lora_name), state=target))


WRITERS: dict[Machine, Callable[[EngineDraft, Any, Any], None]] = {Machine.ADAPTER: write_adapter}

# ================================================================ effects


def allocate_stash(b: EngineAdapterState, a: EngineAdapterState, e: BeginStaging) -> tuple[EngineEffect, ...]:
    return (AllocateStash(e.lora_name, e.attempt_token, e.bucket_count),)


def stash_bucket(b: EngineAdapterState, a: EngineAdapterState, e: ReceiveBucket) -> tuple[EngineEffect, ...]:
    return (StashBucket(e.lora_name, e.attempt_token, e.index),)


def load_pinned(b: EngineAdapterState, a: EngineAdapterState, e: EndStaging) -> tuple[EngineEffect, ...]:
    return (LoadPinned(e.lora_name, e.attempt_token),)


def free_stash(
    b: EngineAdapterState,
    a: EngineAdapterState,
    e: EndStaging | CleanupAttempt | ReclaimAdapter | LoadDone | LoadFailed,
) -> tuple[EngineEffect, ...]:
    return (FreeStash(e.lora_name, b.adapters[e.lora_name].attempt_token),)


def unregister(
    b: EngineAdapterState, a: EngineAdapterState, e: CleanupAttempt | ReclaimAdapter | LoadDone
) -> tuple[EngineEffect, ...]:
    return (Unregister(e.lora_name),)


def await_unload(b: EngineAdapterState, a: EngineAdapterState, e: ReclaimAdapter) -> tuple[EngineEffect, ...]:
    return (AwaitUnload(e.lora_name),)


def physical_unload(
    b: EngineAdapterState, a: EngineAdapterState, e: CleanupAttempt | FinishUnload | ReclaimAdapter | LoadDone
) -> tuple[EngineEffect, ...]:
    return (PhysicalUnload(e.lora_name),)


EFFECTS: dict[str, Callable[[EngineAdapterState, EngineAdapterState, Any], tuple[EngineEffect, ...]]] = {
    f.__name__: f
    for f in (allocate_stash, stash_bucket, load_pinned, free_stash, unregister, await_unload, physical_unload)
}

# ================================================================ results


def adapter_status(b: EngineAdapterState, a: EngineAdapterState, e: AdapterEvent, row: str) -> EngineResult:
    adapter = a.adapters.get(e.lora_name, _ABSENT)
    return AdapterStatus(
        e.lora_name,
        adapter.state,
        adapter.attempt_token,
        a.incarnation,
        adapter.native_refs,
        adapter.buckets_received,
        adapter.reclaim_id,
        adapter.absent,
    )


def ready_local(b: EngineAdapterState, a: EngineAdapterState, e: EndStaging | LoadDone, row: str) -> EngineResult:
    adapter = a.adapters[e.lora_name]
    assert adapter.digest is not None and adapter.attempt_token is not None
    return ReadyLocal(e.lora_name, adapter.digest, adapter.attempt_token, a.incarnation)


def process_status(b: EngineAdapterState, a: EngineAdapterState, e: EngineStarted, row: str) -> EngineResult:
    return ProcessStatus(a.engine, a.incarnation)


RESULTS: dict[str, Callable[[EngineAdapterState, EngineAdapterState, Any, str], EngineResult]] = {
    f.__name__: f for f in (adapter_status, ready_local, process_status)
}
