"""The native kernel under ``kernels.gated_rmsnorm``'s ``torch`` backend (``kernels/_native/norm.cpp``): values
and every gradient against the ``reference`` backend (the formula as plain ops) in float64, both orders of norm
and gate, strided gates (a slice of a wider projection, as in the blocks), and against the PyTorch code of the
same backend in float32; the PyTorch code where the kernel does not apply."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_helpers import spy_native_ops

from mixer_plugins.kernels import _native
from mixer_plugins.kernels.norm import gated_rmsnorm
from mixer_plugins.kernels.norm import torch as norm_torch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native kernels cannot be built here")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert _native.load(), _native.unavailable_reason()


def _case(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(*shape, generator=gen, dtype=dtype)
    wide = torch.randn(*shape[:-1], shape[-1] + 7, generator=gen, dtype=dtype) * 3
    z = wide[..., 3:3 + shape[-1]]  # contiguous rows, row stride width + 7
    weight = torch.rand(shape[-1], generator=gen, dtype=dtype) + 0.5
    return y, z, weight


def _run(y, z, weight, *, before, backend, eps=1e-5):
    leaves = [y.detach().clone().requires_grad_(True), z.detach().requires_grad_(True),
              weight.detach().clone().requires_grad_(True)]
    out = gated_rmsnorm(*leaves, eps=eps, norm_before_gate=before, backend=backend)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    return (out.detach(), *torch.autograd.grad(out, leaves, cot))


def _spy_native(monkeypatch):
    return spy_native_ops(monkeypatch, "norm_forward", "norm_backward")


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 17, 40), (2, 300, 64)], ids=str)
def test_native_norm_matches_reference_in_float64(monkeypatch, before, shape):
    calls = _spy_native(monkeypatch)
    y, z, weight = _case(shape, torch.float64, seed=shape[1])
    got = _run(y, z, weight, before=before, backend="torch")
    want = _run(y, z, weight, before=before, backend="reference")
    assert calls == ["norm_forward", "norm_backward"]
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("before", [True, False])
def test_native_norm_equals_the_pytorch_code_in_float32(monkeypatch, before):
    y, z, weight = _case((2, 500, 512), torch.float32)
    got = _run(y, z, weight, before=before, backend="torch")
    monkeypatch.setattr(norm_torch, "USE_NATIVE", False)
    want = _run(y, z, weight, before=before, backend="torch")
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_pytorch_code_runs_where_the_kernel_does_not_apply(monkeypatch):
    """bfloat16 inputs, and a gate whose channels are strided, take the PyTorch code."""
    calls = _spy_native(monkeypatch)
    y, z, weight = _case((2, 9, 16), torch.float64)
    columns = torch.randn(2, 9, 32, dtype=torch.float64)[..., ::2]
    got = _run(y, columns, weight, before=True, backend="torch")
    want = _run(y, columns, weight, before=True, backend="reference")
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    low = _run(y.bfloat16(), z.bfloat16(), weight.bfloat16(), before=False, backend="torch")
    assert all(t.dtype == torch.bfloat16 for t in low)
    assert calls == []


def test_argument_checks_of_the_native_op():
    y = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.mixer_plugins_native.norm_forward(y, y, torch.ones(7), 1e-5, True)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.mixer_plugins_native.norm_forward(y, torch.randn(8, 4).t(), torch.ones(8), 1e-5, True)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.mixer_plugins_native.norm_forward(y, y.double(), torch.ones(8), 1e-5, True)
