"""The registry as a plain class (RFC §2): the lifecycle core's state behind a durable journal, and idempotent calls.

`RegistryCore` steps the pure core one call at a time and writes its SQLite journal; it never awaits network, NCCL,
probes or unloads: the effects the core returns go back to the caller, who carries them out. A call is acknowledged
only after its journal row is durable, and the in-memory state advances only then; a new instance over the same
journal replays it to exactly the state after the last durable call, and a retried key is answered from the journal,
not re-applied. `adapters/ray_registry.py` hosts it in-process (`LocalRegistry`) or as the named Ray actor.
"""

from __future__ import annotations

import functools
import os
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from versioned_lora import capabilities
from versioned_lora.adapters.journal import CheckpointWriter, Journal, state_digest
from versioned_lora.lifecycle import (
    ArmLeaseTimer,
    ExpireLease,
    RegistryEffect,
    RegistryEvent,
    RegistryState,
    Reserve,
    VersionKey,
    VersionState,
    initial_state,
    step,
)
from versioned_lora.lifecycle.effects import CleanupOnEngine, ReclaimOnEngine
from versioned_lora.runtime.interfaces import (
    MAX_BATCH,
    BatchTooLarge,
    IdempotencyKeyReused,
    RegistryAnswer,
)
from versioned_lora.runtime.views import DispatchView, PublicationView, ViewIndex, dispatch_view
from versioned_lora.spec.identities import check_version_identity

DEFAULT_CHECKPOINT_EVERY = 50_000  # events between checkpoints: bounds replay time after a restart
# Pickling time a checkpoint may add to one call (it is written over as many later calls as it needs).
CHECKPOINT_BUDGET_S = 0.001
DEFAULT_ANSWER_CACHE = 4096  # recent calls answered from memory; older retried keys hit the journal index


@attrs.frozen
class OperationsView:
    """What an operator needs beside `PublicationView` (which the runtime's view module defines): the
    capacity, the slots held, each claimed version's engines that confirmed their unload (of the versions the
    publication view of the same `all_versions` holds), open sessions. Answered from `ViewIndex`: its cost does
    not grow with sessions or with the versions that ended."""

    epoch: int
    capacity: int
    occupied: int
    reclaim_confirmed: dict[VersionKey, tuple[str, ...]]
    open_sessions: int
    # The publisher lease: its holder (None: free), the last fence granted, and the seconds until the registry
    # expires it without a renewal (None: free, or this registry process has armed no timer for it).
    lease_holder: str | None = None
    lease_fence: int = 0
    lease_expires_in_s: float | None = None


@attrs.frozen
class RecoveryReport:
    replayed_calls: int
    seconds: float
    last_seq: int


