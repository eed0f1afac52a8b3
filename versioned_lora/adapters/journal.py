"""The registry's durable journal: SQLite in WAL mode with `synchronous=FULL`.

One row per state-changing registry call: its idempotency key, its events and the answers it got. A
call is one transaction, so a batch of up to 256 events costs one fsync. The core is deterministic,
so replaying the rows' events through `step` rebuilds exactly the state; every replayed answer is
compared with the stored one, which catches a non-deterministic core or a corrupted row on recovery.
Checkpoints (a pickled state plus its canonical digest) bound the replay; the rows stay (they are the
audit log and answer retried keys).

Values are stored as tagged JSON (`encode`/`decode`), not pickle, so a row stays readable and does not
depend on module paths; the same encoding, canonicalised, gives `state_digest`, a hash equal across
processes (Python's `hash` is salted per process).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import operator
import pickle
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from immutables import Map

from versioned_lora import lifecycle
from versioned_lora.lifecycle import RegistryConfig, RegistryEvent, RegistryState
from versioned_lora.runtime.interfaces import RegistryAnswer

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS calls (
    seq INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    events TEXT NOT NULL,
    answers TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (seq INTEGER PRIMARY KEY, state BLOB NOT NULL, digest TEXT NOT NULL);
"""


class JournalCorrupt(Exception):
    """Replaying the journal did not reproduce its stored answers or checkpoint digest."""


class JournalConfigMismatch(Exception):
    """The journal was written for another registry configuration (engines, capacity, epoch)."""


# ---- tagged JSON codec ----------------------------------------------------------------------------------------

# Every value type that can occur in an event, result, effect or state, by class name.
_TYPES: dict[str, type] = {
    name: obj
    for name in lifecycle.__all__
    if isinstance(obj := getattr(lifecycle, name), type)
    and (attrs.has(obj) or issubclass(obj, enum.Enum) or (issubclass(obj, tuple) and hasattr(obj, "_fields")))
}
_TYPES[RegistryAnswer.__name__] = RegistryAnswer
_Encoder = Callable[[Any], Any]
_ENCODERS: dict[type, _Encoder] = {}


def encode(value: Any) -> Any:
    """A JSON-able form of `value`. Lists are always tagged (`[tag, ...]`); scalars stay as they are.
    Maps and frozensets are sorted by their items' canonical JSON, so equal values encode equally.
    One encoder per type, built on first use: the journal encodes every event and answer it writes."""
    cls = type(value)
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        encoder = _ENCODERS[cls] = _encoder_for(cls)
    return encoder(value)


def _scalar(value: Any) -> Any:
    return value


def _encoder_for(cls: type) -> _Encoder:
    if cls in (type(None), bool, int, float, str):
        return _scalar
    name = cls.__name__
    if issubclass(cls, enum.Enum):
        return lambda value: ["E", name, value.value]
    if attrs.has(cls):
        fields = tuple(f.name for f in attrs.fields(cls))
        if len(fields) == 1:
            (only,) = fields
            return lambda value: ["A", name, [encode(getattr(value, only))]]
        getter = operator.attrgetter(*fields)
        return lambda value: ["A", name, [encode(v) for v in getter(value)]]
    if issubclass(cls, tuple):
        if hasattr(cls, "_fields"):
            return lambda value: ["N", name, [encode(v) for v in value]]
        return lambda value: ["T", [encode(v) for v in value]]
    if issubclass(cls, Map):
        return _encode_map
    if issubclass(cls, frozenset):
        return lambda value: ["F", sorted((encode(v) for v in value), key=_canonical)]
    raise TypeError(f"cannot encode {cls.__name__}")


def _encode_map(value: Map[Any, Any]) -> Any:
    items = [[encode(k), encode(v)] for k, v in value.items()]
    items.sort(key=lambda kv: _canonical(kv[0]))
    return ["M", items]


def decode(data: Any) -> Any:
    if not isinstance(data, list):
        return data
    tag = data[0]
    if tag == "A":
        return _TYPES[data[1]](*(decode(v) for v in data[2]))
    if tag == "N":
        return _TYPES[data[1]](*(decode(v) for v in data[2]))
    if tag == "E":
        return _TYPES[data[1]](data[2])
    if tag == "T":
        return tuple(decode(v) for v in data[1])
    if tag == "M":
        return Map((decode(k), decode(v)) for k, v in data[1])
    if tag == "F":
        return frozenset(decode(v) for v in data[1])
    raise ValueError(f"unknown tag {tag!r}")


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def dumps(value: Any) -> str:
    return _canonical(encode(value))


def loads(text: str) -> Any:
    return decode(json.loads(text))


def state_digest(state: RegistryState) -> str:
    """SHA-256 of the canonical encoding of the whole registry state."""
    return hashlib.sha256(dumps(state).encode()).hexdigest()


# ---- the journal ------------------------------------------------------------------------------------------------


@attrs.frozen
class StoredCall:
    seq: int
    key: str
    events: tuple[RegistryEvent, ...]
    answers: tuple[RegistryAnswer, ...]


Step = Callable[[RegistryState, RegistryEvent], tuple[RegistryState, Any, tuple[Any, ...]]]

# Session records serialised per slice of a checkpoint (~1-2 ms of pickling each on this host).
CHECKPOINT_SLICE = 2048


