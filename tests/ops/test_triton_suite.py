"""Runs the Triton kernel tests in a fresh interpreter under ``TRITON_INTERPRET=1`` (CPU machines).

The kernels are defined in interpreter mode when their module is imported, and the Triton interpreter's state does
not reliably survive what other tests do in the same process; a fresh process makes the check exact and
repeatable. The child's failures are shown here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_passes_fresh

pytestmark = pytest.mark.triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the Triton tests run in this process")
@pytest.mark.parametrize("test_file", ["ops/test_scan_triton.py", "ops/test_scan_numerics_triton.py",
                                       "ops/test_mlr_attention_triton_kernels.py", "ops/test_decode_triton.py"])
def test_triton_kernels_under_the_interpreter(test_file):
    pytest.importorskip("triton")
    assert_passes_fresh(test_file, {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=1200)
