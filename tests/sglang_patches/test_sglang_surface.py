"""Guarded against SGLang moving (issue 46, item 6): every SGLang name the patches replace, call or read
(`sglang_patches/surface.py`, `load_lora_adapter_from_tensors` among them) exists in the installed SGLang, under
the version guard it was read against; and the table misses no `replace_attribute` target of the patches."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

import versioned_lora.sglang_patches as patches_pkg
from versioned_lora.sglang_patches.mechanism import SUPPORTED_SGLANG_VERSION, installed_sglang_version
from versioned_lora.sglang_patches.surface import SGLANG_SURFACE, SGLangUse

PATCHES = Path(patches_pkg.__file__).parent


def resolve(use: SGLangUse) -> Any:
    """The named object (or, for a field, the class that must carry it); raises LookupError naming what is
    missing."""
    try:
        owner: Any = importlib.import_module(use.module)
    except ImportError as exc:
        raise LookupError(f"module {use.module} is gone: {exc}") from exc
    *parents, attr = use.path
    if use.kind == "communicator":
        specs = getattr(owner, parents[0], ())
        if attr not in {spec[0] for spec in specs}:
            raise LookupError(f"{use.target}: no communicator {attr}")
        return specs
    for part in parents:
        if not hasattr(owner, part):
            raise LookupError(f"{use.target}: {part} is gone")
        owner = getattr(owner, part)
    if use.kind != "field":
        if not hasattr(owner, attr):
            raise LookupError(f"{use.target}: {attr} is gone")
        return getattr(owner, attr)
    if hasattr(owner, attr):
        return owner
    if dataclasses.is_dataclass(owner) and attr in {f.name for f in dataclasses.fields(owner)}:
        return owner
    source = "".join(inspect.getsource(k) for k in inspect.getmro(owner) if k.__module__.startswith("sglang"))
    if f"self.{attr} =" in source or f"self.{attr}: " in source:
        return owner
    raise LookupError(f"{use.target}: no field or instance attribute {attr}")


def test_the_table_is_read_against_the_guarded_release() -> None:
    assert {use.guard for use in SGLANG_SURFACE} == {SUPPORTED_SGLANG_VERSION}
    assert installed_sglang_version() == SUPPORTED_SGLANG_VERSION  # else the patches refuse to apply at all
    targets = [use.target for use in SGLANG_SURFACE]
    assert len(targets) == len(set(targets))
    assert {use.kind for use in SGLANG_SURFACE} == {"replaced", "called", "field", "communicator"}
    for name in ("sglang.srt.managers.tokenizer_manager:TokenizerManager.load_lora_adapter_from_tensors",
                 "sglang.srt.managers.tp_worker:TpModelWorker.load_lora_adapter_from_tensors",
                 "sglang.srt.model_executor.model_runner:ModelRunner.load_lora_adapter_from_tensors"):
        assert name in targets


@pytest.mark.parametrize("use", SGLANG_SURFACE, ids=lambda use: f"{use.kind}:{use.target}")
def test_every_name_the_patches_use_exists_in_the_installed_sglang(use: SGLangUse) -> None:
    found = resolve(use)
    if use.kind == "called":
        assert callable(found), f"{use.target} is no longer callable"


def test_a_missing_name_is_found_missing() -> None:
    """The check above can fail: a renamed method, a removed module and a dropped field are each reported."""
    for target, kind in (("sglang.srt.managers.tp_worker:TpModelWorker.load_lora_adapter_from_tensors_v2", "called"),
                         ("sglang.srt.no_such_module:f", "called"),
                         ("sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.no_such_field", "field"),
                         ("sglang.srt.managers.tokenizer_control_mixin:_COMMUNICATOR_SPECS.no_such", "communicator")):
        with pytest.raises(LookupError):
            resolve(SGLangUse(target, kind, "nowhere"))


def _replace_attribute_targets(path: Path) -> set[str]:
    """(owner expression, attribute) of each `replace_attribute(set, owner, name, ...)` in `path`; a name taken
    from a loop over literals (`for method in ("a", "b")`, or a dict's keys) is each literal."""
    tree = ast.parse(path.read_text())
    loops: dict[str, list[str]] = {}
    constants: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except Exception:  # not a literal
                pass
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
            iterable: Any = node.iter
            if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute):
                iterable = iterable.func.value  # X.items() / X.keys()
            try:
                values = ast.literal_eval(iterable)
            except Exception:  # not a literal: a name bound to one, or not a loop over names
                values = constants.get(iterable.id) if isinstance(iterable, ast.Name) else None
            if isinstance(target, ast.Name) and values is not None:
                loops[target.id] = [str(v) for v in values]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "replace_attribute":
            owner, name = node.args[1], node.args[2]
            names = [str(name.value)] if isinstance(name, ast.Constant) else loops[name.id]  # type: ignore[attr-defined]
            found |= {f"{ast.unparse(owner)}.{n}" for n in names}
    return found


def test_every_replaced_attribute_of_the_patches_is_in_the_table() -> None:
    replaced = {use.target for use in SGLANG_SURFACE if use.kind == "replaced"}
    # An owner expression names a class or module of the table; `module` in cpu_compat is each pinning module.
    leaves = {t.split(":")[1].split(".")[-2] + "." + t.rsplit(".", 1)[-1] if "." in t.split(":")[1]
              else t.split(":")[0].rsplit(".", 1)[-1] + "." + t.split(":")[1] for t in replaced}
    aliases = {"registry_class": "LoRARegistry", "http_server": "http_server", "rope_base": "base",
               "module": "{layers,torch_backend,lora}"}
    seen: set[str] = set()
    for path in sorted(PATCHES.rglob("*.py")):
        for target in _replace_attribute_targets(path):
            owner, attr = target.rsplit(".", 1)
            if owner == "torch.Tensor":  # torch's, not SGLang's
                continue
            owner = aliases.get(owner, owner)
            owners = owner.strip("{}").split(",")
            for one in owners:
                assert f"{one}.{attr}" in leaves, f"{path.name} replaces {one}.{attr}, not in SGLANG_SURFACE"
                seen.add(f"{one}.{attr}")
    assert seen == leaves, f"listed as replaced but replaced nowhere: {sorted(leaves - seen)}"
