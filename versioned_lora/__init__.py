"""versioned-lora: immutable LoRA versions published to running SGLang engines (see README.md).

The trainer-facing API lives at the top level (`versioned_lora.api`): `connect`, `start_registry`, `Deployment`,
`PublishResult`, `Outcome`, `Sessions`, ... It is imported on first use, so `import versioned_lora.spec` (the pure
core) pulls in none of the runtime."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from versioned_lora.api import (
        DEFAULT_BUCKET_BYTES,
        Deployment,
        DeploymentError,
        InvalidSource,
        Outcome,
        PublishResult,
        ReclaimResult,
        RegistryInfo,
        Resolved,
        Session,
        Sessions,
        connect,
        start_registry,
        stop_registry,
        to_snapshot,
    )

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Deployment",
    "DeploymentError",
    "InvalidSource",
    "Outcome",
    "PublishResult",
    "ReclaimResult",
    "RegistryInfo",
    "Resolved",
    "Session",
    "Sessions",
    "connect",
    "start_registry",
    "stop_registry",
    "to_snapshot",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("versioned_lora.api"), name)
    raise AttributeError(f"module 'versioned_lora' has no attribute {name!r}")
