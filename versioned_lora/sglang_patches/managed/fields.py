"""Exact checks of the request fields an engine reads (issue 19): types exact (a bool is not a number, a float
is not an int), numbers finite and bounded, strings bounded and of a stated charset, unknown fields refused.

Every check raises `BadRequest`, a typed refusal naming the field: the managed endpoints answer it as
``{"error": {"reason", "field", "message"}}`` with its status, the /generate gate the same. Nothing
is read from a request before its field passed here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from versioned_lora.spec.wire import EngineCode, EngineRefusal

# Tokens, ids and names the protocol mints are short printable ASCII; nothing a client sends reaches a
# path, shell or log as anything but text.
TOKEN_RE = re.compile(r"[A-Za-z0-9@._:-]{1,256}")
HEX64_RE = re.compile(r"[0-9a-f]{64}")
HOST_RE = re.compile(r"[A-Za-z0-9.:\[\]_-]{1,255}")
INT64_MAX = 2**63 - 1


class BadRequest(Exception):
    """A request refused before anything was read from it: `code` is the typed reason, `field` the field."""

    def __init__(self, code: EngineCode, message: str, status: int = 400, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.field = field

    def payload(self) -> dict[str, Any]:
        return {"reason": self.code, "message": str(self), **({"field": self.field} if self.field else {})}


def _malformed(name: str, rule: str) -> BadRequest:
    return BadRequest(EngineRefusal.MALFORMED_REQUEST, f"field {name!r} {rule}", field=name)


def only(body: Mapping[str, Any], allowed: Collection[str], where: str = "request") -> None:
    """Refuse any field not in `allowed` (sorted, so the first named is deterministic)."""
    unknown = sorted(str(key) for key in body if key not in allowed)
    if unknown:
        raise BadRequest(EngineRefusal.UNKNOWN_FIELD, f"field {unknown[0]!r} is not accepted by this {where} "
                         f"(accepted: {sorted(allowed)})", field=unknown[0])


def string(body: Mapping[str, Any], name: str, pattern: re.Pattern[str] | None = None, max_len: int = 256,
           default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise _malformed(name, f"must be a string, got {type(value).__name__}")
    if not 0 < len(value) <= max_len:
        raise _malformed(name, f"must be 1..{max_len} characters, got {len(value)}")
    if pattern is not None and pattern.fullmatch(value) is None:
        raise _malformed(name, f"must match {pattern.pattern}")
    return value


def integer(body: Mapping[str, Any], name: str, low: int = 0, high: int = INT64_MAX,
            default: int | None = None) -> int:
    value = body.get(name, default)
    if type(value) is not int:
        raise _malformed(name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise _malformed(name, f"must be in [{low}, {high}], got {value}")
    return value


def number(body: Mapping[str, Any], name: str, low: float, high: float, default: float | None = None,
           low_open: bool = False) -> float:
    """A finite int or float in [low, high] (or (low, high] with `low_open`); bools are not numbers."""
    value = body.get(name, default)
    if type(value) not in (int, float):
        raise _malformed(name, f"must be a number, got {type(value).__name__}")
    number_value = float(value)
    if not math.isfinite(number_value) or number_value > high or number_value < low or (
        low_open and number_value == low
    ):
        raise _malformed(name, f"must be a finite number in {'(' if low_open else '['}{low}, {high}], got {value}")
    return number_value


def boolean(body: Mapping[str, Any], name: str, default: bool | None = None) -> bool:
    value = body.get(name, default)
    if type(value) is not bool:
        raise _malformed(name, f"must be true or false, got {type(value).__name__}")
    return value


def token_ids(value: object, name: str, vocab_size: int, max_len: int) -> list[int]:
    """A non-empty list of at most `max_len` token ids, each an int in [0, vocab_size)."""
    if type(value) is not list:
        raise _malformed(name, f"must be a list of token ids, got {type(value).__name__}")
    if not 0 < len(value) <= max_len:
        raise _malformed(name, f"must hold 1..{max_len} token ids, got {len(value)}")
    for index, token in enumerate(value):
        if type(token) is not int:
            raise _malformed(name, f"[{index}] must be an integer token id, got {type(token).__name__}")
        if not 0 <= token < vocab_size:
            raise BadRequest(EngineRefusal.TOKEN_OUT_OF_VOCAB, f"field {name!r}[{index}] = {token} is outside the "
                             f"vocabulary [0, {vocab_size})", field=name)
    return value
