"""Every code a managed engine refuses with is a member of one of two enums (issue 17, part 4): the table's
`Reason` or the wire's `EngineRefusal` (`spec/wire.py`), which both the engine's patch set and the library
import. The engine names no code by a string of its own: a scan of `sglang_patches/` finds no code literal
where a refusal is built, raised or counted, and none equal to a code anywhere outside a docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from versioned_lora.sglang_patches.managed import metrics
from versioned_lora.spec.reasons import Reason
from versioned_lora.spec.wire import ENGINE_CODES, KEY_MISMATCH, OTHER_CODE, EngineRefusal, PortRefusal

PATCHES = Path(__file__).resolve().parents[2] / "versioned_lora" / "sglang_patches"
# Where a refusal's code is given: the first argument of these calls, the value of a "reason" key.
CODE_TAKERS = {"BadRequest", "StagingFailed", "CandidateRefused", "EngineOperationError", "count_refusal"}
CODE_SHAPE = re.compile(r"[A-Z][A-Z0-9_]{3,}")


def _docstrings(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def code_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) for every string literal of `source` that names a refusal code by hand."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found: list[tuple[int, str]] = []

    def literal(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in CODE_TAKERS:
                # The code is the first argument; count_refusal(endpoint, reason)'s is the second.
                where = 1 if name == "count_refusal" else 0
                text = literal(node.args[where]) if len(node.args) > where else None
                if text is not None and CODE_SHAPE.fullmatch(text):
                    found.append((node.lineno, text))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                text = literal(value)
                if literal(key) == "reason" and text is not None:
                    found.append((node.lineno, text))
        elif isinstance(node, ast.Constant) and id(node) not in docs and literal(node) in ENGINE_CODES:
            found.append((node.lineno, str(node.value)))
        elif isinstance(node, ast.JoinedStr):  # f"CODE: ..." messages
            head = literal(node.values[0]) if node.values else None
            if head is not None and head.split(":")[0] in ENGINE_CODES:
                found.append((node.lineno, head))
    return sorted(set(found))


def test_the_two_enums_are_disjoint_and_name_their_values() -> None:
    assert not {str(r) for r in Reason} & {str(r) for r in EngineRefusal}
    assert all(member.name == member.value for member in (*Reason, *EngineRefusal))
    assert OTHER_CODE not in ENGINE_CODES


def test_the_ports_own_refusals_are_codes_no_engine_answers() -> None:
    """KEY_MISMATCH and PROTOCOL_MISMATCH are refused by the library's port before a call is sent (issue 41)."""
    assert KEY_MISMATCH in set(PortRefusal) and all(member.name == member.value for member in PortRefusal)
    assert not {str(r) for r in PortRefusal} & ENGINE_CODES


def test_the_engine_patch_set_names_every_code_through_the_enums() -> None:
    offenders = {
        str(path.relative_to(PATCHES)): hits
        for path in sorted(PATCHES.rglob("*.py"))
        if (hits := code_literals(path.read_text()))
    }
    assert offenders == {}


def test_the_scan_catches_a_code_by_hand() -> None:
    source = '''
def check(body):
    """NO_FREE_SLOT in a docstring is prose."""
    if not body:
        raise BadRequest("NO_FREE_SLOT", "every slot taken")
    metrics.count_refusal("generate", "SOMETHING_NEW")
    return {"reason": "MALFORMED_REQUEST", "message": f"LOAD_FAILED: {body}"}
'''
    assert {text for _line, text in code_literals(source)} == {
        "NO_FREE_SLOT", "SOMETHING_NEW", "MALFORMED_REQUEST", "LOAD_FAILED: "}


def test_the_refusal_counter_labels_only_codes() -> None:
    before = metrics.refusals()
    metrics.count_refusal("test", EngineRefusal.NO_FREE_SLOT)
    metrics.count_refusal("test", Reason.IN_USE)
    metrics.count_refusal("test", "A_CODE_NOBODY_DEFINED")
    metrics.count_refusal("test", None)
    after = metrics.refusals()
    added = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    assert added == {("test", "NO_FREE_SLOT"): 1, ("test", "IN_USE"): 1, ("test", OTHER_CODE): 2}