class CheckpointWriter:
    """Serialises one registry state a slice at a time, so that no single call pays for a whole large state
    (10^5 session records pickle in ~0.2 s, which stalled the call that took the checkpoint). The state is an
    immutable value: slices taken during later calls still read exactly the state as of call `seq`.

    `advance(budget_s)` pickles slices of the session map until the budget is spent and says whether the
    whole state is done; `blob()` is then the checkpoint: the state without its sessions plus the slices."""

    def __init__(self, seq: int, state: RegistryState) -> None:
        self.seq = seq
        self._head = attrs.evolve(state, sessions=Map())
        self._items = iter(state.sessions.items())
        self._slices: list[bytes] = []
        self.done = False

    def advance(self, budget_s: float) -> bool:
        deadline = time.perf_counter() + budget_s
        while not self.done:
            records = list(itertools.islice(self._items, CHECKPOINT_SLICE))
            if not records:
                self.done = True
                break
            self._slices.append(pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL))
            if time.perf_counter() >= deadline:
                break
        return self.done

    def blob(self) -> bytes:
        if not self.done:
            raise RuntimeError(f"checkpoint at seq {self.seq} is not finished")
        return pickle.dumps((self._head, self._slices), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load(blob: bytes) -> RegistryState:
        head, slices = pickle.loads(blob)
        sessions = Map(itertools.chain.from_iterable(pickle.loads(part) for part in slices))
        state: RegistryState = attrs.evolve(head, sessions=sessions)
        return state


class Journal:
    """Append-only call log plus checkpoints in one SQLite file (WAL, synchronous=FULL)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT), one per call.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: the WAL is fsynced at every commit, so an acknowledged call survives a power loss too.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---- configuration guard
    def bind_config(self, config: RegistryConfig) -> None:
        """Record the registry configuration on first use; refuse a journal written for another one."""
        text = dumps(config)
        row = self._db.execute("SELECT v FROM meta WHERE k='config'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta (k, v) VALUES ('config', ?)", (text,))
        elif row[0] != text:
            raise JournalConfigMismatch(f"{self.path} was written for {row[0]}, not {text}")

    # ---- writes
    def append(
        self,
        seq: int,
        key: str,
        events: Sequence[RegistryEvent],
        answers: Sequence[RegistryAnswer],
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Write one call as row `seq` in its own transaction: durable (fsynced) when this returns.
        `before_commit` runs inside the transaction (fault injection: a kill there loses the row)."""
        with self._transaction():
            self._db.execute(
                "INSERT INTO calls (seq, key, events, answers) VALUES (?, ?, ?, ?)",
                (seq, key, dumps(tuple(events)), dumps(tuple(answers))),
            )
            if before_commit is not None:
                before_commit()

    def next_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM calls").fetchone()
        return int(row[0]) + 1

    def checkpoint(self, writer: CheckpointWriter) -> None:
        """Store a finished checkpoint (the state as of call `writer.seq`); older ones are dropped (one is
        enough to recover). The blob's own SHA-256 guards it: cheap, unlike the canonical digest of a large
        state."""
        blob = writer.blob()
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints (seq, state, digest) VALUES (?, ?, ?)",
                (writer.seq, blob, hashlib.sha256(blob).hexdigest()),
            )
            self._db.execute("DELETE FROM checkpoints WHERE seq < ?", (writer.seq,))

    # ---- reads
    def lookup(self, key: str) -> StoredCall | None:
        row = self._db.execute("SELECT seq, key, events, answers FROM calls WHERE key=?", (key,)).fetchone()
        return None if row is None else _stored(row)

    def calls_after(self, seq: int) -> Iterator[StoredCall]:
        for row in self._db.execute("SELECT seq, key, events, answers FROM calls WHERE seq > ? ORDER BY seq", (seq,)):
            yield _stored(row)

    def stats(self) -> dict[str, int]:
        calls, last = self._db.execute("SELECT COUNT(*), COALESCE(MAX(seq), 0) FROM calls").fetchone()
        checkpoint = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM checkpoints").fetchone()[0]
        return {"calls": int(calls), "last_seq": int(last), "checkpoint_seq": int(checkpoint)}

    # ---- recovery
    def recover(self, initial: RegistryState, step: Step) -> tuple[RegistryState, int]:
        """The state after the last durable call, and the number of calls replayed. Starts from the
        latest checkpoint (its digest verified) and replays every later call, checking each answer."""
        state, after = initial, 0
        row = self._db.execute("SELECT seq, state, digest FROM checkpoints ORDER BY seq DESC LIMIT 1").fetchone()
        if row is not None:
            after, blob, digest = row
            if hashlib.sha256(blob).hexdigest() != digest:
                raise JournalCorrupt(f"checkpoint at seq {after}: digest mismatch")
            state = CheckpointWriter.load(blob)
        replayed = 0
        for call in self.calls_after(after):
            for event, stored in zip(call.events, call.answers, strict=True):
                state, result, effects = step(state, event)
                if (result, tuple(effects)) != (stored.result, stored.effects):
                    raise JournalCorrupt(
                        f"call {call.seq} ({call.key}): replay answered {result!r}, "
                        f"the journal holds {stored.result!r}"
                    )
            replayed += 1
        return state, replayed

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (the fsync happens at COMMIT), or ROLLBACK on an exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _stored(row: tuple[int, str, str, str]) -> StoredCall:
    seq, key, events, answers = row
    return StoredCall(seq, key, loads(events), loads(answers))
