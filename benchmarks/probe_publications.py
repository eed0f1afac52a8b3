"""Publications through the default probe check at a trained model's logit magnitudes (issue 46, item 2).

Two real SGLang CPU engines serve the real-logit fixture (`tiny-real-logits`: top logits 20-30 under its adapters,
where one bf16 step is 0.125); the registry, the Publisher and the reclaim loop are the trainer-facing API's
(`versioned_lora.connect`, default probe check: the engines' teacher-forced scores must agree with each other,
no base model). Agentic sessions run on both engines the whole time. Step i publishes the fixture's adapter A, B
or C (in turn) moved a little further along its own seeded random walk (as an RL loop's small steps; three walks,
so that consecutive versions differ as much as two policies do and as little as two steps of one), waiting for a
slot if both are held.

Every candidate is correct, so every refusal of one is a false refusal. Beside the check that decided, the check of
before is scored on the same engines' answers (each engine's greedy probe token and its logprob, read from the
engine's status right after the publication, against a transformers + PEFT forward's greedy token within 0.02
nats), and so is the reference variant of the new check (the scores against that forward, at the top logit it
measures). Last line:

    fixture=… top_logit_p50=… publications=N committed=… false_refusals=… old_check_refusals=…
    reference_check_refusals=… indistinct_warnings=… failed_requests=… seconds=… commit=…

    python benchmarks/probe_publications.py [--publications 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from versioned_lora import connect, stop_registry
from versioned_lora.adapters.probe_check import PROBE_ULPS, agree, tolerance
from versioned_lora.adapters.reference_forward import ReferenceModel
from versioned_lora.adapters.sglang_client import SGLangClient
from versioned_lora.adapters.snapshot import Snapshot, snapshot_from_tensors
from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.stack import ensure_ray, new_token, start_engines
from versioned_lora.fixtures import REAL_LOGITS, TINY_PROBE_PROMPT, build_fixtures

PROBE = list(TINY_PROBE_PROMPT)
OLD_EPSILON = 0.02  # the fixed-nats check of before
STEP_SCALE = 0.01  # each step's noise, as a share of each tensor's own standard deviation
SESSIONS = 3


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def walks(adapter_dirs: list[Path], count: int, seed: int) -> list[Snapshot]:
    """`count` snapshots: step i moves adapter i % len(adapter_dirs) one step further along its own random walk."""
    generator = torch.Generator().manual_seed(seed)
    current, configs = [], []
    for directory in adapter_dirs:
        current.append({k: t.float() for k, t in load_file(str(directory / "adapter_model.safetensors")).items()})
        configs.append(json.loads((directory / "adapter_config.json").read_text()))
    out = []
    for step in range(count):
        i = step % len(adapter_dirs)
        current[i] = {k: t + STEP_SCALE * t.std() * torch.randn(t.shape, generator=generator)
                      for k, t in current[i].items()}
        out.append(snapshot_from_tensors({k: t.to(torch.bfloat16) for k, t in current[i].items()}, configs[i]))
    return out


async def traffic(deployment: Any, stop: asyncio.Event, failures: list[str]) -> int:
    """Closed-loop sessions on both engines until `stop`: each generates, takes a tool turn, generates, finishes."""
    sessions = deployment.sessions()
    done = 0

    async def worker(index: int) -> None:
        nonlocal done
        while not stop.is_set():
            session = sessions.open([*PROBE[:8], 100 + index])
            try:
                await session.generate(6)
                session.tool_result([7, 8, 9])
                await session.generate(6)
            except Exception as exc:  # counted, never fatal: the figure says how many
                failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                await session.finish()
            done += 1

    await asyncio.gather(*(worker(i) for i in range(SESSIONS)))
    return done


async def probes_of(urls: list[str], token: str, name: str) -> list[dict[str, Any]]:
    """Each engine's probe of the adapter `name` as its status reports it (still loaded right after the commit)."""
    found = []
    for url in urls:
        async with SGLangClient(url, token=token, timeout_s=60.0) as client:
            managed = (await client.status())["managed"]
            adapter = next((a for a in managed if a["name"] == name), None)
            if adapter is not None and adapter.get("probe"):
                found.append(adapter["probe"])
    return found


