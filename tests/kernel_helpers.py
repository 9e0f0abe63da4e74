"""Helpers shared by the kernel tests: a probe of the largest tensor an op produces, and a pytest run of one test
file in a fresh interpreter (for checks whose environment, e.g. ``TRITON_INTERPRET``, must be set before import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]


class LargestTensor(TorchDispatchMode):
    """Records ``largest``: the most elements of any tensor an op returned while the mode was active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def run_test_file_fresh(test_file: str, env: dict[str, str], timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``tests/<test_file>`` with pytest in a fresh interpreter (no xdist, no cache), with ``env`` added to the
    environment and the checkout first on ``PYTHONPATH``; returns the result and the tail of its output."""
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    full.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         str(ROOT / "tests" / test_file)],
        cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    return result, result.stdout[-6000:] + result.stderr[-3000:]


def assert_passes_fresh(test_file: str, env: dict[str, str], timeout: int, *, allow_skips: bool = True) -> None:
    """Run ``tests/<test_file>`` as :func:`run_test_file_fresh` does and assert that it passed: exit code 0, some
    tests passed, none failed (and, with ``allow_skips=False``, none skipped)."""
    result, tail = run_test_file_fresh(test_file, env, timeout)
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
    if not allow_skips:
        assert "skipped" not in result.stdout, tail


def spy_native_ops(monkeypatch, *names: str) -> list[str]:
    """Record every call of the named ``torch.ops.mixer_plugins_native`` ops (in order) while the test runs."""
    import torch

    calls: list[str] = []
    for name in names:
        real = getattr(torch.ops.mixer_plugins_native, name)
        monkeypatch.setattr(torch.ops.mixer_plugins_native, name,
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    return calls
