"""A probe refusal says what it compared (issue 46): the outcome's `reason` is the refusal's code, PROBE_MISMATCH,
not an exception class, and its detail names where the engine's scores differ from the reference's and the
tolerance. The engines are doubles (every call accepted, `end` answers the scores -1.0, -2.0); the probe check is
injected, the real ReferenceProbeCheck's comparison and `explain` over a reference that differs; the registry is the
real core."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_lost_replies_injected import candidate, deployment

from versioned_lora.adapters.reference_forward import ProbeScores, ReferenceProbeCheck
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import EngineRefused, EngineUnreachable
from versioned_lora.runtime.publisher import Publisher, PublisherRefusal, PublishStatus, failure_reason
from versioned_lora.spec.states import VersionState


class InjectedReference(ReferenceProbeCheck):
    """ReferenceProbeCheck (its comparison and its `explain`) over a fixed reference instead of a forward."""

    def __init__(self, reference: ProbeScores) -> None:
        super().__init__(model=None, probe_input_ids=[10, 11, 12])  # type: ignore[arg-type]
        self.fixed = reference

    def reference(self, candidate: Any) -> ProbeScores:
        return self.fixed


def test_injected_probe_mismatch_is_refused_with_its_code_both_sides_and_the_tolerance(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        # Top logit 24: one bf16 ulp there is 0.125, the tolerance 2 x 4 x 0.125 = 1.0 nats; position 2 is 1.5 off.
        check = InjectedReference(ProbeScores(scores=(-1.2, -0.5), top_logit=24.0))
        outcome = await Publisher(registry, engines, check, Deadlines()).publish(version, shipped)
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, PublisherRefusal.PROBE_MISMATCH)
        assert outcome.detail is not None
        assert "the probe check refused the loaded candidate" in outcome.detail, outcome.detail
        assert ("its probe scores differ from the reference forward's by 1.50000 nats at probe position 2 "
                "(-2.00000 against -0.50000); tolerance 1.00000 nats (4 ulps of bfloat16 at the reference's top "
                "logit 24.000, twice)") in outcome.detail, outcome.detail
        assert (await registry.publication_view()).versions[version].state is VersionState.FAILED_CLEAN

    asyncio.run(body())


def test_a_failure_reason_is_the_refusal_code_or_what_went_wrong() -> None:
    assert failure_reason(EngineRefused("MANIFEST_MISMATCH", "E1: bucket 0")) == "MANIFEST_MISMATCH"
    assert failure_reason(EngineUnreachable("E0: end: no answer")) == "EngineUnreachable"
