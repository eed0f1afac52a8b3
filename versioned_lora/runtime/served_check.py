"""The exact-version check of an engine's `end` receipt against the snapshot (issue 46, item 1).

An engine answers `end` with what it read back from its own LoRA memory pool after the load (the served digest, in
the pool's dtype, and the config it applies the weights with). The publisher requires both to equal the
candidate's (`CandidatePort.served_identity`, recorded in its manifest). This is the check `CheckProbe` runs first;
its answer, a `CheckRefused` or None, is what the table's rows read (`probe.mismatch` records the code as the
engine's failure: spec/drivers.py). It only compares; nothing here decides what follows.
"""

from __future__ import annotations

from enum import StrEnum

from versioned_lora.lifecycle.drivers import CheckRefused
from versioned_lora.runtime.interfaces import ReadyReceipt, ServedIdentity


class ServedRefusal(StrEnum):
    # The pool's bytes at the adapter's buffer id, unstacked and unpadded, differ from the snapshot converted to the
    # pool's dtype (or the engine could not read them back): the engine would not serve this version.
    SERVED_DIGEST_MISMATCH = "SERVED_DIGEST_MISMATCH"
    # The engine applies the weights with another rank, alpha, scaling or target modules than the manifest's.
    SERVED_CONFIG_MISMATCH = "SERVED_CONFIG_MISMATCH"


def served_refusal(expected: ServedIdentity, receipt: ReadyReceipt) -> CheckRefused | None:
    """None if the engine serves exactly `expected`; else the refusal, naming both sides. The digest is checked
    before the config: weights that differ make the config's agreement moot."""
    served = receipt.served
    where = f"{receipt.lora_name} on incarnation {receipt.incarnation}"
    if served is None:
        return CheckRefused(ServedRefusal.SERVED_DIGEST_MISMATCH,
                            f"{where}: the engine read back no served digest "
                            f"({receipt.served_error or 'none given'}); the snapshot's is {expected.digest} in "
                            f"{expected.dtype}")
    if (served.dtype, served.digest) != (expected.dtype, expected.digest):
        return CheckRefused(ServedRefusal.SERVED_DIGEST_MISMATCH,
                            f"{where}: the engine's LoRA pool holds served digest {served.digest} in {served.dtype}; "
                            f"the snapshot's is {expected.digest} in {expected.dtype}")
    if served.config != expected.config:
        return CheckRefused(ServedRefusal.SERVED_CONFIG_MISMATCH,
                            f"{where}: the engine loaded config {served.config}; the manifest's is {expected.config}")
    return None
