"""The native engine of the MLR op (our fused C++ CPU kernel, ``kernels/_native/mlr_attention.cpp``): against the
materialized reference in float64 with tiles smaller than, larger than and misaligned with the blocks; float32
against float64 (the vectorized ``exp``), extreme logits; right-padded keys; ``torch.compile`` with inductor; the
automatic choice and its fallback when the kernel cannot be loaded; argument checks.

The engine is also in the engine-parametrized tests of tests/ops/test_mlr_attention.py (every level list, NaN pads, the
FLOP counter) and in the custom-op checks of tests/ops/test_custom_ops.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import inductor_settings

from mixer_plugins.kernels import _native
from mixer_plugins.kernels._dispatch import resolve_backend
from mixer_plugins.kernels.mlr_attention import mlr_attention, native
from mixer_plugins.kernels.mlr_attention.torch import mlr_attention_tiled, mlr_attention_torch

F64 = torch.float64

pytestmark = pytest.mark.skipif(not _native.load(),
                                reason=f"the native CPU kernels are not installed: {_native.unavailable_reason()}")

LEVELS = [
    ([4, 2, 1, 1], [None, 8, 4, 2]),
    ([3, 2, 2, 1], [12, 6, 3, 1]),  # level 0 not global: pairs in different level-0 blocks score 0
    ([2, 2, 4], [None, None, 3]),
    ([6], [None]),  # plain attention
    ([4, 2, 2], [None, 9, 3]),
    ([5, 3], [40, 20]),  # blocks longer than the sequence's tail
]


def _inputs(batch, length, heads, ranks, value_width, *, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, sum(ranks), generator=gen, dtype=dtype)
    k = torch.randn(batch, length, heads, sum(ranks), generator=gen, dtype=dtype)
    v = torch.randn(batch, length, heads, value_width, generator=gen, dtype=dtype)
    return q, k, v


def _value_and_grads(fn, tensors, seed=1):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out.detach(), torch.autograd.grad(out, tensors, cot)


def _err(a, b):
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a - b).abs().max() / (1 + b.abs().max())).item()


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert native.load(), _native.unavailable_reason()


@pytest.fixture
def tiles(monkeypatch):
    """Set the kernel's (query, key) tiles of the forward and the backward."""
    def set_tiles(forward, backward):
        monkeypatch.setitem(native.TILES, "forward", forward)
        monkeypatch.setitem(native.TILES, "backward", backward)
    return set_tiles


@pytest.mark.parametrize("tile", [(1, 1), (3, 5), (7, 4), (16, 64), (256, 512)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("levels", range(len(LEVELS)))
def test_native_matches_reference_at_any_tiling(tiles, tile, causal, levels):
    """Float64, values and every gradient to 1e-12 of the dense reference, whatever the tiles (one row and one key
    per tile, tiles misaligned with every block, tiles longer than the sequence), with right padding."""
    tiles(tile, tile[::-1])
    ranks, sizes = LEVELS[levels]
    length = 43
    mask = torch.arange(length)[None, :] < torch.tensor([length, 30, 2])[:, None]
    q, k, v = _inputs(3, length, 2, ranks, 5, seed=levels)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[0.8 / r for r in ranks], causal=causal, mask=mask)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="native", **kw), (q, k, v))
    assert _err(out, ref) < 1e-12
    for g, rg in zip(grads, ref_grads):
        assert _err(g, rg) < 1e-12


@pytest.mark.parametrize("tile", [(128, 64), (256, 100), (96, 32)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_native_splits_leaves_of_large_blocks(tiles, tile, causal):
    """Blocks of 64 tokens and more near the diagonal: each tile's neighbourhood is split by the finer blocks (plain
    ranges of part of the tile's rows, then smaller leaves); float64 values and gradients equal the reference, with
    right padding, tiles aligned with the blocks or not."""
    tiles(tile, tile)
    ranks, sizes = [4, 2, 2, 1, 1], [None, 128, 64, 16, 4]
    length = 300
    mask = torch.arange(length)[None, :] < torch.tensor([length, 211])[:, None]
    q, k, v = _inputs(2, length, 2, ranks, 5, seed=7)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[0.6 / r for r in ranks], causal=causal, mask=mask)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="native", **kw), (q, k, v))
    assert _err(out, ref) < 1e-12
    for g, rg in zip(grads, ref_grads):
        assert _err(g, rg) < 1e-12


@pytest.mark.parametrize("length", [1, 2, 9])
@pytest.mark.parametrize("block_divide", [True, False])
def test_native_without_block_divide_and_short_sequences(block_divide, length):
    ranks, sizes = [2, 2], [None, 4]
    q, k, v = _inputs(1, length, 1, ranks, 3, seed=length)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[1.0, 1.0], causal=True, block_divide=block_divide)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="native", **kw), (q, k, v))
    assert _err(out, ref) < 1e-12
    for g, rg in zip(grads, ref_grads):
        assert _err(g, rg) < 1e-12


@pytest.mark.parametrize("logit_scale", [1.0, 30.0], ids=["plain", "extreme"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_float32_follows_float64(causal, logit_scale):
    """Float32 (the vectorized ``exp`` of the kernel) against the float64 reference: as close as PyTorch's own
    float32 attention gets, also with logits of hundreds (most probabilities underflow to exactly 0)."""
    ranks, sizes = [8, 4, 4], [None, 32, 8]
    length = 150
    q, k, v = _inputs(2, length, 2, ranks, 16, seed=5)
    q = q * logit_scale
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[1 / r for r in ranks], causal=causal)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    f32 = [t.float() for t in (q, k, v)]
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="native", **kw), f32)
    sdpa_like, sdpa_grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="matmul", **kw), f32)
    for mine, theirs, exact in zip((out, *grads), (sdpa_like, *sdpa_grads), (ref, *ref_grads)):
        budget = max(4 * _err(theirs.double(), exact), 1e-6)
        assert _err(mine.double(), exact) < budget


