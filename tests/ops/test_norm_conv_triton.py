"""The Triton backends of ``kernels.gated_rmsnorm`` and ``kernels.depthwise_conv1d`` against their ``reference``
backends: values and every gradient, float32 and half precision, odd widths, tails, strided inputs; their custom ops
under ``torch.compile(fullgraph=True)``; the launch grids and 64-bit offsets at sizes past 2^31.

Like ``tests/ops/test_mlr_attention_triton_kernels.py``, the kernel checks run on CPU under ``TRITON_INTERPRET=1`` in a
fresh interpreter (``MIXER_PLUGINS_TRITON_FRESH=1``), started by :func:`test_norm_conv_kernels_under_the_interpreter`;
with CUDA they run in this process. The grid arithmetic is plain Python and runs everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mixer_plugins import kernels

FRESH = os.environ.get("MIXER_PLUGINS_TRITON_FRESH") == "1"
IN_PROCESS = FRESH or torch.cuda.is_available()

pytestmark = pytest.mark.triton


@pytest.mark.skipif(IN_PROCESS, reason="the checks run in this process")
@pytest.mark.slow  # a Triton-interpreter suite in a fresh process
def test_norm_conv_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from helpers import assert_passes_fresh

    assert_passes_fresh("ops/test_norm_conv_triton.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=900)


if IN_PROCESS:
    pytest.importorskip("triton")
    import triton
    import triton.language as tl
    from helpers import fast_interpreter  # noqa: F401  (autouse fixture: interpreter speed shims)

    from mixer_plugins.kernels._triton._common import offset64

    @triton.jit
    def _offsets_kernel(out_ptr, start, stride, N: tl.constexpr):
        """``offset64(start + i, stride)`` for i < N, as the kernels form their row offsets."""
        rows = start + tl.arange(0, N)
        tl.store(out_ptr + tl.arange(0, N), offset64(rows, stride))


DEVICE = "cuda" if torch.cuda.is_available() and not FRESH else "cpu"
needs_kernels = pytest.mark.skipif(not IN_PROCESS, reason="runs under the interpreter in a fresh process")

#: (atol, rtol) of the outputs and gradients against the float64 reference, by input dtype
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], names: str, dtype: torch.dtype) -> None:
    """Each ``got`` (the kernels', in the inputs' dtypes) against ``want`` (float64, on the same rounded inputs),
    relative to the reference's scale."""
    atol, rtol = TOLERANCE[dtype]
    for name, a, b in zip(names[:len(got)], got, want, strict=True):
        assert torch.isfinite(a).all(), name
        scale = max(b.abs().max().item(), 1.0)
        torch.testing.assert_close(a.double().cpu(), b, atol=atol * scale, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


# -- gated RMSNorm --------------------------------------------------------------------------------------------

def _norm_check(shape, dtype, before, *, z_dtype=None, w_dtype=torch.float32, strided=False, seed=0):
    width = shape[-1]
    y = _rand(*shape, dtype=dtype, seed=seed)
    z = _rand(*shape, dtype=z_dtype or dtype, seed=seed + 1, scale=2.0)
    w = _rand(width, dtype=w_dtype, seed=seed + 2) + 1.0
    if strided:  # y a slice of wider rows, z with its two leading dims transposed (neither is contiguous)
        y = torch.cat([y, torch.ones_like(y)], dim=-1)[..., :width]
        z = z.transpose(0, 1).contiguous().transpose(0, 1)
    leaves = [t.to(DEVICE).requires_grad_() for t in (y, z, w)]
    out = kernels.gated_rmsnorm(*leaves, 1e-5, before, backend="triton")
    assert out.dtype == y.dtype and out.shape == y.shape
    cot = _rand(*shape, dtype=dtype, seed=seed + 3)
    got = [out, *torch.autograd.grad(out, leaves, cot.to(DEVICE))]
    assert [g.dtype for g in got[1:]] == [t.dtype for t in leaves]
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (y, z, w)]
    want = kernels.gated_rmsnorm(*ref_leaves, 1e-5, before, backend="reference")
    _compare(got, [want.detach(), *torch.autograd.grad(want, ref_leaves, cot.double())], ["out", "dy", "dz", "dw"],
             dtype)


