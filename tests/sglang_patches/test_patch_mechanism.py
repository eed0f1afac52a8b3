"""The patch mechanism: version guard, patch sets applied only where meant, idempotence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from versioned_lora.sglang_patches.mechanism import (
    SUPPORTED_SGLANG_VERSION,
    UnsupportedSGLangVersion,
    require_supported_sglang,
)


def _run_isolated(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )


def test_installed_sglang_is_the_supported_one() -> None:
    require_supported_sglang()


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.5.23rc1", "0.6.0"])
def test_any_other_sglang_version_is_refused_with_a_clear_message(version: str) -> None:
    with pytest.raises(UnsupportedSGLangVersion, match=f"sglang=={SUPPORTED_SGLANG_VERSION}"):
        require_supported_sglang(version)


def test_applying_patches_on_another_sglang_version_fails_before_touching_anything() -> None:
    result = _run_isolated(
        """
        from versioned_lora.sglang_patches import mechanism, apply
        mechanism.installed_sglang_version = lambda: "0.5.22"
        try:
            apply.apply_requested_patches("scheduler")
        except mechanism.UnsupportedSGLangVersion as exc:
            print("REFUSED", exc)
        print("APPLIED", len(mechanism.applied_patches()))
        """,
        VERSIONED_LORA_PATCHES="cpu",
    )
    assert "REFUSED" in result.stdout and "sglang==0.5.22 is installed" in result.stdout, result.stderr
    assert "APPLIED 0" in result.stdout


def test_cpu_patch_applies_in_the_scheduler_of_a_cuda_less_host_only() -> None:
    result = _run_isolated(
        """
        import torch
        from versioned_lora.sglang_patches import mechanism, cpu_compat
        torch.cuda.is_available = lambda: True
        cpu_compat.apply("server"); print("server-with-cuda", len(mechanism.applied_patches()))
        cpu_compat.apply("scheduler"); print("scheduler-with-cuda", len(mechanism.applied_patches()))
        torch.cuda.is_available = lambda: False
        cpu_compat.apply("server"); print("server", len(mechanism.applied_patches()))
        cpu_compat.apply("detokenizer"); print("detokenizer", len(mechanism.applied_patches()))
        torch.cuda.is_available = lambda: False
        cpu_compat.apply("scheduler"); n = len(mechanism.applied_patches()); print("scheduler", n)
        cpu_compat.apply("scheduler"); print("again", len(mechanism.applied_patches()) == n)
        import sglang.srt.layers.rotary_embedding.base as rope
        print("rope", rope._is_cpu, rope._is_cpu_amx_available)
        print("pin", torch.zeros(2).pin_memory().shape)
        """
    )
    out = result.stdout
    # On a GPU host nothing; on a CPU host the server's children start from a fork server (one patch), and the
    # scheduler's LoRA path and rope run without a driver (six more); the detokenizer gets none of its own.
    assert "server-with-cuda 0" in out and "scheduler-with-cuda 0" in out, result.stderr
    assert "server 1" in out and "detokenizer 1" in out, result.stderr
    assert "scheduler 7" in out and "again True" in out
    assert "rope True False" in out and "pin torch.Size([2])" in out


def test_no_patch_set_requested_means_stock_sglang() -> None:
    result = _run_isolated(
        """
        from versioned_lora.sglang_patches import apply, mechanism
        print(apply.apply_requested_patches("scheduler"), len(mechanism.applied_patches()))
        """,
        VERSIONED_LORA_PATCHES="",
    )
    assert "[] 0" in result.stdout, result.stderr
