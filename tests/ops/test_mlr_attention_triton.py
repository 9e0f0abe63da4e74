"""The MLR attention Triton kernels (``kernels/mlr_attention/triton_kernels.py``) against the materialized float64
reference: values and every gradient, for level lists with and without a global level, blocks that are no multiple of
the tiles, square and rectangular tiles smaller than the blocks (uniform runs of several classes and mixed pairs),
partial last tiles, causal and bidirectional, right padding with NaN pads, ``block_divide`` off, half-precision
inputs.

Like ``tests/ops/test_local_attention_triton.py``, the CPU checks run under ``TRITON_INTERPRET=1`` in a fresh
interpreter (``MIXER_PLUGINS_TRITON_FRESH=1``), started by :func:`test_mlr_kernels_under_the_interpreter`; with CUDA
the checks run in this process. Shapes are tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

FRESH = os.environ.get("MIXER_PLUGINS_TRITON_FRESH") == "1"
IN_PROCESS = FRESH or torch.cuda.is_available()

pytestmark = pytest.mark.triton


@pytest.mark.skipif(IN_PROCESS, reason="the checks run in this process")
@pytest.mark.slow  # a Triton-interpreter suite in a fresh process
def test_mlr_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from helpers import assert_passes_fresh

    assert_passes_fresh("ops/test_mlr_attention_triton.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=1200)


if IN_PROCESS:
    pytest.importorskip("triton")
    from helpers import fast_interpreter  # noqa: F401  (autouse fixture: interpreter speed shims)

DEVICE = "cuda" if torch.cuda.is_available() and not FRESH else "cpu"
needs_kernels = pytest.mark.skipif(not IN_PROCESS, reason="runs under the interpreter in a fresh process")
F64 = torch.float64


def _inputs(L, ranks, *, masked, seed=0, p=3, batch=2):
    g = torch.Generator().manual_seed(seed)
    e = sum(ranks)
    q, k = (torch.randn(batch, L, 2, e, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(batch, L, 2, p, generator=g, dtype=F64)
    mask = None
    if masked:
        mask = torch.ones(batch, L, dtype=torch.bool)
        mask[1, L - 5:] = False
        for t in (q, k, v):
            t[~mask] = float("nan")  # pads must never reach a real output or gradient
    return q, k, v, mask


def _tiles(rows_cols):
    from mixer_plugins.kernels.mlr_attention.triton_kernels import Tiles

    fwd, dq, dkdv = rows_cols
    return Tiles(forward=(*fwd, 4, 2), dq=(*dq, 4, 2), dkdv=(*dkdv, 4, 2))


def _kernel(q, k, v, mask, ranks, sizes, scales, causal, block_divide, tiles, dtype=torch.float32):
    """The kernels on ``dtype`` copies (pads selected to 0 first, as the op does), pad outputs selected to 0."""
    from mixer_plugins.kernels.mlr_attention.triton_kernels import MLRSpec, mlr_triton

    if mask is not None:
        q, k, v = (torch.where(mask[:, :, None, None], t, torch.zeros((), dtype=t.dtype)) for t in (q, k, v))
    spec = MLRSpec(tuple(ranks), tuple(0 if s is None else s for s in sizes), tuple(scales), block_divide, causal)
    m = None if mask is None else mask.to(DEVICE)
    y = mlr_triton(*(t.to(dtype).to(DEVICE) for t in (q, k, v)), spec, mask=m, tiles=tiles)
    if m is not None:
        y = torch.where(m[:, :, None, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.to(F64).cpu()


def _check(L, ranks, sizes, causal, masked, block_divide, tiles, *, kernel_sizes=None, dtype=torch.float32,
           tol=3e-5):
    from mixer_plugins.kernels import mlr_attention

    q, k, v, mask = _inputs(L, ranks, masked=masked)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scales = [0.8 / r for r in ranks]
    want = mlr_attention(*leaves, ranks=ranks, block_sizes=sizes, scales=scales, causal=causal, mask=mask,
                         block_divide=block_divide, backend="reference")
    got = _kernel(*leaves, mask, ranks, kernel_sizes or sizes, scales, causal, block_divide, _tiles(tiles), dtype)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for name, a, b in zip("qkv", torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        torch.testing.assert_close(a, b, atol=2 * tol, rtol=2 * tol, msg=lambda m, name=name: f"d{name}: {m}")


# name: L, ranks, block sizes, causal, masked, block_divide, (forward, dq, dk/dv) tiles as (rows, columns)
CASES = {
    # the mixer's test levels; 4-token tiles: uniform runs of classes 1-3, mixed pairs on the finest levels
    "levels-bidir": (19, [4, 2, 1, 1], [None, 8, 4, 2], False, False, True, ((4, 4), (4, 4), (4, 4))),
    "levels-causal-masked": (19, [4, 2, 1, 1], [None, 8, 4, 2], True, True, True, ((4, 4), (4, 4), (4, 4))),
    # level 0 not global: pairs that share no level (score 0) form their own class
    "no-global-level": (21, [3, 2, 2, 1], [12, 6, 3, 1], False, True, True, ((4, 2), (2, 4), (4, 2))),
    "no-global-level-causal": (21, [3, 2, 2, 1], [12, 6, 3, 1], True, False, True, ((2, 2), (2, 2), (2, 2))),
    # blocks that are no multiple of the tiles (9 and 3 tokens): mixed pairs away from the diagonal too
    "odd-blocks": (23, [4, 2, 2], [None, 9, 3], True, True, True, ((4, 8), (8, 4), (8, 2))),
    # rectangular tiles, two global levels, no block division
    "two-globals": (17, [2, 2, 4], [None, None, 4], False, True, False, ((8, 2), (2, 8), (4, 8))),
    # the paper's eight levels (halving blocks 16 ... 1 here), wide tiles
    "paper-levels": (37, [8, 4, 4, 2, 2, 2, 1, 1], [None, 16, 8, 4, 4, 2, 2, 1], True, True, True,
                     ((8, 8), (8, 4), (8, 4))),
    # one global level: plain attention (every pair uniform but the partial tile and the diagonal)
    "one-level": (13, [6], [None], True, False, True, ((4, 4), (4, 4), (4, 4))),
}


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_mlr_kernels_match_reference(case):
    _check(*CASES[case])


@needs_kernels
def test_half_precision_inputs():
    """bfloat16 and float16 q, k, v: operands as they are, float32 accumulation, close to the float64 reference."""
    for dtype in (torch.bfloat16, torch.float16):
        _check(*CASES["levels-causal-masked"], dtype=dtype, tol=3e-2)


@needs_kernels
def test_planted_level_bug_is_caught():
    """The checks fail on a kernel given blocks of the wrong size (one level's blocks half as long)."""
    L, ranks, sizes, causal, masked, block_divide, tiles = CASES["levels-bidir"]
    with pytest.raises(AssertionError):
        _check(L, ranks, sizes, causal, masked, block_divide, tiles, kernel_sizes=[None, 8, 2, 2])


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_op_backend_with_default_tiles(causal):
    """``kernels.mlr_attention(..., backend="triton")`` (default tiles, larger than the sequence here): NaN pads
    never reach real outputs or gradients; pad outputs are 0."""
    from mixer_plugins import kernels

    ranks, sizes = [4, 2, 1, 1], [None, 8, 4, 2]
    q, k, v, mask = _inputs(21, ranks, masked=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(ranks=ranks, block_sizes=sizes, causal=causal, mask=mask)
    got = kernels.mlr_attention(*(t.float().to(DEVICE) for t in leaves), backend="triton",
                                **{**kw, "mask": mask.to(DEVICE)}).double().cpu()
    want = kernels.mlr_attention(*leaves, backend="reference", **kw)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    cot = torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
        torch.testing.assert_close(a, b, atol=6e-5, rtol=6e-5)


@needs_kernels
def test_strided_inputs_are_read_in_place():
    """q, k, v as slices of one packed projection (non-contiguous, unit feature stride) give the contiguous result."""
    from mixer_plugins.kernels.mlr_attention.triton_kernels import MLRSpec, mlr_triton

    g = torch.Generator().manual_seed(3)
    packed = torch.randn(2, 15, 2, 8 + 8 + 3, generator=g).to(DEVICE)
    q, k, v = packed[..., :8], packed[..., 8:16], packed[..., 16:]
    spec = MLRSpec((4, 2, 1, 1), (0, 8, 4, 2), (0.25, 0.5, 1.0, 1.0), True, True)
    tiles = _tiles(((4, 4), (4, 4), (4, 4)))
    torch.testing.assert_close(mlr_triton(q, k, v, spec, tiles=tiles),
                               mlr_triton(q.contiguous(), k.contiguous(), v.contiguous(), spec, tiles=tiles))
