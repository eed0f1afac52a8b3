"""The served digest (issue 46, item 1; adapters/served.py): the snapshot as an engine's LoRA pool holds it.

Its definition is held to an independent computation (round-to-nearest-even by bit arithmetic, hashlib over the
canonical JSON); its record in a v2 manifest is covered by the digest, and a v2 manifest without one keeps its bytes;
a malformed record is refused, typed. The publisher's comparison (runtime/served_check.py) names both sides."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from versioned_lora.adapters.hashing import hash_bytes
from versioned_lora.adapters.manifest import V2_HASH, MalformedManifest, Manifest, manifest_from_tensors
from versioned_lora.adapters.served import (
    ServedError,
    ServedRecord,
    expected_scaling,
    expected_served_config,
    served_config,
    served_record,
)
from versioned_lora.lifecycle.drivers import CheckRefused
from versioned_lora.runtime.interfaces import ReadyReceipt, ServedIdentity
from versioned_lora.runtime.served_check import ServedRefusal, served_refusal

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _tensors() -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(7)
    return {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight": torch.randn(shape, generator=rng)
            for i in range(2) for m in ("q_proj", "v_proj") for ab, shape in (("A", (4, 32)), ("B", (32, 4)))}


def _bf16_rne(t: torch.Tensor) -> bytes:
    """float32 -> bfloat16 by round-to-nearest-even on the bits (no torch conversion), as little-endian bytes."""
    bits = t.contiguous().reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bytes(b for v in rounded.tolist() for b in int(v).to_bytes(2, "little"))


def test_the_served_digest_is_the_round_to_nearest_even_bf16_bytes_hashed_in_canonical_order() -> None:
    tensors = _tensors()
    # A value halfway between two bf16 numbers goes to the even one: 1 + 2**-8 -> 1.0, 1 + 3 * 2**-8 -> 1 + 2**-6.
    tensors[sorted(tensors)[0]][0, :2] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])
    record = served_record(tensors, "bfloat16", V2_HASH)
    entries = [{"name": n, "shape": list(t.shape), "sha256": hash_bytes(_bf16_rne(t), V2_HASH)}
               for n, t in sorted(tensors.items())]
    canonical = json.dumps({"dtype": "bfloat16", "hash": V2_HASH, "tensors": entries}, sort_keys=True,
                           separators=(",", ":")).encode()
    assert record == ServedRecord("bfloat16", hashlib.sha256(canonical).hexdigest())
    assert _bf16_rne(torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])) == torch.tensor(
        [1.0, 1 + 2**-6], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_tensors_already_in_the_pool_dtype_reuse_the_manifests_hashes() -> None:
    tensors = {n: t.to(torch.bfloat16) for n, t in _tensors().items()}
    manifest = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="bfloat16")
    poisoned = {t.name: "0" * 64 for t in manifest.tensors}  # reused as given: nothing hashed again
    assert served_record(tensors, "bfloat16", V2_HASH, known={t.name: t.sha256 for t in manifest.tensors}) == \
        manifest.served
    assert served_record(tensors, "bfloat16", V2_HASH, known=poisoned) != manifest.served


def test_a_v2_manifest_records_it_under_its_digest_and_one_without_keeps_its_bytes() -> None:
    tensors = _tensors()
    bare = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH)
    served = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="bfloat16")
    assert "served" not in json.loads(bare.to_json()) and bare.served is None
    assert served.served is not None and served.digest != bare.digest  # the digest covers the record
    assert Manifest.from_json(served.to_json()) == served
    assert Manifest.from_json(bare.to_json()).to_json_bytes() == bare.to_json_bytes()
    fp16 = manifest_from_tensors(tensors, CONFIG, hash_kind=V2_HASH, served_dtype="float16")
    assert fp16.served is not None and fp16.served.digest != served.served.digest


@pytest.mark.parametrize("served", [{"dtype": "int8", "digest": "0" * 64}, {"dtype": "bfloat16", "digest": "xyz"},
                                    {"dtype": "bfloat16"}, "bfloat16",
                                    {"dtype": "bfloat16", "digest": "0" * 64, "x": 1}])
def test_a_malformed_served_record_is_a_typed_error(served: object) -> None:
    raw = json.loads(manifest_from_tensors(_tensors(), CONFIG, hash_kind=V2_HASH).to_json())
    raw["served"] = served
    with pytest.raises(MalformedManifest, match="served"):
        Manifest.from_json(json.dumps(raw))


def test_a_v1_manifest_has_no_place_for_a_served_record() -> None:
    with pytest.raises(MalformedManifest):
        manifest_from_tensors(_tensors(), CONFIG, served_dtype="bfloat16")
    raw = json.loads(manifest_from_tensors(_tensors(), CONFIG).to_json())
    raw["served"] = {"dtype": "bfloat16", "digest": "0" * 64}
    with pytest.raises(MalformedManifest):
        Manifest.from_json(json.dumps(raw))
    with pytest.raises(ServedError):
        served_record(_tensors(), "int8", V2_HASH)


def test_the_served_config_is_the_one_spelling_for_the_manifest_and_the_engine() -> None:
    assert expected_scaling(CONFIG) == 2.0 and expected_scaling({**CONFIG, "use_rslora": True}) == 4.0
    # What SGLang's LoRAAdapter holds for this manifest (target modules unsorted, alpha an int, scaling alpha / r).
    assert served_config(4, 8, ["v_proj", "q_proj"], 8 / 4) == expected_served_config(CONFIG)
    assert served_config(4, 16, ["q_proj", "v_proj"], 4.0) != expected_served_config(CONFIG)
    assert served_config(4, 8, ["v_proj"], 2.0) != expected_served_config(CONFIG)


def _receipt(served: ServedIdentity | None, error: str = "") -> ReadyReceipt:
    return ReadyReceipt("relax_policy_lora@1-a-0123456789ab", "d" * 64, "t", 3, 7, -1.0, (), served, error)


def test_the_served_check_refuses_a_digest_or_config_that_differs_naming_both_sides() -> None:
    snapshot = ServedIdentity("bfloat16", "a" * 64, expected_served_config(CONFIG))
    assert served_refusal(snapshot, _receipt(snapshot)) is None
    digest = served_refusal(snapshot, _receipt(ServedIdentity("bfloat16", "b" * 64, snapshot.config)))
    assert isinstance(digest, CheckRefused) and digest.code == ServedRefusal.SERVED_DIGEST_MISMATCH
    assert "a" * 64 in digest.detail and "b" * 64 in digest.detail and "incarnation 3" in digest.detail
    dtype = served_refusal(snapshot, _receipt(ServedIdentity("float16", "a" * 64, snapshot.config)))
    assert dtype is not None and dtype.code == ServedRefusal.SERVED_DIGEST_MISMATCH and "float16" in dtype.detail
    other = served_config(4, 16, ["q_proj", "v_proj"], 4.0)
    config = served_refusal(snapshot, _receipt(ServedIdentity("bfloat16", "a" * 64, other)))
    assert config is not None and config.code == ServedRefusal.SERVED_CONFIG_MISMATCH
    assert other in config.detail and snapshot.config in config.detail
    missing = served_refusal(snapshot, _receipt(None, "KeyError: not resident"))
    assert missing is not None and missing.code == ServedRefusal.SERVED_DIGEST_MISMATCH
    assert "not resident" in missing.detail and "a" * 64 in missing.detail


def test_an_end_answer_without_a_served_read_back_becomes_a_receipt_the_check_refuses() -> None:
    """The engine's `end` answer, translated (adapters/engine_staging.py): a read-back the engine could not do, or an
    answer with none (an engine that predates it), is a receipt without `served`, and why; the check refuses it."""
    from versioned_lora.adapters.engine_staging import _served

    identity = ServedIdentity("bfloat16", "a" * 64, "{}")
    assert _served({"dtype": "bfloat16", "digest": "a" * 64, "config": "{}", "read_s": 0.1}) == (identity, "")
    for raw, why in ((None, "carries no served digest"), ({"error": "ReadBackError: no pool slot"}, "no pool slot"),
                     ({"dtype": "bfloat16"}, "lacks 'digest'")):
        served, error = _served(raw)
        assert served is None and why in error, (raw, error)
        refused = served_refusal(identity, _receipt(None, error))
        assert refused is not None and refused.code == ServedRefusal.SERVED_DIGEST_MISMATCH and why in refused.detail
