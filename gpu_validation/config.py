"""The pre-registered configuration (RFC §7.2): everything that decides a verdict, fixed and written to disk
before the harness sends its first request to any engine.

Full prefixes are fixed up front, not taken from what the engines generate during the run: each session's
turns are a greedy chain computed with the transformers+PEFT reference forward of the version the session is
bound to (turn prompt + generated tokens + tool tokens = next turn's prefix). Baselines and the scenario then
score exactly these prefixes, so the harness never compares two free-running generations that have already
diverged (RFC §7.2), and a tolerance cannot be tuned after seeing the numbers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from versioned_lora.adapters.snapshot import Snapshot

CONFIG_FORMAT = "versioned-lora/gpu-validation/preregistered/v1"
# Engine vs engine of the same build, same weights: batching and cache reuse move bf16 logprobs by a few
# 1e-3 at most on the CPU fixture; the fixture's A and B differ by far more than this (checked as
# `baselines_discriminate`). The publication probe's fixed tolerance of before (now ulps: adapters/probe_check.py).
EPSILON = 0.02
# A scoring prefix discriminates A from B when their greedy tokens differ or a logprob differs by this much.
MIN_SEPARATION = 0.1
NEW_TOKENS_PER_TURN = 6


@attrs.frozen
class SessionPlan:
    """One agentic session of RFC §3.4: the version it binds to, its prompt, its tool outputs."""

    name: str  # S_old, S_mid, S_new
    version: str  # "A" or "B"
    prompt: tuple[int, ...]
    tool_outputs: tuple[tuple[int, ...], ...]  # one per turn after the first (tool turn, resume)


# Token ranges are disjoint so no prompt shares a first token with another or with the publication probe
# (the probe that `end` sends through the new name warms its cache namespace; a disjoint first token keeps
# the first scored request of a fresh name a true cold start).
DEFAULT_SESSIONS: tuple[SessionPlan, ...] = (
    SessionPlan("S_old", "A", tuple(range(40, 60)), ((3, 4, 5, 6, 7), (8, 9, 10))),
    SessionPlan("S_mid", "A", tuple(range(100, 118)), ((11, 12, 13, 14), (15, 16, 17, 18, 19))),
    SessionPlan("S_new", "B", tuple(range(200, 222)), ((20, 21, 22), (23, 24, 25, 26))),
)
KV_PROMPT: tuple[int, ...] = tuple(range(300, 324))
PROBE_INPUT_IDS: tuple[int, ...] = (500, 501, 502, 503)


def code_revision(repo: Path) -> dict[str, Any]:
    """HEAD and whether the working tree differs from it (a dirty tree is recorded, not refused)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {"head": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def model_identity(model_dir: Path, full_hash_limit: int = 64 * 1024 * 1024) -> dict[str, Any]:
    """SHA-256 of every model file up to `full_hash_limit` (the fixture is a few MB); size only above it, so an
    8B checkpoint is identified by config and sizes without hashing 16 GB."""
    files: dict[str, Any] = {}
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        entry: dict[str, Any] = {"bytes": size}
        if size <= full_hash_limit:
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        files[path.name] = entry
    raw_config = json.loads((model_dir / "config.json").read_text())
    dtype = raw_config.get("torch_dtype") or raw_config.get("dtype")
    return {"path": str(model_dir), "files": files, "dtype": dtype}


@attrs.frozen
class ScoringPrefix:
    """A full prefix and the version whose chain produced it; every engine request the harness scores is one
    of these, sent with `max_new_tokens` greedy tokens."""

    prefix_id: str  # e.g. S_old/turn2
    session: str
    turn: int
    token_ids: tuple[int, ...]


def reference_chain(
    reference: Any, snapshot: Snapshot, session: SessionPlan, new_tokens: int
) -> tuple[list[ScoringPrefix], list[list[int]]]:
    """The session's turns under its bound version: turn k+1's prefix is turn k's prefix, the reference's
    greedy tokens for it, and the tool's output. Returns the prefixes and the reference's generated tokens."""
    prefixes: list[ScoringPrefix] = []
    generated: list[list[int]] = []
    ids = list(session.prompt)
    for turn in range(len(session.tool_outputs) + 1):
        prefixes.append(ScoringPrefix(f"{session.name}/turn{turn + 1}", session.name, turn + 1, tuple(ids)))
        tokens = [p.token_id for p in reference.logprobs(snapshot, ids, positions=new_tokens)]
        generated.append(tokens)
        if turn < len(session.tool_outputs):
            ids = ids + tokens + list(session.tool_outputs[turn])
    return prefixes, generated


@attrs.frozen
class PreRegistered:
    """What `preregistered.json` holds; `digest` is the SHA-256 of its canonical JSON."""

    body: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical(self.body)).hexdigest()

    def prefixes(self) -> list[ScoringPrefix]:
        return [ScoringPrefix(p["prefix_id"], p["session"], p["turn"], tuple(p["token_ids"]))
                for p in self.body["scoring_prefixes"]]  # fmt: skip

    def prefix(self, prefix_id: str) -> ScoringPrefix:
        return next(p for p in self.prefixes() if p.prefix_id == prefix_id)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.body, "digest": self.digest}, indent=1, sort_keys=True) + "\n")


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def build_preregistered(
    *,
    model_dir: Path,
    snapshots: dict[str, Snapshot],
    adapter_dirs: dict[str, Path],
    repo: Path,
    reference: Any,
    sessions: Sequence[SessionPlan] = DEFAULT_SESSIONS,
    epsilon: float = EPSILON,
    new_tokens: int = NEW_TOKENS_PER_TURN,
    engines: Sequence[str] = (),
    transport: str = "link",
) -> PreRegistered:
    prefixes: list[ScoringPrefix] = []
    chains: dict[str, Any] = {}
    for session in sessions:
        chain, generated = reference_chain(reference, snapshots[session.version], session, new_tokens)
        prefixes += chain
        chains[session.name] = {"version": session.version, "reference_generated": generated}
    prefixes.append(ScoringPrefix("KV/prompt", "KV", 1, KV_PROMPT))
    body = {
        "format": CONFIG_FORMAT,
        "model": model_identity(model_dir),
        "code_revision": code_revision(repo),
        "fixtures": {
            v: {"digest": s.digest, "adapter_dir": str(adapter_dirs[v]), "serving_config": s.serving_config}
            for v, s in snapshots.items()
        },
        "dtype": {
            "weights": model_identity(model_dir)["dtype"],
            "adapters": sorted({e.dtype for s in snapshots.values() for e in s.manifest.tensors}),
        },
        "sampling": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True, "return_logprob": True},
        "epsilon": epsilon,
        "min_separation": MIN_SEPARATION,
        "scoring_rule": (
            "every generated position of every scoring prefix; a generation passes iff it has max_new_tokens "
            "tokens, each token id equals the baseline's and each |logprob - baseline| <= epsilon; positions after "
            "the first differing token are not compared (the sequences diverged)"
        ),
        "sessions": {s.name: {**attrs.asdict(s), **chains[s.name]} for s in sessions},
        "scoring_prefixes": [attrs.asdict(p) for p in prefixes],
        "kv_prompt": list(KV_PROMPT),
        "probe_input_ids": list(PROBE_INPUT_IDS),
        "engines": list(engines),
        "transport": transport,
        "prefix_source": "transformers+PEFT greedy chain (versioned_lora.adapters.reference_forward.ReferenceModel)",
    }
    return PreRegistered(body)
