"""The scan op (``ssd``, ``quasiseparable``, ``directional_scan``) on every CPU backend, against oracles written from
the definitions: the SSM recurrence run token by token and Hydra's flip identity
``QS(X) = shift(SS_f(X)) + flip(shift(SS_b(flip X))) + D X`` (see ``tests/helpers.py``). The Triton backend has
its own file (``test_scan_triton.py``), run under the interpreter."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import F64, LargestTensor, flip_identity_qs, inductor_settings, random_inputs, recurrence_ssd, segments
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins import kernels
from mixer_plugins.kernels import _dispatch
from mixer_plugins.kernels._native_check import require_native
from mixer_plugins.kernels.scan import Direction, _scan, chunk_length, chunked_scan_flops
from mixer_plugins.kernels.scan import mamba_ssm as mamba_backend
from mixer_plugins.kernels.scan.native import scan_native

CPU_BACKENDS = ["reference", "torch", "native"]
TIGHT = dict(rtol=1e-10, atol=1e-10)


def _qs_inputs(length=17, seed=0, requires_grad=False, b=2):
    x, dt_f, A, B_f, C_f = random_inputs(b=b, l=length, seed=seed, requires_grad=requires_grad)
    _, dt_b, _, B_b, C_b = random_inputs(b=b, l=length, seed=seed + 1, requires_grad=requires_grad)
    diag = torch.randn(b, length, 4, dtype=F64).requires_grad_(requires_grad)
    return x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag


def _qs(backend, x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, **kw):
    return kernels.quasiseparable(x, dt_f, A, B_f, C_f, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag,
                                  backend=backend, **kw)


# -- every CPU backend against the oracles ----------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("length, chunk", [(1, 4), (8, 4), (13, 4), (13, 16), (37, 8)])
@pytest.mark.parametrize("d_shape", [(4, 3), (4,)])   # per head and channel; per head (folded into the diagonal)
def test_ssd_matches_the_recurrence(backend, length, chunk, d_shape):
    x, dt, A, B, C = random_inputs(l=length)
    D = torch.randn(*d_shape, dtype=F64)
    z = torch.randn_like(x)
    init = torch.randn(2, 4, 3, 5, dtype=F64)
    y, final = kernels.ssd(x, dt, A, B, C, chunk, D=D, z=z, initial_states=init, return_final_states=True,
                           backend=backend)
    y_ref, final_ref = recurrence_ssd(x, dt, A, B, C, D=D, z=z, initial_state=init)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(final, final_ref, **TIGHT)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ssd_dt_bias_softplus_and_limit(backend):
    x, dt_raw, A, B, C = random_inputs(l=11)
    dt_raw = dt_raw * 8 - 2
    bias = torch.randn(4, dtype=F64)
    limit = (0.05, 0.9)
    y = kernels.ssd(x, dt_raw, A, B, C, 4, dt_bias=bias, dt_softplus=True, dt_limit=limit, backend=backend)
    dt = F.softplus(dt_raw + bias).clamp(*limit)
    torch.testing.assert_close(y, recurrence_ssd(x, dt, A, B, C)[0], **TIGHT)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("length, chunk", [(1, 4), (2, 4), (12, 4), (17, 4), (17, 32)])
def test_quasiseparable_matches_the_flip_identity(backend, shift, length, chunk):
    inputs = _qs_inputs(length)
    y = _qs(backend, *inputs, shift=shift, chunk_size=chunk)
    torch.testing.assert_close(y, flip_identity_qs(*inputs, shift), **TIGHT)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quasiseparable_defaults_share_the_generators_and_take_a_separate_decay(backend):
    x, dt_f, _, A, B_f, C_f, _, _, diag = _qs_inputs()
    y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, diag=diag, chunk_size=4, backend=backend)
    torch.testing.assert_close(y, flip_identity_qs(x, dt_f, dt_f, A, B_f, C_f, B_f, C_f, diag, True), **TIGHT)
    A_b = A.flip(0) * 1.5
    y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, A_bwd=A_b, diag=diag, chunk_size=4, backend=backend)
    torch.testing.assert_close(y, flip_identity_qs(x, dt_f, dt_f, A, B_f, C_f, B_f, C_f, diag, True, A_b=A_b),
                               **TIGHT)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_directional_scan_is_one_side_of_the_identity(backend, reverse, shift):
    x, dt, A, B, C = random_inputs(l=15)
    y = kernels.directional_scan(x, dt, A, B, C, reverse=reverse, shift=shift, chunk_size=4, backend=backend)
    zeros = torch.zeros_like(B)
    forward, backward = (zeros, B) if reverse else (B, zeros)
    torch.testing.assert_close(y, flip_identity_qs(x, dt, dt, A, forward, C, backward, C, None, shift), **TIGHT)


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 40), chunk=st.sampled_from([1, 3, 8, 16, 64]), groups=st.sampled_from([1, 2, 4]),
       shift=st.booleans(), seed=st.integers(0, 10_000))
def test_every_cpu_backend_equals_the_reference_for_random_shapes(length, chunk, groups, shift, seed):
    x, dt, A, B, C = random_inputs(l=length, g=groups, seed=seed)
    init = torch.randn(2, 4, 3, 5, dtype=F64)
    call = dict(x=x, forward=Direction(dt, A, B, C), backward=Direction(dt.flip(1), A, C, B), shift=shift,
                chunk_size=chunk, initial_state=init, return_final_state=True)
    want = _scan(**call, backend="reference")
    for backend in ("torch", "native"):
        got = _scan(**call, backend=backend)
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        torch.testing.assert_close(got[1], want[1], **TIGHT)


# -- gradients --------------------------------------------------------------------------------------------

def _grads(fn, leaves):
    out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(3)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (o * o.sin()).sum() for o in outs)
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("length", [9, 21])
def test_ssd_gradients_match_the_reference(backend, length):
    args = random_inputs(l=length, requires_grad=True)
    D = torch.randn(4, dtype=F64, requires_grad=True)
    bias = torch.randn(4, dtype=F64, requires_grad=True)
    z = torch.randn(2, length, 4, 3, dtype=F64, requires_grad=True)
    init = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True)
    leaves = [*args, D, bias, z, init]

    def run(name):
        return lambda: kernels.ssd(*args, 8, D=D, z=z, dt_bias=bias, dt_softplus=True, initial_states=init,
                                   return_final_states=True, backend=name)

    for g, g_ref in zip(_grads(run(backend), leaves), _grads(run("reference"), leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("shift", [True, False])
def test_quasiseparable_gradients_match_the_reference(backend, shift):
    leaves = _qs_inputs(length=19, requires_grad=True)
    for g, g_ref in zip(_grads(lambda: _qs(backend, *leaves, shift=shift, chunk_size=8), leaves),
                        _grads(lambda: _qs("reference", *leaves, shift=shift, chunk_size=8), leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


# -- the native engine -----------------------------------------------------------------------------------------

@pytest.fixture
def native_ops():
    """The native kernels' raw ops (built or loaded first)."""
    require_native()
    return torch.ops.mixer_plugins_native


