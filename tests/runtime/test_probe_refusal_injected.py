"""A probe refusal says what it compared (issue 46): the outcome's `reason` is the refusal's code, PROBE_MISMATCH,
not an exception class, and its detail names the engine's answer, the reference's and the tolerance. The engines
are doubles (every call accepted, `end` answers token 7 at logprob -1.0); the probe check is injected, the real
ReferenceProbeCheck's `explain` with a reference that differs; the registry is the real core."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_lost_replies_injected import candidate, deployment

from versioned_lora.adapters.reference_forward import ProbeReference, ReferenceProbeCheck
from versioned_lora.runtime.deadlines import Deadlines
from versioned_lora.runtime.interfaces import EngineRefused, EngineUnreachable
from versioned_lora.runtime.publisher import Publisher, PublisherRefusal, PublishStatus, failure_reason
from versioned_lora.spec.states import VersionState


class InjectedReference(ReferenceProbeCheck):
    """ReferenceProbeCheck (its comparison and its `explain`) over a fixed reference instead of a forward."""

    def __init__(self, reference: ProbeReference, epsilon: float) -> None:
        super().__init__(model=None, probe_input_ids=[10, 11], epsilon=epsilon)  # type: ignore[arg-type]
        self.fixed = reference

    def reference(self, candidate: Any) -> ProbeReference:
        return self.fixed


def test_injected_probe_mismatch_is_refused_with_its_code_both_sides_and_the_tolerance(tmp_path: Path) -> None:
    async def body() -> None:
        registry, engines = deployment(tmp_path)
        version, shipped = candidate("A")
        check = InjectedReference(ProbeReference(token_id=9, logprob=-0.5), epsilon=0.02)
        outcome = await Publisher(registry, engines, check, Deadlines()).publish(version, shipped)
        assert (outcome.status, outcome.reason) == (PublishStatus.FAILED_CLEAN, PublisherRefusal.PROBE_MISMATCH)
        assert outcome.detail is not None
        assert "probe 7/-1.00000 differs from the reference forward" in outcome.detail, outcome.detail
        assert "the reference forward answers 9/-0.50000" in outcome.detail
        assert "its logprob within 0.02 nats" in outcome.detail
        assert (await registry.publication_view()).versions[version].state is VersionState.FAILED_CLEAN

    asyncio.run(body())


def test_a_failure_reason_is_the_refusal_code_or_what_went_wrong() -> None:
    assert failure_reason(EngineRefused("MANIFEST_MISMATCH", "E1: bucket 0")) == "MANIFEST_MISMATCH"
    assert failure_reason(EngineUnreachable("E0: end: no answer")) == "EngineUnreachable"
