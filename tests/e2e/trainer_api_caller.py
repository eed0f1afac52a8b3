"""A trainer's code against the top-level API, as a user writes it: `test_trainer_api.py` runs it on a fresh
deployment and checks (by reading this file) that it imports nothing from `versioned_lora`'s subpackages."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import AutoModelForCausalLM

from versioned_lora import Outcome, connect

PROMPT = list(range(10, 30))


async def run(*, journal: Path, engines: list[str], token_file: Path, key_file: Path, model_dir: Path,
              adapters: dict[str, Path], registry: str) -> dict[str, Any]:
    seen: dict[str, Any] = {"phases": []}
    async with await connect(journal=journal, engines=engines, token_file=token_file, key_file=key_file,
                             capacity=2, registry=registry, probe_prompt=PROMPT,
                             on_phase=lambda version, phase, s: seen["phases"].append((version, phase))) as deployment:
        seen["v1"] = await deployment.publish("v1", adapters["A"])  # a PEFT adapter directory
        sessions = deployment.sessions()
        first = sessions.open(PROMPT)
        await first.generate(4)

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapters["B"])
        seen["v2"] = await deployment.publish("v2", model)  # a live PEFT model
        first.tool_result([7, 8, 9])  # a tool turn, then the session's next generation: still on v1
        await first.generate(4)
        second = sessions.open(PROMPT)
        await second.generate(4)

        # Both slots hold a version a session still uses: refused for capacity, typed ...
        seen["v3_refused"] = await deployment.publish("v3", adapters["C"])
        # ... and, waiting for a slot, committed once the first session's close lets v1 be reclaimed.
        waiting = asyncio.create_task(deployment.publish("v3", adapters["C"], wait_for_slot_s=600))
        await first.finish()
        seen["v3"] = await waiting
        await second.finish()
        seen["reclaimed"] = await deployment.wait_reclaimed(["v1", "v2"], timeout_s=600)
        seen["sessions"] = {"first": (first.version_id, sorted(first.lora_names)),
                            "second": (second.version_id, sorted(second.lora_names))}
        seen["default"] = await deployment.default_version()
        seen["epoch"] = deployment.epoch
        seen["outcomes"] = {k: v.outcome for k, v in seen.items() if hasattr(v, "outcome")}
        seen["committed"] = Outcome.COMMITTED
    return seen
