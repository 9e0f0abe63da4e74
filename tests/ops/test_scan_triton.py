"""The scan's ``triton`` backend (our fused kernels), run on CPU under ``TRITON_INTERPRET=1`` (or on CUDA, where the
GPU script runs this file), against the ``reference`` backend.

Values and every gradient are compared (``torch.autograd.grad``) with the materialized oracle in float64.
Shapes are tiny: the interpreter runs each kernel program in Python.

``TRITON_INTERPRET`` is read by ``triton.jit`` when a kernel is *defined* (triton 3.5:
``knobs.runtime.interpret`` in the decorator), and the interpreter's state does not survive every other test that
may run before these in one process (inductor compiles, for one). So on a machine without CUDA this module runs
in a fresh interpreter with ``TRITON_INTERPRET=1``, started by ``tests/ops/test_triton_suite.py``
(``MIXER_PLUGINS_TRITON_FRESH=1`` marks that run); collected in any other process it is skipped.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import fast_interpreter, triton_kernels_module  # noqa: F401  (fast_interpreter: an autouse fixture)

from mixer_plugins import kernels
from mixer_plugins.kernels import directional_scan, quasiseparable, ssd

#: the kernels, where they run (CPU tensors under the interpreter, CUDA ones otherwise: every tensor of a test is
#: made there) and the module's marks
qs_triton, DEVICE, pytestmark = triton_kernels_module("mixer_plugins.kernels.scan.triton_kernels")
triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _on_the_kernels_device(request):
    """Every tensor a test makes is made on :data:`DEVICE` (the compile test places its own: dynamo does not trace
    under a default-device context)."""
    if "compiles_fullgraph" in request.node.name:
        yield
        return
    with torch.device(DEVICE):
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)




def _rand(*shape, dtype=torch.float32, positive=False):
    t = torch.rand(*shape, dtype=torch.float64) * 0.9 + 0.1 if positive else torch.randn(*shape, dtype=torch.float64)
    return t.to(dtype).requires_grad_()


def _inputs(b, L, h, p, g, n, *, separate: bool, diag: bool, dtype=torch.float32):
    """Leaf tensors of a quasiseparable call (bwd generators only when ``separate``)."""
    t = dict(
        x=_rand(b, L, h, p, dtype=dtype), dt=_rand(b, L, h, positive=True), A=(-_rand(h, positive=True)).detach(),
        B=_rand(b, L, g, n, dtype=dtype), C=_rand(b, L, g, n, dtype=dtype),
    )
    t["A"].requires_grad_()
    if separate:
        t.update(dt_bwd=_rand(b, L, h, positive=True), A_bwd=(-_rand(h, positive=True)).detach().requires_grad_(),
                 B_bwd=_rand(b, L, g, n, dtype=dtype), C_bwd=_rand(b, L, g, n, dtype=dtype))
    if diag:
        t["diag"] = _rand(b, L, h, dtype=dtype)
    return t


def _to64(t: dict) -> dict:
    return {k: v.detach().double().requires_grad_() for k, v in t.items()}


def _compare(fn_triton, fn_ref, leaves: dict, *, atol=2e-5, rtol=2e-5, ref_leaves: dict | None = None,
             extra_out: bool = False):
    """Run both, compare outputs and the gradients of a random projection w.r.t. every leaf."""
    ref_leaves = _to64(leaves) if ref_leaves is None else ref_leaves
    out_t = fn_triton(**leaves)
    out_r = fn_ref(**ref_leaves)
    outs_t = out_t if isinstance(out_t, tuple) else (out_t,)
    outs_r = out_r if isinstance(out_r, tuple) else (out_r,)
    cotangents = [torch.randn(o.shape, dtype=torch.float64) for o in outs_r]
    for o_t, o_r in zip(outs_t, outs_r):
        torch.testing.assert_close(o_t.double(), o_r.double(), atol=atol, rtol=rtol)
    names = list(leaves)
    g_t = torch.autograd.grad([o.double() for o in outs_t], [leaves[k] for k in names],
                              [c.to(torch.float64) for c in cotangents], allow_unused=True)
    g_r = torch.autograd.grad(list(outs_r), [ref_leaves[k] for k in names],
                              [c.to(o.dtype) for c, o in zip(cotangents, outs_r)], allow_unused=True)
    for name, a, r in zip(names, g_t, g_r):
        assert (a is None) == (r is None), name
        if a is not None:
            torch.testing.assert_close(a.double(), r.double(), atol=atol * 5, rtol=rtol * 5,
                                       msg=lambda m, name=name: f"d{name}: {m}")


def _qs(backend="triton", **kw):
    return lambda **t: quasiseparable(**t, backend=backend, **kw)


# (b, L, h, p, g, n, chunk, shift, diag, separate, seq_idx)
CASES = {
    "hydra_odd_length": (1, 13, 2, 3, 1, 4, 4, True, True, True, None),
    "unshifted_shared_bc": (1, 13, 2, 3, 1, 4, 5, False, True, False, None),
    "groups2_segments_shift": (1, 8, 4, 2, 2, 3, 3, True, False, True, [0] * 4 + [3] * 3 + [7]),
    "segments_unshifted_diag": (1, 14, 2, 2, 1, 4, 4, False, True, True, [0] * 4 + [1] + [2] * 9),
    "batch2_segments_divides": (2, 16, 2, 2, 1, 2, 8, True, True, False, "two"),
    "one_chunk": (1, 7, 2, 3, 1, 4, 64, True, True, True, None),
    "chunk_of_one": (1, 5, 1, 2, 1, 2, 1, True, True, True, [0, 0, 1, 1, 1]),
    "length_one": (1, 1, 1, 2, 1, 2, 4, False, True, True, None),
}


def _seq(spec, b, L):
    if spec is None:
        return None
    if spec == "two":  # one boundary inside a chunk in row 0, exactly on a chunk boundary in row 1
        return torch.tensor([[0] * 5 + [1] * (L - 5), [0] * 8 + [1] * (L - 8)])[:b]
    return torch.tensor([spec] * b)


@pytest.mark.parametrize("case", list(CASES))
def test_quasiseparable_matches_reference(case):
    b, L, h, p, g, n, chunk, shift, diag, separate, seq = CASES[case]
    leaves = _inputs(b, L, h, p, g, n, separate=separate, diag=diag)
    seq_idx = _seq(seq, b, L)
    kw = dict(shift=shift, chunk_size=chunk, seq_idx=seq_idx)
    _compare(_qs(**kw), _qs("reference", **kw), leaves)


def test_shared_generators_passed_twice_match_defaults():
    """Passing the forward tensors as the backward ones (same objects) accumulates both gradients."""
    leaves = _inputs(1, 9, 2, 2, 1, 3, separate=False, diag=False)

    def twice(**t):
        return quasiseparable(t["x"], t["dt"], t["A"], t["B"], t["C"], dt_bwd=t["dt"], A_bwd=t["A"], B_bwd=t["B"],
                              C_bwd=t["C"], chunk_size=4, backend="triton")

    _compare(twice, _qs("reference", chunk_size=4), leaves)


def test_dt_preparation_is_differentiated():
    """dt_bias + softplus + dt_limit run in PyTorch before the kernel; dt_bias gets its gradient."""
    leaves = _inputs(1, 10, 2, 2, 1, 3, separate=True, diag=True)
    leaves["dt"] = torch.randn(1, 10, 2).requires_grad_()
    leaves["dt_bwd"] = torch.randn(1, 10, 2).requires_grad_()
    leaves["dt_bias"] = torch.randn(2).requires_grad_()
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.5), chunk_size=4)
    _compare(_qs(**kw), _qs("reference", **kw), leaves)


def test_segment_ids_start_a_new_segment_where_they_change():
    """seq_idx [0,0,0,1,1,0,0,0]: the last run is its own segment (as ids [0,0,0,1,1,2,2,2])."""
    leaves = _inputs(1, 8, 2, 2, 1, 3, separate=True, diag=True)
    with torch.no_grad():
        y = quasiseparable(**leaves, chunk_size=3, seq_idx=torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]]),
                           backend="triton")
        ref = quasiseparable(**_to64(leaves), chunk_size=3, seq_idx=torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]),
                             backend="reference")
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("reverse,shift", [(False, False), (True, True)])
def test_directional_scan_matches_reference(reverse, shift):
    leaves = _inputs(1, 11, 2, 2, 1, 3, separate=False, diag=False)
    seq_idx = torch.tensor([[0] * 6 + [1] * 5])
    kw = dict(reverse=reverse, shift=shift, chunk_size=4, seq_idx=seq_idx)
    _compare(lambda **t: directional_scan(**t, backend="triton", **kw),
             lambda **t: directional_scan(**t, backend="reference", **kw), leaves)


@pytest.mark.parametrize("with_seq", [False, True])
def test_ssd_matches_reference_with_states(with_seq):
    b, L, h, p, g, n = 2, 10, 2, 2, 1, 3
    leaves = _inputs(b, L, h, p, g, n, separate=False, diag=False)
    leaves["D"] = _rand(h)
    leaves["initial_states"] = _rand(b, h, p, n)
    if with_seq:
        leaves["z"] = _rand(b, L, h, p)
    seq_idx = torch.tensor([[0] * 3 + [1] * 7, [0] * 10]) if with_seq else None
    kw = dict(chunk_size=4, seq_idx=seq_idx, return_final_states=True)
    _compare(lambda **t: ssd(**t, backend="triton", **kw), lambda **t: ssd(**t, backend="reference", **kw), leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    """Half inputs: same result as the reference on the same inputs (which scans in float32), to half precision."""
    leaves = _inputs(1, 9, 2, 2, 1, 3, separate=True, diag=True, dtype=dtype)
    ref_leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}

    def run(**t):
        y = quasiseparable(**t, chunk_size=4, backend="triton")
        assert y.dtype == dtype
        return y

    _compare(run, _qs("reference", chunk_size=4), leaves, ref_leaves=ref_leaves, atol=2e-2, rtol=2e-2)


def test_the_comparison_catches_a_wrong_decay():
    """The value comparison can fail: against a reference with another decay, it does."""
    leaves = _inputs(1, 9, 2, 2, 1, 3, separate=True, diag=False)
    with pytest.raises(AssertionError):
        _compare(_qs(chunk_size=4), lambda **t: quasiseparable(**{**t, "A": t["A"] * 1.01}, chunk_size=4,
                                                                backend="reference"), leaves)


class _ScaledGradient(torch.autograd.Function):
    """The identity whose backward scales the gradient (a wrong gradient with the right values)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def test_the_comparison_catches_a_wrong_gradient():
    """The gradient comparison can fail too: a reference whose dt gradient is 1% off (values unchanged)."""
    leaves = _inputs(1, 9, 1, 2, 1, 3, separate=False, diag=False)
    with pytest.raises(AssertionError, match="ddt"):
        _compare(_qs(chunk_size=4), lambda **t: quasiseparable(**{**t, "dt": _ScaledGradient.apply(t["dt"])},
                                                                chunk_size=4, backend="reference"), leaves)


