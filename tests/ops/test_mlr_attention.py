"""The MLR attention op (``mixer_plugins.kernels.mlr_attention``): fast path vs its materialized reference vs the
``mlr_attention`` mixer's own math, in float64, values and gradients; masks with NaN pads, odd lengths, several
level lists; memory (no ``L x L`` intermediate); argument checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import LargestTensor

import mixer_plugins
from mixer_plugins.kernels.mlr_attention import mlr_attention, mlr_attention_flops, plan_tasks
from mixer_plugins.kernels.mlr_attention.torch import mlr_attention_torch
from mixer_plugins.layers.masks import zero_pads

F64 = torch.float64

# (ranks, block_sizes): the mixer's test levels, a non-global level 0 (pairs sharing no level score 0), two global
# levels, a single global level (plain attention), non-halving nesting, the paper's 8 levels (blocks 64 ... 1 here).
LEVELS = [
    ([4, 2, 1, 1], [None, 8, 4, 2]),
    ([3, 2, 2, 1], [12, 6, 3, 1]),
    ([2, 2, 4], [None, None, 3]),
    ([8], [None]),
    ([4, 2, 2], [None, 9, 3]),
    ([32, 8, 6, 4, 4, 4, 4, 2], [None, 64, 32, 16, 8, 4, 2, 1]),
]


def _inputs(batch, length, heads, ranks, value_width, *, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    width = sum(ranks)
    q = torch.randn(batch, length, heads, width, generator=gen, dtype=dtype)
    k = torch.randn(batch, length, heads, width, generator=gen, dtype=dtype)
    v = torch.randn(batch, length, heads, value_width, generator=gen, dtype=dtype)
    return q, k, v


def _right_mask(batch, length, lengths):
    pos = torch.arange(length)
    return pos[None, :] < torch.tensor(lengths)[:, None]


def _value_and_grads(fn, tensors, cotangent_seed=1):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    gen = torch.Generator().manual_seed(cotangent_seed)
    cot = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    grads = torch.autograd.grad(out, tensors, cot)
    return out.detach(), grads


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * (1 + b.abs().max().item()), err


ENGINES = {"native": dict(engine="native"), "matmul": dict(engine="matmul")}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("levels", range(len(LEVELS)))
@pytest.mark.parametrize("length", [37])
def test_op_matches_reference(engine, causal, levels, length):
    ranks, sizes = LEVELS[levels]
    scales = [0.7 / r for r in ranks]
    q, k, v = _inputs(2, length, 2, ranks, 5, seed=length + levels)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=scales, causal=causal)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, **ENGINES[engine], **kw), (q, k, v))
    _close(out, ref)
    for g, rg in zip(grads, ref_grads):
        _close(g, rg)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("levels", [0, 1, 4])
def test_masked_nan_pads(engine, causal, levels):
    """Pads are selected away: NaN pad queries/keys/values change no real output or gradient; pad outputs are 0;
    a fully padded row gives zeros, never NaN."""
    ranks, sizes = LEVELS[levels]
    length = 29
    mask = _right_mask(4, length, [29, 17, 1, 0])
    q, k, v = _inputs(4, length, 2, ranks, 6, seed=3)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[1 / r for r in ranks], causal=causal, mask=mask)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    pad = ~mask[:, :, None, None]
    nan_inputs = [t.masked_fill(pad, float("nan")) for t in (q, k, v)]
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, **ENGINES[engine], **kw), nan_inputs)
    _close(out, ref)
    assert (out.masked_select(pad) == 0).all()
    for g, rg in zip(grads, ref_grads):
        _close(g, rg)
        assert (g.masked_select(pad) == 0).all()
    # and the real outputs equal those of the unpadded sequences run alone
    for row, n in enumerate([29, 17, 1]):
        alone = mlr_attention(q[row:row + 1, :n], k[row:row + 1, :n], v[row:row + 1, :n], ranks=ranks,
                              block_sizes=sizes, causal=causal, backend="torch")
        _close(out[row:row + 1, :n], alone)


def _mixer_case(causal, options, length=23, batch=3, seed=0):
    torch.manual_seed(seed)
    mixer = mixer_plugins.create_mixer("mlr_attention", 32, num_heads=2, causal=causal, **options).to(F64)
    with torch.no_grad():  # nonzero query gain (muP zero-initialises it) so the scores are not all 0
        mixer.q_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(batch, length, 32, dtype=F64)
    mask = _right_mask(batch, length, [length, length - 6, 4])
    return mixer, x, mask


def _mixer_via_op(mixer, x, mask):
    """What ``MLRAttention.mix`` computes when it calls the op (the lines given to the lead)."""
    ctx = mixer.prepare(x, mask)
    y = mlr_attention(ctx.q, ctx.k, ctx.values, ranks=mixer.ranks, block_sizes=mixer.block_sizes,
                      scales=mixer.level_scales, causal=mixer.causal, mask=ctx.mask,
                      block_divide=mixer.block_divide)
    return zero_pads(mixer.finish(ctx, y), mask)


MIXER_OPTIONS = [
    {"ranks": [8, 4, 2, 2], "block_sizes": [None, 8, 4, 2]},
    {"ranks": [8, 4, 2, 2], "block_sizes": [16, 8, 4, 1], "block_divide": False, "divide_by_levels": True},
    {"ranks": [4, 4, 4, 4], "min_block_size": 3, "logit_scaling": "standard", "logit_multiplier": 2.0},
    {"ranks": [10, 6], "block_sizes": [None, 5]},
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("options", range(len(MIXER_OPTIONS)))
def test_op_matches_mixer(causal, options):
    """The op inside the mixer equals the mixer's forward and its materialized matrix, values and gradients (input
    and every parameter)."""
    mixer, x, mask = _mixer_case(causal, MIXER_OPTIONS[options], seed=options)
    params = [p for p in mixer.parameters() if p.requires_grad]
    cot = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(5))

    def run(fn):
        xr = x.clone().requires_grad_(True)
        out = fn(xr)
        grads = torch.autograd.grad(out, [xr, *params], cot)
        return out.detach(), grads

    via_op, op_grads = run(lambda xr: _mixer_via_op(mixer, xr, mask))
    for oracle in (lambda xr: mixer(xr, mask=mask), lambda xr: mixer.forward_via_matrix(xr, mask=mask)):
        expected, expected_grads = run(oracle)
        _close(via_op, expected)
        for g, eg in zip(op_grads, expected_grads):
            _close(g, eg)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_length_one(engine):
    ranks, sizes = LEVELS[0]
    q, k, v = _inputs(2, 1, 2, ranks, 3)
    for causal in (False, True):
        kw = dict(ranks=ranks, block_sizes=sizes, scales=[1 / r for r in ranks], causal=causal)
        ref, ref_grads = _value_and_grads(lambda *t, kw=kw: mlr_attention(*t, backend="reference", **kw), (q, k, v))
        out, grads = _value_and_grads(lambda *t, kw=kw: mlr_attention_torch(*t, **ENGINES[engine], **kw), (q, k, v))
        _close(out, ref)
        for g, rg in zip(grads, ref_grads):
            _close(g, rg)


def test_float32_close_to_float64():
    ranks, sizes = LEVELS[5]
    q, k, v = _inputs(1, 200, 2, ranks, 64, seed=7)
    kw = dict(ranks=ranks, block_sizes=sizes, causal=True)
    exact = mlr_attention(q, k, v, backend="reference", **kw)
    fast = mlr_attention(q.float(), k.float(), v.float(), **kw)
    assert fast.dtype == torch.float32
    assert (fast.double() - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("length", [1, 7, 64, 100, 129])
def test_plan_covers_every_pair_once(causal, length):
    for (ranks, sizes), dyadic in itertools.product(LEVELS, [False, True]):
        plan = plan_tasks(length, ranks, sizes, causal=causal, block_divide=True, dyadic=dyadic)
        seen = torch.zeros(length, length, dtype=torch.long)
        for group in plan.groups:
            for t in group.tasks:
                for p in range(t.count):
                    base = t.start + p * t.plen
                    block = seen[base + t.q0: base + t.q0 + t.q_len, base + t.k0: base + t.k0 + t.k_len]
                    block += torch.ones_like(block).tril() if t.causal else 1
        expected = torch.ones(length, length, dtype=torch.long)
        assert torch.equal(seen, expected.tril() if causal else expected)


@pytest.mark.parametrize("engine", ["native", "matmul"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_no_quadratic_tensor(engine, causal):
    """Forward and backward never build a tensor near ``L x L`` per head (the reference does)."""
    length, ranks, sizes = 1024, [16, 8, 4, 4], [None, 64, 32, 16]
    q, k, v = (t.float().requires_grad_(True) for t in _inputs(1, length, 1, ranks, 32, seed=2))
    mask = _right_mask(1, length, [1000])
    with LargestTensor() as probe:
        out = mlr_attention_torch(q, k, v, ranks=ranks, block_sizes=sizes, scales=[1 / r for r in ranks],
                                  causal=causal, mask=mask, **ENGINES[engine])
        out.sum().backward()
    assert probe.largest <= length * length // 8, probe.largest
    with LargestTensor() as probe:
        mlr_attention(q, k, v, ranks=ranks, block_sizes=sizes, causal=causal, backend="reference")
    assert probe.largest >= length * length  # the probe sees an L x L tensor when there is one


def test_argument_checks():
    q, k, v = _inputs(1, 8, 1, [2, 2], 3)
    ok = dict(ranks=[2, 2], block_sizes=[None, 4])
    with pytest.raises(ValueError, match="sum to"):
        mlr_attention(q, k, v, ranks=[2, 1], block_sizes=[None, 4])
    with pytest.raises(ValueError, match="one per level"):
        mlr_attention(q, k, v, ranks=[2, 2], block_sizes=[None])
    with pytest.raises(ValueError, match="nest"):
        mlr_attention(q, k, v, ranks=[2, 2], block_sizes=[6, 4])
    with pytest.raises(ValueError, match="global levels must come first"):
        mlr_attention(q, k, v, ranks=[2, 2], block_sizes=[4, None])
    with pytest.raises(ValueError, match="positive"):
        mlr_attention(q, k, v, ranks=[2, 2], block_sizes=[None, 0])
    with pytest.raises(ValueError, match="scales"):
        mlr_attention(q, k, v, scales=[1.0], **ok)
    with pytest.raises(ValueError, match="same shape"):
        mlr_attention(q, k[:, :7], v, **ok)
    with pytest.raises(ValueError, match="share"):
        mlr_attention(q, k, v[:, :7], **ok)
    with pytest.raises(TypeError, match="dtype"):
        mlr_attention(q, k.float(), v, **ok)
    with pytest.raises(TypeError, match="bool"):
        mlr_attention(q, k, v, mask=torch.ones(1, 8), **ok)
    with pytest.raises(ValueError, match="right-padded"):
        mlr_attention(q, k, v, mask=torch.tensor([[True, False] * 4]), **ok)
    with pytest.raises(ValueError, match="native engine takes float32 or float64"):
        mlr_attention_torch(q.half(), k.half(), v.half(), scales=[0.5, 0.5], engine="native", **ok)
    with pytest.raises(ValueError, match="engine must be"):
        mlr_attention_torch(q, k, v, scales=[0.5, 0.5], engine="flash", **ok)


def _paper_count(batch, heads, length, ranks, sizes, value_width):
    """Independent of the op: per (query, key) pair of the L x L matrix, the features of every level whose block
    holds both (from dense same-block masks), and ``value_width`` for ``A V``; 2 FLOPs per multiply-add."""
    from mixer_plugins.kernels.mlr_attention.reference import same_block_mask

    macs = sum(r * int(same_block_mask(length, s).sum()) for r, s in zip(ranks, sizes))
    return 2 * batch * heads * macs, 2 * batch * heads * length * length * value_width


@pytest.mark.parametrize("engine", ["native", "matmul"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("levels", [0, 1, 2])
def test_flops_match_the_flop_counter(engine, causal, levels):
    """FlopCounterMode counts the op by its registered formula: the paper's count (each pair the features of the
    levels it shares; causal not subtracted, as PyTorch's SDPA formula), whatever the engine executes; forward and
    backward (3x the score FLOPs and 2x the value FLOPs, PyTorch's convention for attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    ranks, sizes = LEVELS[levels]
    q, k, v = (t.float().requires_grad_(True) for t in _inputs(2, 45, 3, ranks, 8))
    mask = _right_mask(2, 45, [45, 30])
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[1.0] * len(ranks), causal=causal, mask=mask, engine=engine)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        mlr_attention_torch(q, k, v, **kw)
    scores, values = _paper_count(2, 3, 45, ranks, sizes, 8)
    expected = mlr_attention_flops(2, 3, 45, ranks=ranks, block_sizes=sizes, value_width=8, causal=causal)
    assert expected == {"scores": scores, "weighted_values": values}
    assert counter.get_total_flops() == scores + values
    with FlopCounterMode(display=False) as counter:
        mlr_attention_torch(q, k, v, **kw).sum().backward()
    assert counter.get_total_flops() == 4 * scores + 3 * values


