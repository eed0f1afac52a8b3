"""Identities (DESIGN.md §2): the names every message carries so that replays, late arrivals and
restarts can be told apart from new requests."""

from __future__ import annotations

import hashlib
import re
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


RECLAIM_SALT_LEN = 16  # the part of a reclaim id nobody can compute without the registry's salt, in hex digits


def reclaim_id(version: VersionKey, salt: str = "") -> str:
    """Stable per version and registry: a version is reclaimed at most once per epoch, so the id never
    changes across retries of `claim_reclaim` and engine unloads stay idempotent per id. Its last part is
    keyed by the registry's `id_salt` (random per journal), so the id cannot be computed from the version's
    name: only the registry's answers (and what the engines echo in their status) carry it. What stops an
    unload the registry did not decide is the capability a keyed engine requires (`versioned_lora.capabilities`);
    this keeps a guessed id from even naming a claim.

    An empty salt gives the unsalted id of journals written before salts existed (and of the model checker),
    so such a journal replays to the ids its engines hold."""
    if not salt:
        return f"reclaim@{version.epoch}-{version.version_id}"
    keyed = hashlib.sha256(f"{salt}\x00{version.epoch}\x00{version.version_id}".encode()).hexdigest()
    return f"reclaim@{version.epoch}-{version.version_id}-{keyed[:RECLAIM_SALT_LEN]}"


def attempt_token(epoch: int, serial: int) -> str:
    """Attempt tokens come from a counter in the registry state (not a random source), so a
    registry replayed from its journal mints exactly the same tokens."""
    return f"attempt@{epoch}-{serial}"


# ---- the grammar of managed names (issue 19) -------------------------------------------------------------------
#
#   relax_policy_lora@<epoch>-<version_id>-<digest prefix>
#
# epoch:          decimal, no sign, no leading zero, < 2**63 (at most 19 digits)
# version_id:     1..64 characters of [A-Za-z0-9._-], starting with a letter or digit; it may itself hold
#                 '-', which is why a name is parsed from both ends: the epoch is everything up to the first
#                 '-', the digest prefix everything after the last one, the version id what lies between
# digest prefix:  the first 12 of the version's digest, which is 64 lowercase hex digits (SHA-256)
#
# Nothing in a name can reach a path, a shell or a log line as anything but plain text.

EPOCH_MAX = 2**63 - 1
VERSION_ID_MAX_LEN = 64
DIGEST_LEN = 64
_EPOCH_RE = re.compile(r"0|[1-9][0-9]{0,18}")
_VERSION_ID_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{VERSION_ID_MAX_LEN - 1}}}")
_DIGEST_PREFIX_RE = re.compile(rf"[0-9a-f]{{{DIGEST_PREFIX_LEN}}}")
_DIGEST_RE = re.compile(rf"[0-9a-f]{{{DIGEST_LEN}}}")
LORA_NAME_MAX_LEN = len(LORA_NAME_PREFIX) + 19 + 1 + VERSION_ID_MAX_LEN + 1 + DIGEST_PREFIX_LEN


class InvalidIdentity(ValueError):
    """A name, version id, epoch or digest outside the grammar above. `part` says which part is wrong
    (``type``, ``length``, ``prefix``, ``epoch``, ``version_id``, ``digest``); nothing was done with it."""

    def __init__(self, part: str, value: object, rule: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = f"{shown[:77]}..."
        super().__init__(f"INVALID_IDENTITY: {part} {shown} {rule}")
        self.part = part
        self.value = value
        self.rule = rule

    def __reduce__(self) -> tuple[type[InvalidIdentity], tuple[str, object, str]]:
        # Raised inside the registry actor, it crosses Ray's process boundary pickled.
        return (type(self), (self.part, self.value, self.rule))


class LoraNameParts(NamedTuple):
    epoch: int
    version_id: str
    digest_prefix: str


def check_epoch(epoch: object) -> int:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= EPOCH_MAX:
        raise InvalidIdentity("epoch", epoch, f"must be an int in [0, {EPOCH_MAX}]")
    return epoch


def check_version_id(version_id: object) -> str:
    if not isinstance(version_id, str) or _VERSION_ID_RE.fullmatch(version_id) is None:
        raise InvalidIdentity(
            "version_id", version_id,
            f"must be a string of 1..{VERSION_ID_MAX_LEN} of [A-Za-z0-9._-] starting with a letter or digit",
        )
    return version_id


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or _DIGEST_RE.fullmatch(digest) is None:
        raise InvalidIdentity("digest", digest, f"must be {DIGEST_LEN} lowercase hex digits")
    return digest


def check_version_identity(version: object, digest: object) -> None:
    """What a `Reserve` must carry: a `VersionKey` of an epoch and a version id inside the grammar, and a
    full digest. Raises InvalidIdentity."""
    if not isinstance(version, tuple) or len(version) != 2:
        raise InvalidIdentity("version", version, "must be a VersionKey(epoch, version_id)")
    check_epoch(version[0])
    check_version_id(version[1])
    check_digest(digest)


def parse_lora_name(name: object) -> LoraNameParts:
    """The parts of a managed name, or InvalidIdentity naming the part outside the grammar."""
    if not isinstance(name, str):
        raise InvalidIdentity("type", name, "a managed name must be a string")
    if len(name) > LORA_NAME_MAX_LEN:
        raise InvalidIdentity("length", name, f"is {len(name)} characters, at most {LORA_NAME_MAX_LEN}")
    if not name.startswith(LORA_NAME_PREFIX):
        raise InvalidIdentity("prefix", name, f"must start with {LORA_NAME_PREFIX!r}")
    body = name[len(LORA_NAME_PREFIX):]
    epoch_text, sep, rest = body.partition("-")
    version_id, sep2, digest_prefix = rest.rpartition("-")
    if not sep or not sep2:
        raise InvalidIdentity("name", name, "must be <prefix><epoch>-<version_id>-<digest[:12]>")
    if _EPOCH_RE.fullmatch(epoch_text) is None or int(epoch_text) > EPOCH_MAX:
        raise InvalidIdentity("epoch", epoch_text, f"must be a decimal in [0, {EPOCH_MAX}] without leading zeros")
    check_version_id(version_id)
    if _DIGEST_PREFIX_RE.fullmatch(digest_prefix) is None:
        raise InvalidIdentity("digest", digest_prefix, f"prefix must be {DIGEST_PREFIX_LEN} lowercase hex digits")
    return LoraNameParts(int(epoch_text), version_id, digest_prefix)


def check_lora_name(name: object, digest: str | None = None) -> LoraNameParts:
    """`parse_lora_name`, and, given the full `digest` the name is meant for, that its digest part is that
    digest's prefix."""
    parts = parse_lora_name(name)
    if digest is not None and parts.digest_prefix != digest[:DIGEST_PREFIX_LEN]:
        raise InvalidIdentity("digest", parts.digest_prefix,
                              f"disagrees with the manifest digest {digest[:DIGEST_PREFIX_LEN]}...")
    return parts