# Where an armed fault holds the actor (test-only fault injection: a real process cannot be made to
# stop at an exact point of a call on demand, so the actor pauses there and the test kill -9s it).
class RegistryCore:
    """The registry as a plain class: the core's state, its journal, idempotent calls."""

    def __init__(
        self,
        journal_path: str | Path,
        engines: Sequence[str] = ("E0", "E1"),
        capacity: int = 2,
        epoch: int = 0,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        answer_cache: int = DEFAULT_ANSWER_CACHE,
        capability_key: bytes | capabilities.KeyRing | None = None,
        id_salt: str | None = None,
        publisher_lease: bool = True,
        insecure: bool = False,
        engine_urls: Mapping[str, str] | None = None,
    ) -> None:
        """`capability_key`: the key engines check cleanups and reclaims with (`versioned_lora.capabilities`), or a
        `KeyRing` (a rotation); default: the key ring of this process's environment (`keyring_from_env`). Without
        one the registry does not start (`KeyRequired`, before its journal is opened): it could sign nothing, and
        engines refuse every cleanup and reclaim it orders (issue 41). `insecure=True` lets it run keyless (tests
        that say so): its answers then carry no capabilities and no key id, and every engine port refuses it
        (`KEY_MISMATCH`).
        `id_salt`: the reclaim-id salt of a new journal (default: a random one; `Journal.id_salt`).
        `publisher_lease`: whether a new journal requires the publisher lease's fence on every Reserve and
        Commit (`RegistryConfig.publisher_lease`); a journal keeps what it was begun with (one begun before
        leases existed replays unfenced, as it ran).
        `engine_urls`: where each engine is reached (name -> URL), recorded in the journal beside its configuration
        so that every other process needs only the registry's name (None: keep what the journal recorded)."""
        started = time.perf_counter()
        key = capability_key if capability_key is not None else capabilities.keyring_from_env()
        if key is None and not insecure:
            raise capabilities.KeyRequired(
                f"the registry needs the deployment's capability key: ${capabilities.KEY_FILE_ENV} (or "
                f"create_registry_actor(capability_key_file=...)), the file the engines read; make one with "
                f"`versioned-lora keygen PATH`. Only tests run a registry without one (insecure=True)")
        self._keys = capabilities.KeyRing(key) if isinstance(key, bytes) else key
        self._journal = Journal(journal_path)
        recorded = self._journal.recorded_config()
        initial = initial_state(engines=engines, capacity=capacity, epoch=epoch,
                                id_salt=self._journal.id_salt(id_salt),
                                publisher_lease=publisher_lease if recorded is None else recorded.publisher_lease)
        self._journal.bind_config(initial.config)
        self._engine_urls = self._journal.engine_urls(engine_urls)
        self._state, replayed = self._journal.recover(initial, step)
        self._index = ViewIndex(self._state)  # the one walk of every session and version: at start, not per read
        self._next_seq = self._journal.next_seq()
        self._checkpoint_every = checkpoint_every
        self._events_since_checkpoint = 0
        self._checkpointing: CheckpointWriter | None = None  # a checkpoint written a slice per call
        self._recent: OrderedDict[str, tuple[tuple[RegistryEvent, ...], tuple[RegistryAnswer, ...]]] = OrderedDict()
        self._answer_cache = answer_cache
        # The publisher lease's timer (ArmLeaseTimer): (fence, monotonic deadline). A recovered registry grants a
        # held lease a whole ttl from now: it never expires a lease sooner than its holder could have renewed it.
        lease = self._state.lease
        self._lease_timer = None if lease.holder is None else (lease.fence, time.monotonic() + lease.ttl_s)
        self.recovery = RecoveryReport(replayed, time.perf_counter() - started, self._next_seq - 1)

    def _after_checkpoint(self) -> None:
        """A hook for the process that hosts the registry (see RegistryActor)."""

    # ---- calls
    def submit(self, key: str, event: RegistryEvent) -> RegistryAnswer:
        return self.submit_batch(key, (event,))[0]

    def submit_batch(self, key: str, events: Sequence[RegistryEvent]) -> tuple[RegistryAnswer, ...]:
        """Apply `events` in order as one call. Atomic: a ProtocolError on any event (a bug) leaves the
        state and the journal untouched. A call that changes nothing is answered without a journal row."""
        events = tuple(events)
        if len(events) > MAX_BATCH:
            raise BatchTooLarge(len(events))
        _check_identities(events)
        self._expire_lease_when_due()
        answered = self._answered(key, events)
        if answered is not None:
            return self._signed(answered)
        state = self._state
        steps = []
        for index, event in enumerate(events):
            state, result, effects = step(state, event)
            steps.append((result, tuple(effects)))
            self._reached("mid_batch", index + 1)
        if state is self._state:  # every row was a keep row: no effect to protect, no fsync
            self._arm_lease_timer(steps)
            return self._signed(tuple(RegistryAnswer(result, effects, None) for result, effects in steps))
        seq = self._next_seq
        answers = tuple(RegistryAnswer(result, effects, seq) for result, effects in steps)
        try:
            checkpoint_stored = self._journal.append(
                seq,
                key,
                events,
                answers,
                before_commit=functools.partial(self._reached, "before_commit"),
                checkpoint=self._checkpointing,
                checkpoint_budget_s=CHECKPOINT_BUDGET_S,
            )
        except BaseException:
            self._checkpointing = None  # it moved past slices the rolled-back transaction held: start afresh
            self._events_since_checkpoint = self._checkpoint_every
            raise
        # Only now, with the row durable, does the state move and the call become answerable.
        self._next_seq = seq + 1
        self._index.advance(self._state, state, events)
        self._state = state
        self._arm_lease_timer(steps)
        self._remember(key, events, answers)
        if checkpoint_stored:
            self._checkpointing = None
            self._after_checkpoint()
        self._events_since_checkpoint += len(events)
        if self._checkpointing is None and self._events_since_checkpoint >= self._checkpoint_every:
            self._checkpointing = CheckpointWriter(seq, state)  # written a slice per call from the next one on
            self._events_since_checkpoint = 0
        self._reached("after_commit")
        return self._signed(answers)

    def _arm_lease_timer(self, steps: Sequence[tuple[Any, tuple[RegistryEffect, ...]]]) -> None:
        for _, effects in steps:
            for effect in effects:
                if isinstance(effect, ArmLeaseTimer):
                    self._lease_timer = (effect.fence, time.monotonic() + effect.ttl_s)

    def _expire_lease_when_due(self) -> None:
        """The lease timer fires here, at the start of the first call after its deadline, rather than on a
        thread of its own: a lease is only ever observed through a call, so one that expired with no call in
        between is the same as one that expires now. The expiry is a row (lease.expire), journaled under a key
        of its fence; a timer of a fence no longer live changes nothing (lease.expire_late)."""
        timer = self._lease_timer
        if timer is None or time.monotonic() < timer[1]:
            return
        self._lease_timer = None
        if self._state.lease.holder is not None and self._state.lease.fence == timer[0]:
            self.submit_batch(f"lease-expired:{timer[0]}", (ExpireLease(timer[0]),))

    def _signed(self, answers: tuple[RegistryAnswer, ...]) -> tuple[RegistryAnswer, ...]:
        """The answers with this registry's key ids (where the engine ports read them) and a capability for each
        cleanup of an ABORTED version (an abort row's effect) and each reclaim of a RECLAIMING one (a claim row's),
        minted now: the journal holds them unsigned."""
        keys = self._keys
        if keys is None:
            return answers
        now = time.time()
        ids = keys.ids(now)
        return tuple(
            RegistryAnswer(answer.result, answer.effects, answer.journal_seq, answer.from_journal,
                           tuple(self._capability(keys, effect, now) for effect in answer.effects)
                           if answer.effects else answer.capabilities, ids)
            for answer in answers
        )

    def _capability(self, keys: capabilities.KeyRing, effect: RegistryEffect, now: float) -> str | None:
        version = self._state.versions.get(getattr(effect, "version", None))  # type: ignore[arg-type]
        state = None if version is None else version.state
        if isinstance(effect, CleanupOnEngine) and state in (VersionState.ABORTED, VersionState.FAILED_CLEAN):
            return capabilities.mint_all(keys, capabilities.Action.CLEANUP, effect.lora_name, effect.attempt_token,
                                         now)
        if isinstance(effect, ReclaimOnEngine) and state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            return capabilities.mint_all(keys, capabilities.Action.RECLAIM, effect.lora_name, effect.reclaim_id, now)
        return None

    def key_ids(self) -> tuple[str, ...]:
        """The ids of the keys this registry signs under now, the current first (empty: insecure)."""
        return () if self._keys is None else self._keys.ids()

    def _answered(self, key: str, events: tuple[RegistryEvent, ...]) -> tuple[RegistryAnswer, ...] | None:
        hit = self._recent.get(key)
        if hit is None:
            stored = self._journal.lookup(key)
            if stored is None:
                return None
            hit = (stored.events, stored.answers)
        if hit[0] != events:
            raise IdempotencyKeyReused(f"key {key!r} was used for other events")
        return tuple(attrs.evolve(answer, from_journal=True) for answer in hit[1])

    def _remember(self, key: str, events: tuple[RegistryEvent, ...], answers: tuple[RegistryAnswer, ...]) -> None:
        self._recent[key] = (events, answers)
        if len(self._recent) > self._answer_cache:
            self._recent.popitem(last=False)

    # ---- read-only queries
    def version_states(self, versions: Collection[VersionKey]) -> dict[VersionKey, VersionState]:
        known = self._state.versions
        return {v: known[v].state for v in versions if v in known}

    def state(self) -> RegistryState:
        return self._state

    def dispatch_view(self, versions: Collection[VersionKey]) -> dict[VersionKey, DispatchView]:
        return dispatch_view(self._state, versions)

    def publication_view(self, all_versions: bool = False) -> PublicationView:
        """Every live version and the last few ended ones (`views.RECENT_ENDED`); `all_versions`: every one."""
        return self._index.view(self._state, all_versions)

    def view_index(self) -> ViewIndex:
        return self._index

    def state_digest(self) -> str:
        return state_digest(self._state)

    def operations_view(self, all_versions: bool = False) -> OperationsView:
        state, timer = self._state, self._lease_timer  # a read expires nothing: an overdue lease shows 0 s left
        held = state.lease.holder is not None and timer is not None and timer[0] == state.lease.fence
        index = self._index
        shown = state.versions.keys() if all_versions else index.shown()
        return OperationsView(
            state.config.epoch, state.config.capacity, len(index.live),  # every live version holds one slot
            {key: tuple(sorted(v.reclaim_confirmed)) for key in shown
             if (v := state.versions[key]).reclaim_id is not None},
            index.open_sessions,
            state.lease.holder, state.lease.fence,
            max(0.0, timer[1] - time.monotonic()) if held and timer is not None else None,
        )

    def engine_urls(self) -> dict[str, str]:
        """The engines' URLs this registry recorded (name -> URL; empty: none recorded)."""
        return dict(self._engine_urls)

    @property
    def journal_format(self) -> int:
        return self._journal.format

    def journal_has(self, key: str) -> bool:
        """Read-only: whether a call under `key` is durable in the journal (tests show a lost reply's
        request landed)."""
        return self._journal.lookup(key) is not None

    def journal_stats(self) -> dict[str, int]:
        return {**self._journal.stats(), "replayed_calls": self.recovery.replayed_calls}

    def recovery_report(self) -> RecoveryReport:
        return self.recovery

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._journal.close()

    def _reached(self, point: str, events_done: int = 0) -> None:
        """A point of a call: `mid_batch` (after `events_done` events were stepped), `before_commit` (its journal row
        written, not yet committed), `after_commit`. Nothing happens here; a test-only subclass holds the process at
        one (tests/registry_faults.py: a real process cannot be made to stop at an exact point of a call on demand, so
        it pauses there and the test kills it)."""


def _check_identities(events: Sequence[RegistryEvent]) -> None:
    """Where a version's identity enters the registry, it must be inside the name grammar
    (spec/identities.py): a `Reserve` mints the version's managed name and takes a slot, so one outside it
    is refused here with InvalidIdentity, before any event of the call is stepped — nothing is taken,
    nothing journaled. The pure core stays total over any key (the model checker's digests are not hex)."""
    for event in events:
        if isinstance(event, Reserve):
            check_version_identity(event.version, event.digest)


