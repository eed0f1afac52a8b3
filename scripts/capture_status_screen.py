"""Take the README's screen of `versioned-lora status` from a real terminal (tmux) on a live deployment.

Starts a local Ray cluster, the registry actor and two patched SGLang CPU engines (the demo's `Stack`),
publishes A, binds a session to A, publishes B (every slot now held), runs `versioned-lora status` in a
detached tmux window 150 columns wide and writes what `tmux capture-pane` shows to docs/status-screen.txt.
Run it alone on the host (it starts two engines): `.venv/bin/python scripts/capture_status_screen.py`.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from versioned_lora.capabilities import write_key_file
from versioned_lora.demo.stack import Stack, ensure_ray, load_fixtures, new_token, start_engines

OUT = Path(__file__).parents[1] / "docs" / "status-screen.txt"
SESSION = "versioned-lora-status-screen"


async def prepare(stack: Stack) -> None:
    await stack.publisher.sync_incarnations()
    a_version, a = stack.candidate("A")
    b_version, b = stack.candidate("B")
    assert (await stack.publisher.publish(a_version, a)).committed
    binder = stack.new_binder(stack.backend, shard=0)
    await binder.bind_first(binder.open("S_long_running"))  # keeps A's session ref
    assert (await stack.publisher.publish(b_version, b)).committed


def capture(command: str) -> str:
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True, check=False)
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "150", "-y", "45",
                    f"{command}; echo; echo '[exit '$?']'; sleep 600"], check=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True,
                                  check=True).stdout
            if "[exit " in text:
                return text
            time.sleep(1.0)
        raise TimeoutError(f"status did not finish in the tmux window:\n{text}")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True, check=False)


async def screen(urls: list[str], token: str, workdir: Path) -> str:
    import ray

    stack = Stack(urls, token, workdir, load_fixtures(), capability_key_file=workdir / "capability.key")
    try:
        await prepare(stack)
        address = ray.get_runtime_context().gcs_address
        command = " ".join(shlex.quote(part) for part in [
            f"{Path(sys.executable).parent}/versioned-lora", "status", "--address", address,
            "--name", stack.registry_name, "--engines", ",".join(urls)])
        text = await asyncio.to_thread(capture, command)
    finally:
        await stack.close()
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return (f"$ versioned-lora status --address {address} --name {stack.registry_name} --engines {','.join(urls)}\n"
            + "\n".join(lines) + "\n")


def main() -> int:
    import ray

    token = new_token()
    workdir = Path(tempfile.mkdtemp(prefix="status-screen-"))
    started_ray = ensure_ray()
    key_file = write_key_file(workdir / "capability.key")  # the engines' and the registry actor's
    engines = start_engines(load_fixtures(), workdir, token, capability_key_file=key_file)
    try:
        OUT.write_text(asyncio.run(screen([e.url for e in engines], token, workdir)))
        print(OUT.read_text())
    finally:
        for engine in engines:
            engine.stop()
        if started_ray:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