@pytest.mark.parametrize("decay", [-0.02, -2.0, -5.0, -40.0])
def test_the_shifted_scan_keeps_float32_accuracy_at_any_decay(decay):
    """As accurate in float32 as the released computation (unshifted scans, then the outputs shifted)."""
    gen = _gen(1)
    b, L, h, p, g, n = 1, 24, 2, 4, 1, 4
    x = torch.randn(b, L, h, p, generator=gen, dtype=torch.float64)
    dt, dt_b = (torch.rand(b, L, h, generator=gen, dtype=torch.float64) * 0.9 + 0.1 for _ in range(2))
    A = torch.full((h,), decay / 0.55, dtype=torch.float64)
    B, C, B_b, C_b = (torch.randn(b, L, g, n, generator=gen, dtype=torch.float64) for _ in range(4))
    kw = dict(chunk_size=8)
    truth = quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, backend="reference", **kw)
    f32 = [t.float() for t in (x, dt, A, B, C, dt_b, B_b, C_b)]
    x, dt, A, B, C, dt_b, B_b, C_b = f32
    y = quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, backend="triton", **kw)
    y_f = directional_scan(x, dt, A, B, C, backend="triton", **kw)
    y_b = directional_scan(x, dt_b, A, B_b, C_b, reverse=True, backend="triton", **kw)
    released = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0)) + F.pad(y_b[:, 1:], (0, 0, 0, 0, 0, 1))
    scale = truth.abs().max()
    error = (y.double() - truth).abs().max() / scale
    released_error = (released.double() - truth).abs().max() / scale
    assert error <= 1.5 * released_error + 2e-7, (error.item(), released_error.item())


