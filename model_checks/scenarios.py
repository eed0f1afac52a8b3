"""Scripted starting points for the Hypothesis state machines (stateful.py).

Random rules from the empty registry rarely reach the deep states where some rows live (a version
RECLAIMING while a rehydrate is still staging, an adapter DRAINING with two requests, a candidate
READY and in use when its attempt is aborted...). Each machine run starts from a random prefix of one
of these scripts, then draws rules from the table. Every scripted step goes through the same checked
`fire` as a random one, so a script can never paper over a bug: it only decides where the random walk
begins.

A step is a function of the machine returning (engine name or None for the registry, event); tokens
and incarnations are read from the machine's current state, so a script stays valid under the
spec's own token minting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from versioned_lora.lifecycle import SessionKey, VersionKey, lora_name, reclaim_id
from versioned_lora.lifecycle.enabled import FORGED_RECLAIM_ID
from versioned_lora.spec import events as ev

ENGINES = ("E0", "E1")
VERSIONS = tuple((VersionKey(0, v), f"{v}" * 64) for v in "ABC")
SESSIONS = tuple(SessionKey(0, shard, seq) for shard in (0, 1) for seq in (0, 1))
BUCKETS = 2

Step = Callable[[Any], tuple[str | None, Any]]
A, B, C = 0, 1, 2


def _key(v: int) -> VersionKey:
    return VERSIONS[v][0]


def _digest(v: int) -> str:
    return VERSIONS[v][1]


def _name(v: int) -> str:
    return lora_name(_key(v), _digest(v))


def token(m: Any, v: int) -> str:
    """The version's publication attempt token (as the registry minted it)."""
    return str(m.registry.versions[_key(v)].attempt_token)


def placement_token(m: Any, v: int, e: str) -> str:
    """The attempt the registry placed on engine e: a rehydrate after a restart has its own token."""
    return str(m.registry.placements[(_key(v), e)].attempt_token)


def incarnation(m: Any, e: str) -> int:
    return int(m.registry.incarnations[e])


def _b_token(m: Any) -> str:
    return token(m, B)


def _c_token(m: Any) -> str:
    return token(m, C)


def reg(make: Callable[[Any], Any]) -> Step:
    return lambda m: (None, make(m))


def eng(e: str, make: Callable[[Any], Any]) -> Step:
    return lambda m: (e, make(m))


def stage(v: int, e: str, tok: Callable[[Any], str] | None = None, manifest_ok: bool = True,
          record: bool = True) -> list[Step]:
    """Begin, every bucket, end on engine e; the PREPARED and READY records when `record`."""
    t = tok or (lambda m: placement_token(m, v, e))
    name, key, digest = _name(v), _key(v), _digest(v)
    steps = [eng(e, lambda m: ev.BeginStaging(name, t(m), incarnation(m, e), digest, BUCKETS))]
    if record:
        steps.append(reg(lambda m: ev.RecordPrepared(key, t(m), e, incarnation(m, e), digest)))
    steps += [eng(e, lambda m, i=i: ev.ReceiveBucket(name, t(m), incarnation(m, e), i)) for i in range(BUCKETS)]
    steps.append(eng(e, lambda m: ev.EndStaging(name, t(m), incarnation(m, e), manifest_ok)))
    if record and manifest_ok:
        steps.append(reg(lambda m: ev.RecordReady(key, t(m), e, incarnation(m, e), digest)))
    return steps


def publish(v: int) -> list[Step]:
    steps = [reg(lambda m: ev.Reserve(_key(v), _digest(v)))]
    for e in ENGINES:
        steps += stage(v, e)
    # A commit whose expected revision is stale (a publisher that read the revision before the last
    # commit landed) is refused by the compare-and-swap; then the right one.
    steps.append(reg(lambda m: ev.Commit(_key(v), token(m, v), _stale(m.registry.default_revision))))
    steps.append(reg(lambda m: ev.Commit(_key(v), token(m, v), m.registry.default_revision)))
    return steps


def _stale(revision: int) -> int:
    return revision - 1 if revision else revision + 1