NORM_SHAPES = {
    "odd-width": (2, 3, 37),          # one row tile, the width padded to 64
    "row-tails": (150, 37),           # 5 row tiles of 32; the backward splits them over programs (tails included)
    "narrow": (7, 5, 3),              # width under the 16-wide minimum block
    "wide": (5, 1000),                # two rows a tile
}


@needs_kernels
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_norm_matches_reference_float32(shape, before):
    _norm_check(NORM_SHAPES[shape], torch.float32, before)


@needs_kernels
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_norm_matches_reference_half(dtype, before):
    _norm_check(NORM_SHAPES["row-tails"], dtype, before)


@needs_kernels
def test_norm_strided_and_mixed_dtype_inputs():
    _norm_check((6, 4, 24), torch.float32, True, strided=True)
    _norm_check((9, 40), torch.bfloat16, False, z_dtype=torch.float32, w_dtype=torch.float32)


@needs_kernels
def test_norm_planted_bug_is_caught(monkeypatch):
    """The checks fail on a wrong epsilon inside the kernel (the comparison can fail)."""
    from mixer_plugins.kernels.norm import triton_kernels as norm

    real = norm._norm_fwd
    monkeypatch.setattr(norm, "_norm_fwd", lambda y, z, w, eps, before: real(y, z, w, eps + 0.5, before))
    with pytest.raises(AssertionError):
        _norm_check((3, 16), torch.float32, True)


@needs_kernels
def test_norm_empty_rows_and_deterministic_weight_gradient():
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    y = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    out = kernels.gated_rmsnorm(y, y.detach().clone(), w, backend="triton")
    assert out.shape == (0, 8)
    (dw,) = torch.autograd.grad(out.sum(), [w])
    assert torch.equal(dw, torch.zeros_like(dw))
    y, z = _rand(150, 37, dtype=torch.float32, seed=5).to(DEVICE), _rand(150, 37, dtype=torch.float32, seed=6)
    w = torch.rand(37, device=DEVICE, requires_grad=True)
    grads = [torch.autograd.grad(kernels.gated_rmsnorm(y, z.to(DEVICE), w, backend="triton").sum(), [w])[0]
             for _ in range(2)]
    assert torch.equal(grads[0], grads[1])


@needs_kernels
def test_norm_backend_refuses_float64_and_too_wide_rows():
    from mixer_plugins.kernels.norm.triton_kernels import MAX_WIDTH

    y = torch.randn(2, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(kernels.BackendUnavailableError, match="float64"):
        kernels.gated_rmsnorm(y, y, torch.ones(8, dtype=torch.float64, device=DEVICE), backend="triton")
    wide = torch.zeros(1, MAX_WIDTH + 1, device=DEVICE)
    with pytest.raises(kernels.BackendUnavailableError, match="limit"):
        kernels.gated_rmsnorm(wide, wide, torch.ones(MAX_WIDTH + 1, device=DEVICE), backend="triton")


# -- depthwise convolution --------------------------------------------------------------------------------

def _conv_check(batch, length, channels, k, causal, silu, bias, dtype, *, w_dtype=None, layout="contiguous", seed=0):
    x = _rand(batch, length, channels, dtype=dtype, seed=seed)
    w = _rand(channels, k, dtype=w_dtype or dtype, seed=seed + 1, scale=0.5)
    b = _rand(channels, dtype=w_dtype or dtype, seed=seed + 2) if bias else None
    if layout == "slice":        # a channel slice of a wider tensor, as the block passes its input projection
        x = torch.cat([x, torch.ones_like(x)], dim=-1)[..., :channels]
    elif layout == "channels-strided":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b) if t is not None]
    out = kernels.depthwise_conv1d(leaves[0], leaves[1], leaves[2] if bias else None, causal=causal, silu=silu,
                                   backend="triton")
    assert out.dtype == x.dtype and out.shape == x.shape
    cot = _rand(batch, length, channels, dtype=dtype, seed=seed + 3)
    got = [out, *torch.autograd.grad(out, leaves, cot.to(DEVICE))]
    assert [g.dtype for g in got[1:]] == [t.dtype for t in leaves]
    ref = [t.detach().double().cpu().requires_grad_() for t in (x, w, b) if t is not None]
    want = kernels.depthwise_conv1d(ref[0], ref[1], ref[2] if bias else None, causal=causal, silu=silu,
                                    backend="reference")
    _compare(got, [want.detach(), *torch.autograd.grad(want, ref, cot.double())], ["out", "dx", "dw", "db"], dtype)