def _prepared(length, chunk, *, scale=1.0, shift=True, dirs="fb", init=True):
    x, dt, A, B, C = random_inputs(l=length, requires_grad=True)
    dt = (dt.detach() * scale).requires_grad_()
    fwd = Direction(dt, A, B, C) if "f" in dirs else None
    bwd = Direction(dt.flip(1), A, C, B) if "b" in dirs else None
    init_state = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True) if init and fwd is not None else None
    diag = torch.randn(2, length, 4, dtype=F64, requires_grad=True)
    call = dict(x=x, forward=fwd, backward=bwd, diag=diag, shift=shift, chunk_size=chunk, initial_state=init_state,
                return_final_state=fwd is not None)
    leaves = [t for t in (x, dt, A, B, C, diag, init_state) if t is not None]
    return call, leaves


@pytest.mark.parametrize("dirs", ["f", "b", "fb"])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("length, chunk", [(1, 4), (11, 4), (16, 4), (23, 64)])
def test_the_native_engine_matches_the_reference_values_and_gradients(dirs, shift, length, chunk):
    call, leaves = _prepared(length, chunk, shift=shift, dirs=dirs)
    want_final = call["forward"] is not None

    def native():
        y, final = scan_native(**call)
        return (y, final) if want_final else y

    def reference():
        return _scan(**call, backend="reference")

    got, want = native(), reference()
    for g, w in zip(got if want_final else (got,), want if want_final else (want,)):
        torch.testing.assert_close(g, w, **TIGHT)
    for g, g_ref in zip(_grads(native, leaves), _grads(reference, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 30.0), (F64, 300.0)])