def test_available_reports_why_not():
    assert qs_triton.available(DEVICE) is None
    reason = qs_triton.available("meta")
    assert isinstance(reason, str) and reason


# -- the custom op -----------------------------------------------------------------------------------

def _op_args(shift=True, chunk=4):
    t = _inputs(1, 9, 2, 2, 1, 3, separate=True, diag=True)
    return (t["x"], t["dt"].detach().float(), t["A"].detach().float(), t["B"], t["C"], t["dt_bwd"].detach().float(),
            t["A_bwd"].detach().float(), t["B_bwd"], t["C_bwd"], t["diag"], None,
            torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32), torch.zeros(2).requires_grad_(), 0.0, math.inf,
            True, shift, chunk, False)


def test_custom_op_passes_opcheck():
    """Schema, fake kernel (shapes/dtypes without running) and autograd registration of the forward ops."""
    torch.library.opcheck(torch.ops.mixer_plugins.quasiseparable_triton.default, _op_args(),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    chunked = _op_args()
    torch.library.opcheck(torch.ops.mixer_plugins.quasiseparable_triton_one_chunk.default, chunked[:10] +
                          chunked[11:13] + (0.0, math.inf, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_flop_counter_sees_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode

    leaves = _inputs(1, 9, 2, 2, 1, 3, separate=True, diag=True)
    with FlopCounterMode(display=False) as counter:
        y = quasiseparable(**leaves, chunk_size=4, backend="triton")
        y.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    fwd = counts[torch.ops.mixer_plugins.quasiseparable_triton]
    bwd = counts[torch.ops.mixer_plugins.quasiseparable_triton_backward]
    assert fwd == qs_triton.scan_triton_flops(1, 9, 2, 2, 3, 2, 4) > 0
    assert bwd == qs_triton.scan_triton_flops(1, 9, 2, 2, 3, 2, 4, backward=True) > fwd


def test_on_cuda_the_triton_backend_is_the_automatic_first_choice():
    rows = {(r.op, r.backend): r for r in kernels.backend_report(devices=["cuda"])}
    assert rows["scan", "triton"].automatic
    assert kernels._dispatch.OPS["scan"].automatic["cuda"][0] == "triton"


def test_a_compiled_call_reaches_the_triton_op():
    """Under torch.compile the dispatcher chooses as in eager: with the triton backend preferred, the traced graph
    holds our Triton custom op (on CUDA it is the automatic choice)."""
    leaves = {k: v.detach() for k, v in _inputs(1, 9, 2, 2, 1, 3, separate=False, diag=False).items()}
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    with kernels.use_backend("triton"):
        compiled = torch.compile(lambda **t: quasiseparable(**t, chunk_size=4), backend=backend, fullgraph=True)
        y = compiled(**leaves)
    assert any("quasiseparable_triton" in name for name in seen), seen
    torch.testing.assert_close(y.double(), quasiseparable(**_to64(leaves), chunk_size=4, backend="reference"),
                               atol=2e-5, rtol=2e-5)


# -- the one-chunk kernels (sequences of one chunk, no states) ----------------------------------------------

one_chunk = pytest.importorskip("mixer_plugins.kernels.scan.triton_one_chunk")


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 rows, so that the test lengths span several tiles (the kernels' cross-tile decays)."""
    monkeypatch.setattr(one_chunk, "TILE", 16)


# (b, L, h, p, g, n, shift, diag, separate, seq_idx); chunk_size 64 >= L: every case runs on the one-chunk kernels
ONE_CHUNK_CASES = {
    "hydra_three_tiles": (1, 40, 2, 3, 1, 4, True, True, True, None),
    "unshifted_shared_bc_partial_tile": (1, 37, 2, 3, 1, 4, False, True, False, None),
    "groups2_segments_across_tiles": (1, 33, 4, 2, 2, 3, True, False, True, [0] * 10 + [3] * 17 + [7] * 6),
    "batch2_one_tile": (2, 12, 2, 2, 1, 2, True, True, True, "two"),
    "length_one": (1, 1, 1, 2, 1, 2, True, True, True, None),
}


@pytest.mark.parametrize("case", list(ONE_CHUNK_CASES))
def test_one_chunk_kernels_match_reference(case, small_tiles):
    b, L, h, p, g, n, shift, diag, separate, seq = ONE_CHUNK_CASES[case]
    leaves = _inputs(b, L, h, p, g, n, separate=separate, diag=diag)
    seq_idx = None if seq is None else (torch.tensor([[0] * 5 + [1] * (L - 5), [0] * 8 + [1] * (L - 8)])[:b]
                                        if seq == "two" else torch.tensor([seq] * b))
    kw = dict(shift=shift, chunk_size=64, seq_idx=seq_idx)
    seen = []
    original = one_chunk._fwd

    def spy(*args):
        seen.append(True)
        return original(*args)

    one_chunk._fwd = spy
    try:
        _compare(_qs(**kw), _qs("reference", **kw), leaves)
    finally:
        one_chunk._fwd = original
    assert seen, "the one-chunk kernels did not run"


def test_one_chunk_head_blocks_sum_to_the_reference(small_tiles, monkeypatch):
    """The backward's d(C~ B^T) launch with a group's four heads in two blocks of two (the partial sums its next
    launch adds up), and the step-size gradients of each block's heads, against the reference."""
    monkeypatch.setattr(one_chunk, "MIN_PROGRAMS", 6)
    assert one_chunk.OneChunkGeometry(1, 40, 4, 1, 3, 4, tile=16).head_blocks() == 2
    leaves = _inputs(1, 40, 4, 3, 1, 4, separate=True, diag=True)
    kw = dict(shift=True, chunk_size=64)
    _compare(_qs(**kw), _qs("reference", **kw), leaves)


def test_one_chunk_dt_preparation_and_directional_scans(small_tiles):
    """dt_bias, softplus and dt_limit inside the one-chunk kernels (dt_bias gets its gradient); single directions."""
    leaves = _inputs(2, 20, 2, 2, 1, 3, separate=True, diag=True)
    leaves["dt"] = torch.randn(2, 20, 2).requires_grad_()
    leaves["dt_bwd"] = torch.randn(2, 20, 2).requires_grad_()
    leaves["dt_bias"] = torch.randn(2).requires_grad_()
    kw = dict(dt_softplus=True, dt_limit=(0.05, 1.5), chunk_size=64)
    _compare(_qs(**kw), _qs("reference", **kw), leaves)
    single = _inputs(1, 35, 2, 2, 1, 3, separate=False, diag=False)
    for reverse, shift in ((False, True), (True, False)):
        kw = dict(reverse=reverse, shift=shift, chunk_size=64)
        _compare(lambda kw=kw, **t: directional_scan(**t, backend="triton", **kw),
                 lambda kw=kw, **t: directional_scan(**t, backend="reference", **kw), single)


@pytest.mark.parametrize("length,chunk", [(20, 64), (20, 8)], ids=["one_chunk", "chunked"])
def test_A_log_is_taken_inside_the_kernels(length, chunk, small_tiles):
    """``A_log`` in place of ``A`` (what the Hydra block passes): ``A = -exp(A_log)`` formed inside the kernels, and
    A_log's gradient (``A dA``, summed over both directions) against the float64 reference given the same A_log,
    with raw dt, dt_bias and softplus, on both kernel families and for a single direction."""
    leaves = _inputs(2, length, 2, 2, 1, 3, separate=False, diag=True)
    del leaves["A"]
    leaves["A_log"] = torch.tensor([-1.5, 1.2]).requires_grad_()   # strong and weak decays
    leaves["dt"] = torch.randn(2, length, 2).requires_grad_()
    leaves["dt_bwd"] = torch.randn(2, length, 2).requires_grad_()
    leaves["B_bwd"], leaves["C_bwd"] = _rand(2, length, 1, 3), _rand(2, length, 1, 3)
    leaves["dt_bias"] = torch.randn(2).requires_grad_()
    kw = dict(dt_softplus=True, chunk_size=chunk)
    _compare(lambda **t: quasiseparable(A=None, **t, backend="triton", **kw),
             lambda **t: quasiseparable(A=None, **t, backend="reference", **kw), leaves)
    single = {k: leaves[k] for k in ("x", "dt", "B", "C", "A_log", "dt_bias")}
    kw = dict(reverse=True, shift=True, dt_softplus=True, chunk_size=chunk)
    _compare(lambda **t: directional_scan(A=None, **t, backend="triton", **kw),
             lambda **t: directional_scan(A=None, **t, backend="reference", **kw), single)


def test_A_log_equals_its_rates_and_excludes_A():
    """The reference with ``A_log`` equals the reference with ``A = -exp(A_log)`` (values and A_log's gradient through
    the rates); passing both, or neither, is refused."""
    t = _to64(_inputs(1, 9, 2, 2, 1, 3, separate=False, diag=True))
    A_log = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    del t["A"]
    y = quasiseparable(A=None, A_log=A_log, **t, chunk_size=4, backend="reference")
    ref = quasiseparable(A=-torch.exp(A_log), **t, chunk_size=4, backend="reference")
    torch.testing.assert_close(y, ref)
    cot = torch.randn(y.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(y, A_log, cot)[0], torch.autograd.grad(ref, A_log, cot)[0])
    with pytest.raises(ValueError, match="exactly one"):
        quasiseparable(A=-torch.exp(A_log), A_log=A_log, **t, backend="reference")
    with pytest.raises(ValueError, match="exactly one"):
        directional_scan(t["x"], t["dt"], None, t["B"], t["C"], backend="reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_chunk_half_precision(dtype, small_tiles):
    """Half inputs on the one-chunk kernels against the reference on the same inputs (in float32): errors relative
    to each output's largest entry. The matmul operands are rounded to bfloat16 (as mamba-ssm's kernels do), and a
    row of the one-chunk block sums all 30 keys: values within 2%, gradients within 10% (dA sums the whole sequence
    with cancellations)."""
    leaves = _inputs(1, 30, 2, 2, 1, 3, separate=True, diag=True, dtype=dtype)
    ref_leaves = {k: v.detach().float().requires_grad_() for k, v in leaves.items()}
    y = quasiseparable(**leaves, chunk_size=64, backend="triton")
    assert y.dtype == dtype
    ref = quasiseparable(**ref_leaves, chunk_size=64, backend="reference")
    cot = torch.randn(ref.shape, generator=_gen(3))

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    assert rel(y, ref) < 2e-2
    grads = torch.autograd.grad(y, list(leaves.values()), cot.to(dtype))
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()), cot)
    for name, g, r in zip(leaves, grads, ref_grads):
        assert g.dtype == leaves[name].dtype, name
        assert rel(g, r) < 1e-1, name


@pytest.mark.parametrize("decay", [-0.02, -2.0, -5.0, -40.0])
def test_the_one_chunk_shifted_scan_keeps_float32_accuracy_at_any_decay(decay, small_tiles):
    """As the chunked kernels' test: across tile boundaries the neighbours' decay stays exactly 1 (the pieces of a
    cross-tile log decay all have its sign), so the shifted scan is as accurate as unshifted scans shifted after."""
    gen = _gen(1)
    b, L, h, p, g, n = 1, 40, 2, 4, 1, 4
    x = torch.randn(b, L, h, p, generator=gen, dtype=torch.float64)
    dt, dt_b = (torch.rand(b, L, h, generator=gen, dtype=torch.float64) * 0.9 + 0.1 for _ in range(2))
    A = torch.full((h,), decay / 0.55, dtype=torch.float64)
    B, C, B_b, C_b = (torch.randn(b, L, g, n, generator=gen, dtype=torch.float64) for _ in range(4))
    kw = dict(chunk_size=64)
    truth = quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, backend="reference", **kw)
    x, dt, A, B, C, dt_b, B_b, C_b = (t.float() for t in (x, dt, A, B, C, dt_b, B_b, C_b))
    y = quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, backend="triton", **kw)
    # the released computation in chunks of a tile (PyTorch's chunked scans, unshifted, then the outputs shifted)
    y_f = directional_scan(x, dt, A, B, C, backend="torch", chunk_size=16)
    y_b = directional_scan(x, dt_b, A, B_b, C_b, reverse=True, backend="torch", chunk_size=16)
    released = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0)) + F.pad(y_b[:, 1:], (0, 0, 0, 0, 0, 1))
    scale = truth.abs().max()
    error = (y.double() - truth).abs().max() / scale
    released_error = (released.double() - truth).abs().max() / scale
    assert error <= 1.5 * released_error + 2e-7, (error.item(), released_error.item())


