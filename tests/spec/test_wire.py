"""The transfer-group name both ends agree on (`spec/wire.py`): the engine reads the incarnation a group is named
for from the name exactly, never by looking for its digits inside it."""

from __future__ import annotations

import pytest

from versioned_lora.spec.wire import transfer_group_incarnation, transfer_group_name

INCARNATION = 1764633600123456789  # time.time_ns()-sized, as the engines' are


def test_a_group_name_carries_its_incarnation_exactly() -> None:
    name = transfer_group_name(INCARNATION, "0a1b2c3d")
    assert name == f"vlora-{INCARNATION}-0a1b2c3d"
    assert transfer_group_incarnation(name) == INCARNATION
    assert transfer_group_incarnation(f"vlora-{INCARNATION}7-x") == INCARNATION * 10 + 7  # another incarnation
    assert transfer_group_incarnation("vlora-0-x") == 0


@pytest.mark.parametrize("name", [
    "", "vlora--x", "vlora-01-x", "vlora-1-", "vlora-1-a b", "vlora-1-x-y", f"x-{INCARNATION}-x",
    f"vlora-{INCARNATION}", "vlora-1-" + "a" * 65, "vlora-" + "9" * 22 + "-x", f"prefix-vlora-{INCARNATION}-x",
])
def test_anything_else_is_not_a_group_name(name: str) -> None:
    assert transfer_group_incarnation(name) is None


def test_a_nonce_that_would_not_parse_back_is_refused() -> None:
    with pytest.raises(ValueError):
        transfer_group_name(1, "a-b")
