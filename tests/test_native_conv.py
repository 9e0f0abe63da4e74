"""The native kernel under ``kernels.depthwise_conv1d``'s ``torch`` backend (``kernels/_native/conv.cpp``): values
and every gradient against the ``reference`` backend (PyTorch's grouped ``conv1d``) in float64, and against the
PyTorch code of the same backend in float32; strided inputs, centred and causal kernels, sequences shorter than
the kernel, SiLU and bias on and off; the PyTorch code where the kernel does not apply."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_helpers import spy_native_ops

from mixer_plugins.kernels import _native
from mixer_plugins.kernels.conv import depthwise_conv1d
from mixer_plugins.kernels.conv import torch as conv_torch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native kernels cannot be built here")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert _native.load(), _native.unavailable_reason()


def _case(batch, length, channels, k, *, strided, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # channels contiguous, rows strided: a slice of a wider projection, as in the blocks
        x = torch.randn(batch, length, channels + 5, generator=gen, dtype=dtype)[..., 2:channels + 2]
    else:
        x = torch.randn(batch, length, channels, generator=gen, dtype=dtype)
    weight = torch.randn(channels, k, generator=gen, dtype=dtype)
    bias = torch.randn(channels, generator=gen, dtype=dtype)
    return x, weight, bias


def _run(x, weight, bias, *, causal, silu, backend, seed=1):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight) + ((bias,) if bias is not None else ())]
    y = depthwise_conv1d(leaves[0], leaves[1], leaves[2] if bias is not None else None, causal=causal, silu=silu,
                         backend=backend)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.dtype)
    return (y.detach(), *torch.autograd.grad(y, leaves, cot))


def _spy_native(monkeypatch):
    return spy_native_ops(monkeypatch, "conv_forward", "conv_backward")


@pytest.mark.parametrize("k,causal", [(1, True), (4, True), (7, True), (3, False), (7, False)])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("length", [1, 3, 70])
def test_native_conv_matches_reference_in_float64(monkeypatch, k, causal, silu, with_bias, length):
    calls = _spy_native(monkeypatch)
    x, weight, bias = _case(3, length, 37, k, strided=True, dtype=torch.float64, seed=k + length)
    bias = bias if with_bias else None
    got = _run(x, weight, bias, causal=causal, silu=silu, backend="torch")
    want = _run(x, weight, bias, causal=causal, silu=silu, backend="reference")
    assert calls == ["conv_forward", "conv_backward"]  # the native kernel ran, forward and backward
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("strided", [True, False])
def test_native_conv_equals_the_pytorch_code_in_float32(monkeypatch, causal, strided):
    """Float32 at the block's sizes (768 channels, several blocks of rows, both threads): the native kernel and the
    PyTorch code of the same backend agree to float32 rounding, values and every gradient."""
    x, weight, bias = _case(2, 300, 768, 7 if not causal else 4, strided=strided, dtype=torch.float32)
    got = _run(x, weight, bias, causal=causal, silu=True, backend="torch")
    monkeypatch.setattr(conv_torch, "USE_NATIVE", False)
    want = _run(x, weight, bias, causal=causal, silu=True, backend="torch")
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)


def test_extreme_activations_are_finite_and_exact_enough():
    """SiLU at |v| up to 1e3 (exp's cut-off below -87) stays finite and equals the float64 reference."""
    x, weight, bias = _case(1, 50, 40, 4, strided=False, dtype=torch.float64)
    x = x * 300.0
    got = _run(x.float(), weight.float(), bias.float(), causal=True, silu=True, backend="torch")
    want = _run(x, weight, bias, causal=True, silu=True, backend="reference")
    for a, e in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-3 * e.abs().max().item())


def test_the_pytorch_code_runs_where_the_kernel_does_not_apply(monkeypatch):
    """bfloat16, and inputs whose channels are strided, take the PyTorch code (and agree with the reference)."""
    calls = _spy_native(monkeypatch)
    x, weight, bias = _case(2, 20, 16, 4, strided=False, dtype=torch.float64)
    wide = torch.randn(2, 20, 32, dtype=torch.float64)
    results = []
    for backend in ("torch", "reference"):
        leaf = wide.clone().requires_grad_(True)
        y = depthwise_conv1d(leaf[..., ::2], weight, bias, causal=True, silu=True, backend=backend)  # stride 2
        results.append((y.detach(), *torch.autograd.grad(y, leaf, torch.ones_like(y))))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    low = _run(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), causal=True, silu=True, backend="torch")
    assert all(t.dtype == torch.bfloat16 for t in low)
    assert calls == []


def test_argument_checks_of_the_native_op():
    x = torch.randn(1, 8, 4)
    w = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="left"):
        torch.ops.mixer_plugins_native.conv_forward(x, w, None, 3, False)
    with pytest.raises(RuntimeError, match="contiguous channels"):
        torch.ops.mixer_plugins_native.conv_forward(torch.randn(1, 4, 8).transpose(1, 2), w, None, 1, False)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.mixer_plugins_native.conv_forward(x.double(), w, None, 1, False)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.mixer_plugins_native.conv_forward(x, w, torch.randn(5), 1, False)
