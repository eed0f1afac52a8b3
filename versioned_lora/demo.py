"""The main job on two local CPU engines.

Today (foundation): start E0 and E1 with the tiny Qwen3 fixture, load adapters A and B on both
(pinned), and print per engine and version the greedy tokens, first-token logprobs and cached
tokens of a cold and a warm request. The publication demo (issue: demo-bench) replaces this body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from versioned_lora.adapters.engine_process import EngineConfig, EngineProcess
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.fixtures import build_fixtures

PROMPT = list(range(10, 30))
BASE_PORT = 31000


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fixtures = build_fixtures()
    console.print(f"fixture model [bold]{fixtures.model_dir}[/bold]")
    engines = [
        EngineProcess(
            EngineConfig(model_dir=fixtures.model_dir, port=BASE_PORT + 100 * i, log_path=out_dir / f"E{i}.log")
        )
        for i in range(2)
    ]
    try:
        with console.status("starting two SGLang CPU engines (about a minute)..."):
            for engine in engines:
                engine.start()
        rows = asyncio.run(_probe(engines, {n: fixtures.adapters[n] for n in ("A", "B")}))
    finally:
        for engine in engines:
            engine.stop()

    table = Table(title="greedy decoding per engine and version (prompt: 20 tokens)")
    for column in ("engine", "version", "lora_id", "tokens", "first logprob", "cached cold", "cached warm"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["engine"], row["version"], row["lora_id"][:8], " ".join(map(str, row["tokens"])),
            f"{row['first_logprob']:.5f}", str(row["cached_cold"]), str(row["cached_warm"]),
        )
    console.print(table)
    (out_dir / "report.json").write_text(json.dumps(rows, indent=2))
    console.print(f"report written to {out_dir / 'report.json'}")
    return 0


async def _probe(engines: list[EngineProcess], adapters: dict[str, Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for index, engine in enumerate(engines):
        async with SGLangClient(engine.url) as client:
            for name, path in adapters.items():
                result = await client.load_lora_adapter(name, str(path), pinned=True)
                if not result["success"]:
                    raise RuntimeError(f"E{index} failed to load {name}: {result}")
            status = await client.status()
            ids = {a["name"]: a["lora_id"] for a in status["adapters"]}
            for name in adapters:
                cold = await client.generate(PROMPT, name, max_new_tokens=6)
                warm = await client.generate(PROMPT, name, max_new_tokens=6)
                rows.append(
                    {
                        "engine": f"E{index}",
                        "version": name,
                        "lora_id": ids[name],
                        "tokens": cold.output_ids,
                        "first_logprob": cold.logprobs[0],
                        "cached_cold": cold.cached_tokens,
                        "cached_warm": warm.cached_tokens,
                    }
                )
    return rows
