"""The fused Triton MLR attention kernels, run on CPU under ``TRITON_INTERPRET=1``, against the mixer's own fast path
and the ``reference`` backend.

Values and every gradient are compared (``torch.autograd.grad``) with the materialized oracle in float64.
Shapes are tiny: the interpreter runs each kernel program in Python.

``TRITON_INTERPRET`` is read by ``triton.jit`` when a kernel is *defined* (triton 3.5:
``knobs.runtime.interpret`` in the decorator), and the interpreter's state does not survive every other test that
may run before these in one process (inductor compiles, for one). So on a machine without CUDA this module runs
in a fresh interpreter with ``TRITON_INTERPRET=1``, started by ``tests/ops/test_triton_suite_mlr_attention.py``
(``MIXER_PLUGINS_TRITON_FRESH=1`` marks that run); collected in any other process it is skipped.
"""

from __future__ import annotations

import pytest
import torch
from helpers import fast_interpreter, triton_kernels_module  # noqa: F401  (fast_interpreter: an autouse fixture)

mlr_triton, _, pytestmark = triton_kernels_module("mixer_plugins.kernels.mlr_attention.triton_kernels")
triton = pytest.importorskip("triton")




# -- MLR attention ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "causal,masked,tile,options",
    [
        (False, False, 4, {}),
        (True, False, 4, {}),
        (False, True, 8, {"block_divide": False}),
        (True, True, 16, {"divide_by_levels": True, "logit_scaling": "standard"}),
    ],
)
def test_mlr_attention_matches_mixer(causal, masked, tile, options):
    """The fused kernels (values and dq, dk, dv) equal the mixer's own ``mix`` (blocked scores, masked softmax,
    values), for tiles smaller and larger than the blocks, odd lengths (partial last tile and block), right padding."""
    from mixer_plugins import create_mixer
    from mixer_plugins.kernels.mlr_attention.triton_kernels import mlr_attention_triton

    L = 9 if tile == 4 else 13
    mixer = create_mixer("mlr_attention", dim=16, num_heads=2, ranks=[4, 2, 1, 1], block_sizes=[None, 8, 4, 2],
                         causal=causal, **options).double()
    x = torch.randn(1 + masked, L, 16, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.ones(2, L, dtype=torch.bool)
        mask[0, 7:] = False
    with torch.no_grad():
        ctx = mixer.prepare(x, mask)
    q, k, v = (t.detach().requires_grad_() for t in (ctx.q, ctx.k, ctx.values))
    ctx.q, ctx.k, ctx.values = q, k, v
    expected = mixer.mix(ctx)
    y = mlr_attention_triton(q.float(), k.float(), v.float(), mixer.ranks, mixer.block_sizes, mixer.level_scales,
                             block_divide=mixer.block_divide, causal=causal, mask=ctx.mask, tile_size=tile)
    if mask is not None:  # the op's contract, as its triton backend applies it: pad outputs are selected to 0
        y = y.masked_fill(~mask[:, :, None, None], 0)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(expected)
    grads = torch.autograd.grad(y.double(), (q, k, v), dy)
    grads_ref = torch.autograd.grad(expected, (q, k, v), dy)
    for name, a, r in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(a, r, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_mlr_attention_half_inputs():
    """bfloat16 q, k, v: float32 accumulation, bfloat16 output and gradients close to the float32 mixer."""
    from mixer_plugins import create_mixer
    from mixer_plugins.kernels.mlr_attention.triton_kernels import mlr_attention_triton

    mixer = create_mixer("mlr_attention", dim=16, num_heads=2, ranks=[4, 2, 1, 1], block_sizes=[None, 8, 4, 2])
    with torch.no_grad():
        ctx = mixer.prepare(torch.randn(1, 11, 16), None)
    half = [t.detach().bfloat16().requires_grad_() for t in (ctx.q, ctx.k, ctx.values)]
    full = [t.detach().float().requires_grad_() for t in half]
    ctx.q, ctx.k, ctx.values = full
    expected = mixer.mix(ctx)
    y = mlr_attention_triton(*half, mixer.ranks, mixer.block_sizes, mixer.level_scales, tile_size=8)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)
    dy = torch.randn_like(expected)
    for name, a, r in zip("qkv", torch.autograd.grad(y, half, dy.bfloat16()), torch.autograd.grad(expected, full, dy)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), r, atol=3e-2, rtol=3e-2, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_mlr_op_triton_backend_matches_reference(causal):
    """``kernels.mlr_attention(..., backend="triton")`` (our fused kernel) against the materialized oracle."""
    from mixer_plugins import kernels

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 13, 2, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    v = torch.randn(2, 13, 2, 3, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, 9:] = False
    kw = dict(ranks=[2, 2], block_sizes=[None, 4], scales=[0.5, 0.25], causal=causal, mask=mask)
    got = kernels.mlr_attention(q.float(), k.float(), v.float(), backend="triton", **kw)
    want = kernels.mlr_attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    cot = torch.randn_like(want)
    g_got = torch.autograd.grad(got.double(), (q, k, v), cot)
    g_want = torch.autograd.grad(want, (q, k, v), cot)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
