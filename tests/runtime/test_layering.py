"""Imports point toward the core (DESIGN.md §4): the runtime never imports adapters; adapters implement
the runtime's ports."""

from __future__ import annotations

import ast
from pathlib import Path

import versioned_lora.runtime as runtime_pkg
from versioned_lora.adapters.ray_registry import LocalRegistry, RayRegistry
from versioned_lora.adapters.sglang_backend import SGLangBackend
from versioned_lora.runtime.interfaces import GenerationBackend, RegistryPort


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_does_not_import_adapters() -> None:
    for path in Path(runtime_pkg.__file__).parent.glob("*.py"):
        offenders = {m for m in imported_modules(path) if m.startswith(("versioned_lora.adapters", "ray"))}
        assert not offenders, f"{path.name} imports {offenders}"


def test_adapters_implement_the_runtime_ports() -> None:
    for cls in (LocalRegistry, RayRegistry):
        for name in ("submit", "submit_batch", "version_states", "state_digest"):
            assert callable(getattr(cls, name)) and hasattr(RegistryPort, name)
    assert all(callable(getattr(SGLangBackend, name)) for name in ("generate", "abort"))
    assert hasattr(GenerationBackend, "generate")


def test_the_driver_executors_decide_nothing_by_state_or_reason() -> None:
    """The Reclaimer, the restart supervisor and the driver loop execute spec/drivers.py's rows: they import no
    state or reason names (what they would compare to decide), and read no view of the registry, except where a
    driver commands it: the supervisor's `ViewPlacement`, the driver loop's `ReadRevision` (the settle driver's),
    `ReadLiveFence` (the lease keeper's: its acquire's key names the fence) and `ReadAttempt` (a publication's stage
    driver's: its reserve's key names the version's last attempt)."""
    folder = Path(runtime_pkg.__file__).parent
    for name in ("reclaimer.py", "driver_loop.py", "supervisor.py"):
        path = folder / name
        modules = imported_modules(path)
        assert not modules & {"versioned_lora.spec.states", "versioned_lora.spec.reasons"}, (name, modules)
        source = path.read_text()
        assert "version_states" not in source, name
        reads = source.count("publication_view")
        assert reads == (name != "reclaimer.py"), (name, reads)
    supervisor = (folder / "supervisor.py").read_text()
    assert "if isinstance(command, ViewPlacement):\n                view = await self.publisher.registry." \
           "publication_view()" in supervisor
    loop = (folder / "driver_loop.py").read_text()
    assert "if isinstance(command, (ReadRevision, ReadLiveFence, ReadAttempt)):\n                view = await " \
           "self.registry.publication_view()" in loop
    # The Publisher's two reads: the recovery driver's `ViewPending`, and `rehydrate` (a caller that names the version
    # and the engine; the supervisor's rows are what decides a rehydrate). A take-over's fence is the keeper's read.
    publisher = (folder / "publisher.py").read_text()
    assert publisher.count("publication_view()") == 2
    assert "if isinstance(command, drivers.ViewPending):\n                view = await self.registry." \
           "publication_view()" in publisher


def test_the_library_side_reaches_the_engine_patch_only_over_its_wire() -> None:
    """adapters/, runtime/, ops/, demo/ and the CLI import nothing from sglang_patches/: they reach an engine's
    patch set over HTTP (and start it as a process by module name), and take the constants both ends agree on
    (paths, the token header, environment names, the protocol version) from spec/wire.py."""
    package = Path(runtime_pkg.__file__).parents[1]
    folders = ("adapters", "runtime", "ops", "demo")
    paths = [package / "cli.py", *(p for sub in folders for p in (package / sub).glob("*.py"))]
    for path in paths:
        offenders = {m for m in imported_modules(path) if m.startswith("versioned_lora.sglang_patches")}
        assert not offenders, f"{path.relative_to(package)} imports {offenders}"
