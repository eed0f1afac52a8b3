"""``python -m gpu_validation run --engines URL0,URL1 [--launch]``: the RFC §7.2 harness.

Exit code 0 iff every positive check passes and every negative control is detected (reported FAIL).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from pathlib import Path

from gpu_validation.engines import DEFAULT_BUCKET_BYTES, TOKEN_ENV, LaunchSpec, start_engine, stop_engine
from gpu_validation.harness import Options, run_all
from gpu_validation.report import write_reports
from versioned_lora.capabilities import KEY_FILE_ENV, write_key_file

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpu_validation")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="pre-register, baseline, run the RFC §3.4 scenario and KV checks, report")
    run.add_argument("--engines", help="URL0,URL1 of two patched SGLang engines serving --model")
    run.add_argument("--launch", action="store_true", help="start E0/E1 here (ignores --engines)")
    run.add_argument("--out", type=Path, default=Path("runs/gpu_validation"), help="report directory")
    run.add_argument("--model", type=Path, help="model directory (default: the tiny Qwen3 fixture)")
    run.add_argument("--adapters", help="A_DIR,B_DIR: two PEFT adapters (default: fixture adapters A and B)")
    run.add_argument("--token", help=f"managed-endpoint token (default: ${TOKEN_ENV}; with --launch, a new one)")
    run.add_argument("--capability-key-file", type=Path,
                     help=f"the capability key the engines were started with (default: ${KEY_FILE_ENV}; with "
                          f"--launch, a new one in --out)")
    run.add_argument(
        "--gpu", action="store_true", help="engines serve on CUDA (those the harness starts; the link joins with NCCL)"
    )
    run.add_argument(
        "--transport",
        choices=("link", "disk"),
        default="link",
        help="link: buckets over torch.distributed (gloo, NCCL with --gpu); disk: managed begin from the adapter dir",
    )
    run.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    run.add_argument("--max-lora-rank", type=int, default=8)
    run.add_argument("--lora-target-modules", default="q_proj,v_proj")
    return parser


async def _main(args: argparse.Namespace) -> int:
    from versioned_lora.fixtures import build_fixtures

    if args.model is None or args.adapters is None:
        fixtures = build_fixtures()
    model_dir = args.model or fixtures.model_dir
    adapter_dirs = (dict(zip("AB", (Path(p) for p in args.adapters.split(",")), strict=True)) if args.adapters
                    else {v: fixtures.adapters[v] for v in "AB"})  # fmt: skip
    token = args.token or os.environ.get(TOKEN_ENV) or (secrets.token_hex(16) if args.launch else None)
    args.out.mkdir(parents=True, exist_ok=True)
    key_file = args.capability_key_file or (Path(os.environ[KEY_FILE_ENV]) if os.environ.get(KEY_FILE_ENV) else None)
    if key_file is None and args.launch:
        key_file = write_key_file(args.out / "capability.key")
    if key_file is None:
        print(f"give --capability-key-file (or ${KEY_FILE_ENV}): the key the engines were started with",
              file=sys.stderr)
        return 2
    spec = LaunchSpec(model_dir=model_dir, token=token or "", log_dir=args.out / "engine-logs", key_file=key_file,
                      gpu=args.gpu,
                      max_lora_rank=args.max_lora_rank,
                      lora_target_modules=tuple(args.lora_target_modules.split(",")),
                      source_roots=tuple(sorted({d.resolve().parent for d in adapter_dirs.values()})))  # fmt: skip
    launched = []
    try:
        if args.launch:
            launched = list(await asyncio.gather(start_engine(spec, "E0"), start_engine(spec, "E1")))
            urls = [p.url for p in launched]
        elif args.engines:
            urls = args.engines.split(",")
        else:
            print("give --engines URL0,URL1 or --launch", file=sys.stderr)
            return 2
        options = Options(engine_urls=urls, out_dir=args.out, model_dir=model_dir, adapter_dirs=adapter_dirs,
                          launch=spec, token=token, repo=REPO, transport=args.transport,
                          bucket_bytes=args.bucket_bytes)  # fmt: skip
        run = await run_all(options)
    finally:
        await asyncio.gather(*(stop_engine(p) for p in launched))
    result = write_reports(run, args.out)
    for check in run.checks:
        mark = "ok " if check.ok else "BAD"
        print(f"[{mark}] {check.kind:<8} {check.verdict:<4} {check.name}: {check.detail.splitlines()[-1][:160]}")
    print(f"positives_passed={result['positives_passed']} negative_controls_detected="
          f"{result['negative_controls_detected']} ok={result['ok']} report={args.out / 'report.md'}")  # fmt: skip
    return int(result["exit_code"])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