def test_the_backend_chooses_the_kernels_by_shape():
    """One chunk long (chunk_length gives the whole length), at most ONE_CHUNK_MAX tokens, no states: the one-chunk
    kernels; anything else: the chunked ones. Shapes and options only."""
    from mixer_plugins.kernels.scan import ONE_CHUNK_MAX, uses_one_chunk

    def args(length, chunk=64, heads=24, head_dim=64, state=64, return_final_state=False):
        x = torch.empty(1, length, heads, head_dim, device="meta")
        return x, state, chunk, return_final_state

    assert uses_one_chunk(*args(197))                      # a ViT's tokens: one chunk at the block's sizes
    assert uses_one_chunk(*args(ONE_CHUNK_MAX))
    assert not uses_one_chunk(*args(ONE_CHUNK_MAX + 1))
    assert not uses_one_chunk(*args(197, heads=1, head_dim=8, state=4))     # small states keep chunks of 64
    assert uses_one_chunk(*args(40, heads=1, head_dim=8, state=4))
    assert not uses_one_chunk(*args(100, return_final_state=True))


# -- what the kernels launch, and what they do not ------------------------------------------------------------

def _launches_module():
    """``benchmarks/gpu/launches.py``, the launch counter (loaded from its file: benchmarks are not a package)."""
    if "gpu_launches" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "launches.py"
        spec = importlib.util.spec_from_file_location("gpu_launches", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_launches"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_launches"]


