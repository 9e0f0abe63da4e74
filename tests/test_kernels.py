"""The scan and Toeplitz ops: every backend against independent oracles.

The oracles here are written from the definitions, not from the library's reference backend:
the SSM recurrence ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t`` run token by token,
and the paper's flip identity ``QS(X) = shift(SS_f(X)) + flip(shift(SS_b(flip X))) + D X``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_helpers import LargestTensor
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins import kernels
from mixer_plugins.kernels._scan import (
    Direction,
    ScanInputs,
    chunked_scan,
    chunked_scan_flops,
    reference_scan,
    scan_chunked,
)

F64 = torch.float64


# -- independent oracles ---------------------------------------------------------------------------------

def recurrence_ssd(x, dt, A, B, C, D=None, z=None, initial_state=None, seq_idx=None):
    """Token-by-token SSM recurrence (float64). Returns y and the final state."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    group = torch.arange(h) // (h // g)
    y = torch.zeros_like(x)
    final = torch.zeros(b, h, p, n, dtype=x.dtype)
    for bi in range(b):
        state = initial_state[bi].clone() if initial_state is not None else torch.zeros(h, p, n, dtype=x.dtype)
        for t in range(l):
            if seq_idx is not None and t > 0 and seq_idx[bi, t] != seq_idx[bi, t - 1]:
                state = torch.zeros(h, p, n, dtype=x.dtype)
            decay = torch.exp(A * dt[bi, t])                                              # (h,)
            inflow = dt[bi, t][:, None, None] * x[bi, t][:, :, None] * B[bi, t, group][:, None, :]
            state = decay[:, None, None] * state + inflow
            y[bi, t] = torch.einsum("hpn,hn->hp", state, C[bi, t, group])
        final[bi] = state
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, final


def flip_identity_qs(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, shift):
    """QS = shift(SS_f(x)) + flip(shift(SS_b(flip x))) + diag x, with the recurrence as SS."""
    y_f, _ = recurrence_ssd(x, dt_f, A, B_f, C_f)
    y_b, _ = recurrence_ssd(x.flip(1), dt_b.flip(1), A, B_b.flip(1), C_b.flip(1))
    if shift:
        y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))   # shift down: row i reads SS(x)_{i-1}
        y_b = F.pad(y_b[:, :-1], (0, 0, 0, 0, 1, 0))   # in flipped time, likewise
    y = y_f + y_b.flip(1)
    if diag is not None:
        y = y + diag[..., None] * x
    return y


def random_inputs(b=2, l=13, h=4, p=3, g=2, n=5, dtype=F64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=dtype)).requires_grad_(requires_grad)

    x = r(b, l, h, p)
    dt = (0.5 * torch.rand(b, l, h, generator=gen, dtype=dtype)).requires_grad_(requires_grad)
    A = (-torch.rand(h, generator=gen, dtype=dtype) - 0.2).requires_grad_(requires_grad)
    return x, dt, A, r(b, l, g, n), r(b, l, g, n)


