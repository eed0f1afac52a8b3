"""Capabilities: the registry's word, checkable by an engine without calling the registry, that one exact
managed name may be cleaned (an aborted attempt) or unloaded (a claimed reclaim).

A capability is an HMAC-SHA256 over (action, lora_name, attempt token or reclaim id) under a key that only
the registry actor and the engines hold (`KEY_ENV` in their environments; never the publisher's or the
reclaimer's). The lora_name carries the deployment epoch and the digest prefix, so a capability is bound to
one epoch and one version; the action and the reference bind it to one call. The registry signs when it
answers (`adapters.registry_core.RegistryCore`): a cleanup only for a version that is ABORTED (an abort
row), a reclaim only for one that is RECLAIMING (a claim row), never at reserve, so a publisher never holds
a capability to clean a version it later commits. The journal keeps the unsigned answer; an answer replayed
from it is signed again, so recovery and a key change (same key on registry and engines) strand nothing.

Pure stdlib: imported by the registry adapter and by the engine patch alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

KEY_ENV = "VERSIONED_LORA_CAPABILITY_KEY"  # hex; the same value in the registry actor and every engine
KEY_FILE_ENV = "VERSIONED_LORA_CAPABILITY_KEY_FILE"  # or: a file (0600) holding that hex, read at start
# Rotation: the key the deployment used before, accepted (and signed under) until a stated time, then ignored.
PREVIOUS_KEY_ENV = "VERSIONED_LORA_PREVIOUS_CAPABILITY_KEY"
PREVIOUS_KEY_FILE_ENV = "VERSIONED_LORA_PREVIOUS_CAPABILITY_KEY_FILE"
PREVIOUS_KEY_UNTIL_ENV = "VERSIONED_LORA_PREVIOUS_CAPABILITY_KEY_UNTIL"  # unix seconds, or ISO 8601 with offset
PREFIX = "vlcap1."  # the format; a capability of another format is refused like a forged one
_DOMAIN = b"versioned-lora capability v1"
MAX_LENGTH = len(PREFIX) + 64


class Action(StrEnum):
    CLEANUP = "cleanup"
    RECLAIM = "reclaim"


class CapabilityKeyError(ValueError):
    """The configured key is not 32 or more bytes of hex (or a previous key has no stated window)."""


class KeyRequired(CapabilityKeyError):
    """No key is configured where one is required (a registry not built `insecure=True`, a managed engine)."""


_KEY_ID_DOMAIN = b"versioned-lora key id v1\n"


def key_id(key: bytes) -> str:
    """The key's public name: a hash of it (never the key), equal in the registry and in every engine that holds
    the same key. 64 bits: enough to tell a deployment's keys apart, useless to recover the key."""
    return "kid-" + hashlib.sha256(_KEY_ID_DOMAIN + key).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class KeyRing:
    """The current key and, during a rotation, the previous one until `previous_until` (unix seconds)."""

    current: bytes
    previous: bytes | None = None
    previous_until: float = 0.0

    def keys(self, now: float | None = None) -> tuple[bytes, ...]:
        """Every key accepted now, the current one first."""
        if self.previous is None or (time.time() if now is None else now) >= self.previous_until:
            return (self.current,)
        return (self.current, self.previous)

    def ids(self, now: float | None = None) -> tuple[str, ...]:
        return tuple(key_id(key) for key in self.keys(now))


def new_key() -> str:
    """A fresh key, hex (256 bits)."""
    return secrets.token_hex(32)


def parse_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise CapabilityKeyError(f"{KEY_ENV} must be hex: {exc}") from None
    if len(key) < 32:
        raise CapabilityKeyError(f"{KEY_ENV} must hold at least 32 bytes (64 hex digits), got {len(key)}")
    return key


def key_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The key from `KEY_ENV`, else from the file `KEY_FILE_ENV` names, else None (no key configured)."""
    text = environ.get(KEY_ENV)
    if not text and environ.get(KEY_FILE_ENV):
        text = Path(environ[KEY_FILE_ENV]).read_text()
    return None if not text else parse_key(text)


def _previous_until(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    import datetime

    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CapabilityKeyError(f"{PREVIOUS_KEY_UNTIL_ENV} must be unix seconds or ISO 8601, got {text!r}") from None
    if when.tzinfo is None:
        raise CapabilityKeyError(f"{PREVIOUS_KEY_UNTIL_ENV} must state its time zone (e.g. ...+00:00), got {text!r}")
    return when.timestamp()


def keyring_from_env(environ: Mapping[str, str] = os.environ) -> KeyRing | None:
    """The current key (`key_from_env`) and the previous one with its window, if configured; None: no key."""
    current = key_from_env(environ)
    if current is None:
        return None
    text = environ.get(PREVIOUS_KEY_ENV)
    if not text and environ.get(PREVIOUS_KEY_FILE_ENV):
        text = Path(environ[PREVIOUS_KEY_FILE_ENV]).read_text()
    if not text:
        return KeyRing(current)
    until = environ.get(PREVIOUS_KEY_UNTIL_ENV, "")
    if not until:
        raise CapabilityKeyError(f"a previous capability key needs {PREVIOUS_KEY_UNTIL_ENV}: the time until which it "
                                 f"is still accepted")
    return KeyRing(current, parse_key(text), _previous_until(until))


def write_key_file(path: Path) -> Path:
    """A new key in a file only its owner may read (the deployment gives its path to the registry and engines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(new_key() + "\n")
    return path


def _mac(key: bytes, action: Action, lora_name: str, reference: str) -> str:
    message = b"\n".join((_DOMAIN, action.value.encode(), lora_name.encode(), reference.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def mint(key: bytes, action: Action, lora_name: str, reference: str) -> str:
    """The capability to do `action` on `lora_name` for `reference` (attempt token or reclaim id)."""
    return PREFIX + _mac(key, action, lora_name, reference)


def mint_all(ring: KeyRing, action: Action, lora_name: str, reference: str, now: float | None = None) -> str:
    """`mint` under every key the ring accepts now, joined by ","; one capability outside a rotation window."""
    return ",".join(mint(key, action, lora_name, reference) for key in ring.keys(now))


def verify_any(ring: KeyRing, capability: object, action: Action, lora_name: str, reference: str,
               now: float | None = None) -> bool:
    """Valid if one of the (at most two) joined capabilities verifies under one of the keys the ring accepts now."""
    if not isinstance(capability, str) or len(capability) > 2 * MAX_LENGTH + 1:
        return False
    keys = ring.keys(now)
    return any(verify(key, part, action, lora_name, reference) for part in capability.split(",") for key in keys)


def verify(key: bytes, capability: object, action: Action, lora_name: str, reference: str) -> bool:
    """Constant-time check; anything that is not a capability of this format is simply not valid."""
    if not isinstance(capability, str) or len(capability) != MAX_LENGTH or not capability.startswith(PREFIX):
        return False
    return hmac.compare_digest(capability[len(PREFIX):], _mac(key, action, lora_name, reference))
