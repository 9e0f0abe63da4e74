"""The fused decoding step (:func:`mixer_plugins.kernels.decode.ssd_decode_step`): every backend that runs here against
a written-out float64 recurrence, at the extremes users reach (strong decays, step sizes past softplus' threshold and
clamped, low-precision inputs over a float32 state), with the states updated in place and carried over steps."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixer_plugins.kernels import available_backends
from mixer_plugins.kernels.decode import decode_unchecked, ssd_decode_step

F64 = torch.float64


def naive_step(xbc, conv_state, weight, bias, state, dt, A_log, D, *, bc_order, dt_bias, dt_softplus, dt_limit, scale,
               silu):
    """One token, written out row by row and head by head in float64: returns (y, conv_state, state)."""
    b, h, p, n = state.shape
    conv_state, state = conv_state.to(F64).clone(), state.to(F64).clone()
    y = torch.zeros(b, h * p, dtype=F64)
    groups = (xbc.shape[1] - h * p) // (2 * n)
    for row in range(b):
        window = torch.cat([conv_state[row, :, 1:], xbc[row].to(F64)[:, None]], dim=1)
        conv_state[row] = window
        u = (window * weight.to(F64)).sum(-1) + (0 if bias is None else bias.to(F64))
        u = F.silu(u) if silu else u
        x, first, second = u.split([h * p, groups * n, groups * n])
        B, C = (first, second) if bc_order == "BC" else (second, first)
        for head in range(h):
            g = head // (h // groups)
            step = 1.0 if dt is None else float(dt[row, head]) + (0.0 if dt_bias is None else float(dt_bias[head]))
            if dt is not None and dt_softplus:
                step = float(F.softplus(torch.tensor(step, dtype=F64)))
            if dt_limit != (0.0, math.inf):   # the default limits clamp nothing (mamba-ssm's convention)
                step = min(max(step, dt_limit[0]), dt_limit[1])
            decay = 1.0 if A_log is None else math.exp(-math.exp(float(A_log[head])) * step)
            xs = x[head * p:(head + 1) * p]
            Bg, Cg = B[g * n:(g + 1) * n], C[g * n:(g + 1) * n]
            state[row, head] = decay * state[row, head] + step * torch.outer(xs, Bg)
            if isinstance(D, torch.Tensor):
                skip = D[head].to(F64) if D.dim() == 1 else D[head].to(F64)
            else:
                skip = 0.0 if D is None else D
            y[row, head * p:(head + 1) * p] = scale * (state[row, head] @ Cg) + skip * xs
    return y, conv_state, state


def make(seed, *, b=2, h=4, p=3, n=5, k=4, groups=2, dtype=F64, state_dtype=None, decay=True, d="head",
         strided=True, transposed_conv=False, dt_shift=0.0, bias=True):
    g = torch.Generator().manual_seed(seed)
    width = h * p + 2 * groups * n
    state_dtype = state_dtype or dtype
    big = torch.randn(b, width + 5, generator=g, dtype=F64).to(dtype)
    xbc = big[:, 2:2 + width] if strided else big[:, :width].contiguous()
    if transposed_conv:   # mamba-ssm's layout: a transposed view of (b, k, width)
        conv_state = torch.randn(b, k, width, generator=g, dtype=F64).to(state_dtype).transpose(1, 2)
    else:
        conv_state = torch.randn(b, width, k, generator=g, dtype=F64).to(state_dtype)
    state = torch.randn(b, h, p, n, generator=g, dtype=F64).to(state_dtype)
    weight = (torch.randn(width, k, generator=g, dtype=F64) / 2).to(dtype)
    conv_bias = torch.randn(width, generator=g, dtype=F64).to(dtype) if bias else None
    dt = (torch.randn(b, h, generator=g, dtype=F64) + dt_shift).to(dtype) if decay else None
    A_log = (torch.rand(h, generator=g, dtype=F64) * 4 - 2).to(state_dtype) if decay else None   # A in [-7.4, -0.14]
    D = {"head": torch.randn(h, generator=g, dtype=F64).to(dtype),
         "channel": torch.randn(h, p, generator=g, dtype=F64).to(dtype), "number": 1.0, "none": None}[d]
    return xbc, conv_state, weight, conv_bias, state, dt, A_log, D


CASES = {
    "mamba2": dict(make={}, kw=dict(dt_softplus=True, dt_bias=True)),
    "one_group_per_channel_D": dict(make=dict(groups=1, d="channel"), kw=dict(dt_softplus=True, dt_bias=True)),
    "clamped": dict(make=dict(d="none"), kw=dict(dt_softplus=True, dt_bias=True, dt_limit=(0.2, 0.6))),
    # step sizes past softplus' threshold and decays exp(A dt) down to e^-200: the state forgets, nothing overflows
    "strong_decay": dict(make=dict(dt_shift=25.0), kw=dict(dt_softplus=True, dt_bias=True)),
    "raw_step_sizes": dict(make=dict(bias=False), kw=dict()),
    "linear_attention": dict(make=dict(groups=4, n=3, decay=False, d="number"), kw=dict(bc_order="CB", scale=0.3)),
    "no_silu_mamba_layout": dict(make=dict(transposed_conv=True, strided=False), kw=dict(silu=False)),
}


def _kwargs(case, h):
    kw = dict(CASES[case]["kw"])
    if kw.pop("dt_bias", False):
        kw["dt_bias"] = torch.linspace(-1, 1, h, dtype=F64)
    return kw


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_equal_the_written_out_recurrence(case, backend):
    """Three consecutive steps, states carried in place, against the float64 recurrence."""
    if backend not in available_backends("decode", "cpu"):
        pytest.skip(f"{backend} unavailable")
    xbc, conv_state, weight, bias, state, dt, A, D = make(0, **CASES[case]["make"])
    kw = _kwargs(case, state.shape[1])
    full = dict(bc_order="BC", dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), scale=1.0, silu=True)
    full.update(kw)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    conv_ptr, state_ptr = conv_state.data_ptr(), state.data_ptr()
    for i in range(3):
        shifted = xbc.roll(i, dims=0)
        y = ssd_decode_step(shifted, conv_state, weight, bias, state, dt, A, D, backend=backend, **kw)
        y_ref, ref_conv, ref_state = naive_step(shifted, ref_conv, weight, bias, ref_state, dt, A, D, **full)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(conv_state, ref_conv, rtol=0, atol=0)
        torch.testing.assert_close(state, ref_state, rtol=1e-12, atol=1e-12)
    assert conv_state.data_ptr() == conv_ptr and state.data_ptr() == state_ptr, "states updated in place"


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_unchecked_entry_takes_the_depthwise_weight(case, backend):
    """``decode_unchecked`` (the blocks' one-token step) with nn.Conv1d's (channels, 1, kernel) weight and a
    non-contiguous skip gives what the public op gives with the (channels, kernel) weight."""
    if backend not in available_backends("decode", "cpu"):
        pytest.skip(f"{backend} unavailable")
    xbc, conv_state, weight, bias, state, dt, A, D = make(2, **CASES[case]["make"])
    kw = dict(bc_order="BC", dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), scale=1.0, silu=True)
    kw.update(_kwargs(case, state.shape[1]))
    if isinstance(D, torch.Tensor) and D.dim() == 2:
        D = D.t().contiguous().t()   # a transposed view: the kernel reads it contiguously
    conv_2, state_2 = conv_state.clone(), state.clone()
    y = decode_unchecked(xbc, conv_state, weight[:, None, :].clone(), bias, state, dt, A, D, kw["bc_order"],
                         kw["dt_bias"], kw["dt_softplus"], kw["dt_limit"], kw["scale"], kw["silu"], None, backend)
    D_2 = D.contiguous() if isinstance(D, torch.Tensor) else D
    y_2 = ssd_decode_step(xbc, conv_2, weight, bias, state_2, dt, A, D_2, backend=backend, **kw)
    torch.testing.assert_close(y, y_2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(conv_state, conv_2, rtol=0, atol=0)
    torch.testing.assert_close(state, state_2, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_the_gated_norm_of_the_step(backend, dtype, norm_before_gate):
    """With ``z`` and ``norm_weight`` the step returns the gated RMSNorm of its output row (the written-out
    formula over the float64 recurrence), and updates the states as without it."""
    if backend not in available_backends("decode", "cpu"):
        pytest.skip(f"{backend} unavailable")
    xbc, conv_state, weight, bias, state, dt, A, D = make(3, dtype=dtype, d="channel")
    b, h, p = state.shape[:3]
    g = torch.Generator().manual_seed(4)
    z = torch.randn(b, h * p + 3, generator=g, dtype=F64).to(dtype)[:, 1:1 + h * p]   # a strided view
    norm_weight = torch.rand(h * p, generator=g, dtype=F64).to(dtype) + 0.5
    kw = dict(dt_bias=torch.linspace(-1, 1, h, dtype=dtype), dt_softplus=True)
    full = dict(bc_order="BC", dt_limit=(0.0, math.inf), scale=1.0, silu=True, **kw)
    y_ref, conv_ref, state_ref = naive_step(xbc.double(), conv_state.double(), weight.double(), bias.double(),
                                            state.double(), dt.double(), A.double(), D.double(),
                                            **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                               for k, v in full.items()})
    zs = F.silu(z.double())
    u = y_ref if norm_before_gate else y_ref * zs
    out_ref = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.double()
    out_ref = out_ref * zs if norm_before_gate else out_ref
    out = ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, z=z, norm_weight=norm_weight, eps=1e-5,
                          norm_before_gate=norm_before_gate, backend=backend, **kw)
    tol = 1e-12 if dtype == F64 else 2e-5
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), out_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(state.double(), state_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(conv_state.double(), conv_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
def test_float32_is_float32_accurate(backend):
    """Float32 inputs and states: relative error at float32's scale against the float64 recurrence, strong decays
    included."""
    if backend not in available_backends("decode", "cpu"):
        pytest.skip(f"{backend} unavailable")
    xbc, conv_state, weight, bias, state, dt, A, D = make(1, dtype=torch.float32, dt_shift=4.0)
    kw = dict(dt_bias=torch.zeros(4), dt_softplus=True)
    y_ref, conv_ref, state_ref = naive_step(xbc, conv_state, weight, bias, state, dt, A, D, bc_order="BC",
                                            dt_limit=(0.0, math.inf), scale=1.0, silu=True, **kw)
    y = ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, backend=backend, **kw)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_over_a_float32_state():
    """A bfloat16 model over a float32 cache: the step computes in the state's float32 (the native kernel leaves it to
    the torch backend and says why), y comes back in bfloat16."""
    xbc, conv_state, weight, bias, state, dt, A, D = make(2, dtype=torch.bfloat16, state_dtype=torch.float32)
    kw = dict(dt_bias=torch.zeros(4), dt_softplus=True)
    y_ref, _, state_ref = naive_step(xbc, conv_state, weight, bias, state, dt, A, D, bc_order="BC",
                                     dt_limit=(0.0, math.inf), scale=1.0, silu=True, **kw)
    y = ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, **kw)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-2, atol=1e-2)
    from mixer_plugins.kernels.decode import DECODE
    reason = DECODE.reason("native", torch.device("cpu"), state=state, dt=dt, conv_weight=weight,
                           others=(xbc, conv_state, bias, A, None, D))
    assert "one dtype" in (reason or "")


def test_bad_arguments_are_refused_clearly():
    xbc, conv_state, weight, bias, state, dt, A, D = make(3)
    with pytest.raises(ValueError, match="channels"):
        ssd_decode_step(xbc[:, 1:], conv_state, weight, bias, state, dt, A, D)
    with pytest.raises(ValueError, match="conv_state"):
        ssd_decode_step(xbc, conv_state[:, :, 1:], weight, bias, state, dt, A, D)
    with pytest.raises(ValueError, match="bc_order"):
        ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, bc_order="CX")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dt must be"):
        ssd_decode_step(xbc, conv_state, weight, bias, state, dt[:, 1:], A, D)
    b, h, p = state.shape[:3]
    with pytest.raises(ValueError, match="both z and norm_weight"):
        ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, z=torch.randn(b, h * p, dtype=F64))
    with pytest.raises(ValueError, match="z must be"):
        ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, z=torch.randn(b, h * p + 1, dtype=F64),
                        norm_weight=torch.ones(h * p, dtype=F64))
    with pytest.raises(ValueError, match="norm_weight must be"):
        ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, z=torch.randn(b, h * p, dtype=F64),
                        norm_weight=torch.ones(h * p + 1, dtype=F64))


def test_compiles_with_fullgraph():
    """Under ``torch.compile(fullgraph=True)`` the torch backend is traced (states updated in place in the graph)."""
    xbc, conv_state, weight, bias, state, dt, A, D = make(4, dtype=torch.float32)
    kw = dict(dt_bias=torch.zeros(4), dt_softplus=True)
    conv2, state2 = conv_state.clone(), state.clone()
    y = ssd_decode_step(xbc, conv_state, weight, bias, state, dt, A, D, **kw)
    compiled = torch.compile(lambda *a: ssd_decode_step(*a, **kw), fullgraph=True, backend="eager")
    y2 = compiled(xbc, conv2, weight, bias, state2, dt, A, D)
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(state2, state)
    torch.testing.assert_close(conv2, conv_state)