# -- ssd ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("length, chunk", [(1, 4), (8, 4), (13, 4), (13, 16), (37, 8)])
@pytest.mark.parametrize("d_shape", [(4, 3), (4,)])   # per head and channel; per head (the torch scan's diagonal)
def test_ssd_matches_the_recurrence(backend, length, chunk, d_shape):
    x, dt, A, B, C = random_inputs(l=length)
    D = torch.randn(*d_shape, dtype=F64)
    z = torch.randn_like(x)
    init = torch.randn(2, 4, 3, 5, dtype=F64)
    y, final = kernels.ssd(x, dt, A, B, C, chunk, D=D, z=z, initial_states=init, return_final_states=True,
                           backend=backend)
    y_ref, final_ref = recurrence_ssd(x, dt, A, B, C, D=D, z=z, initial_state=init)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_ssd_dt_bias_softplus_and_limit(backend):
    x, dt_raw, A, B, C = random_inputs(l=11)
    dt_raw = dt_raw * 8 - 2
    bias = torch.randn(4, dtype=F64)
    limit = (0.05, 0.9)
    y = kernels.ssd(x, dt_raw, A, B, C, 4, dt_bias=bias, dt_softplus=True, dt_limit=limit, backend=backend)
    dt = F.softplus(dt_raw + bias).clamp(*limit)
    torch.testing.assert_close(y, recurrence_ssd(x, dt, A, B, C)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_ssd_seq_idx_equals_separate_sequences(backend):
    x, dt, A, B, C = random_inputs(b=1, l=19)
    bounds = [0, 5, 6, 14, 19]       # segments of 5, 1, 8 and 5 tokens, chunk 4 cuts across them
    seq_idx = torch.zeros(1, 19, dtype=torch.int32)
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        seq_idx[:, lo:hi] = s
    init = torch.randn(1, 4, 3, 5, dtype=F64)
    y, final = kernels.ssd(x, dt, A, B, C, 4, initial_states=init, seq_idx=seq_idx, return_final_states=True,
                           backend=backend)
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = slice(lo, hi)
        ys, fs = recurrence_ssd(x[:, part], dt[:, part], A, B[:, part], C[:, part],
                                initial_state=init if s == 0 else None)
        torch.testing.assert_close(y[:, part], ys, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, fs, rtol=1e-10, atol=1e-10)  # the last segment's state


def test_ssd_torch_gradients_match_reference():
    args = random_inputs(l=21, requires_grad=True)
    D = torch.randn(4, dtype=F64, requires_grad=True)
    bias = torch.randn(4, dtype=F64, requires_grad=True)
    init = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True)
    leaves = [*args, D, bias, init]
    grads = {}
    for backend in ("reference", "torch"):
        y, final = kernels.ssd(*args, 8, D=D, dt_bias=bias, dt_softplus=True, initial_states=init,
                               return_final_states=True, backend=backend)
        loss = (y.sin() * y).sum() + (final ** 2).sum()
        grads[backend] = torch.autograd.grad(loss, leaves)
    for g_ref, g in zip(grads["reference"], grads["torch"]):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 40), chunk=st.sampled_from([1, 3, 8, 16, 64]), groups=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 10_000))
def test_ssd_torch_equals_reference_for_random_shapes(length, chunk, groups, seed):
    x, dt, A, B, C = random_inputs(l=length, g=groups, seed=seed)
    y_t, f_t = kernels.ssd(x, dt, A, B, C, chunk, return_final_states=True, backend="torch")
    y_r, f_r = kernels.ssd(x, dt, A, B, C, chunk, return_final_states=True, backend="reference")
    torch.testing.assert_close(y_t, y_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_t, f_r, rtol=1e-10, atol=1e-10)


# -- quasiseparable -----------------------------------------------------------------------------------

def _qs_inputs(length=17, seed=0, requires_grad=False):
    x, dt_f, A, B_f, C_f = random_inputs(l=length, seed=seed, requires_grad=requires_grad)
    _, dt_b, _, B_b, C_b = random_inputs(l=length, seed=seed + 1, requires_grad=requires_grad)
    diag = torch.randn(2, length, 4, dtype=F64).requires_grad_(requires_grad)
    return x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("length, chunk", [(1, 4), (2, 4), (12, 4), (17, 4), (17, 32)])
def test_quasiseparable_matches_the_flip_identity(backend, shift, length, chunk):
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = _qs_inputs(length)
    y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag, shift=shift,
                               chunk_size=chunk, backend=backend)
    expected = flip_identity_qs(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, shift)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)


def test_quasiseparable_defaults_share_the_generators():
    x, dt_f, _, A, B_f, C_f, _, _, diag = _qs_inputs()
    y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, diag=diag, chunk_size=4)
    expected = flip_identity_qs(x, dt_f, dt_f, A, B_f, C_f, B_f, C_f, diag, True)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)


def test_quasiseparable_seq_idx_neither_scans_nor_shifts_across_segments():
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = _qs_inputs(length=17)
    x, dt_f, dt_b, B_f, C_f, B_b, C_b, diag = (t[:1] for t in (x, dt_f, dt_b, B_f, C_f, B_b, C_b, diag))
    bounds = [0, 6, 7, 17]
    y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag, chunk_size=4,
                               seq_idx=_segments(bounds, batch=1))
    _assert_each_segment_alone(y, bounds, x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag)


def _segments(bounds, batch=2):
    seq_idx = torch.zeros(batch, bounds[-1], dtype=torch.long)
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        seq_idx[:, lo:hi] = s
    return seq_idx


def _assert_each_segment_alone(y, bounds, x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag):
    """Each segment of y equals the flip identity run on that segment alone (shifted Hydra)."""
    for lo, hi in zip(bounds, bounds[1:]):
        part = slice(lo, hi)
        expected = flip_identity_qs(x[:, part], dt_f[:, part], dt_b[:, part], A, B_f[:, part], C_f[:, part],
                                    B_b[:, part], C_b[:, part], diag[:, part], True)
        torch.testing.assert_close(y[:, part], expected, rtol=1e-10, atol=1e-10)


