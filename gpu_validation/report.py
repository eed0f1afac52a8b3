"""The run's report: `report.json` (every check, comparison and observation) and `report.md` (for people)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_validation.harness import Run


def summary(run: Run) -> dict[str, Any]:
    positives = [c for c in run.checks if c.kind == "positive"]
    negatives = [c for c in run.checks if c.kind == "negative"]
    ok = all(c.ok for c in run.checks) and len(negatives) >= 2
    return {
        "positives_passed": f"{sum(c.ok for c in positives)}/{len(positives)}",
        "negative_controls_detected": f"{sum(c.ok for c in negatives)}/{len(negatives)}",
        "ok": ok,
        "exit_code": 0 if ok else 1,
    }


def write_reports(run: Run, out_dir: Path) -> dict[str, Any]:
    result = summary(run)
    body = {
        "summary": result,
        "preregistered": {"path": "preregistered.json", "digest": run.pre.digest},
        "run_id": run.run_id,
        "engines": run.options.engine_urls,
        "transport": run.options.transport,
        "timings_s": run.timings,
        "notes": run.notes,
        "checks": [c.to_dict() for c in run.checks],
        "observations": [o.to_dict() for o in run.observations],
    }
    (out_dir / "report.json").write_text(json.dumps(body, indent=1) + "\n")
    (out_dir / "report.md").write_text(markdown(run, result))
    return result


def markdown(run: Run, result: dict[str, Any]) -> str:
    pre = run.pre.body
    lines = [
        "# RFC §7.2 validation report",
        "",
        f"- engines: {', '.join(run.options.engine_urls)} (transport: {run.options.transport})",
        f"- pre-registered config: `preregistered.json`, sha256 `{run.pre.digest}`",
        f"- code: `{pre['code_revision']['head']}`" + (" (dirty tree)" if pre["code_revision"]["dirty"] else ""),
        "- fixtures: " + ", ".join(f"{v} `{f['digest'][:16]}`" for v, f in pre["fixtures"].items()),
        f"- sampling: greedy, {pre['sampling']['max_new_tokens']} tokens per scoring prefix; epsilon {pre['epsilon']}",
        f"- **positives passed {result['positives_passed']}, negative controls detected "
        f"{result['negative_controls_detected']} → {'OK' if result['ok'] else 'NOT OK'}**",
        "",
        "| check | kind | verdict | as required | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for check in run.checks:
        detail = check.detail.replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(
            f"| {check.name} | {check.kind} | {check.verdict} | {'yes' if check.ok else '**no**'} | {detail} |"
        )
    lines += ["", "## Cached tokens (KV isolation)", "", "| engine | request | lora_name | cached | prompt |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for o in run.observations:
        if o.prefix_id == "KV/prompt" and not o.phase.startswith("baseline"):
            lines.append(f"| {o.engine} | {o.phase} | `{o.lora_name[-30:]}` | {o.cached_tokens} | {o.prompt_tokens} |")
    lines += ["", "## Notes", "", *(f"- {n}" for n in run.notes), "", "## Timings (s)", "",
              *(f"- {k}: {v}" for k, v in run.timings.items()), ""]  # fmt: skip
    return "\n".join(lines)
