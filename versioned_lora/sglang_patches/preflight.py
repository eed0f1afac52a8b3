"""What a managed engine needs before anything starts: the shared-secret token and the registry's capability key.

Checked twice. First in ``server.main`` before SGLang is imported, so that an engine started without either stops
in about a second with the reason, instead of after SGLang's imports and argument parsing (about 20 s of CPU on a
CPU host, in a CLI that is told nothing until then). Then again where the managed patch set applies, which reads
the key ring this process keeps (``require_capability_key``): a process started some other way is held to the same.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from versioned_lora import capabilities
from versioned_lora.spec.wire import TOKEN_ENV

MIN_TOKEN_LEN = 16
MANAGED_PATCH_SET = "managed"


class MissingToken(RuntimeError):
    """The managed patch set does not start without a shared-secret token: managed endpoints change what an
    engine serves, and an engine without a token would take those calls from anyone who can reach its port."""


class MissingCapabilityKey(RuntimeError):
    """The managed patch set does not start without the registry's capability key: without it an engine could
    not tell an unload the registry decided from one a token holder made up."""


def require_capability_key() -> capabilities.KeyRing:
    """The engine's key ring, read from its environment once per process (the key files are read at start)."""
    global _KEYRING
    if _KEYRING is not None:
        return _KEYRING
    try:
        ring = capabilities.keyring_from_env()
    except (OSError, capabilities.CapabilityKeyError) as exc:
        raise MissingCapabilityKey(f"the capability key could not be read: {exc}") from None
    if ring is None:
        raise MissingCapabilityKey(
            f"versioned-lora managed engines need the deployment's capability key: ${capabilities.KEY_FILE_ENV} (a "
            f"0600 file the registry actor reads too) or ${capabilities.KEY_ENV}; `versioned-lora keygen PATH` "
            f"makes one (docs/runbook.md, 'KEY_MISMATCH')"
        )
    _KEYRING = ring
    return ring


_KEYRING: capabilities.KeyRing | None = None


def require_token() -> str:
    secret = os.environ.get(TOKEN_ENV, "")
    if len(secret) < MIN_TOKEN_LEN:
        raise MissingToken(
            f"versioned-lora managed engines need ${TOKEN_ENV} of at least {MIN_TOKEN_LEN} characters "
            f"({'unset' if not secret else f'{len(secret)} given'}); `versioned-lora engine` generates one"
        )
    return secret


def check(patch_sets: Sequence[str]) -> None:
    """Raises MissingToken or MissingCapabilityKey if the managed patch set is asked for without them."""
    if MANAGED_PATCH_SET in patch_sets:
        require_token()
        require_capability_key()