def _projection_views(b, L, h, p, g, n, dtype):
    """x, B/C of both directions and the raw dt of both, as the block passes them: strided views of one buffer."""
    gen = _gen(0)
    width = h * p + 4 * g * n
    u = torch.randn(b, L, width + 3, generator=gen).to(dtype)[..., :width]     # a slice: rows wider than the data
    x, B, C, B_b, C_b = u.split([h * p, g * n, g * n, g * n, g * n], dim=-1)
    raw = torch.randn(b, L, 2 * h, generator=gen)
    dt, dt_b = raw.unflatten(-1, (2, h)).unbind(dim=2)
    return [t.detach().requires_grad_() for t in (x.unflatten(-1, (h, p)), dt, B.unflatten(-1, (g, n)),
                                                   C.unflatten(-1, (g, n)), dt_b, B_b.unflatten(-1, (g, n)),
                                                   C_b.unflatten(-1, (g, n)))]


@pytest.mark.parametrize("length,chunk", [(24, 64), (24, 16)], ids=["one_chunk", "chunked"])
def test_the_scan_launches_its_kernels_and_nothing_else(length, chunk, small_tiles):
    """bfloat16 strided views of one projection, raw dt with bias and softplus, forward and backward: the scan's
    Triton kernels and one small sum of per-chunk partials (dA, d dt_bias), nothing more: no zero fills of unused
    gradients (the auxiliary outputs are non-differentiable), no copies of the strided inputs, no casts (every
    gradient comes out in its input's dtype), no host syncs."""
    launches = _launches_module()
    x, dt, B, C, dt_b, B_b, C_b = _projection_views(2, length, 2, 16, 1, 16, torch.bfloat16)
    A = (-torch.rand(2) - 0.1).requires_grad_()
    bias = torch.zeros(2).requires_grad_()
    diag = torch.randn(2, length, 2).to(torch.bfloat16).requires_grad_()
    leaves = (x, dt, A, B, C, dt_b, B_b, C_b, diag, bias)
    cot = torch.ones(x.shape, dtype=x.dtype)

    def step():
        y = quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag, dt_bias=bias,
                           dt_softplus=True, chunk_size=chunk, backend="triton")
        grads = torch.autograd.grad(y, leaves, cot)
        assert all(g.dtype == t.dtype for g, t in zip(grads, leaves))

    counts = launches.count_launches(step)
    kernels_run = {name for name in counts.by_name if name.startswith("triton.")}
    aten = {name: k for name, k in counts.by_name.items() if not name.startswith("triton.")}
    if length <= chunk:
        assert kernels_run == {"triton._prep_kernel", "triton._out_kernel", "triton._dx_kernel", "triton._dcb_kernel",
                               "triton._dbc_kernel"}
    else:
        assert kernels_run == {"triton._states_kernel", "triton._pass_kernel", "triton._out_kernel",
                               "triton._dstate_kernel", "triton._dx_kernel", "triton._dbc_kernel"}
    # the per-chunk partials of dA (one A for both directions: one gradient) and d dt_bias are summed once
    assert aten == {"aten.sum.dim_IntList": 1}, counts.table()
    assert counts.syncs == 0


