"""The scan's ``triton`` backend (our fused kernels), run on CPU under ``TRITON_INTERPRET=1``, against the
``reference`` backend.

Values and every gradient are compared (``torch.autograd.grad``) with the materialized oracle in float64.
Shapes are tiny: the interpreter runs each kernel program in Python.

``TRITON_INTERPRET`` is read by ``triton.jit`` when a kernel is *defined* (triton 3.5:
``knobs.runtime.interpret`` in the decorator), and the interpreter's state does not survive every other test that
may run before these in one process (inductor compiles, for one). So on a machine without CUDA this module runs
in a fresh interpreter with ``TRITON_INTERPRET=1``, started by ``tests/ops/test_triton_suite.py``
(``MIXER_PLUGINS_TRITON_FRESH=1`` marks that run); collected in any other process it is skipped.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from mixer_plugins import kernels
from mixer_plugins.kernels import directional_scan, quasiseparable, ssd

FRESH = os.environ.get("MIXER_PLUGINS_TRITON_FRESH") == "1"
if not FRESH and not torch.cuda.is_available():
    pytest.skip("the Triton kernels' CPU checks run in a fresh interpreter (tests/test_triton_suite.py)",
                allow_module_level=True)

triton = pytest.importorskip("triton")
qs_triton = pytest.importorskip("mixer_plugins.kernels.scan.triton_kernels")

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(qs_triton.available("cpu") is not None,
                       reason=f"triton kernels cannot run on CPU here: {qs_triton.available('cpu')}"),
]


@pytest.fixture(autouse=True, scope="module")
def _fast_interpreter():
    """Test-speed shims for the triton 3.5 interpreter (semantics unchanged):

    * it re-patches ``triton.language`` on every device-function call (``tl.sum``, ``tl.cumsum``, ...); the
      patch is permanent and idempotent, so it is done once per kernel module;
    * it checks every int32 index operation for overflow; the test shapes are far from int32 limits.
    Together they halve the run time. Skipped silently if the interpreter internals differ.
    """
    try:
        from triton.runtime import interpreter as interp
        original_patch = interp._patch_lang
        original_options = interp.interpreter_builder.options
        fast_options = dataclasses.replace(original_options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        yield
        return
    done: set[int] = set()

    def patch_once(fn):
        if id(fn.__globals__) not in done:
            original_patch(fn)
            done.add(id(fn.__globals__))

    interp._patch_lang = patch_once
    interp.interpreter_builder.options = fast_options
    try:
        yield
    finally:
        interp._patch_lang = original_patch
        interp.interpreter_builder.options = original_options


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
    gen = torch.Generator().manual_seed(1)
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
    assert qs_triton.available("cpu") is None
    reason = qs_triton.available("meta")
    assert isinstance(reason, str) and reason


# -- the custom op -----------------------------------------------------------------------------------

def _op_args(shift=True, chunk=4):
    t = _inputs(1, 9, 2, 2, 1, 3, separate=True, diag=True)
    return (t["x"], t["dt"].detach().float(), t["A"].detach().float(), t["B"], t["C"], t["dt_bwd"].detach().float(),
            t["A_bwd"].detach().float(), t["B_bwd"], t["C_bwd"], t["diag"], None,
            torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32), shift, chunk)


def test_custom_op_passes_opcheck():
    """Schema, fake kernel (shapes/dtypes without running) and autograd registration of the forward op."""
    torch.library.opcheck(torch.ops.mixer_plugins.quasiseparable_triton.default, _op_args(),
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
    priorities = {name: b.priority for name, b in kernels._dispatch._backends_of("scan").items()}
    assert priorities["triton"] > max(p for name, p in priorities.items() if name != "triton" and p is not None)


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