def test_wide_decays_match_the_reference(dtype, scale):
    # chunks whose decays sum past e^-40 (float32) and e^-300 (float64): every exponent is a sum over its own
    # tokens, so nothing leaves the dtype's range and the result is the reference's
    call, _ = _prepared(24, 8, scale=scale, dirs="fb", init=False)
    cast = dict(x=call["x"].detach().to(dtype), forward=Direction(*(t.detach().to(dtype) for t in call["forward"])),
                backward=Direction(*(t.detach().to(dtype) for t in call["backward"])), shift=True, chunk_size=8)
    y, _ = scan_native(**cast)
    want = _scan(**cast, backend="reference")
    torch.testing.assert_close(y, want, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=1e-5)
    assert torch.isfinite(y).all()


def test_a_tuned_short_sequence_runs_as_one_chunk_on_every_backend():
    # heads x head_dim x state >= 4096: 100 tokens at chunk_size 16 (<= 16 + 4 x 32) are one chunk of 100
    assert chunk_length(100, 16, 4, 32, 32) == 100
    x, dt, A, B, C = random_inputs(b=1, l=100, h=4, p=32, g=1, n=32)
    for backend in ("torch", "native"):
        y = kernels.quasiseparable(x, dt, A, B, C, chunk_size=16, backend=backend)
        torch.testing.assert_close(y, kernels.quasiseparable(x, dt, A, B, C, chunk_size=16, backend="reference"),
                                   **TIGHT)


