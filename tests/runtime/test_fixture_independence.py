"""Production code does not depend on the fixtures (issue 46, item 5): no module under versioned_lora/ but
fixtures.py and demo/ imports the fixtures module, directly, relatively or through importlib; the CLI reaches
it only lazily, through demo/, on the commands that need a fixture; the engine has no default source root."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import versioned_lora

PACKAGE = Path(versioned_lora.__file__).parent
FIXTURES_MODULE = "versioned_lora.fixtures"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fixture_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every way `source` (the text of `module`) names the fixtures module: `import versioned_lora.fixtures`,
    `from versioned_lora import fixtures`, `from versioned_lora.fixtures import X`, the relative forms
    (`from . import fixtures`, `from ..fixtures import X`), and the module's dotted name in any string (what an
    `importlib.import_module` or `__import__` call needs)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[:2] == FIXTURES_MODULE.split(".")]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if target == FIXTURES_MODULE or any(f"{target}.{a.name}" == FIXTURES_MODULE for a in node.names):
                found.append(f"from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().startswith(
                FIXTURES_MODULE):  # a module name (what importlib takes), not prose in a docstring
            found.append(f"string {node.value!r}")
    return found


def test_the_detector_sees_every_form_of_import() -> None:
    """The walk below can fail: each way of importing the fixtures module is found, in a module of adapters/."""
    here = "versioned_lora.adapters.example"
    for source in ("import versioned_lora.fixtures", "from versioned_lora import fixtures",
                   "from versioned_lora.fixtures import build_fixtures", "from .. import fixtures",
                   "from ..fixtures import cache_root",
                   "import importlib\nimportlib.import_module('versioned_lora.fixtures')",
                   "def f():\n    from versioned_lora.fixtures import TINY\n    return TINY"):
        assert fixture_imports(source, here), source
    for source in ("from versioned_lora import capabilities", "from . import fixtures",  # adapters.fixtures: another
                   "from versioned_lora.demo.defaults import build_fixtures", '"""see versioned_lora.fixtures"""'):
        assert not fixture_imports(source, here), source
    assert fixture_imports("from . import fixtures", "versioned_lora.cli")
    assert fixture_imports("from .fixtures import TINY", "versioned_lora", is_package=True)


def test_no_production_module_imports_the_fixtures() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the walk sees the whole package
    offenders = {}
    for path in modules:
        relative = path.relative_to(PACKAGE)
        if relative == Path("fixtures.py") or relative.parts[0] == "demo":
            continue
        found = fixture_imports(path.read_text(), module_name(path), is_package=path.name == "__init__.py")
        if found:
            offenders[str(relative)] = found
    assert offenders == {}


def test_the_cli_and_the_operating_commands_load_no_fixture_code() -> None:
    """Building every subcommand's parser (what each `versioned-lora ...` call does) and importing the operating
    commands, the Publisher and the engine adapters leave the fixtures module unloaded: it comes in only where a
    command needs a fixture (`fixtures`, `demo`, a default model)."""
    code = ("import sys, contextlib, io\n"
            "import versioned_lora.cli as cli, versioned_lora.ops.commands, versioned_lora.runtime.publisher\n"
            "import versioned_lora.adapters.engine_staging, versioned_lora.adapters.reference_forward\n"
            "import versioned_lora.demo\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    cli.main(['publish', '--help'])\n"
            f"print(sorted(m for m in sys.modules if m.startswith(('{FIXTURES_MODULE}', 'versioned_lora.demo.'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("configured", ["", None])
def test_an_engine_without_a_source_root_reads_no_candidate_from_disk(
    configured: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from versioned_lora.sglang_patches.managed.endpoints import confined_source, source_roots
    from versioned_lora.sglang_patches.managed.fields import BadRequest
    from versioned_lora.spec.wire import SOURCE_ROOT_ENV

    if configured is None:
        monkeypatch.delenv(SOURCE_ROOT_ENV, raising=False)
    else:
        monkeypatch.setenv(SOURCE_ROOT_ENV, configured)
    (tmp_path / "candidate").mkdir()
    assert source_roots() == []
    with pytest.raises(BadRequest) as refused:
        confined_source(str(tmp_path / "candidate"))
    assert refused.value.code == "SOURCE_PATH_REFUSED" and "none configured" in str(refused.value)
    monkeypatch.setenv(SOURCE_ROOT_ENV, str(tmp_path))
    assert confined_source(str(tmp_path / "candidate")) == (tmp_path / "candidate").resolve()


def test_the_engine_command_passes_its_source_roots(tmp_path: Path) -> None:
    import os

    from versioned_lora.cli import engine_source_roots
    from versioned_lora.spec.wire import SOURCE_ROOT_ENV

    assert engine_source_roots(None) == {}
    assert engine_source_roots([str(tmp_path), "rel"]) == {
        SOURCE_ROOT_ENV: os.pathsep.join([str(tmp_path.resolve()), str(Path("rel").resolve())])}
