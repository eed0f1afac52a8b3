"""Compile the model checker's hot modules with mypyc, in place (see model_checks/native.py).

Run from anywhere: `.venv/bin/python scripts/build_checker.py [--if-stale]` (`--if-stale`: only when
the sources changed since the last build; scripts/setup.sh passes it). Needs a C compiler and the Python
headers (both on a fresh machine of this project's kind). Takes about a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # mypyc names modules by their path relative to the working directory
    from mypyc.build import mypycify
    from setuptools import setup

    # By path, not `import model_checks`: the package's import refuses a stale build, and this
    # script is how a stale build gets replaced.
    spec = importlib.util.spec_from_file_location("model_checks_native", ROOT / "model_checks" / "native.py")
    assert spec is not None and spec.loader is not None
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)

    if "--if-stale" in argv and native.extension_files() and native.is_fresh():
        print("compiled checker up to date")
        return 0
    for old in native.extension_files():
        old.unlink()  # a failed build must not leave the previous one in place
    native.DIGEST_FILE.unlink(missing_ok=True)
    digest = native.source_digest()  # of exactly what is compiled below
    paths = [f"model_checks/{name}.py" for name in native.COMPILED]
    with tempfile.TemporaryDirectory(prefix="build-checker-") as build:
        # Everything but the extension files stays in the temporary directory (no build/ in the repo).
        args = ["-q", "build_ext", "--inplace", "--build-temp", build, "--build-lib", build]
        setup(name="model-checks-native", script_args=args,
              ext_modules=mypycify(paths, group_name=native.GROUP, target_dir=build, opt_level="3"))
    native.DIGEST_FILE.write_text(digest + "\n")
    print("compiled:", ", ".join(p.name for p in native.extension_files()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