def test_the_launch_count_catches_a_copy():
    """The count above can fail: a contiguous copy of a strided input is a launch it sees."""
    launches = _launches_module()
    x = torch.randn(4, 6)[:, :3]
    assert launches.count_launches(lambda: x.contiguous()).total == 1
    assert launches.count_launches(lambda: x[:, 1:]).total == 0
    assert launches.count_launches(lambda: x.sum().item()).syncs == 1


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("length,chunk", [(24, 64), (48, 16)], ids=["one_chunk", "chunked"])
def test_launches_per_hydra_block(length, chunk, autocast, small_tiles):
    """Kernel launches of one Hydra mixer (``quasi``: in_proj, short conv + SiLU, both scans with the shift and the
    diagonal, gated RMSNorm, out_proj), forward and backward, on the GPU path (``backend="triton"``), counted from
    a trace under the interpreter (``benchmarks/gpu/launches.py``):

    * every Triton kernel launch (the interpreter's launcher is wrapped while the step runs);
    * every ATen op dispatched that launches a kernel on a GPU (a ``TorchDispatchMode``): matmuls, reductions,
      elementwise ops, copies, fills, and ``contiguous``/``reshape``/``to`` when they copy; views and allocations
      launch nothing. Our custom ops are opened (their Python implementations run under the trace), so the ATen ops
      they dispatch inside count too.

    The step zeroes the gradients first (set to None), as a training loop does, and takes a fixed output gradient.
    At most 40 launches per mixer forward and backward (attention's: about 21), in float32 and under bf16 autocast
    (what users run on a GPU: each weight cast once, its gradient cast back once, the input and its gradient cast),
    for a sequence of one chunk (a ViT's) and a chunked one (its two state passes more). ``A = -exp(A_log)`` is formed
    inside the scan kernels, and no cast or elementwise op of dt or A runs outside them."""
    launches = _launches_module()
    mixer = launches.hydra_block(32, head_dim=16, d_state=8, chunk_size=chunk)
    x = torch.randn(2, length, 32, requires_grad=True)
    with kernels.use_backend("triton"):
        step = launches.block_step(mixer, x, autocast)
        counts = launches.count_launches(step)
    assert counts.total <= 40, counts.table()
    assert counts.syncs == 0
    triton_kernels = sum(k for name, k in counts.by_name.items() if name.startswith("triton."))
    assert triton_kernels == (10 if length <= chunk else 12), counts.table()   # scan 5 or 7, conv 3, norm 2
    # no glue of the scan's generators: no exp/neg of A_log, no softplus of dt (one stack remains: the gradients of
    # the two directions' dt, views unbound from in_proj's one dt slice)
    assert not {"aten.exp", "aten.neg", "aten.softplus"} & set(counts.by_name), counts.table()
    # under autocast, a cast per weight (in_proj, fc_D with D, out_proj), its gradient's, the input's and its gradient
    assert counts.by_name.get("aten._to_copy", 0) == (10 if autocast else 0), counts.table()


