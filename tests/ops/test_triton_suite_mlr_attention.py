"""Runs ``tests/ops/test_mlr_attention_triton_kernels.py`` (the MLR attention kernels) in a fresh interpreter under
``TRITON_INTERPRET=1`` (CPU machines).

The kernels are defined in interpreter mode when their module is imported, and the Triton interpreter's state does
not reliably survive what other tests do in the same process; a fresh process makes the check exact and
repeatable. The child's failures are shown here. One Triton test file per module: the test workers
(``--dist loadfile``) share them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_passes_fresh

pytestmark = pytest.mark.triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the Triton tests run in this process")
def test_mlr_attention_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    assert_passes_fresh("ops/test_mlr_attention_triton_kernels.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=1200)
