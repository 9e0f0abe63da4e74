"""``gated_rmsnorm`` on every CPU backend (``torch``: tile by tile with a hand-written backward; ``native``: our C++
kernel) against the formula written out: values and every gradient, both orders of norm and gate, strided gates (a
slice of a wider projection, as in the blocks), tile edges, half precision."""

from __future__ import annotations

import pytest
import torch
from helpers import F64

from mixer_plugins.kernels import _dispatch
from mixer_plugins.kernels.norm import gated_rmsnorm, gated_rmsnorm_reference
from mixer_plugins.kernels.norm import torch as norm_torch

BACKENDS = ["torch", "native"]


def _formula(y, z, w, before, eps=1e-5):
    gate = z * torch.sigmoid(z)
    v = y if before else y * gate
    n = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    return w * n * (gate if before else 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("tile", [12, 12 * 5, 1 << 18])
def test_gated_rmsnorm_matches_the_formula(monkeypatch, backend, before, tile):
    monkeypatch.setattr(norm_torch, "TILE_ELEMENTS", tile)              # one row per tile, 5 rows, everything at once
    y = torch.randn(2, 7, 12, dtype=F64, requires_grad=True)
    wide = torch.randn(2, 7, 19, dtype=F64)
    z = wide[..., 3:15].clone().requires_grad_() if tile == 12 else torch.randn(2, 7, 12, dtype=F64).requires_grad_()
    w = torch.randn(12, dtype=F64, requires_grad=True)
    expected = _formula(y, z, w, before)
    out = gated_rmsnorm(y, z, w, 1e-5, before, backend=backend)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda y, z, w: gated_rmsnorm(y, z, w, 1e-5, before, backend=backend), (y, z, w))
    grads = torch.autograd.grad((out * out.cos()).sum(), (y, z, w))
    expected_grads = torch.autograd.grad((expected * expected.cos()).sum(), (y, z, w))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("before", [True, False])
def test_strided_gates_and_one_row(before):
    columns = torch.randn(2, 9, 32, dtype=F64)[..., ::2]   # channels strided: the torch backend runs
    y, w = torch.randn(2, 9, 16, dtype=F64), torch.rand(16, dtype=F64) + 0.5
    torch.testing.assert_close(gated_rmsnorm(y, columns, w, 1e-5, before), _formula(y, columns, w, before))
    one = torch.randn(1, 1, 1, dtype=F64)
    for backend in BACKENDS:
        torch.testing.assert_close(gated_rmsnorm(one, one, torch.ones(1, dtype=F64), 1e-5, before, backend=backend),
                                   _formula(one, one, torch.ones(1, dtype=F64), before))


@pytest.mark.parametrize("before", [True, False])
def test_the_native_kernel_equals_the_pytorch_code_in_float32(before):
    gen = torch.Generator().manual_seed(0)
    y, z, w = torch.randn(2, 500, 512, generator=gen), torch.randn(2, 500, 512, generator=gen) * 3, torch.rand(512)
    results = []
    for backend in BACKENDS:
        leaves = [t.detach().clone().requires_grad_() for t in (y, z, w)]
        out = gated_rmsnorm(*leaves, 1e-5, before, backend=backend)
        results.append((out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_half_precision_errors_and_the_automatic_choice():
    y, z, w = torch.randn(3, 9, 16), torch.randn(3, 9, 16), torch.randn(16)
    out = gated_rmsnorm(y.bfloat16(), z.bfloat16(), w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), gated_rmsnorm_reference(y, z, w, 1e-5, True), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="same shape"):
        gated_rmsnorm(y, z[..., :8], w)
    with pytest.raises(ValueError, match="weight must be"):
        gated_rmsnorm(y, z, w[:8])

    def chosen(y, z, w):
        return _dispatch.resolve_backend("norm", None, y.device, y=y, z=z, weight=w)

    assert chosen(y, z, w) == "native"
    assert chosen(y.bfloat16(), z.bfloat16(), w) == "torch"
    for backend in BACKENDS:   # the hand-written backwards are not differentiable again: they say so
        yy = y.clone().requires_grad_()
        gy, = torch.autograd.grad(gated_rmsnorm(yy, z, w, backend=backend).sum(), yy, create_graph=True)
        with pytest.raises(RuntimeError):
            gy.sum().backward()


def test_argument_checks_of_the_native_op():
    y = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.mixer_plugins_native.norm_forward(y, y, torch.ones(7), 1e-5, True)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.mixer_plugins_native.norm_forward(y, torch.randn(8, 4).t(), torch.ones(8), 1e-5, True)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.mixer_plugins_native.norm_forward(y, y.double(), torch.ones(8), 1e-5, True)