@triton.jit
def _offset_probe(out_ptr, b, t0, k, sb, sl, sk):
    """Store the scan kernels' offset of (b, t0, k) from int32 indices."""
    tl = triton.language
    tl.store(out_ptr, qs_triton._offset(tl.full([], b, tl.int32), tl.full([], t0, tl.int32), tl.full([], k, tl.int32),
                                        sb, sl, sk))


def test_the_offsets_are_64_bit():
    """The kernels' element offsets of whole tensors (``_offset``: sequence * its stride + row * its stride + ...)
    are formed in 64 bits from int32 indices: exact past 2^31 (a 32-bit product would wrap)."""
    out = torch.zeros(1, dtype=torch.int64)
    b, t0, k, sb, sl, sk = 70_000, 60_000, 23, 65_536 * 1_792, 1_792, 64
    _offset_probe[(1,)](out, b, t0, k, sb, sl, sk)
    assert out.item() == b * sb + t0 * sl + k * sk > 2**31


def test_grids_are_one_dimensional_past_65535_sequences_times_heads():
    """Every launch grid is one-dimensional (CUDA allows 2^31 - 1 programs there, 65,535 on the other two), so a
    batch whose sequences times heads passes 65,535 launches; past 2^31 - 1 programs the error says so."""
    from mixer_plugins.kernels._triton._common import MAX_GRID
    from mixer_plugins.kernels.scan.triton_kernels import ScanGeometry

    geo = ScanGeometry(batch=8192, length=1024, heads=24, groups=1, head_dim=64, state=64, chunk=64)
    assert 8192 * 24 > 65_535
    for grid in (geo.head_grid(), geo.group_grid(), geo.pass_grid(2, 64 * 64)):
        assert len(grid) == 1 and 0 < grid[0] <= MAX_GRID
    assert geo.head_grid() == (8192 * 16 * 24,)
    assert ScanGeometry(batch=1, length=4096, heads=24, groups=1, head_dim=64, state=64, chunk=256).Q == 64
    one = one_chunk.OneChunkGeometry(batch=8192, length=197, heads=24, groups=1, head_dim=64, state=64)
    assert one.tile_grid(24) == (8192 * 24 * 4,) and one.head_blocks() == 1
    assert one.grids() == {"dx": (8192 * 24 * 4,), "dcb": (8192 * 4,), "dbc": (8192 * 4 * 2,)}
    with pytest.raises(ValueError, match="grid limit"):
        ScanGeometry(batch=2**20, length=2**16, heads=32, groups=1, head_dim=64, state=64, chunk=64).head_grid()


def test_a_hydra_block_compiles_fullgraph_on_the_triton_path(small_tiles):
    """The block under ``torch.compile(fullgraph=True)`` (aot_eager: dynamo and AOTAutograd trace forward and
    backward as under inductor) reaches the Triton ops, and matches eager, values and gradients."""
    import mixer_plugins as mp

    torch.manual_seed(0)
    mixer = mp.create_mixer("quasi", 32, head_dim=16, d_state=8).to(DEVICE)
    x = torch.randn(2, 24, 32).to(DEVICE)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    with kernels.use_backend("triton"):
        torch._dynamo.reset()
        compiled = torch.compile(mixer, backend=backend, fullgraph=True)
        x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_e, y_c = mixer(x_e), compiled(x_c)
        probe = torch.randn(y_e.shape).to(DEVICE)
        y_e.backward(probe)
        y_c.backward(probe)
    assert any("quasiseparable_triton" in name for name in seen), seen
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-5)