CONV_CASES = {
    # batch, length, channels, k, causal, silu, bias: lengths over tiles with tails, channels over blocks of 64
    "centred-7-silu": (2, 37, 70, 7, False, True, True),
    "causal-4-silu": (3, 21, 5, 4, True, True, True),
    "causal-4-nobias": (2, 33, 9, 4, True, False, False),
    "centred-3": (1, 19, 66, 3, False, False, True),
    "centred-1-silu": (2, 5, 3, 1, False, True, True),
    "causal-2-silu-nobias": (2, 17, 4, 2, True, True, False),
    "shorter-than-kernel": (2, 3, 6, 7, False, True, True),
    "causal-longer-than-length": (1, 2, 3, 5, True, True, True),
}


@needs_kernels
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_matches_reference_float32(case):
    _conv_check(*CONV_CASES[case], torch.float32)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["centred-7-silu", "causal-4-nobias"])
def test_conv_matches_reference_half(case, dtype):
    _conv_check(*CONV_CASES[case], dtype)


@needs_kernels
@pytest.mark.parametrize("layout", ["slice", "channels-strided"])
def test_conv_strided_inputs(layout):
    _conv_check(2, 20, 12, 3, False, True, True, torch.float32, layout=layout)


@needs_kernels
def test_conv_mixed_dtypes_as_under_autocast():
    """bfloat16 activations with float32 parameters: each gradient in its input's dtype."""
    _conv_check(2, 18, 10, 4, True, True, True, torch.bfloat16, w_dtype=torch.float32)


@needs_kernels
def test_conv_planted_bug_is_caught(monkeypatch):
    """The checks fail on a kernel shifted by one tap (the comparison can fail)."""
    from mixer_plugins.kernels.conv import triton_kernels as conv

    real = conv._conv_fwd
    monkeypatch.setattr(conv, "_conv_fwd", lambda x, w, b, left, right, silu: real(x, w, b, left - 1, right + 1, silu))
    with pytest.raises(AssertionError):
        _conv_check(*CONV_CASES["centred-7-silu"], torch.float32)


@needs_kernels
def test_conv_empty_and_refusals():
    from mixer_plugins.kernels.conv.triton_kernels import MAX_TAPS

    x = torch.zeros(2, 0, 4, device=DEVICE, requires_grad=True)
    w = torch.ones(4, 3, device=DEVICE, requires_grad=True)
    out = kernels.depthwise_conv1d(x, w, None, causal=True, silu=True, backend="triton")
    assert out.shape == (2, 0, 4)
    assert torch.equal(torch.autograd.grad(out.sum(), [w])[0], torch.zeros_like(w))
    with pytest.raises(kernels.BackendUnavailableError, match="float64"):
        kernels.depthwise_conv1d(x.double(), w.double(), None, causal=True, backend="triton")
    with pytest.raises(kernels.BackendUnavailableError, match="limit"):
        kernels.depthwise_conv1d(torch.zeros(1, 4, 2, device=DEVICE), torch.zeros(2, MAX_TAPS + 1, device=DEVICE),
                                 None, causal=True, backend="triton")


# -- dispatch --------------------------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("op", ["norm", "conv"])
def test_dispatcher_picks_triton_first_on_cuda_only(op):
    from mixer_plugins.kernels import _dispatch

    rows = {(r.op, r.backend, r.device): r for r in kernels.backend_report(devices=["cuda", "cpu"])}
    assert rows[op, "triton", "cuda"].automatic and not rows[op, "triton", "cpu"].automatic
    assert _dispatch.OPS[op].automatic["cuda"][0] == "triton"   # first on CUDA
    # CPU tensors (even under the interpreter): never the Triton backend
    assert kernels.resolve_backend(op, None, "cpu") != "triton"


# -- torch.compile ---------------------------------------------------------------------------------------------