def test_quasiseparable_torch_gradients_match_reference():
    leaves = _qs_inputs(length=19, requires_grad=True)
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = leaves
    grads = {}
    for backend in ("reference", "torch"):
        y = kernels.quasiseparable(x, dt_f, A, B_f, C_f, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag,
                                   chunk_size=8, backend=backend)
        grads[backend] = torch.autograd.grad((y * y.cos()).sum(), leaves)
    for g_ref, g in zip(grads["reference"], grads["torch"]):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_directional_scan_is_one_side_of_the_identity(reverse, shift):
    x, dt, A, B, C = random_inputs(l=15)
    y = kernels.directional_scan(x, dt, A, B, C, reverse=reverse, shift=shift, chunk_size=4)
    zeros_like_B = torch.zeros_like(B)
    if reverse:
        expected = flip_identity_qs(x, dt, dt, A, zeros_like_B, C, B, C, None, shift)
    else:
        expected = flip_identity_qs(x, dt, dt, A, B, C, zeros_like_B, C, None, shift)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)


def test_half_precision_inputs_are_scanned_in_float32():
    x, dt, A, B, C = random_inputs(l=20, dtype=torch.float32)
    y32 = kernels.quasiseparable(x, dt, A, B, C, chunk_size=8)
    y16 = kernels.quasiseparable(x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), chunk_size=8)
    assert y16.dtype == torch.bfloat16
    assert (y16.float() - y32).norm() / y32.norm() < 2e-2


# -- tiles: the torch backend walks the chunks a tile at a time; the tile size changes nothing ------------

def _bidirectional(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, **options):
    return ScanInputs(x=x, forward=Direction(dt_f, A, B_f, C_f), backward=Direction(dt_b, A, B_b, C_b), diag=diag,
                      **options)


@pytest.mark.parametrize("slab", [1, 2, 4])
@pytest.mark.parametrize("shift", [True, False])
def test_slabs_quasiseparable_matches_the_flip_identity(slab, shift):
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = _qs_inputs(length=17)   # 6 chunks of 3: 6, 3 and 2 tiles
    y = scan_chunked(_bidirectional(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, shift=shift, chunk_size=3),
                     tile_size=slab)
    expected = flip_identity_qs(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, shift)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("slab", [1, 2, 3])
def test_slabs_carry_initial_and_final_states_and_respect_segments(slab):
    x, dt, A, B, C = random_inputs(l=23)
    init = torch.randn(2, 4, 3, 5, dtype=F64)
    seq_idx = _segments([0, 5, 12, 23])
    y, final = scan_chunked(ScanInputs(x=x, forward=Direction(dt, A, B, C), initial_state=init, seq_idx=seq_idx,
                                       chunk_size=4), tile_size=slab, return_final_state=True)
    y_ref, final_ref = recurrence_ssd(x, dt, A, B, C, initial_state=init, seq_idx=seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("slab", [1, 2])
def test_slabs_bidirectional_segments(slab):
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = _qs_inputs(length=17)
    bounds = [0, 6, 7, 17]
    y = scan_chunked(_bidirectional(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, seq_idx=_segments(bounds),
                                    shift=True, chunk_size=4), tile_size=slab)
    _assert_each_segment_alone(y, bounds, x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag)


def test_slabs_gradients_match_reference():
    leaves = _qs_inputs(length=19, requires_grad=True)
    x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag = leaves
    init = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True)
    grads = {}
    inputs = _bidirectional(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, initial_state=init, shift=True,
                            chunk_size=4)
    for name, fn, extra in (("reference", reference_scan, {}),
                            ("slabs", scan_chunked, {"tile_size": 2})):
        y, final = fn(inputs, return_final_state=True, **extra)
        loss = (y * y.cos()).sum() + (final * final.sin()).sum()
        grads[name] = torch.autograd.grad(loss, leaves + (init,))
    for g_ref, g in zip(grads["reference"], grads["slabs"]):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


def test_slabs_rejects_a_bad_slab_size():
    x, dt, A, B, C = random_inputs(l=8)
    with pytest.raises(ValueError, match="slab_size must be positive"), pytest.warns(DeprecationWarning):
        scan_chunked(ScanInputs(x=x, forward=Direction(dt, A, B, C), chunk_size=4), slab_size=0)
    with pytest.raises(ValueError, match="tile_size must be positive"):
        scan_chunked(ScanInputs(x=x, forward=Direction(dt, A, B, C), chunk_size=4), tile_size=0)


