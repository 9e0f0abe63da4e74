"""The scan's factored-decay path (``kernels/_scan/factored.py``): values and gradients against the materialized
reference, where it applies; the general path wherever it must not run (packed sequences, non-finite values, a
decay range too wide for the dtype, float16)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mixer_plugins import kernels
from mixer_plugins.kernels._scan import Direction, ScanInputs, factored, reference_scan
from mixer_plugins.kernels._scan import custom_op as custom_op_module
from mixer_plugins.kernels._scan import native as native_scan


@pytest.fixture(autouse=True)
def _pytorch_path(monkeypatch):
    """These tests are about the PyTorch scan (factored or general); the native kernel would take their calls."""
    monkeypatch.setattr(native_scan, "USE_NATIVE", False)

F64 = torch.float64


def _scan_inputs(*, length, chunk, groups, heads, shift, diag, directions, init, b=2, p=3, n=5, dt_scale=0.5,
                 dtype=F64, seed=0):
    torch.manual_seed(seed)

    def direction():
        dt = torch.rand(b, length, heads, dtype=dtype) * dt_scale
        A = -torch.rand(heads, dtype=dtype) * 2 - 0.05
        B = torch.randn(b, length, groups, n, dtype=dtype)
        C = torch.randn(b, length, groups, n, dtype=dtype)
        return Direction(*(t.requires_grad_(True) for t in (dt, A, B, C)))

    x = torch.randn(b, length, heads, p, dtype=dtype, requires_grad=True)
    return ScanInputs(
        x=x,
        forward=direction() if "f" in directions else None,
        backward=direction() if "b" in directions else None,
        diag=torch.randn(b, length, heads, dtype=dtype, requires_grad=True) if diag else None,
        initial_state=torch.randn(b, heads, p, n, dtype=dtype, requires_grad=True) if init else None,
        shift=shift, chunk_size=chunk)


def _leaves(inputs: ScanInputs) -> list[torch.Tensor]:
    tensors = [inputs.x, inputs.diag, inputs.initial_state]
    for d in (inputs.forward, inputs.backward):
        if d is not None:
            tensors += [d.dt, d.A, d.B, d.C]
    return [t for t in tensors if t is not None]


def _assert_matches_reference(got, inputs, want_final, tol=1e-11):
    want = reference_scan(inputs, return_final_state=want_final)
    got = got if want_final else (got,)
    want = want if want_final else (want,)
    torch.manual_seed(1)
    weights = [torch.randn_like(w) for w in want]
    leaves = _leaves(inputs)
    grads_got = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), leaves)
    grads_want = torch.autograd.grad(sum((g * w).sum() for g, w in zip(want, weights)), leaves)
    for a, e in [*zip(got, want), *zip(grads_got, grads_want)]:
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


CASES = [
    # length, chunk, groups, heads, shift, diag, directions, init, tile
    (length, chunk, groups, 4, shift, diag, directions, init, tile)
    for length, chunk, groups, shift, diag, directions, init, tile in itertools.product(
        [1, 7, 33], [4, 8], [1, 2], [True, False], [True, False], ["fb", "f", "b"], [False, True], [None, 2])
    if not (init and "f" not in directions)
]


@pytest.mark.parametrize("length,chunk,groups,heads,shift,diag,directions,init,tile", CASES[::3])
def test_factored_scan_matches_the_reference_values_and_gradients(length, chunk, groups, heads, shift, diag,
                                                                 directions, init, tile):
    # odd lengths (a partial last chunk), one chunk or many, tiles of 2 chunks, groups, shift, diagonal, one or
    # both directions, an initial state and the final state (float64 against the materialized matrix)
    inputs = _scan_inputs(length=length, chunk=chunk, groups=groups, heads=heads, shift=shift, diag=diag,
                          directions=directions, init=init)
    want_final = "f" in directions
    got = factored.scan_factored(inputs, return_final_state=want_final, tile_size=tile)
    assert got is not None
    _assert_matches_reference(got, inputs, want_final)


def test_the_public_ops_take_the_factored_path_for_finite_inputs(monkeypatch):
    taken = []
    original = factored.scan_factored

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(factored, "scan_factored", spy)
    inputs = _scan_inputs(length=40, chunk=8, groups=1, heads=2, shift=True, diag=True, directions="fb", init=False)
    f, bwd = inputs.forward, inputs.backward
    y = kernels.quasiseparable(inputs.x, f.dt, f.A, f.B, f.C, dt_bwd=bwd.dt, B_bwd=bwd.B, C_bwd=bwd.C,
                               diag=inputs.diag, chunk_size=8, backend="torch")
    y.sum().backward()
    assert taken and all(taken)
    torch.testing.assert_close(y, reference_scan(ScanInputs(x=inputs.x, forward=f, backward=Direction(bwd.dt, f.A,
                                                                                                     bwd.B, bwd.C),
                                                            diag=inputs.diag, shift=True)), rtol=1e-11, atol=1e-11)


def _general_path_spy(monkeypatch):
    """Records, per scan, whether the factored path declined (None) and the general path ran."""
    declined = []
    original = factored.scan_factored

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        declined.append(out is None)
        return out

    monkeypatch.setattr(factored, "scan_factored", spy)
    return declined


@pytest.mark.parametrize("case", ["seq_idx", "nan_future_dt", "inf_B", "wide_decay", "float16"])
def test_the_general_path_runs_where_the_factored_one_must_not(case, monkeypatch):
    dtype = torch.float16 if case == "float16" else F64
    inputs = _scan_inputs(length=24, chunk=8, groups=1, heads=2, shift=True, diag=False, directions="fb",
                          init=False, dt_scale=(200.0 if case == "wide_decay" else 0.5), dtype=torch.float32
                          if case == "float16" else dtype)
    seq_idx = None
    if case == "seq_idx":
        seq_idx = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    x = inputs.x.detach().clone()
    B = inputs.forward.B.detach().clone()
    dt_f = inputs.forward.dt.detach().clone()
    if case == "nan_future_dt":
        dt_f[:, -1] = float("nan")   # the last token: the forward direction of every other token never sees it
    if case == "inf_B":
        B[:, -1] = float("inf")
    if case == "float16":
        x, B = x.half(), B.half()
    f, bwd = inputs.forward, inputs.backward
    cast = (lambda t: t.detach().half()) if case == "float16" else (lambda t: t.detach())
    declined = _general_path_spy(monkeypatch)
    y = custom_op_module.run_chunked(
        ScanInputs(x=x, forward=Direction(cast(dt_f), cast(f.A), B, cast(f.C)),
                   backward=Direction(cast(bwd.dt), cast(bwd.A), cast(bwd.B), cast(bwd.C)), seq_idx=seq_idx,
                   shift=True, chunk_size=8), want_final=False)[0]
    assert declined == [True]
    if case in ("nan_future_dt", "inf_B"):
        # no token before the last one may see it through the forward direction (every earlier token's backward
        # direction does read it, legitimately), so the forward direction alone is checked for a leak
        y_fwd = custom_op_module.run_chunked(
            ScanInputs(x=x, forward=Direction(dt_f, f.A.detach(), B, f.C.detach()), shift=True,
                       chunk_size=8), want_final=False)[0]
        assert torch.isfinite(y_fwd[:, :-1]).all()
    elif case == "float16":
        assert torch.isfinite(y).all()
    else:
        want = reference_scan(ScanInputs(x=x, forward=Direction(dt_f, f.A.detach(), B, f.C.detach()),
                                         backward=Direction(bwd.dt.detach(), bwd.A.detach(), bwd.B.detach(),
                                                            bwd.C.detach()),
                                         seq_idx=None if seq_idx is None else kernels._scan.normalize_seq_idx(seq_idx),
                                         shift=True))
        torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)


def test_the_decay_range_bound_is_what_the_dtype_allows():
    # a chunk whose whole decay is 2 x MAX_HALF_RANGE[float32] + a little: declined in float32, taken in float64
    inputs = _scan_inputs(length=8, chunk=8, groups=1, heads=1, shift=False, diag=False, directions="f",
                          init=False, dtype=torch.float32)
    f = inputs.forward
    A = torch.tensor([-1.0])
    dt = torch.full_like(f.dt, (2 * factored.MAX_HALF_RANGE[torch.float32] + 1.0) / 8).detach()
    wide = ScanInputs(x=inputs.x.detach(), forward=Direction(dt, A, f.B.detach(), f.C.detach()), chunk_size=8)
    assert factored.scan_factored(wide) is None
    wide64 = ScanInputs(x=inputs.x.detach().double(), forward=Direction(dt.double(), A.double(),
                                                                         f.B.detach().double(),
                                                                         f.C.detach().double()), chunk_size=8)
    got = factored.scan_factored(wide64)
    assert got is not None
    torch.testing.assert_close(got, reference_scan(wide64), rtol=1e-10, atol=1e-10)


def test_float32_and_bfloat16_follow_the_float64_reference():
    inputs = _scan_inputs(length=70, chunk=16, groups=1, heads=4, shift=True, diag=True, directions="fb",
                          init=False, b=1, p=8, n=8)
    want = reference_scan(inputs).detach()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 6e-2)):
        cast = ScanInputs(
            x=inputs.x.detach().to(dtype),
            forward=Direction(*(getattr(inputs.forward, k).detach().to(dtype) for k in ("dt", "A", "B", "C"))),
            backward=Direction(*(getattr(inputs.backward, k).detach().to(dtype) for k in ("dt", "A", "B", "C"))),
            diag=inputs.diag.detach().to(dtype), shift=True, chunk_size=16)
        got = factored.scan_factored(cast)
        assert got is not None and got.dtype == dtype
        scale = want.abs().max()
        assert (got.double() - want).abs().max() <= tol * scale, dtype


@pytest.mark.parametrize("nchunks", [1, 2, 5])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("steep", [False, True])
def test_the_scaled_state_recurrence_matches_the_plain_one(nchunks, reverse, with_init, steep):
    # factored.scaled_state_recurrence (K_c = e^{m_c} H_c, a written-out backward past one chunk) against the
    # recurrence H_c = e^{2 m_c} H_{c-1} + e^{m_c} S'_c written with plain autograd, float64: values and the
    # gradients of every input, for the entering states only, the final state only, and both. ``steep``: chunks
    # whose decay is ~e^-40 (tiny links between chunks), compared relatively, to the last bits: a gradient formed
    # by a cancelling difference loses them there
    torch.manual_seed(0)
    b, g, n, r, p = 2, 1, 3, 2, 4
    states = torch.randn(b, nchunks, g, n, r, p, dtype=F64, requires_grad=True)
    half_log = -torch.rand(b, nchunks, g, 1, r, 1, dtype=F64) * 3
    if steep:
        half_log = half_log - 18
    half_log.requires_grad_(True)
    tol = {"rtol": 1e-10, "atol": 0.0} if steep else {"rtol": 1e-12, "atol": 1e-12}
    init = torch.randn(b, g, n, r, p, dtype=F64, requires_grad=True) if with_init else None

    def plain():
        h = torch.zeros_like(states[:, 0]) if init is None else init
        entering = [None] * nchunks
        for c in (reversed(range(nchunks)) if reverse else range(nchunks)):
            entering[c] = torch.exp(half_log[:, c]) * h
            h = torch.exp(2 * half_log[:, c]) * h + torch.exp(half_log[:, c]) * states[:, c]
        return torch.stack(entering, dim=1), h

    got, want = factored.scaled_state_recurrence(states, half_log, init, reverse), plain()
    if got[0] is None:  # nothing enters: the read-out is skipped, and what would enter is zero
        assert nchunks == 1 and init is None and not want[0].any()
        got = (torch.zeros_like(want[0]), got[1])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **tol)
    leaves = [t for t in (states, half_log, init) if t is not None]
    weights = (torch.randn_like(want[0]), torch.randn_like(want[1]))
    for use in ((0, 1), (0,), (1,)):
        if got[0].grad_fn is None and 0 in use and len(use) == 1:
            continue  # a constant zero: no gradient to compare
        grads_got = torch.autograd.grad(sum((got[i] * weights[i]).sum() for i in use), leaves, retain_graph=True,
                                        allow_unused=True)
        grads_want = torch.autograd.grad(sum((want[i] * weights[i]).sum() for i in use), leaves, retain_graph=True,
                                         allow_unused=True)
        for a, e in zip(grads_got, grads_want):
            if a is None or e is None:  # unused on both sides, or zero on the plain one
                assert (a is None or not a.any()) and (e is None or not e.any())
                continue
            torch.testing.assert_close(a, e, **tol)