def test_chunk_length_rule():
    assert chunk_length(13, 64, 8, 64, 64) == 13                 # shorter than a chunk: one chunk of its length
    assert chunk_length(200, 64, 1, 4, 4) == 64                  # small scans: chunk_size as given
    assert chunk_length(197, 64, 8, 64, 64) == 197               # tuned: up to chunk + 4 state tokens in one chunk
    assert chunk_length(1024, 64, 8, 64, 64) == 64               # longer: balanced chunks of at most 64
    assert chunk_length(1000, 64, 8, 64, 64) == 63               # 16 chunks of 63 (1008 tokens), not 1024
    for length in range(330, 700, 37):
        q = chunk_length(length, 64, 8, 64, 64)
        assert q <= 64 and -(-length // q) == -(-length // 64)   # the fewest chunks, balanced


def test_the_native_engine_reads_x_in_place_from_wider_rows(native_ops, monkeypatch):
    # x as a projection hands it over: a slice of wider rows (batch and row strides of its own, heads and channels
    # dense). The op takes the view as it is and gives what a contiguous copy gives, bit for bit; through autograd,
    # the gradient reaches the wide tensor's slice.
    inputs, leaves = _prepared(11, 4, dirs="fb", init=False)
    gens = [t.detach() for d in (inputs["forward"], inputs["backward"]) for t in d]
    wide = torch.randn(2, 11, 17, dtype=F64)
    view = wide[..., 2:14].unflatten(-1, (4, 3))
    assert not view.is_contiguous()
    ops = native_ops
    dy = torch.randn(view.shape, dtype=F64)
    for x in (view, view[1:]):                   # a batch stride of its own, then an offset view
        dense = x.contiguous()
        n = x.shape[0]
        g = [t[-n:] if t.dim() > 1 else t for t in gens]
        for got, want in zip(ops.scan_forward(x, *g, None, True, 4, False),
                             ops.scan_forward(dense, *g, None, True, 4, False)):
            assert torch.equal(got, want)
        for got, want in zip(ops.scan_backward(dy[-n:], None, x, *g, None, True, 4),
                             ops.scan_backward(dy[-n:], None, dense, *g, None, True, 4)):
            assert torch.equal(got, want)
    wide.requires_grad_()
    x_leaf = inputs["x"].detach().clone().requires_grad_()
    with torch.no_grad():
        wide[..., 2:14] = x_leaf.flatten(-2)
    strided = {**inputs, "x": wide[..., 2:14].unflatten(-1, (4, 3))}
    contiguous = {**inputs, "x": x_leaf}
    seen = []                                    # the x each raw op gets: the slice itself, forward and backward

    def recording(op, position):
        def call(*op_args):
            seen.append((op_args[position].data_ptr(), op_args[position].stride()))
            return op(*op_args)
        return call

    monkeypatch.setattr(ops, "scan_forward", recording(ops.scan_forward, 0))
    monkeypatch.setattr(ops, "scan_backward", recording(ops.scan_backward, 2))   # (dy, dfinal, x, ...)
    y_strided, _ = scan_native(**strided)
    (y_strided * dy).sum().backward()
    monkeypatch.undo()
    assert seen == [(strided["x"].data_ptr(), strided["x"].stride())] * 2
    y_contiguous, _ = scan_native(**contiguous)
    assert torch.equal(y_strided, y_contiguous)
    (y_contiguous * dy).sum().backward()
    assert torch.equal(wide.grad[..., 2:14].unflatten(-1, (4, 3)), x_leaf.grad)
    assert not wide.grad[..., :2].any() and not wide.grad[..., 14:].any()


def test_the_native_engine_copies_x_whose_channels_are_not_dense():
    # every other channel of wider rows: the engine cannot read it in place, so it gets a copy (same values and
    # gradients as a contiguous x, and as the reference)
    inputs, leaves = _prepared(11, 4, dirs="fb", init=False)
    wide = torch.randn(2, 11, 4, 6, dtype=F64, requires_grad=True)
    x = wide[..., ::2]
    dense = x.detach().clone().requires_grad_()
    y, _ = scan_native(**{**inputs, "x": x})
    want, _ = scan_native(**{**inputs, "x": dense})
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    want_ref, _ = _scan(**{**inputs, "x": dense.detach()}, backend="reference")   # (y, final state)
    torch.testing.assert_close(y, want_ref, **TIGHT)
    dy = torch.randn(y.shape, dtype=F64)
    (y * dy).sum().backward()
    (want * dy).sum().backward()
    torch.testing.assert_close(wide.grad[..., ::2], dense.grad, rtol=0, atol=0)
    assert not wide.grad[..., 1::2].any()


def test_native_op_argument_checks(native_ops):
    inputs, _ = _prepared(8, 4, dirs="f")
    d = inputs["forward"]
    ops = native_ops
    gens = (d.dt.detach(), d.A.detach(), d.B.detach(), d.C.detach(), None, None, None, None)
    x = inputs["x"].detach()
    with pytest.raises(RuntimeError, match="heads and channels must be dense"):
        ops.scan_forward(x.transpose(1, 2), *gens, None, False, 4, False)
    with pytest.raises(RuntimeError, match="float32/float64 CPU tensor"):
        ops.scan_forward(x.to(torch.float16), *gens, None, False, 4, False)
    with pytest.raises(RuntimeError, match="the sequence is empty"):
        ops.scan_forward(x[:, :0], *(t[:, :0] if t.dim() > 1 else t for t in gens[:4]), *gens[4:], None, False, 4,
                         True)
    with pytest.raises(RuntimeError, match="initial state needs the forward direction"):
        ops.scan_forward(x, None, None, None, None, *gens[:4], torch.zeros(2, 4, 3, 5, dtype=F64), False, 4, False)
    with pytest.raises(RuntimeError, match="initial state \\(B, H, P, N\\)"):
        ops.scan_forward(x, *gens, torch.zeros(2, 4, 5, 3, dtype=F64), False, 4, False)
    with pytest.raises(RuntimeError, match="dy must be contiguous"):
        ops.scan_backward(x[:, :4], None, x, *gens, None, False, 4)
    with pytest.raises(RuntimeError, match="chunk > 0"):
        ops.scan_backward(x, None, x, *gens, None, False, 0)


# -- packed sequences ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_ssd_seq_idx_equals_separate_sequences(backend):
    x, dt, A, B, C = random_inputs(b=1, l=19)
    bounds = [0, 5, 6, 14, 19]       # segments of 5, 1, 8 and 5 tokens; chunk 4 cuts across them
    init = torch.randn(1, 4, 3, 5, dtype=F64)
    y, final = kernels.ssd(x, dt, A, B, C, 4, initial_states=init, seq_idx=segments(bounds, batch=1),
                           return_final_states=True, backend=backend)
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = slice(lo, hi)
        ys, fs = recurrence_ssd(x[:, part], dt[:, part], A, B[:, part], C[:, part],
                                initial_state=init if s == 0 else None)
        torch.testing.assert_close(y[:, part], ys, **TIGHT)
    torch.testing.assert_close(final, fs, **TIGHT)  # the last segment's state


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_quasiseparable_neither_scans_nor_shifts_across_segments(backend, chunk):
    bounds = [0, 6, 7, 17]
    inputs = _qs_inputs(length=17, b=1)
    y = _qs(backend, *inputs, chunk_size=chunk, seq_idx=segments(bounds, batch=1))
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = inputs
    for lo, hi in zip(bounds, bounds[1:]):
        p = slice(lo, hi)
        want = flip_identity_qs(x[:, p], dt_f[:, p], dt_b[:, p], A, B_f[:, p], C_f[:, p], B_b[:, p], C_b[:, p],
                                diag[:, p], True)
        torch.testing.assert_close(y[:, p], want, **TIGHT)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_reused_id_is_a_new_segment(backend):
    inputs = _qs_inputs(length=12, b=1)
    reused = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])   # three segments
    distinct = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    torch.testing.assert_close(_qs(backend, *inputs, chunk_size=4, seq_idx=reused),
                               _qs(backend, *inputs, chunk_size=4, seq_idx=distinct), **TIGHT)


