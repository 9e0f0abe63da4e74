"""``depthwise_conv1d`` on every CPU backend (``torch``: shifted multiply-adds tile by tile; ``native``: our C++
kernel) against PyTorch's grouped ``conv1d`` on an explicitly padded input: values and every gradient, centred and
causal kernels, sequences shorter than the kernel, fused SiLU, bias on and off, strided inputs, tile edges."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import F64
from torch.utils.flop_counter import FlopCounterMode

from mixer_plugins.kernels import _dispatch
from mixer_plugins.kernels.conv import depthwise_conv1d
from mixer_plugins.kernels.conv import torch as conv_torch

BACKENDS = ["torch", "native"]


def _conv_by_torch(x, w, b, *, causal, silu):
    """The depthwise convolution (+ SiLU) by PyTorch's own conv1d on an explicitly zero-padded input."""
    kernel = w.shape[1]
    pad = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)
    y = F.conv1d(F.pad(x.transpose(1, 2), pad), w[:, None], b, groups=w.shape[0]).transpose(1, 2)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, kernel", [(False, 7), (False, 1), (True, 4), (True, 1)])
def test_depthwise_conv_matches_conv1d(backend, causal, kernel):
    x = torch.randn(2, 11, 5, dtype=F64, requires_grad=True)
    w = torch.randn(5, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(5, dtype=F64, requires_grad=True)
    expected = _conv_by_torch(x, w, b, causal=causal, silu=False)
    torch.testing.assert_close(depthwise_conv1d(x, w, b, causal=causal, backend=backend), expected)
    assert torch.autograd.gradcheck(lambda x, w, b: depthwise_conv1d(x, w, b, causal=causal, backend=backend),
                                    (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: depthwise_conv1d(x, w, None, causal=causal, backend=backend), (x, w))
    with FlopCounterMode(display=False) as counter:
        depthwise_conv1d(x, w, b, causal=causal, backend=backend)
    assert counter.get_total_flops() == 2 * 2 * 11 * 5 * kernel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, kernel", [(False, 7), (True, 4)])
@pytest.mark.parametrize("silu", [False, True])
def test_tiles_strided_inputs_and_fused_silu(monkeypatch, backend, causal, kernel, silu):
    monkeypatch.setattr(conv_torch, "TILE_ELEMENTS", 2 * 3 * 5)      # tiles of 3 steps: every tile edge is exercised
    base = torch.randn(2, 11, 8, dtype=F64)
    x = base[..., 1:6].clone().requires_grad_()
    w = torch.randn(5, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(5, dtype=F64, requires_grad=True)
    expected = _conv_by_torch(x, w, b, causal=causal, silu=silu)

    def conv(x, w, b):
        return depthwise_conv1d(x, w, b, causal=causal, silu=silu, backend=backend)

    torch.testing.assert_close(conv(x, w, b), expected)
    assert torch.autograd.gradcheck(conv, (x, w, b))
    strided = base.clone().requires_grad_()                     # a strided slice, as the block passes it
    out = conv(strided[..., 1:6], w, b)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    torch.testing.assert_close(strided.grad[..., 1:6], torch.autograd.grad(expected.sum(), x)[0])
    assert strided.grad[..., :1].abs().sum() == 0 and strided.grad[..., 6:].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length, causal, kernel", [(1, False, 7), (2, True, 4), (3, False, 3), (6, True, 7),
                                                    (3, True, 7), (2, False, 7), (70, True, 4), (70, False, 3)])
@pytest.mark.parametrize("silu", [False, True])
def test_sequences_shorter_and_longer_than_the_kernel(backend, length, causal, kernel, silu):
    x = torch.randn(2, length, 3, dtype=F64, requires_grad=True)
    w = torch.randn(3, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)

    def conv(x, w, b=None):
        return depthwise_conv1d(x, w, b, causal=causal, silu=silu, backend=backend)

    torch.testing.assert_close(conv(x, w, b), _conv_by_torch(x, w, b, causal=causal, silu=silu))
    assert torch.autograd.gradcheck(conv, (x, w, b))
    assert torch.autograd.gradcheck(conv, (x, w))


@pytest.mark.parametrize("causal", [True, False])
def test_the_native_kernel_equals_the_pytorch_code_in_float32(causal):
    """Float32 at the block's sizes (768 channels, several blocks of rows): the two agree to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 773, generator=gen)[..., 2:770]
    w, b = torch.randn(768, 4 if causal else 7, generator=gen), torch.randn(768, generator=gen)
    results = []
    for backend in BACKENDS:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = depthwise_conv1d(*leaves, causal=causal, silu=True, backend=backend)
        results.append((y.detach(), *torch.autograd.grad(y, leaves, torch.ones_like(y))))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-4)


def test_extreme_activations_are_finite_and_exact_enough():
    """SiLU at |v| up to 1e3 (exp's cut-off below -87) stays finite and equals the float64 result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 50, 40, generator=gen, dtype=F64) * 300
    w, b = torch.randn(40, 4, generator=gen, dtype=F64), torch.randn(40, generator=gen, dtype=F64)
    got = depthwise_conv1d(x.float(), w.float(), b.float(), causal=True, silu=True, backend="native")
    want = _conv_by_torch(x, w, b, causal=True, silu=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


def test_the_automatic_choice_on_cpu():
    x, w = torch.randn(2, 9, 6), torch.randn(6, 4)

    def chosen(x, w):
        return _dispatch.resolve_backend("conv", None, x.device, x=x, weight=w)

    assert chosen(x, w) == "native"
    assert chosen(x.bfloat16(), w.bfloat16()) == "torch"
    assert chosen(torch.randn(2, 9, 12)[..., ::2], w) == "torch"


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


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.randn(2, 5)), "x must be"),
    (dict(weight=torch.randn(4, 3)), "weight must be"),
    (dict(bias=torch.randn(5)), "bias must be"),
    (dict(weight=torch.randn(3, 4), causal=False), "must be odd"),
])
def test_bad_arguments_raise_clear_errors(bad, message):
    args = dict(x=torch.randn(2, 5, 3), weight=torch.randn(3, 3), bias=None, causal=True) | bad
    with pytest.raises(ValueError, match=message):
        depthwise_conv1d(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)
