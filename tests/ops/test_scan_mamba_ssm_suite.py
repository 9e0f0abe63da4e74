"""Runs ``tests/ops/test_scan_mamba_ssm.py`` (mamba-ssm's own kernels through our backend) in a fresh interpreter
under ``TRITON_INTERPRET=1``, where mamba-ssm's files, Triton and einops can be imported (not in CI's extras)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import assert_passes_fresh


def test_mamba_ssm_kernels_match_the_reference_under_the_interpreter():
    missing = [name for name in ("mamba_ssm", "triton", "einops") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    assert_passes_fresh("ops/test_scan_mamba_ssm.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_MAMBA_FRESH": "1"}, timeout=1200, allow_skips=False)