def test_packed_sequences_gradients_match_the_reference():
    leaves = _qs_inputs(length=14, requires_grad=True)
    seq = segments([0, 3, 9, 14])
    for g, g_ref in zip(_grads(lambda: _qs("torch", *leaves, chunk_size=4, seq_idx=seq), leaves),
                        _grads(lambda: _qs("reference", *leaves, chunk_size=4, seq_idx=seq), leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


def test_normalize_seq_idx():
    ids = torch.tensor([[0, 0, 1, 1, 0, 0], [5, 5, 5, 5, 5, 5]])
    assert kernels.scan.normalize_seq_idx(ids).tolist() == [[0, 0, 1, 1, 2, 2], [0] * 6]


@pytest.mark.parametrize("bad", [torch.zeros(2, 13), torch.zeros(2, 12, dtype=torch.long), "ids"])
def test_seq_idx_is_validated(bad):
    x, dt, A, B, C = random_inputs(l=13)
    with pytest.raises(mp.MixerInputError, match="seq_idx must be an integer"):
        kernels.ssd(x, dt, A, B, C, 4, seq_idx=bad)


# -- numbers -------------------------------------------------------------------------------------------------------

def _decay_case(decay, dtype, length=128):
    gen = torch.Generator().manual_seed(1)
    b, h, p, g, n = 2, 4, 8, 1, 8
    x = torch.randn(b, length, h, p, generator=gen)
    dt = torch.rand(b, length, h, generator=gen) * 0.9 + 0.1       # mean 0.55
    A = torch.full((h,), decay / 0.55)
    B, C = torch.randn(b, length, g, n, generator=gen), torch.randn(b, length, g, n, generator=gen)
    dt_b = torch.rand(b, length, h, generator=gen) * 0.9 + 0.1
    B_b, C_b = torch.randn(b, length, g, n, generator=gen), torch.randn(b, length, g, n, generator=gen)
    diag = torch.randn(b, length, h, generator=gen)
    return [t.to(dtype) for t in (x, dt, dt_b, A, B, C, B_b, C_b, diag)]


def _released_style(backend, x, dt, dt_b, A, B, C, B_b, C_b, diag):
    """What the released Hydra code computes: unshifted scans, then the outputs shifted."""
    y_f = kernels.directional_scan(x, dt, A, B, C, chunk_size=32, backend=backend)
    y_b = kernels.directional_scan(x, dt_b, A, B_b, C_b, reverse=True, chunk_size=32, backend=backend)
    return F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0)) + F.pad(y_b[:, 1:], (0, 0, 0, 0, 0, 1)) + diag[..., None] * x


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("decay", [-0.02, -2.0, -5.0, -40.0])
def test_the_shifted_scan_keeps_float32_accuracy_at_any_decay(backend, decay):
    # float32 against float64: the shifted scan is as accurate as the released computation (scan, then shift)
    truth = _qs("reference", *_decay_case(decay, F64), chunk_size=32)
    scale = truth.abs().max()
    case32 = _decay_case(decay, torch.float32)
    error = (_qs(backend, *case32, chunk_size=32).double() - truth).abs().max() / scale
    released = (_released_style(backend, *case32).double() - truth).abs().max() / scale
    assert error <= 1.5 * released + 2e-7, (error.item(), released.item())


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("bad", ["nan_dt", "inf_B", "inf_C"])
def test_a_non_finite_generator_reaches_only_the_tokens_that_see_it(backend, bad):
    x, dt, A, B, C = random_inputs(l=10, dtype=torch.float32)
    dt, B, C = dt.clone(), B.clone(), C.clone()
    if bad == "nan_dt":
        dt[:, -1] = float("nan")
    elif bad == "inf_B":
        B[:, -1] = float("inf")
    else:
        C[:, -1] = float("inf")
    for shift in (False, True):
        y = kernels.directional_scan(x, dt, A, B, C, shift=shift, chunk_size=4, backend=backend)
        assert torch.isfinite(y[:, :-1]).all(), (shift, y[:, :-1])


