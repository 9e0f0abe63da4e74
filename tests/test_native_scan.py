"""The native CPU scan (``kernels/_native/scan.cpp``, :mod:`mixer_plugins.kernels._scan.native`): values, final
states and every gradient against the materialized reference in float64, with factored decays, with exact ones and
as one chunk, over both directions and each alone, shift on and off, the diagonal, groups, initial and final
states, lengths shorter than, equal to and not a multiple of the chunk, chunks of several triangular row blocks;
where it must not run (the PyTorch path then runs)."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from mixer_plugins.kernels import _native
from mixer_plugins.kernels._scan import Direction, ScanInputs, reference_scan
from mixer_plugins.kernels._scan import native as native_scan

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native kernels cannot be built here")

F64 = torch.float64


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    assert _native.load(), _native.unavailable_reason()
    monkeypatch.setattr(native_scan, "USE_NATIVE", True)


def _direction(gen, b, length, heads, groups, state):
    return Direction(dt=torch.rand(b, length, heads, generator=gen, dtype=F64) * 0.6,
                     A=-torch.rand(heads, generator=gen, dtype=F64) * 2,
                     B=torch.randn(b, length, groups, state, generator=gen, dtype=F64),
                     C=torch.randn(b, length, groups, state, generator=gen, dtype=F64))


def _case(length, chunk, directions, diag, init, shift, heads, groups, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, p, n = 2, 3, 5
    x = torch.randn(b, length, heads, p, generator=gen, dtype=F64)
    fwd = _direction(gen, b, length, heads, groups, n) if "f" in directions else None
    bwd = _direction(gen, b, length, heads, groups, n) if "b" in directions else None
    d = torch.randn(b, length, heads, generator=gen, dtype=F64) if diag else None
    h0 = torch.randn(b, heads, p, n, generator=gen, dtype=F64) if init else None
    return ScanInputs(x=x, forward=fwd, backward=bwd, diag=d, initial_state=h0, shift=shift, chunk_size=chunk)


def _leaves(inputs):
    dirs = [d for d in (inputs.forward, inputs.backward) if d is not None]
    return [inputs.x] + [t for d in dirs for t in (d.dt, d.A, d.B, d.C)] + [
        t for t in (inputs.diag, inputs.initial_state) if t is not None]


def _rebuild(inputs, leaves):
    it = iter(leaves)
    x = next(it)
    fwd = Direction(*(next(it) for _ in range(4))) if inputs.forward is not None else None
    bwd = Direction(*(next(it) for _ in range(4))) if inputs.backward is not None else None
    diag = next(it) if inputs.diag is not None else None
    init = next(it) if inputs.initial_state is not None else None
    return ScanInputs(x=x, forward=fwd, backward=bwd, diag=diag, initial_state=init, shift=inputs.shift,
                      chunk_size=inputs.chunk_size)


def _run(inputs, final, which):
    leaves = [t.detach().clone().requires_grad_(True) for t in _leaves(inputs)]
    run = _rebuild(inputs, leaves)
    if which == "native":
        assert native_scan.applies(run)
        y, state = native_scan.run_native(run, want_final=final)
    else:
        out = reference_scan(run, return_final_state=final)
        y, state = out if final else (out, None)
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum()
    if final:
        loss = loss + (state * torch.linspace(0.5, -1, state.numel(), dtype=F64).view_as(state)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [y.detach()] + ([state.detach()] if final else []) + list(grads)


# (length, chunk): chunks of 70 and 97 rows span several of the kernel's triangular row blocks (32 rows)
CASES = [c for c in itertools.product([(1, 4), (13, 4), (16, 16), (50, 8), (75, 70), (97, 128)], ["f", "b", "fb"],
                                      [False, True],
                                      [False, True], [False, True], [False, True], [(2, 1), (4, 2)])
         if not ((c[3] or c[5]) and "f" not in c[1])]


@pytest.mark.parametrize("form", ["factored", "exact", "one_chunk"])
@pytest.mark.parametrize("case", CASES[::4] + CASES[1::9], ids=str)
def test_native_scan_matches_the_reference(case, form, monkeypatch):
    # one_chunk: sequences of up to chunk + 4 x state tokens as one chunk (the default); elsewhere the given chunks
    monkeypatch.setattr(native_scan, "FACTORED", form != "exact")
    monkeypatch.setattr(native_scan, "ONE_CHUNK_STATES", 4 if form == "one_chunk" else 0)
    (length, chunk), directions, diag, init, shift, final, (heads, groups) = case
    inputs = _case(length, chunk, directions, diag, init, shift, heads, groups, seed=length)
    for got, want in zip(_run(inputs, final, "native"), _run(inputs, final, "reference")):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_wide_decays_take_the_exact_form(monkeypatch):
    """Chunks whose decay range is too wide for the factors (|p_last| / 2 > MAX_HALF_RANGE) run the exact form, and
    still equal the reference."""
    from kernel_helpers import spy_native_ops

    calls = spy_native_ops(monkeypatch, "scan_forward", "scan_factored_forward")
    inputs = _case(24, 8, "fb", True, True, True, 2, 1)
    wide = ScanInputs(x=inputs.x, forward=Direction(inputs.forward.dt * 200, *_rest(inputs.forward)),
                      backward=Direction(inputs.backward.dt * 200, *_rest(inputs.backward)), diag=inputs.diag,
                      initial_state=inputs.initial_state, shift=True, chunk_size=8)
    for got, want in zip(_run(wide, True, "native"), _run(wide, True, "reference")):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    assert calls == ["scan_forward"]


def _rest(d):
    return d.A, d.B, d.C


def test_a_short_sequence_runs_as_one_chunk_where_its_whole_decay_fits(monkeypatch):
    """Up to chunk + 4 x state tokens run as one chunk (factored); a sequence whose whole decay is too wide for the
    factors keeps its chunks (factored where each chunk fits); longer sequences keep theirs."""
    from kernel_helpers import spy_native_ops

    calls = spy_native_ops(monkeypatch, "scan_factored_forward")
    chunks = []
    real = native_scan._NativeScan.apply
    monkeypatch.setattr(native_scan._NativeScan, "apply", lambda *a: chunks.append(a[1]) or real(*a))
    short = _case(28, 8, "fb", True, False, True, 2, 1)        # 28 <= 8 + 4 x 5 tokens
    assert native_scan._chunk_and_form(short) == (28, True)
    for got, want in zip(_run(short, False, "native"), _run(short, False, "reference")):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    assert chunks == [28] and calls == ["scan_factored_forward"]
    assert native_scan._chunk_and_form(_case(29, 8, "fb", True, False, True, 2, 1)) == (8, True)   # one token more
    # dt 2 and A -1.5: the whole sequence's half decay, 42, is too wide for float32's factors (40), a chunk's, 12, not
    f, b = short.forward, short.backward
    steep = [torch.full_like(f.dt, 2.0).float(), torch.full_like(f.A, -1.5).float()]
    wide = ScanInputs(x=short.x.float(), forward=Direction(*steep, f.B.float(), f.C.float()),
                      backward=Direction(*steep, b.B.float(), b.C.float()), shift=True, chunk_size=8)
    assert native_scan._chunk_and_form(wide) == (8, True)


def test_the_public_op_runs_it(monkeypatch):
    from mixer_plugins import kernels

    calls = []
    real = native_scan.run_native
    monkeypatch.setattr(native_scan, "run_native", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = _case(20, 8, "fb", True, False, True, 2, 1)
    f, b = inputs.forward, inputs.backward
    y = kernels.quasiseparable(inputs.x, f.dt, f.A, f.B, f.C, dt_bwd=b.dt, A_bwd=b.A, B_bwd=b.B, C_bwd=b.C,
                               diag=inputs.diag, shift=True, chunk_size=8, backend="torch")
    torch.testing.assert_close(y, reference_scan(inputs), rtol=1e-11, atol=1e-11)
    assert calls


@pytest.mark.parametrize("case", ["seq_idx", "inf_x", "positive_A", "negative_dt", "float16", "off", "many_chunks"])
def test_it_does_not_run_where_it_must_not(case, monkeypatch):
    inputs = _case(12, 4, "f", False, False, False, 2, 1)
    x, d = inputs.x, inputs.forward
    if case == "seq_idx":
        inputs = ScanInputs(x=x, forward=d, seq_idx=torch.zeros(2, 12, dtype=torch.int32), chunk_size=4)
    elif case == "inf_x":
        inputs = ScanInputs(x=x.index_fill(1, torch.tensor([5]), float("inf")), forward=d, chunk_size=4)
    elif case == "positive_A":
        inputs = ScanInputs(x=x, forward=Direction(d.dt, -d.A, d.B, d.C), chunk_size=4)
    elif case == "negative_dt":
        inputs = ScanInputs(x=x, forward=Direction(-d.dt, d.A, d.B, d.C), chunk_size=4)
    elif case == "float16":
        inputs = ScanInputs(x=x.half(), forward=Direction(*(t.half() for t in (d.dt, d.A, d.B, d.C))), chunk_size=4)
    elif case == "many_chunks":
        monkeypatch.setattr(native_scan, "MAX_CHUNKS", 2)  # 12 tokens in chunks of 4: 3 chunks
    else:
        monkeypatch.setattr(native_scan, "USE_NATIVE", False)
    assert not native_scan.applies(inputs)


def test_argument_checks_of_the_native_ops():
    inputs = _case(8, 4, "f", False, False, False, 2, 1)
    d = inputs.forward
    ops = torch.ops.mixer_plugins_native
    args = (d.dt, d.A, d.B, d.C, None, None, None, None)
    with pytest.raises(RuntimeError, match="contiguous float32/float64"):
        ops.scan_factored_forward(inputs.x.transpose(1, 2), *args, None, False, 4, False)
    with pytest.raises(RuntimeError, match="initial state needs the forward direction"):
        ops.scan_forward(inputs.x, None, None, None, None, *args[:4], torch.zeros(2, 2, 3, 5, dtype=F64), False, 4,
                         False)
    with pytest.raises(RuntimeError, match="initial state \\(B, H, P, N\\)"):
        ops.scan_factored_forward(inputs.x, *args, torch.zeros(2, 2, 5, 3, dtype=F64), False, 4, False)
    with pytest.raises(RuntimeError, match="dy must be contiguous"):
        ops.scan_factored_backward(inputs.x[:, :4], None, inputs.x, *args, None, False, 4)
    with pytest.raises(RuntimeError, match="chunk > 0"):
        ops.scan_backward(inputs.x, None, inputs.x, *args, None, False, 0)
