"""Issue 46, item 1: exact-version proof from the engine's own memory, on real engines.

After the load, each engine reads the candidate back from SGLang's LoRA memory pool (the A and B buffers at its
buffer id: what the kernels read), undoes the stacking and padding and hashes it (`managed/served_readback.py`); its
`end` answers that served digest and the config it loaded, and the publisher requires both to equal the snapshot's
(`runtime/served_check.py`, read by the table's `probe.mismatch` row). Injected (`managed/served_faults.py`, the
test-only set): a byte flipped in the pool after SGLang's copy, and a load with another alpha or fewer target modules
than the manifest's; each is refused at `end`, typed, naming both sides.

Everything but the injected fault is real: the Ray registry actor, the Publisher, both CPU engines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from engine_helpers import client_for, run
from test_publication_e2e import deployed

from versioned_lora.adapters.served import expected_served_config
from versioned_lora.runtime.interfaces import ReadyReceipt
from versioned_lora.runtime.publisher import PublishStatus
from versioned_lora.runtime.served_check import ServedRefusal
from versioned_lora.spec.states import VersionState


async def _arm(d: Any, engine: str, point: str, name: str, release: bool = False) -> None:
    async with client_for(d.clients[engine].base_url) as client:
        await client.managed("test_hold", point=point, lora_name=name, **({"release": True} if release else {}))


def _record_receipts(d: Any) -> dict[tuple[str, str], ReadyReceipt]:
    """Each engine's `end` receipt by (engine, lora_name), recorded on the way through the real staging ports."""
    receipts: dict[tuple[str, str], ReadyReceipt] = {}
    for name, port in d.publisher.engines.items():
        real_end = port.end

        async def end(candidate: Any, attempt_token: str, name: str = name, real_end: Any = real_end) -> ReadyReceipt:
            receipt: ReadyReceipt = await real_end(candidate, attempt_token)
            receipts[(name, receipt.lora_name)] = receipt
            return receipt

        port.end = end
    return receipts


def test_a_version_is_ready_only_once_each_engine_reads_back_the_snapshots_served_digest(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            receipts = _record_receipts(d)
            version, b = d.candidate("B")
            expected = b.served_identity()
            manifest = b.snapshot.manifest
            assert manifest.served is not None and (manifest.served.dtype, manifest.served.digest) == (
                expected.dtype, expected.digest)  # recorded in the manifest, so the version's digest covers it
            assert expected.config == expected_served_config(manifest.serving_config)
            outcome = await d.publisher.publish(version, b)
            assert outcome.status is PublishStatus.COMMITTED, outcome
            for engine in ("E0", "E1"):
                served = receipts[(engine, b.lora_name)].served
                assert served == expected, (engine, served, expected)
                view = next(m for m in (await d.clients[engine].status())["managed"] if m["name"] == b.lora_name)
                assert view["served"]["digest"] == expected.digest and view["end_parts"]["served_s"] > 0, view

    run(body())


def test_injected_flipped_pool_byte_changes_the_served_logprob_and_is_refused_at_end_typed(
    engines, fixtures, tmp_path
) -> None:
    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            receipts = _record_receipts(d)
            clean_version, clean = d.candidate("B")
            assert (await d.publisher.publish(clean_version, clean)).committed
            # The same tensors as another version: every byte sent and verified is the same as the clean one's.
            flipped_version, flipped = d.candidate("B-flipped", "B")
            assert flipped.digest == clean.digest and flipped.lora_name != clean.lora_name
            await _arm(d, "E1", "flip_pool_byte", flipped.lora_name)
            try:
                outcome = await d.publisher.publish(flipped_version, flipped)
            finally:
                await _arm(d, "E1", "flip_pool_byte", flipped.lora_name, release=True)

            # The flip changes what E1 serves: its probe differs from its own probe of the same bytes unflipped,
            # while E0 (not flipped) scores both versions alike.
            e1_clean, e1_flipped = receipts[("E1", clean.lora_name)], receipts[("E1", flipped.lora_name)]
            e0_clean, e0_flipped = receipts[("E0", clean.lora_name)], receipts[("E0", flipped.lora_name)]
            assert e0_flipped.probe_scores == e0_clean.probe_scores
            assert e1_flipped.probe_scores != e1_clean.probe_scores, e1_flipped
            drift = max(abs(a - b) for a, b in zip(e1_flipped.probe_scores, e1_clean.probe_scores, strict=True))
            assert drift > 0, drift

            expected = flipped.served_identity()
            assert e0_flipped.served == expected
            assert e1_flipped.served is not None and e1_flipped.served.digest != expected.digest
            assert outcome.status is PublishStatus.FAILED_CLEAN, outcome
            assert outcome.reason == ServedRefusal.SERVED_DIGEST_MISMATCH, outcome
            # Both sides named: what E1's pool holds and what the snapshot says.
            assert e1_flipped.served.digest in outcome.detail and expected.digest in outcome.detail, outcome.detail
            assert "E1" in outcome.detail, outcome.detail
            view = await d.registry.publication_view()
            assert view.versions[flipped_version].state is VersionState.FAILED_CLEAN
            assert view.default == clean_version

    run(body())


@pytest.mark.parametrize("fault", ["alter_alpha", "drop_module"])
def test_injected_load_with_another_config_than_the_manifests_is_refused_at_end_typed(
    engines, fixtures, tmp_path, fault: str
) -> None:
    """Another alpha (the weights applied at another scale), or a target module left out of the config."""

    async def body() -> None:
        async with deployed(engines, fixtures, tmp_path) as d:
            receipts = _record_receipts(d)
            version, c = d.candidate("C")
            await _arm(d, "E0", fault, c.lora_name)
            try:
                outcome = await d.publisher.publish(version, c)
            finally:
                await _arm(d, "E0", fault, c.lora_name, release=True)
            expected = c.served_identity()
            loaded = receipts[("E0", c.lora_name)].served
            assert loaded is not None and loaded.digest == expected.digest  # the weights are right ...
            assert loaded.config != expected.config  # ... under another config
            changed = {k for k, v in json.loads(loaded.config).items() if json.loads(expected.config)[k] != v}
            assert changed == ({"lora_alpha", "scaling"} if fault == "alter_alpha" else {"target_modules"}), changed
            assert receipts[("E1", c.lora_name)].served == expected
            assert outcome.status is PublishStatus.FAILED_CLEAN, outcome
            assert outcome.reason == ServedRefusal.SERVED_CONFIG_MISMATCH, outcome
            assert loaded.config in outcome.detail and expected.config in outcome.detail, outcome.detail
            assert (await d.registry.publication_view()).versions[version].state is VersionState.FAILED_CLEAN

    run(body())