def test_half_precision_inputs_are_scanned_in_float32():
    x, dt, A, B, C = random_inputs(l=20, dtype=torch.float32)
    y32 = kernels.quasiseparable(x, dt, A, B, C, chunk_size=8)
    y16 = kernels.quasiseparable(x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), chunk_size=8)
    assert y16.dtype == torch.bfloat16
    assert (y16.float() - y32).norm() / y32.norm() < 2e-2


# -- dispatch ----------------------------------------------------------------------------------------------------

def _chosen(device, x, dt, A, B, C, seq_idx=None) -> str:
    """The name of the backend the scan picks for an SSD call on these tensors."""
    others = (dt, A, B, C)
    return _dispatch.resolve_backend("scan", None, device, x=x, others=others, seq_idx=seq_idx, causal=True)


def test_the_automatic_choice_reads_device_dtype_and_options_never_values(monkeypatch):
    x, dt, A, B, C = random_inputs(l=8, dtype=torch.float32)
    plain = (x, dt, A, B, C)
    assert _chosen("cpu", *plain) == "native"
    assert _chosen("cpu", *(t.double() for t in plain)) == "native"
    assert _chosen("cpu", x.bfloat16(), dt, A, B, C) == "torch"
    assert _chosen("cpu", *plain, seq_idx=torch.zeros(2, 8, dtype=torch.int32)) == "torch"

    class NoValueReads(TorchDispatchMode):  # fails on any op that would read a tensor's values to decide
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"the choice ran {func}")

    with NoValueReads():
        assert _chosen("cpu", *plain) == "native"
    # while compiling: the torch backend on CPU, our Triton ops on CUDA (their check sees the device, not values)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _chosen("cpu", *plain) == "torch"