def test_default_slabs_keep_temporaries_near_the_target_size():
    from mixer_plugins.kernels._scan.chunked import TILE_ELEMENTS, tile_chunks

    per_slab = tile_chunks(1, 64, 8, 64)               # Hydra's defaults at dim 256: 16 chunks of 64 tokens
    assert per_slab * 64 * 8 * 64 == TILE_ELEMENTS
    assert tile_chunks(4096, 64, 8, 64) == 1           # never fewer than one chunk


@pytest.mark.parametrize("chunks_per_slab", [1, 2, 4])
def test_flop_formula_counts_every_slab(monkeypatch, chunks_per_slab):
    import mixer_plugins.kernels._scan.chunked as sc

    # one chunk of the shapes below is (batch 2) x (Q 8) x (heads 4) x (width max(p, Q, n) = 8) elements
    monkeypatch.setattr(sc, "TILE_ELEMENTS", chunks_per_slab * 2 * 8 * 4 * 8)
    x, dt, A, B, C = random_inputs(b=2, l=45, h=4, p=3, g=2, n=5, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=8)
    assert counter.get_total_flops() == chunked_scan_flops(2, 45, 4, 3, 2, 5, 2, 8)


# -- memory: the torch backend never builds an L x L tensor -------------------------------------------

def test_chunked_scan_memory_is_linear_in_length():
    b, l, h, p, n, q = 1, 1024, 2, 4, 4, 16
    x, dt, A, B, C = random_inputs(b=b, l=l, h=h, p=p, g=1, n=n, dtype=torch.float32)
    with LargestTensor() as mode:
        scan_chunked(_bidirectional(x, dt, dt, A, B, C, B, C, dt, shift=True, chunk_size=q))
    # the largest intermediate is the (b, chunks, heads, Q, Q) intra-chunk block: h L Q, not h L^2
    assert mode.largest <= b * h * l * q
    assert mode.largest < l * l


# -- dispatcher, custom ops and FLOP accounting -----------------------------------------------------------

def test_backend_selection_and_errors(monkeypatch):
    x, dt, A, B, C = random_inputs(l=5)
    assert set(kernels.available_backends("ssd")) >= {"reference", "torch"}
    assert "mamba_ssm" not in kernels.available_backends("ssd")  # CPU tensors
    with pytest.raises(kernels.BackendUnavailableError, match="mamba_ssm"):
        kernels.ssd(x, dt, A, B, C, 4, backend="mamba_ssm")
    with pytest.raises(kernels.BackendUnavailableError, match="unknown backend"):
        kernels.ssd(x, dt, A, B, C, 4, backend="cuda_magic")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors: the triton backend needs CUDA
    with pytest.raises(kernels.BackendUnavailableError, match="TRITON_INTERPRET"):
        kernels.ssd(x, dt, A, B, C, 4, backend="triton")
    with kernels.use_backend("reference"):
        assert kernels.resolve_backend("ssd", None, x.device).__name__ == "impl"
    monkeypatch.setenv("MIXER_PLUGINS_BACKEND", "no_such_backend")
    with pytest.raises(kernels.BackendUnavailableError):
        kernels.ssd(x, dt, A, B, C, 4)


@pytest.mark.parametrize("bad, message", [
    (lambda x, dt, A, B, C: (x[0], dt, A, B, C), "x must be"),
    (lambda x, dt, A, B, C: (x, dt[:, :-1], A, B, C), "dt must be"),
    (lambda x, dt, A, B, C: (x, dt, A[:-1], B, C), "A must be"),
    (lambda x, dt, A, B, C: (x, dt, A, B, C[..., :-1]), "C must have"),
    (lambda x, dt, A, B, C: (x, dt, A, B[:, :, :1].expand(-1, -1, 3, -1), C[:, :, :1].expand(-1, -1, 3, -1)),
     "multiple of groups"),
])
def test_bad_arguments_raise_clear_errors(bad, message):
    args = bad(*random_inputs(l=6))
    with pytest.raises(mp.MixerInputError, match=message):
        kernels.ssd(*args, 4)
    with pytest.raises(mp.MixerInputError, match=message):
        kernels.quasiseparable(*args)


