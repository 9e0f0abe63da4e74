"""Runs ``tests/test_triton_kernels.py`` in a fresh interpreter under ``TRITON_INTERPRET=1`` (CPU machines).

The kernels are defined in interpreter mode when their module is imported, and the Triton interpreter's state does
not reliably survive what other tests do in the same process; a fresh process makes the check exact and
repeatable. The child's failures are shown here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import assert_passes_fresh

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, test_triton_kernels.py runs in this process")
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    assert_passes_fresh("test_triton_kernels.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=1200)