def test_a_compiling_cuda_call_resolves_to_the_triton_op(monkeypatch):
    # the decision for a CUDA device while compiling, without a GPU: Triton installed, the check passes for CUDA
    x, dt, A, B, C = random_inputs(l=8, dtype=torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    from mixer_plugins.kernels import _requirements

    monkeypatch.setattr(_requirements, "TRITON_INSTALLED", True)
    assert _chosen("cuda", x, dt, A, B, C) == "triton"
    assert _chosen("cuda", x.double(), dt, A, B, C) == "torch"   # float64 policy


def test_named_backends_and_their_reasons(monkeypatch):
    x, dt, A, B, C = random_inputs(l=5)
    assert set(kernels.available_backends("scan")) >= {"reference", "torch", "native"}
    with pytest.raises(kernels.BackendUnavailableError, match="mamba-ssm's kernels need CUDA tensors"):
        kernels.ssd(x, dt, A, B, C, 4, backend="mamba_ssm")
    with pytest.raises(kernels.BackendUnavailableError, match="unknown backend"):
        kernels.ssd(x, dt, A, B, C, 4, backend="cuda_magic")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(kernels.BackendUnavailableError, match="TRITON_INTERPRET"):
        kernels.ssd(x, dt, A, B, C, 4, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(kernels.BackendUnavailableError, match="float64"):
        kernels.ssd(x, dt, A, B, C, 4, backend="triton")
    with pytest.raises(kernels.BackendUnavailableError, match="seq_idx"):
        kernels.ssd(x, dt, A, B, C, 4, seq_idx=torch.zeros(2, 5, dtype=torch.long), backend="native")
    with kernels.use_backend("reference"):
        assert _chosen("cpu", x, dt, A, B, C) == "reference"


@pytest.mark.parametrize("bad, message", [
    (lambda x, dt, A, B, C: (x[0], dt, A, B, C), "x must be"),
    (lambda x, dt, A, B, C: (x, dt[:, :-1], A, B, C), "dt must be"),
    (lambda x, dt, A, B, C: (x, dt, A[:-1], B, C), "A must be"),
    (lambda x, dt, A, B, C: (x, dt, A, B, C[..., :-1]), "C must have"),
    (lambda x, dt, A, B, C: (x, dt, A, B[:, :, :1].expand(-1, -1, 3, -1), C[:, :, :1].expand(-1, -1, 3, -1)),
     "multiple of groups"),
    (lambda x, dt, A, B, C: (x, dt.long(), A, B, C), "dt must be a floating-point"),
])
def test_bad_arguments_raise_clear_errors(bad, message):
    args = bad(*random_inputs(l=6))
    with pytest.raises(mp.MixerInputError, match=message):
        kernels.ssd(*args, 4)
    with pytest.raises(mp.MixerInputError, match=message):
        kernels.quasiseparable(*args)


# -- FLOPs, memory, compile, export, meta --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("length, init, final", [(45, False, False), (45, True, True), (7, False, False),
                                                 (7, True, False), (7, False, True), (7, True, True)])
def test_flop_counter_counts_the_analytic_flops(backend, length, init, final):
    x, dt, A, B, C = random_inputs(b=2, l=length, h=4, p=3, g=2, n=5, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=8, backend=backend)
    assert counter.get_total_flops() == chunked_scan_flops(2, length, 4, 3, 2, 5, 2, 8)
    state = torch.randn(2, 4, 3, 5) if init else None
    with FlopCounterMode(display=False) as counter:
        kernels.ssd(x, dt, A, B, C, 8, initial_states=state, return_final_states=final, backend=backend)
    assert counter.get_total_flops() == chunked_scan_flops(2, length, 4, 3, 2, 5, 1, 8, initial_state=init,
                                                           final_state=final)


def test_the_torch_backend_never_builds_an_l_by_l_tensor():
    b, l, h, p, n, q = 1, 1024, 2, 4, 4, 16
    x, dt, A, B, C = random_inputs(b=b, l=l, h=h, p=p, g=1, n=n, dtype=torch.float32)
    with LargestTensor() as mode:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=q, backend="torch")
    assert mode.largest <= b * h * l * q   # the intra-chunk blocks, (b, chunks, Q, Q, h)
    assert mode.largest < l * l


def test_the_torch_backward_work_is_linear_in_the_chunks():
    """The backward of the state pass touches each chunk's state a bounded number of times: doubling the chunks
    doubles what its ops return (an indexed chunk's gradient the size of all the states, per chunk, would make it
    grow fourfold)."""
    def backward_elements(length):
        x, dt, A, B, C = random_inputs(b=1, l=length, h=2, p=4, g=1, n=4, dtype=torch.float32,
                                       requires_grad=True)
        y = kernels.ssd(x, dt, A, B, C, 4, backend="torch")
        with LargestTensor() as mode:
            y.sum().backward()
        return mode.total

    small, large = backward_elements(256), backward_elements(512)
    assert large < 2.5 * small, (small, large)