def test_under_torch_compile_with_inductor():
    """``torch.compile(fullgraph=True)`` (inductor) keeps the op as one node that runs the native engine; values and
    gradients equal eager ones."""
    ranks, sizes = [4, 2, 2], [None, 8, 2]
    q, k, v = _inputs(2, 33, 2, ranks, 4, seed=2, dtype=torch.float32)
    mask = torch.arange(33)[None, :] < torch.tensor([33, 20])[:, None]

    def fn(q, k, v):
        return mlr_attention_torch(q, k, v, ranks=ranks, block_sizes=sizes, scales=[0.5, 0.5, 0.5], causal=True,
                                   mask=mask, engine="native")

    with inductor_settings():
        compiled = torch.compile(fn, fullgraph=True, backend="inductor")
        eager, eager_grads = _value_and_grads(fn, (q, k, v))
        out, grads = _value_and_grads(compiled, (q, k, v))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _chosen(q):
    return resolve_backend("mlr_attention", None, q.device, q=q)


def test_auto_prefers_native_and_falls_back(monkeypatch):
    """The automatic choice runs the native backend on CPU float32/float64 when it is installed; when it cannot load
    it warned once and the torch backend (the matmul engine) runs (``engine="native"`` raises, saying why); float16
    goes to torch."""
    q, k, v = _inputs(1, 12, 1, [2, 2], 3, dtype=torch.float32)
    kw = dict(ranks=[2, 2], block_sizes=[None, 4], scales=[0.5, 0.5])
    assert _chosen(q) == "native"
    assert _chosen(q.half()) == "torch"
    assert _chosen(q.bfloat16()) == "torch"

    monkeypatch.setattr(_native, "_STATE", {"tried": False, "error": None})

    def broken_library():
        raise ImportError("_C.so: undefined symbol: c10_error")

    monkeypatch.setattr(_native, "_import", broken_library)
    with pytest.warns(RuntimeWarning, match="cannot be loaded"):
        assert _chosen(q) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert _chosen(q) == "torch"
        out = mlr_attention(q, k, v, **kw)
    torch.testing.assert_close(out, mlr_attention(q, k, v, backend="reference", **kw))
    with pytest.raises(RuntimeError, match="undefined symbol: c10_error"):
        mlr_attention_torch(q, k, v, engine="native", **kw)


def test_environment_variable_disables_the_kernels(monkeypatch):
    monkeypatch.setattr(_native, "_STATE", {"tried": False, "error": None})
    monkeypatch.setenv(_native.ENV_VAR, "0")
    monkeypatch.setattr(_native, "_import", lambda: pytest.fail("loaded although disabled"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.load()
    assert _native.ENV_VAR in _native.unavailable_reason()
    assert _chosen(torch.zeros(1, 2, 1, 2)) == "torch"


def test_argument_checks():
    q, k, v = _inputs(2, 8, 1, [2, 2], 3)
    with pytest.raises(ValueError, match="float32 or float64"):
        mlr_attention_torch(q.half(), k.half(), v.half(), ranks=[2, 2], block_sizes=[None, 4], scales=[1, 1],
                            engine="native")
    key_real = torch.tensor([[True] * 8, [True, False] * 4])
    with pytest.raises(ValueError, match="right-padded"):
        mlr_attention_tiled(q, k, v, key_real, [2, 2], [0, 4], [1.0, 1.0], False, True, "native")
    op = torch.ops.mixer_plugins_native.mlr_forward
    levels = ([2, 4], [0, 4], [1.0, 0.5], [1.0, 1.0])
    with pytest.raises(RuntimeError, match="unit feature stride"):
        op(torch.cat([q, q], -1)[..., ::2], k, v, None, *levels, False, 4, 4)
    with pytest.raises(RuntimeError, match="key lengths"):
        op(q, k, v, torch.tensor([8, 0]), *levels, False, 4, 4)
    with pytest.raises(RuntimeError, match="exceed"):
        op(q, k, v, None, [2, 6], [0, 4], [1.0, 0.5], [1.0, 1.0], False, 4, 4)
    with pytest.raises(RuntimeError, match="one width, size, scale and tau"):
        op(q, k, v, None, [2, 4], [0, 4], [1.0, 0.5], [1.0], False, 4, 4)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_strided_inputs_are_read_in_place(causal):
    """q, k, v as views of one packed projection (the mixer's layout: no copy is made) and a transposed batch give
    the values and gradients of contiguous copies."""
    gen = torch.Generator().manual_seed(5)
    ranks, sizes = [4, 2, 1, 1], [None, 8, 4, 2]
    packed = torch.randn(3, 21, 2, 8 + 8 + 5, generator=gen, dtype=F64)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[0.7 / r for r in ranks], causal=causal, engine="native")

    def views(t):
        return t[..., :8], t[..., 8:16], t[..., 16:]

    out, grads = _value_and_grads(lambda t: mlr_attention_torch(*views(t), **kw), (packed,))
    assert not views(packed)[2].is_contiguous()
    ref, ref_grads = _value_and_grads(lambda t: mlr_attention_torch(*(x.contiguous() for x in views(t)), **kw),
                                      (packed,))
    assert _err(out, ref) < 1e-14 and _err(grads[0], ref_grads[0]) < 1e-14
    batch_major = packed.transpose(0, 1).contiguous().transpose(0, 1)  # batch stride < length stride
    out2 = mlr_attention_torch(*views(batch_major), **kw)
    assert _err(out2, ref) < 1e-14
