"""One request/reply pair between the server process and the scheduler, over SGLang's own IPC.

The stash of a candidate lives in the scheduler (where the torch.distributed group and the model
are); the engine-side machine lives in the server. The server calls named functions of
`scheduler_side` through these two structs. They subclass SGLang's ``BaseReq`` (msgspec, tagged),
are registered with ``io_struct.hook_custom_types`` in both processes so the msgpack IPC decodes
them, and the reply is routed by a FanOutCommunicator added to ``_COMMUNICATOR_SPECS``
(``tokenizer_control_mixin``) before the TokenizerManager is built.
"""

from __future__ import annotations

import json
from typing import Any

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class VersionedLoraSchedulerCall(BaseReq, kw_only=True):
    method: str
    payload: bytes  # JSON


class VersionedLoraSchedulerReply(BaseReq, kw_only=True):
    ok: bool
    payload: bytes  # JSON
    error: str = ""


COMMUNICATOR_NAME = "versioned_lora_scheduler"


def register_types() -> None:
    hook_custom_types(VersionedLoraSchedulerCall, VersionedLoraSchedulerReply)


def encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def decode(raw: bytes) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(raw or b"{}")
    return value