def restart(e: str) -> list[Step]:
    """The engine process restarts (new incarnation) and the registry adopts it."""
    return [eng(e, lambda m: ev.EngineStarted(m.engines[e].incarnation + 1)),
            reg(lambda m: ev.EngineRestarted(e, m.engines[e].incarnation))]


def close(s: int, finalize: bool = True) -> list[Step]:
    steps = [reg(lambda m: ev.BeginClose(SESSIONS[s]))] if finalize else []
    return [*steps, reg(lambda m: ev.CloseAndRelease(SESSIONS[s]))]


def _happy_path() -> list[Step]:
    """RFC §3.4: A published, sessions bound and generating, B published, A reclaimed; then a failed
    publication of C (a manifest that does not verify on E0), abort, cleanup, retry."""
    a_name, a_rid = _name(A), reclaim_id(_key(A))
    steps = publish(A)
    steps += [reg(lambda m, s=s: ev.BindFirst(SESSIONS[s])) for s in (0, 1)]
    steps += [eng(e, lambda m: ev.AcquireRequest(a_name)) for e in ENGINES]
    steps += publish(B)
    steps += [reg(lambda m, s=s: ev.BeginClose(SESSIONS[s])) for s in (0, 1)]
    steps += [reg(lambda m, s=s: ev.CloseAndRelease(SESSIONS[s])) for s in (0, 1)]
    steps += [reg(lambda m: ev.ClaimReclaim(_key(A))), reg(lambda m: ev.ClaimReclaim(_key(A)))]  # claim, retried
    for e in ENGINES:
        steps += [eng(e, lambda m: ev.ReclaimAdapter(a_name, a_rid)), eng(e, lambda m: ev.ReleaseRequest(a_name)),
                  eng(e, lambda m: ev.FinishUnload(a_name, a_rid)),
                  reg(lambda m, e=e: ev.ConfirmReclaim(_key(A), e, FORGED_RECLAIM_ID)),  # a forged receipt
                  reg(lambda m, e=e: ev.ConfirmReclaim(_key(A), e, a_rid)),
                  reg(lambda m, e=e: ev.ConfirmReclaim(_key(A), e, a_rid))]  # and a duplicate one
    steps.append(reg(lambda m: ev.Reserve(_key(C), _digest(C))))
    steps += stage(C, "E0", _c_token, manifest_ok=False, record=False)
    steps += [reg(lambda m: ev.Abort(_key(C), token(m, C))),
              eng("E1", lambda m: ev.CleanupAttempt(_name(C), token(m, C))),
              reg(lambda m: ev.RecordCleaned(_key(C), token(m, C), "E0")),
              reg(lambda m: ev.RecordCleaned(_key(C), token(m, C), "E1")),
              reg(lambda m: ev.Reserve(_key(C), _digest(C)))]
    steps += stage(C, "E0", _c_token, record=False)[:1]
    return steps


def _drain_and_restart() -> list[Step]:
    """A retired while two requests hold it on E0; E1 restarts and starts rehydrating A and B; A is
    claimed while its rehydrate is still staging on E1; E0 drains (in use, one release, the last
    release, the one unload, a second unload); receipts from both engines; B finishes its rehydrate."""
    a_name, a_key, a_rid = _name(A), _key(A), reclaim_id(_key(A))
    steps = publish(A)
    steps += [reg(lambda m, s=s: ev.BindFirst(SESSIONS[s])) for s in (0, 1)]
    steps += [eng("E0", lambda m: ev.AcquireRequest(a_name)), eng("E0", lambda m: ev.AcquireRequest(a_name)),
              eng("E1", lambda m: ev.AcquireRequest(a_name))]
    steps += publish(B)
    steps += [reg(lambda m: ev.ClaimReclaim(a_key)), reg(lambda m: ev.Reserve(_key(C), _digest(C)))]
    steps += restart("E1")
    steps += stage(A, "E1")[:3]  # begin, PREPARED, first bucket: the rehydrate is half-way
    steps += close(0) + close(1, finalize=False)
    steps += [reg(lambda m: ev.ClaimReclaim(a_key)),
              reg(lambda m: ev.RecordPrepared(a_key, placement_token(m, A, "E1"), "E1", incarnation(m, "E1"),
                                              _digest(A))),
              reg(lambda m: ev.RecordReady(a_key, placement_token(m, A, "E1"), "E1", incarnation(m, "E1"),
                                           _digest(A))),
              eng("E1", lambda m: ev.ReclaimAdapter(a_name, a_rid)),
              eng("E0", lambda m: ev.ReclaimAdapter(a_name, a_rid)),
              eng("E0", lambda m: ev.FinishUnload(a_name, a_rid)),
              eng("E0", lambda m: ev.CleanupAttempt(a_name, token(m, A))),
              eng("E0", lambda m: ev.ReleaseRequest(a_name)),
              eng("E0", lambda m: ev.ReleaseRequest(a_name)),
              eng("E0", lambda m: ev.FinishUnload(a_name, a_rid)),
              eng("E0", lambda m: ev.FinishUnload(a_name, a_rid)),
              reg(lambda m: ev.ConfirmReclaim(a_key, "E0", a_rid)),
              reg(lambda m: ev.ClaimReclaim(a_key)),
              reg(lambda m: ev.ConfirmReclaim(a_key, "E1", a_rid)),
              reg(lambda m: ev.ClaimReclaim(a_key))]
    steps += stage(B, "E1")
    return steps


