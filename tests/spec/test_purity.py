"""The core stays pure: an AST scan of spec/ and lifecycle/ finds no import of asyncio, Ray, torch,
HTTP clients, SGLang, sockets or file/process I/O, and no call to open()/print()/input()."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "versioned_lora"
FORBIDDEN_MODULES = {
    "asyncio", "ray", "torch", "httpx", "aiohttp", "sglang", "socket", "requests", "urllib", "http",
    "io", "os", "pathlib", "shutil", "tempfile", "subprocess", "multiprocessing", "threading", "sqlite3",
    "pickle", "glob", "fcntl", "mmap", "signal", "selectors", "ssl", "zmq", "numpy", "safetensors",
}  # fmt: skip
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}
# The docs command is the one module under spec/ that writes files (its renderers in render.py are pure).
EXEMPT = {PACKAGE / "spec" / "docs.py"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{path.name}:{node.lineno} calls {node.func.id}()")
    return found


def test_lifecycle_and_spec_import_no_io() -> None:
    files = sorted((PACKAGE / "lifecycle").glob("*.py")) + sorted((PACKAGE / "spec").glob("*.py"))
    assert len(files) > 15
    problems = [v for path in files if path not in EXEMPT for v in _violations(path)]
    assert problems == []


def test_the_scan_catches_io(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom torch import nn\nimport os.path\nopen('x')\n")
    assert len(_violations(bad)) == 4


def test_the_exemption_is_only_the_docs_command() -> None:
    assert _violations(PACKAGE / "spec" / "docs.py")  # it does touch files, hence the exemption
    assert all(path.exists() for path in EXEMPT)
