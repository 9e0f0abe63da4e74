"""Runs ``tests/test_triton_kernels.py`` in a fresh interpreter under ``TRITON_INTERPRET=1`` (CPU machines).

The kernels are defined in interpreter mode when their module is imported, and the Triton interpreter's state does
not reliably survive what other tests do in the same process; a fresh process makes the check exact and
repeatable. The child's failures are shown here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, test_triton_kernels.py runs in this process")
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         str(ROOT / "tests" / "test_triton_kernels.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