@needs_kernels
def test_compile_fullgraph_sees_one_op_each_way():
    """Under ``torch.compile(fullgraph=True)`` each backend is one opaque custom op in the graph, and the compiled
    forward and backward (inductor, the compiler users use) equal eager."""
    ops = []

    def count_ops(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def block(x, w, b, y, z, g):
        u = kernels.depthwise_conv1d(x, w, b, causal=False, silu=True, backend="triton")
        return kernels.gated_rmsnorm(u * y, z, g, 1e-5, False, backend="triton")

    args = [_rand(*s, dtype=torch.float32, seed=i).to(DEVICE).requires_grad_()
            for i, s in enumerate([(2, 9, 6), (6, 3), (6,), (2, 9, 6), (2, 9, 6), (6,)])]
    torch.compile(block, fullgraph=True, backend=count_ops)(*args)
    assert sum("depthwise_conv1d_triton" in op for op in ops) == 1, ops
    assert sum("gated_rmsnorm_triton" in op for op in ops) == 1, ops
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager)
    cot = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(compiled, args, cot), torch.autograd.grad(eager, args, cot)):
        torch.testing.assert_close(a, b)


# -- 64-bit offsets and launch grids -----------------------------------------------------------------------------

@needs_kernels
def test_row_offsets_are_64_bit():
    """The kernels' offset helper multiplies in 64 bits: rows x stride past 2^31 (int32 arithmetic would wrap)."""
    start, stride = 2**20 + 3, 4099          # (2^20 + 3) * 4099 > 2^32
    out = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    _offsets_kernel[(1,)](out, start, stride, N=8)
    assert out.cpu().tolist() == [(start + i) * stride for i in range(8)]


def test_grids_stay_one_dimensional_and_cover_every_row():
    """The launch grids at sizes past CUDA's limits on the other grid dimensions (65,535) and past 2^31 elements:
    one dimension, within 2^31 - 1 programs, covering every row / (sequence, time tile) exactly, no empty program."""
    pytest.importorskip("triton")
    from mixer_plugins.kernels.conv import triton_kernels as conv
    from mixer_plugins.kernels.norm import triton_kernels as norm

    for rows, width in [(1, 16), (150, 37), (70_000 * 197, 1536), (2**31 + 5, 64), (2**30, 4096)]:
        block_r, block_w, warps = norm.forward_layout(width)
        assert block_w >= width and 1 <= warps <= 16 and block_r * block_w <= max(norm.TILE_ELEMENTS, block_w)
        (programs,) = norm.forward_grid(rows, block_r)
        assert programs * block_r >= rows > (programs - 1) * block_r and programs <= norm.MAX_GRID
        for budget in (1, 4, 528):
            n, per = norm.backward_programs(rows, block_r, budget)
            assert per % block_r == 0 and n <= max(budget, 1) and n * per >= rows > (n - 1) * per
    for batch, length, channels in [(1, 1, 1), (2, 37, 70), (70_000, 197, 1664), (65_536, 2**16, 8)]:
        (programs,), blocks = conv.forward_layout(batch, length, channels)
        assert programs == batch * blocks["NT"] * blocks["NCB"] <= norm.MAX_GRID
        assert blocks["NT"] * blocks["BLOCK_T"] >= length and blocks["NCB"] * blocks["BLOCK_C"] >= channels
        for budget in (1, 4, 528):
            (programs,), blocks = conv.backward_layout(batch, length, channels, budget)
            items, per, splits = blocks["ITEMS"], blocks["items_per_program"], blocks["splits"]
            assert programs == splits * blocks["NCB"] and items == batch * blocks["NT"]
            assert splits * per >= items > (splits - 1) * per
    with pytest.raises(ValueError, match="grid limit"):
        norm.forward_grid(2**31 * 4, 2)
    with pytest.raises(ValueError, match="limit"):
        norm.forward_layout(norm.MAX_WIDTH + 1)


# -- the GPU benchmark's dry run ---------------------------------------------------------------------------------

@pytest.mark.skipif(IN_PROCESS, reason="runs once, from the main process")
def test_normconv_benchmark_dry_run(tmp_path):
    """``benchmarks/gpu/normconv_rows.py --dry`` (tiny shapes, CPU, the interpreter) prints its whole table."""
    pytest.importorskip("triton")
    from helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "normconv_rows.py"), "--dry",
                             "--json", str(tmp_path / "rows.json")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| op | candidate |" in result.stdout
    import json

    rows = json.loads((tmp_path / "rows.json").read_text())
    measured = {(r["op"], r["candidate"]) for r in rows if r["ms"] is not None}
    assert {("norm", "triton"), ("norm", "torch"), ("conv", "triton"), ("conv", "cudnn (reference)"),
            ("conv", "torch")} <= measured