def test_the_scan_compiles_without_graph_breaks_and_exports():
    x, dt, A, B, C = random_inputs(l=12, dtype=torch.float32)

    def f(x, dt, A, B, C):
        return kernels.quasiseparable(x, dt, A, B, C, chunk_size=4) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, dt, A, B, C), f(x, dt, A, B, C), rtol=1e-5, atol=1e-6)

    class Scan(torch.nn.Module):
        def forward(self, x, dt, A, B, C):
            return f(x, dt, A, B, C)

    exported = torch.export.export(Scan(), (x, dt, A, B, C))
    torch.testing.assert_close(exported.module()(x, dt, A, B, C), f(x, dt, A, B, C), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # inductor compiles the scan forward and backward
def test_the_scan_compiles_with_inductor_values_and_gradients():
    leaves = [t.float().detach().requires_grad_() for t in _qs_inputs(length=12)]

    def f(*t):
        return _qs(None, *t, chunk_size=4)

    with inductor_settings():
        y = torch.compile(f, fullgraph=True)(*leaves)
        torch.testing.assert_close(y, f(*leaves), rtol=1e-4, atol=1e-5)
        g = torch.autograd.grad(y.square().sum(), leaves)
    g_eager = torch.autograd.grad(f(*leaves).square().sum(), leaves)
    for a, e in zip(g, g_eager):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_meta_tensors_give_shapes():
    inputs = [t.to("meta") for t in _qs_inputs(length=9)]
    y = _qs(None, *inputs, chunk_size=4)
    assert y.device.type == "meta" and y.shape == inputs[0].shape


# -- the mamba_ssm backend, with a stand-in for mamba-ssm ----------------------------------------------------------

def _fake_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                    seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                                    return_final_states=False):
    """mamba-ssm's contract, computed by the token recurrence (what the real kernel computes)."""
    dt = kernels.prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    y, final = recurrence_ssd(x, dt, A, B, C, D=D, z=z, initial_state=initial_states, seq_idx=seq_idx)
    return (y, final) if return_final_states else y


@pytest.mark.parametrize("shift", [True, False])
def test_the_mamba_ssm_backend_runs_each_direction_the_hydra_way(monkeypatch, shift):
    monkeypatch.setitem(mamba_backend._loaded, "scan", _fake_mamba_chunk_scan_combined)
    # the stand-in runs on CPU tensors: let the op take it there
    monkeypatch.setattr(importlib.import_module("mixer_plugins.kernels.scan"), "mamba_ssm_unavailable",
                        lambda device, **kw: None)
    inputs = _qs_inputs(length=11, b=1)
    seq = segments([0, 4, 11], batch=1)
    call = dict(x=inputs[0], forward=Direction(inputs[1], inputs[3], inputs[4], inputs[5]),
                backward=Direction(inputs[2], inputs[3], inputs[6], inputs[7]), diag=inputs[8], shift=shift,
                chunk_size=4, seq_idx=kernels.scan.normalize_seq_idx(seq))
    torch.testing.assert_close(_scan(**call, backend="mamba_ssm"), _scan(**call, backend="reference"), **TIGHT)
    x, dt, A, B, C = random_inputs(l=9)
    D, z = torch.randn(4, dtype=F64), torch.randn(2, 9, 4, 3, dtype=F64)
    ssd_call = dict(x=x, forward=Direction(dt, A, B, C), D=D, z=z, chunk_size=4, return_final_state=True,
                    initial_state=torch.randn(2, 4, 3, 5, dtype=F64))
    for got, want in zip(_scan(**ssd_call, backend="mamba_ssm"), _scan(**ssd_call, backend="reference")):
        torch.testing.assert_close(got, want, **TIGHT)


def test_where_mamba_ssm_does_not_import_the_backend_says_why(monkeypatch, tmp_path):
    # a mamba-ssm whose package __init__ fails, as it does without its CUDA extensions
    package = tmp_path / "mamba_ssm"
    (package / "ops" / "triton").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('libcudart.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in __import__("sys").modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    monkeypatch.delitem(mamba_backend._loaded, "scan", raising=False)
    reason = mamba_backend.mamba_ssm_unavailable(torch.device("cuda"))
    assert reason is not None and "cannot be imported" in reason and "libcudart" in reason
    assert mamba_backend.mamba_ssm_unavailable(torch.device("cpu")).startswith("mamba-ssm's kernels need CUDA")