async def run(args: argparse.Namespace, urls: list[str], token: str, key_file: Path, out: Path) -> dict[str, Any]:
    fixtures = build_fixtures(fixture=REAL_LOGITS)
    reference = ReferenceModel(fixtures.model_dir)
    candidates = walks([fixtures.adapters[name] for name in sorted(fixtures.adapters)], args.publications, args.seed)
    (out / "engine.token").write_text(token)
    registry = f"probe-bench-{uuid.uuid4().hex[:8]}"
    statuses: dict[str, int] = {}
    false_refusals, old_refusals, reference_refusals, warnings, tops, read = [], 0, 0, 0, [], 0
    failures: list[str] = []
    began = time.monotonic()
    try:
        async with await connect(journal=out / "registry.sqlite", engines=urls, token=token, key_file=key_file,
                                 capacity=2, registry=registry, probe_prompt=PROBE) as deployment:
            stop = asyncio.Event()
            load: asyncio.Task[int] | None = None
            for step, snapshot in enumerate(candidates):
                result = await deployment.publish(f"s{step}", snapshot, wait_for_slot_s=300)
                if load is None and result.committed:  # sessions from the first version on
                    load = asyncio.create_task(traffic(deployment, stop, failures))
                statuses[str(result.outcome)] = statuses.get(str(result.outcome), 0) + 1
                warnings += result.warning is not None
                expected = reference.probe(snapshot, PROBE)
                tops.append(expected.top_logit)
                if not result.committed:
                    false_refusals.append(f"s{step}: {result.outcome} {result.code} {result.detail}")
                    continue
                first = reference.first_token(snapshot, PROBE)
                for probe in await probes_of(urls, token, result.lora_name or ""):
                    read += 1
                    old_refusals += not (probe["token_id"] == first.token_id
                                         and abs(probe["logprob"] - first.logprob) <= OLD_EPSILON)
                    within = tolerance(expected.top_logit, "bfloat16", PROBE_ULPS)
                    reference_refusals += not agree(probe["scores"], expected.scores, within)
                if (step + 1) % 10 == 0:
                    print(f"step {step + 1}: {statuses} old_check_refusals={old_refusals} "
                          f"failed_requests={len(failures)}", flush=True)
            stop.set()
            sessions_done = await load if load is not None else 0
    finally:
        stop_registry(registry, address=None)
    return {
        "fixture": REAL_LOGITS, "top_logit_p50": round(statistics.median(tops), 2), "publications": len(candidates),
        "committed": statuses.get("COMMITTED", 0), "false_refusals": len(false_refusals),
        "engine_probes_read": read, "old_check_refusals": old_refusals, "reference_check_refusals": reference_refusals,
        "indistinct_warnings": warnings, "failed_requests": len(failures), "sessions": sessions_done,
        "seconds": round(time.monotonic() - began, 1), "commit": args.commit,
        "false_refusal_details": false_refusals, "failure_details": failures[:10], "statuses": statuses,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--publications", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--commit", default=None, help="the commit this code is (default: git's HEAD here)")
    args = parser.parse_args(argv)
    args.commit = args.commit or git_commit()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="probe-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    fixtures = build_fixtures(fixture=REAL_LOGITS)
    started_ray = ensure_ray()
    token = new_token()
    key_file = write_key_file(out / "capability.key")
    engines = start_engines(fixtures, out, token, capability_key_file=key_file)
    try:
        report = asyncio.run(run(args, [e.url for e in engines], token, key_file, out))
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            import ray

            ray.shutdown()
    print(json.dumps({k: v for k, v in report.items() if k.endswith("details") or k == "statuses"}, indent=1))
    keys = ("fixture", "top_logit_p50", "publications", "committed", "false_refusals", "engine_probes_read",
            "old_check_refusals",
            "reference_check_refusals", "indistinct_warnings", "failed_requests", "sessions", "seconds", "commit")
    print(" ".join(f"{k}={report[k]}" for k in keys), flush=True)
    ok = report["false_refusals"] == 0 and report["failed_requests"] == 0
    return 0 if ok and report["engine_probes_read"] == 2 * report["committed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
