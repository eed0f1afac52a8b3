"""`versioned-lora diagram` and the exit-status mapping (no engines, no Ray)."""

from __future__ import annotations

from pathlib import Path

from ops_helpers import CliRun, cli_here

from versioned_lora.ops.commands import Exit, publish_exit, reclaim_exit
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.reclaimer import ReclaimStatus
from versioned_lora.spec.states import Machine

STATE_MACHINES_DOC = Path(__file__).parents[2] / "docs" / "state-machines.md"


def diagram(*args: str) -> CliRun:
    return cli_here("diagram", *args)


def test_diagram_of_each_machine_is_the_mermaid_block_of_the_committed_state_machines_doc() -> None:
    doc = STATE_MACHINES_DOC.read_text()
    for machine in Machine:
        out = diagram(machine.value)
        assert out.code == 0, out.stderr
        assert out.stdout.startswith("stateDiagram-v2\n")
        assert f"## {machine.value}\n\n```mermaid\n{out.stdout}```" in doc


def test_diagram_without_a_machine_prints_all_and_an_unknown_machine_is_refused() -> None:
    out = diagram()
    assert out.code == 0 and out.stdout.count("stateDiagram-v2") == len(Machine)
    refused = diagram("nope")
    assert refused.code == Exit.ERROR and refused.stdout == ""
    assert "unknown machine 'nope'" in refused.stderr


def test_every_publish_and_reclaim_outcome_has_its_own_exit_status() -> None:
    publish = {(status, reason): publish_exit(status, reason) for status, reason in [
        (PublishStatus.COMMITTED, None), (PublishStatus.REJECTED, "CAPACITY_ERROR"),
        (PublishStatus.REJECTED, "COMMIT_UNRESOLVED"), (PublishStatus.FAILED_CLEAN, "EngineRefused"),
        (PublishStatus.UNKNOWN, "COMMIT_OUTCOME_UNKNOWN"), (PublishStatus.REPLAYED, None)]}
    assert list(publish.values()) == [Exit.OK, Exit.REJECTED_CAPACITY, Exit.REJECTED, Exit.FAILED_CLEAN,
                                      Exit.UNKNOWN, Exit.PENDING]
    assert [reclaim_exit(s) for s in ReclaimStatus] == [Exit.OK, Exit.REJECTED, Exit.PENDING, Exit.UNKNOWN]
    assert {int(e) for e in Exit} == {0, 1, 3, 4, 5, 6, 7}  # 2 stays argparse's usage error
