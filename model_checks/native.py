"""The checker's hot modules, compiled to C by mypyc from their own Python source.

`scripts/build_checker.py` (run by `scripts/setup.sh`) compiles `COMPILED` in place: each module
gets an extension file next to its .py, and Python's import system prefers the extension. The
compiled modules are the same source, so there is one model and one checker; mypyc only removes
the interpreter's per-operation overhead (about 2x on the checker's bounds, model_checks/results/
FIGURES.md). The build also type-checks the modules: mypyc refuses a module mypy rejects.

The risk of building in place is a stale build: edit system.py, forget to rebuild, and the checker
silently runs the old model. So the build records a digest of the sources it compiled, and
`check_fresh` (called when `model_checks` is imported) refuses to run compiled modules whose
sources have changed since.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
COMPILED = ("kernel", "system", "bfs")  # modules of this package, by name
GROUP = "model_checks._native"  # mypyc's shared library for the group, kept inside the package
DIGEST_FILE = PACKAGE / "_native.digest"


class StaleNativeBuild(ImportError):
    """Compiled checker modules exist but were built from other sources than the .py files now."""


def source_digest(package: Path = PACKAGE) -> str:
    h = hashlib.sha256()
    for name in COMPILED:
        h.update(name.encode() + b"\0" + (package / f"{name}.py").read_bytes() + b"\0")
    return h.hexdigest()


def extension_files(package: Path = PACKAGE) -> list[Path]:
    """The compiled modules (and mypyc's group library) present in the package directory."""
    names = [*COMPILED, GROUP.rsplit(".", 1)[1] + "__mypyc"]
    return [package / f"{n}{suffix}" for n in names for suffix in importlib.machinery.EXTENSION_SUFFIXES
            if (package / f"{n}{suffix}").exists()]


def is_fresh(package: Path = PACKAGE) -> bool:
    """The build's recorded digest matches the sources now (False when there is no build)."""
    digest = package / DIGEST_FILE.name
    return digest.exists() and digest.read_text().strip() == source_digest(package)


def check_fresh(package: Path = PACKAGE) -> None:
    if extension_files(package) and not is_fresh(package):  # nothing compiled: the .py files run as they are
        raise StaleNativeBuild(
            f"the compiled checker in {package} was built from other sources than the .py files there now "
            f"({', '.join(f'{n}.py' for n in COMPILED)}). Rebuild it: .venv/bin/python scripts/build_checker.py "
            "(or delete the extension files to run the .py files)")


def is_compiled() -> bool:
    """Whether the modules in use are the compiled ones."""
    from model_checks import bfs, kernel, system

    return all(not str(m.__file__).endswith(".py") for m in (kernel, system, bfs))


def package_copy(dest: Path, *, compiled: bool) -> Path:
    """A copy of the package under `dest`: as built (`compiled`), or its .py files alone. Put `dest`
    first on PYTHONPATH to run that checker beside the other (the conformance test, the speed benchmark)."""
    skip = ["__pycache__"] if compiled else ["__pycache__", "*.so", DIGEST_FILE.name]
    shutil.copytree(PACKAGE, dest / "model_checks", ignore=shutil.ignore_patterns(*skip))
    return dest
