"""Identities (DESIGN.md §2): the names every message carries so that replays, late arrivals and
restarts can be told apart from new requests."""

from __future__ import annotations

from typing import NamedTuple

LORA_NAME_PREFIX = "relax_policy_lora@"
DIGEST_PREFIX_LEN = 12


class VersionKey(NamedTuple):
    """`(deployment_epoch, version_id)`: chosen before the first reserve, never changes."""

    epoch: int
    version_id: str


class SessionKey(NamedTuple):
    """`(deployment_epoch, shard, seq)`, `seq` increasing per shard.

    The caller's own session id travels as data elsewhere; this key distinguishes lifecycles of
    sessions that share an id and lets closed sessions compact into per-shard low-water marks.
    """

    epoch: int
    shard: int
    seq: int


def lora_name(version: VersionKey, digest: str) -> str:
    """The immutable adapter name requests carry as `lora_path`.

    The digest prefix only helps humans; content is always compared on the full digest.
    """
    return f"{LORA_NAME_PREFIX}{version.epoch}-{version.version_id}-{digest[:DIGEST_PREFIX_LEN]}"


def reclaim_id(version: VersionKey) -> str:
    """Stable per version: a version is reclaimed at most once per epoch, so the id never changes
    across retries of `claim_reclaim` and engine unloads stay idempotent per id."""
    return f"reclaim@{version.epoch}-{version.version_id}"


def attempt_token(epoch: int, serial: int) -> str:
    """Attempt tokens come from a counter in the registry state (not a random source), so a
    registry replayed from its journal mints exactly the same tokens."""
    return f"attempt@{epoch}-{serial}"
