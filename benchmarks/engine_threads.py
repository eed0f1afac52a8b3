"""Decode speed of the tiny fixture's CPU engines with one torch thread each (`EngineConfig.cpu_threads=1`, the
default since 1fd6716) against torch's default (every core: `cpu_threads=None`), on this 2-core host.

Per setting: two engines started together; one greedy generation of `TOKENS` tokens (ignore_eos) on E0 alone,
three times, then one on each engine at once, three times; tokens/s per generation (client wall time). Not a
test: nothing is asserted. Output: one line per setting.

    python benchmarks/engine_threads.py 1|inherit [TOKENS]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.stack import new_token, start_engines
from versioned_lora.fixtures import build_fixtures

PROMPT = list(range(10, 30))


async def one(url: str, token: str, tokens: int) -> float:
    async with SGLangClient(url, token=token) as client:
        started = time.monotonic()
        generation = await client.generate(PROMPT, None, tokens, ignore_eos=True)
        return len(generation.output_ids) / (time.monotonic() - started)


async def measure(urls: list[str], token: str, tokens: int) -> tuple[list[float], list[list[float]]]:
    await one(urls[0], token, tokens)  # warm-up
    alone = [await one(urls[0], token, tokens) for _ in range(3)]
    both = [list(await asyncio.gather(one(urls[0], token, tokens), one(urls[1], token, tokens))) for _ in range(3)]
    return alone, both


def main(threads: str, tokens: int) -> None:
    fixtures = build_fixtures()
    out = Path(f"/tmp/engine-threads-{threads}")
    out.mkdir(parents=True, exist_ok=True)
    token = new_token()
    engines = start_engines(fixtures, out, token, capability_key_file=write_key_file(out / "capability.key"),
                            cpu_threads=None if threads == "inherit" else int(threads))
    try:
        alone, both = asyncio.run(measure([e.url for e in engines], token, tokens))
        print(f"cpu_threads={threads}: one stream alone tok/s {[round(x) for x in alone]}; two streams, one per "
              f"engine, tok/s each {[[round(x) for x in b] for b in both]}", flush=True)
    finally:
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1900)
