"""How a patch is applied: version guard, one record per replaced attribute, idempotence.

Every patch module calls :func:`replace_attribute` for each SGLang attribute it replaces, naming
the function it replaces and why. The records make patches visible (the status endpoint lists
them) and make applying twice a no-op, which matters because a spawned child may import the patch
module through more than one path.
"""

from __future__ import annotations

import importlib.metadata
import os
import types
from collections.abc import Callable
from typing import Any

import attrs

from versioned_lora.spec.wire import PATCHES_ENV

SUPPORTED_SGLANG_VERSION = "0.5.23"

# PATCHES_ENV (spec/wire.py): comma-separated patch set names ("cpu", "managed"). Set by the server entry
# point in its own environment so that the scheduler and detokenizer (spawned, so they inherit os.environ)
# apply exactly the same set. EXIT_WITH_PARENT_ENV "1": the engine stops once the process that started it is
# gone (`server.exit_with_parent`).


class UnsupportedSGLangVersion(RuntimeError):
    """Raised before any patch touches an SGLang whose internals we have not read."""


@attrs.frozen
class PatchRecord:
    patch_set: str
    target: str  # "module:attribute", the thing replaced
    why: str
    original: Any = attrs.field(eq=False, repr=False)


_applied: dict[str, PatchRecord] = {}


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported_sglang(version: str | None = None) -> None:
    found = installed_sglang_version() if version is None else version
    if found != SUPPORTED_SGLANG_VERSION:
        raise UnsupportedSGLangVersion(
            f"versioned-lora patches SGLang internals that differ between releases; they were written "
            f"and tested against sglang=={SUPPORTED_SGLANG_VERSION}, but sglang=={found} is installed. "
            f"Install sglang=={SUPPORTED_SGLANG_VERSION}, or run SGLang without the versioned-lora patches."
        )


def replace_attribute(patch_set: str, owner: Any, name: str, new: Any, why: str) -> Any:
    """Replace ``owner.name`` by ``new`` once per process and return the original."""
    require_supported_sglang()
    if isinstance(owner, types.ModuleType):
        target = f"{owner.__name__}:{name}"
    else:
        target = f"{owner.__module__}:{owner.__qualname__}.{name}"
    if target in _applied:
        return _applied[target].original
    original = getattr(owner, name)
    setattr(owner, name, new)
    _applied[target] = PatchRecord(patch_set=patch_set, target=target, why=why, original=original)
    return original


def applied_patches() -> list[PatchRecord]:
    return list(_applied.values())


def requested_patch_sets() -> list[str]:
    raw = os.environ.get(PATCHES_ENV, "")
    return [name.strip() for name in raw.split(",") if name.strip()]


PatchSet = Callable[[], None]