def test_custom_op_passes_torch_library_checks():
    x, dt, A, B, C = random_inputs(l=9, dtype=torch.float32, requires_grad=True)
    args = (x, dt, A, B, C, dt, A, B, C, None, None, None, True, 4)
    torch.library.opcheck(chunked_scan, args, test_utils=("test_schema", "test_faketensor",
                                                          "test_autograd_registration"))


def test_flop_counter_sees_the_scan_and_the_fft():
    x, dt, A, B, C = random_inputs(b=2, l=30, h=4, p=3, g=2, n=5, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=8)
    assert counter.get_total_flops() == chunked_scan_flops(2, 30, 4, 3, 2, 5, 2, 8)
    taps = torch.randn(1, 4, 59)
    with FlopCounterMode(display=False) as counter:
        kernels.toeplitz_mix(taps, x)
    assert counter.get_total_flops() > 0


def test_scan_compiles_without_graph_breaks():
    x, dt, A, B, C = random_inputs(l=12, dtype=torch.float32)

    def f(x, dt, A, B, C):
        return kernels.quasiseparable(x, dt, A, B, C, chunk_size=4) * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, dt, A, B, C), f(x, dt, A, B, C))


# -- toeplitz ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 2, 7, 16, 33])
def test_toeplitz_fft_matches_the_definition(length):
    taps = torch.randn(2, 3, 2 * length - 1, dtype=F64)
    v = torch.randn(2, length, 3, 4, dtype=F64)
    y = kernels.toeplitz_mix(taps, v)
    expected = torch.zeros_like(v)
    for i in range(length):
        for j in range(length):
            expected[:, i] += taps[:, :, i - j + length - 1][..., None] * v[:, j]
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kernels.toeplitz_mix(taps, v, backend="reference"), expected)


@pytest.mark.parametrize("tap_batch", [1, 2])
def test_toeplitz_gradients(tap_batch):
    taps = torch.randn(tap_batch, 2, 9, dtype=F64, requires_grad=True)
    v = torch.randn(2, 5, 2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, u: kernels.toeplitz_mix(t, u), (taps, v))


def test_toeplitz_rejects_mismatched_taps():
    with pytest.raises(mp.MixerInputError, match="2\\*length-1"):
        kernels.toeplitz_mix(torch.randn(1, 2, 8), torch.randn(1, 5, 2, 3))


def test_fft_size_covers_the_linear_convolution():
    from mixer_plugins.kernels.toeplitz.torch import _fft_size

    for length in (1, 2, 3, 100, 1000):
        n = _fft_size(length)
        assert n >= 2 * length - 1 and n & (n - 1) == 0 and n < 4 * length
        assert math.log2(n).is_integer()


# -- depthwise short convolution ----------------------------------------------------------------------------

@pytest.mark.parametrize("causal, kernel", [(False, 7), (False, 1), (True, 4), (True, 1)])
def test_depthwise_conv_matches_conv1d(causal, kernel):
    from mixer_plugins.kernels.conv import depthwise_conv1d

    x = torch.randn(2, 11, 5, dtype=F64, requires_grad=True)
    w = torch.randn(5, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(5, dtype=F64, requires_grad=True)
    pad = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)
    expected = F.conv1d(F.pad(x.transpose(1, 2), pad), w[:, None], b, groups=5).transpose(1, 2)
    torch.testing.assert_close(depthwise_conv1d(x, w, b, causal=causal), expected)
    assert torch.autograd.gradcheck(lambda x, w, b: depthwise_conv1d(x, w, b, causal=causal), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: depthwise_conv1d(x, w, None, causal=causal), (x, w))
    with FlopCounterMode(display=False) as counter:
        depthwise_conv1d(x, w, b, causal=causal)
    assert counter.get_total_flops() == 2 * 2 * 11 * 5 * kernel


def _conv_by_torch(x, w, b, *, causal, silu):
    """The depthwise convolution (+ SiLU) by PyTorch's own conv1d on an explicitly zero-padded input."""
    kernel = w.shape[1]
    pad = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)
    y = F.conv1d(F.pad(x.transpose(1, 2), pad), w[:, None], b, groups=w.shape[0]).transpose(1, 2)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("causal, kernel", [(False, 7), (True, 4)])