def test_executed_flops_of_the_matmul_engine():
    """What the matmul engine really multiplies (documented): every pair at the width of the levels it shares;
    bidirectional, exactly the counted FLOPs; causal, the full rectangles of the tasks on or below the diagonal
    (more than half of the bidirectional count, less than all of it)."""
    ranks, sizes = LEVELS[0]
    kw = dict(ranks=ranks, block_sizes=sizes, value_width=8)
    counted = mlr_attention_flops(1, 1, 64, **kw)
    assert mlr_attention_flops(1, 1, 64, executed=True, **kw) == counted
    causal = mlr_attention_flops(1, 1, 64, causal=True, executed=True, **kw)
    for part in ("scores", "weighted_values"):
        assert counted[part] / 2 < causal[part] < counted[part]
    assert mlr_attention_flops(1, 1, 64, causal=True, **kw) == counted  # the count does not subtract the mask
    with pytest.raises(TypeError, match="executed"):
        mlr_attention_flops(1, 1, 64, executed="matmul", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("levels", [0, 1, 4, 5])
def test_matmul_engine_in_small_chunks(monkeypatch, causal, levels):
    """The chunked engine with a tiny score budget (many row chunks per task, chunks of one row wider than the
    budget, causal chunks that skip their masked keys) still equals the reference, values and gradients."""
    from mixer_plugins.kernels.mlr_attention import chunked

    monkeypatch.setattr(chunked, "DEFAULT_BUDGET", 40)
    ranks, sizes = LEVELS[levels]
    length = 41
    mask = _right_mask(3, length, [41, 26, 3])
    q, k, v = _inputs(3, length, 2, ranks, 5, seed=11)
    kw = dict(ranks=ranks, block_sizes=sizes, scales=[0.5 / r for r in ranks], causal=causal, mask=mask)
    ref, ref_grads = _value_and_grads(lambda *t: mlr_attention(*t, backend="reference", **kw), (q, k, v))
    out, grads = _value_and_grads(lambda *t: mlr_attention_torch(*t, engine="matmul", **kw), (q, k, v))
    _close(out, ref, 1e-12)
    for g, rg in zip(grads, ref_grads):
        _close(g, rg, 1e-12)


def test_export_traces_the_reference_formula():
    """Under ``torch.export`` the backend traces the materialized formula, not the custom op: the exported program
    holds standard ops only (so it translates to ONNX, tests/backbones/test_onnx.py) and gives the eager values.
    (``torch.compile(fullgraph=True)`` of the mixer, which keeps the op whole, is tests/mixers/test_compile.py.)"""
    ranks, sizes = LEVELS[0]
    mask = _right_mask(2, 19, [19, 11])
    q, k, v = (t.float() for t in _inputs(2, 19, 2, ranks, 4, seed=4))

    def fn(q, k, v, mask):
        return mlr_attention(q, k, v, ranks=ranks, block_sizes=sizes, causal=True, mask=mask, backend="torch")

    class Wrap(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return fn(q, k, v, mask)

    program = torch.export.export(Wrap(), (q, k, v, mask))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "mixer_plugins" in t], targets
    torch.testing.assert_close(program.module()(q, k, v, mask), fn(q, k, v, mask))


def test_triton_backend_refuses_float64(monkeypatch):
    """One float64 policy for the Triton backends: asked for by name, the triton backend refuses float64 inputs
    with a clear error (before any kernel is loaded); chosen automatically on CUDA, the dispatcher passes it over for
    the torch backend, and takes it for float32."""
    from mixer_plugins.kernels import BackendUnavailableError
    from mixer_plugins.kernels._dispatch import resolve_backend

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check; dtype is what is refused
    q, k, v = _inputs(1, 8, 1, [2, 2], 3)
    with pytest.raises(BackendUnavailableError, match="float64"):
        mlr_attention(q, k, v, ranks=[2, 2], block_sizes=[None, 4], backend="triton")
    cuda = torch.device("cuda")
    assert resolve_backend("mlr_attention", None, cuda, q=q) == "torch"
    assert resolve_backend("mlr_attention", None, cuda, q=q.float()) == "triton"


def _dense_tile_check(length, rows, cols, sizes, causal, keys_are_rows, window=None, num_global=0):
    """Expand a tile plan to the L x L pairs: every allowed pair visited once, no disallowed pair inside a uniform
    tile pair, and every pair of a uniform tile pair shares exactly its class's levels."""
    from mixer_plugins.kernels.local_attention.reference import allowed_pairs
    from mixer_plugins.kernels.mlr_attention.plan import tile_plan
    from mixer_plugins.kernels.mlr_attention.reference import same_block_mask

    plan = tile_plan(length, rows, cols, sizes, causal=causal, keys_are_rows=keys_are_rows, window=window,
                     num_global=num_global)
    shared = sum(same_block_mask(length, s).long() for s in sizes)  # levels shared by (query, key)
    if window is None:
        allowed = torch.ones(length, length, dtype=torch.bool)
        allowed = allowed.tril() if causal else allowed
    else:
        allowed = allowed_pairs(length, window, causal, num_global)
    if keys_are_rows:  # index [row token, column token]
        shared, allowed = shared.T, allowed.T
    seen = torch.zeros(length, length, dtype=torch.long)
    n_classes = len(plan.classes)
    for r in range(plan.n_rows):
        rs = slice(r * rows, (r + 1) * rows)
        for c, cls in enumerate(plan.classes):
            for first, end in plan.segs[plan.seg_ptr[r * n_classes + c]: plan.seg_ptr[r * n_classes + c + 1]].tolist():
                block = slice(first * cols, end * cols)
                assert end * cols <= length  # never the partial tile
                assert allowed[rs, block].all()
                assert (shared[rs, block] == cls).all()
                seen[rs, block] += 1
        for t in plan.mixed[plan.mixed_ptr[r]: plan.mixed_ptr[r + 1]].tolist():
            seen[rs, t * cols: (t + 1) * cols] += 1
    assert (seen[allowed] == 1).all()
    assert (seen <= 1).all()
    return plan


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("keys_are_rows", [False, True], ids=["query-rows", "key-rows"])
@pytest.mark.parametrize("length,rows,cols", [(37, 4, 8), (64, 8, 8), (50, 16, 4), (5, 8, 8)])
def test_tile_plan_covers_every_pair_once(causal, keys_are_rows, length, rows, cols):
    for _, sizes in LEVELS:
        _dense_tile_check(length, rows, cols, sizes, causal, keys_are_rows)
    for window, num_global in [(3, 0), (5, 2), (0, 1), (40, 0), (6, 9)]:
        _dense_tile_check(length, rows, cols, [None], causal, keys_are_rows, window, num_global)


def test_tile_plan_is_mostly_uniform_at_the_papers_levels():
    """At 4k with the paper's levels and 64-token tiles, only the diagonal tiles need per-entry masks, and the tiles
    outside a window are skipped."""
    from mixer_plugins.kernels.mlr_attention.plan import tile_plan

    plan = tile_plan(4096, 64, 64, [None, 512, 256, 128, 64, 32, 16, 8], causal=True)
    assert plan.pair_counts() == {"uniform": 64 * 63 // 2, "mixed": 64}
    assert plan.classes == (1, 2, 3, 4, 5, 6, 7, 8)
    local = tile_plan(4096, 64, 64, [None], causal=False, window=128)
    assert sum(local.pair_counts().values()) == 64 * 5 - 6  # tiles r - 2 .. r + 2 of each row r