def _abort_paths() -> list[Step]:
    """B's attempt: an unknown outcome on E1, a candidate READY and in use on E0 when the attempt is
    aborted, cleanups that overtake begins, late records, FAILED_CLEAN, a retry with a new token that
    is aborted again before E1 begins, and a manifest that does not verify."""
    b_name, b_key, b_digest = _name(B), _key(B), _digest(B)
    tok = _b_token
    steps = publish(A)
    steps += [reg(lambda m: ev.Reserve(b_key, b_digest)), reg(lambda m: ev.Reserve(_key(C), _digest(C)))]
    steps += stage(B, "E0")
    steps += [eng("E0", lambda m: ev.AcquireRequest(b_name)),
              reg(lambda m: ev.RecordUnknown(b_key, tok(m), "E1")),
              reg(lambda m: ev.Commit(b_key, tok(m), m.registry.default_revision)),
              reg(lambda m: ev.Abort(b_key, tok(m))),
              reg(lambda m: ev.Abort(b_key, tok(m))),
              eng("E0", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              eng("E0", lambda m: ev.ReleaseRequest(b_name)),
              eng("E0", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              eng("E0", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              eng("E0", lambda m: ev.BeginStaging(b_name, tok(m), incarnation(m, "E0"), b_digest, BUCKETS)),
              eng("E0", lambda m: ev.EndStaging(b_name, tok(m), incarnation(m, "E0"), True)),
              eng("E1", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              reg(lambda m: ev.RecordCleaned(b_key, tok(m), "E0")),
              reg(lambda m: ev.RecordCleaned(b_key, tok(m), "E0")),
              reg(lambda m: ev.RecordReady(b_key, tok(m), "E0", incarnation(m, "E0"), b_digest)),
              reg(lambda m: ev.RecordPrepared(b_key, tok(m), "E0", incarnation(m, "E0"), b_digest)),
              reg(lambda m: ev.RecordCleaned(b_key, tok(m), "E1")),
              reg(lambda m: ev.Commit(b_key, tok(m), m.registry.default_revision)),
              reg(lambda m: ev.Abort(b_key, tok(m))),
              reg(lambda m: ev.Reserve(b_key, b_digest)),
              reg(lambda m: ev.Abort(b_key, tok(m))),
              eng("E1", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              eng("E0", lambda m: ev.CleanupAttempt(b_name, tok(m))),
              reg(lambda m: ev.RecordCleaned(b_key, tok(m), "E0")),
              reg(lambda m: ev.RecordCleaned(b_key, tok(m), "E1")),
              reg(lambda m: ev.Reserve(b_key, b_digest))]
    steps += stage(B, "E0", tok)
    steps += stage(B, "E1", tok, manifest_ok=False)
    return steps


SCENARIOS: tuple[tuple[Step, ...], ...] = tuple(tuple(s()) for s in (_happy_path, _drain_and_restart, _abort_paths))
HAPPY_PATH = SCENARIOS[0]