@pytest.mark.parametrize("silu", [False, True])
def test_depthwise_conv_tiles_and_fused_silu(monkeypatch, causal, kernel, silu):
    import mixer_plugins.kernels.conv as conv
    from mixer_plugins.kernels.conv import torch as conv_torch

    monkeypatch.setattr(conv_torch, "TILE_ELEMENTS", 2 * 3 * 5)      # tiles of 3 steps: every tile edge is exercised
    base = torch.randn(2, 11, 8, dtype=F64)
    x = base[..., 1:6].clone().requires_grad_()
    w = torch.randn(5, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(5, dtype=F64, requires_grad=True)
    expected = _conv_by_torch(x, w, b, causal=causal, silu=silu)
    torch.testing.assert_close(conv.depthwise_conv1d(x, w, b, causal=causal, silu=silu), expected)
    assert torch.autograd.gradcheck(lambda x, w, b: conv.depthwise_conv1d(x, w, b, causal=causal, silu=silu),
                                    (x, w, b))
    strided = base.clone().requires_grad_()                     # a strided slice, as the block passes it
    out = conv.depthwise_conv1d(strided[..., 1:6], w, b, causal=causal, silu=silu)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    torch.testing.assert_close(strided.grad[..., 1:6], torch.autograd.grad(expected.sum(), x)[0])
    assert strided.grad[..., :1].abs().sum() == 0 and strided.grad[..., 6:].abs().sum() == 0


@pytest.mark.parametrize("length", [1, 2, 3, 6])
@pytest.mark.parametrize("causal, kernel", [(False, 7), (True, 4), (False, 3), (True, 7)])
@pytest.mark.parametrize("silu", [False, True])
def test_depthwise_conv_of_sequences_shorter_than_the_kernel(length, causal, kernel, silu):
    # rows whose every tap, or all but a few, fall outside the sequence (zero padding without a padded copy)
    from mixer_plugins.kernels.conv import depthwise_conv1d

    x = torch.randn(2, length, 3, dtype=F64, requires_grad=True)
    w = torch.randn(3, kernel, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    torch.testing.assert_close(depthwise_conv1d(x, w, b, causal=causal, silu=silu),
                               _conv_by_torch(x, w, b, causal=causal, silu=silu))
    assert torch.autograd.gradcheck(lambda x, w, b: depthwise_conv1d(x, w, b, causal=causal, silu=silu), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: depthwise_conv1d(x, w, None, causal=causal, silu=silu), (x, w))


# -- gated RMSNorm ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("tile", [12, 12 * 5, 1 << 18])
def test_gated_rmsnorm_matches_the_formula(monkeypatch, norm_before_gate, tile):
    import mixer_plugins.kernels.norm as G
    from mixer_plugins.kernels.norm import torch as norm_torch

    monkeypatch.setattr(norm_torch, "TILE_ELEMENTS", tile)              # one row per tile, 5 rows, everything at once
    y = torch.randn(2, 7, 12, dtype=F64, requires_grad=True)
    z = torch.randn(2, 7, 12, dtype=F64, requires_grad=True)
    w = torch.randn(12, dtype=F64, requires_grad=True)
    # the formula, written out: n = v / sqrt(mean(v^2) + eps)
    gate = z * torch.sigmoid(z)
    v = y if norm_before_gate else y * gate
    n = v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5)
    expected = w * n * (gate if norm_before_gate else 1.0)
    out = G.gated_rmsnorm(y, z, w, 1e-5, norm_before_gate)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda y, z, w: G.gated_rmsnorm(y, z, w, 1e-5, norm_before_gate), (y, z, w))
    grads = torch.autograd.grad((out * out.cos()).sum(), (y, z, w))
    expected_grads = torch.autograd.grad((expected * expected.cos()).sum(), (y, z, w))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


def test_gated_rmsnorm_half_precision_and_errors():
    from mixer_plugins.kernels.norm import gated_rmsnorm, gated_rmsnorm_reference

    y, z, w = torch.randn(3, 9, 16), torch.randn(3, 9, 16), torch.randn(16)
    out = gated_rmsnorm(y.bfloat16(), z.bfloat16(), w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), gated_rmsnorm_reference(y, z, w, 1e-5, True), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="same shape"):
        gated_rmsnorm(y, z[..., :8], w)
    with pytest.raises(ValueError, match="weight must be"):
        gated_rmsnorm(y, z, w[:8])
    yy = y.clone().requires_grad_()
    gy, = torch.autograd.grad(gated_rmsnorm(yy, z, w).sum(), yy, create_graph=True)
    with pytest.raises(RuntimeError):   # the hand-written backward is not differentiable again: it says so
        gy.sum().backward()
