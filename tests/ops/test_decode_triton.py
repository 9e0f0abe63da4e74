"""The ``triton`` backend of ``kernels.decode.ssd_decode_step`` (our fused kernels) against the ``torch`` backend (the
oracle): y, the convolution state and the SSD state over a few consecutive steps (states carried), for both orders of
B and C, one and several groups, with and without step sizes and decay, every form of the skip D, clamped step
sizes, a read-out scale, SiLU on and off, no convolution bias, xbc and dt as strided views of a fused projection,
float32 and bfloat16 inputs with float32 states; the fused gated norm; both states updated in place; the float64
refusal; the custom op under ``torch.compile(fullgraph=True)`` and its fake kernel.

Shapes are tiny (the interpreter runs each program in Python). On a machine without CUDA this module runs in a fresh
interpreter with ``TRITON_INTERPRET=1``, started by ``tests/ops/test_triton_suite_decode.py``; collected in any other
process it is skipped. With CUDA it runs in this process.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fast_interpreter, triton_kernels_module  # noqa: F401  (fast_interpreter: an autouse fixture)

from mixer_plugins.errors import BackendUnavailableError
from mixer_plugins.kernels.decode import ssd_decode_step

decode_triton, DEVICE, pytestmark = triton_kernels_module("mixer_plugins.kernels.decode.triton_kernels")

BATCH, HEADS, HEAD_DIM, D_STATE, TAPS = 2, 4, 6, 5, 4   # head_dim and d_state not powers of two: masked tiles
STEPS = 3
#: (atol, rtol) of y by xbc's dtype (the states are float32: compared at float32's)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles smaller than the rows, so that a head's state spans several programs (2 blocks of 4 rows) and the
    windows' roll several blocks of channels."""
    monkeypatch.setattr(decode_triton, "STATE_TILE", 32)
    monkeypatch.setattr(decode_triton, "ROLL_CHANNELS", 16)


def _rand(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _inputs(*, groups=1, dtype=torch.float32, conv_dtype=torch.float32, dt="raw", A=True, D="head", bias=True,
            strided=False, seed=0):
    """One call's tensors and the initial states. ``strided``: xbc and dt are column slices of one wide projection
    (row stride above their widths)."""
    h, p, n = HEADS, HEAD_DIM, D_STATE
    width = h * p + 2 * groups * n
    if strided:
        proj = _rand(STEPS, BATCH, 7 + width + h + 3, seed=seed, dtype=dtype)
        xbcs = [proj[i, :, 7:7 + width] for i in range(STEPS)]
        dts = [proj[i, :, 7 + width:7 + width + h] for i in range(STEPS)]
    else:
        xbcs = [_rand(BATCH, width, seed=seed + i, dtype=dtype) for i in range(STEPS)]
        dts = [_rand(BATCH, h, seed=seed + 10 + i, dtype=dtype) for i in range(STEPS)]
    skips = {"head": _rand(h, seed=seed + 20), "channel": _rand(h, p, seed=seed + 21), "number": 0.75, "none": None}
    return dict(
        xbcs=xbcs, dts=dts if dt == "raw" else [None] * STEPS,
        conv_state=_rand(BATCH, width, TAPS, seed=seed + 30, dtype=conv_dtype),
        state=_rand(BATCH, h, p, n, seed=seed + 31),
        conv_weight=_rand(width, TAPS, seed=seed + 32, dtype=dtype, scale=0.5),
        conv_bias=_rand(width, seed=seed + 33, dtype=dtype) if bias else None,
        A_log=_rand(h, seed=seed + 34) if A else None, D=skips[D],
    )


def _run_steps(t: dict, backend: str, **options) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``STEPS`` consecutive steps from copies of the initial states: the outputs and both final states. Checks that
    the states are updated in place (their storage never changes)."""
    conv_state, state = t["conv_state"].clone(), t["state"].clone()
    pointers = conv_state.data_ptr(), state.data_ptr()
    ys = []
    for xbc, dt in zip(t["xbcs"], t["dts"], strict=True):
        ys.append(ssd_decode_step(xbc, conv_state, t["conv_weight"], t["conv_bias"], state, dt, t["A_log"], t["D"],
                                  backend=backend, **options))
        assert (conv_state.data_ptr(), state.data_ptr()) == pointers
    return ys, conv_state, state


def _check_against_oracle(t: dict, **options) -> None:
    got_y, got_conv, got_state = _run_steps(t, "triton", **options)
    want_y, want_conv, want_state = _run_steps(t, "torch", **options)
    atol, rtol = TOLERANCE[t["xbcs"][0].dtype]
    for step, (a, b) in enumerate(zip(got_y, want_y, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=lambda m, s=step: f"y {s}: {m}")
    # the windows only move values: exact; the states in float32
    torch.testing.assert_close(got_conv, want_conv, atol=0, rtol=0)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got_state, t["state"]) and not torch.equal(got_conv, t["conv_state"])


# -- values against the torch backend -------------------------------------------------------------------------

CASES = {
    # Mamba-2: softplus(dt + bias), decay, D per head, B then C
    "mamba2": (dict(), dict(dt_bias=True, dt_softplus=True)),
    # groups > 1, C before B, D per channel, clamped step sizes, a scale
    "groups-cb-clamp": (dict(groups=2, D="channel"),
                        dict(bc_order="CB", dt_bias=True, dt_softplus=True, dt_limit=(0.3, 0.9), scale=0.5)),
    # linear attention: no step sizes, no decay, no skip, no SiLU, no bias
    "linear-attention": (dict(groups=2, dt="none", A=False, D="none", bias=False),
                         dict(bc_order="CB", silu=False, scale=0.25)),
    # raw step sizes (no softplus, no bias), decay, a number as D, an upper clamp only
    "raw-dt-number-d": (dict(D="number"), dict(dt_limit=(0.0, 0.5))),
    # step sizes without decay; decay without step sizes (step 1)
    "dt-no-A": (dict(A=False), dict(dt_softplus=True)),
    "A-no-dt": (dict(dt="none", groups=2), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_backend_float32(case):
    make, options = CASES[case]
    t = _inputs(**make, seed=len(case))
    if options.pop("dt_bias", False):
        options["dt_bias"] = _rand(HEADS, seed=99)
    _check_against_oracle(t, **options)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_the_gated_norm_of_the_step(norm_before_gate):
    """With ``z`` and ``norm_weight`` (the blocks' gated RMSNorm of the step's row), against the torch backend."""
    t = _inputs(groups=2, seed=5)
    z = _rand(BATCH, HEADS * HEAD_DIM + 2, seed=97)[:, 1:-1]   # a strided view
    _check_against_oracle(t, dt_bias=_rand(HEADS, seed=96), dt_softplus=True, z=z,
                          norm_weight=_rand(HEADS * HEAD_DIM, seed=95).abs() + 0.5, norm_before_gate=norm_before_gate)


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_inputs_with_float32_state_strided(conv_dtype):
    """A bfloat16 model with a float32 SSD state: xbc and dt bfloat16 views of one projection, the weights bfloat16,
    the convolution state bfloat16 (the model's dtype) or float32."""
    t = _inputs(dtype=torch.bfloat16, conv_dtype=conv_dtype, strided=True, groups=2, D="channel", seed=3)
    assert t["xbcs"][0].stride(0) > t["xbcs"][0].shape[1]
    _check_against_oracle(t, dt_bias=_rand(HEADS, seed=98), dt_softplus=True, dt_limit=(0.0, 2.0), scale=1.5)


def test_float32_inputs_with_a_bfloat16_window_cache():
    """The new input enters the convolution unrounded (y at float32's accuracy); the window stores it rounded to
    bfloat16. One step: the interpreter truncates float32 -> bfloat16 where the GPU (and torch) round to nearest even,
    so the stored windows may differ by one bfloat16 unit in the last place there (exact on CUDA)."""
    t = _inputs(conv_dtype=torch.bfloat16, seed=4)
    t["xbcs"], t["dts"] = t["xbcs"][:1], t["dts"][:1]
    got_y, got_conv, got_state = _run_steps(t, "triton")
    want_y, want_conv, want_state = _run_steps(t, "torch")
    torch.testing.assert_close(got_y[0], want_y[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    exact = DEVICE == "cuda"
    torch.testing.assert_close(got_conv, want_conv, atol=0, rtol=0 if exact else 2**-7)


def test_float32_strided_views_and_default_tiles(monkeypatch):
    """xbc and dt as views of a fused projection, with the production tiles (one program per head)."""
    monkeypatch.setattr(decode_triton, "STATE_TILE", 2048)
    monkeypatch.setattr(decode_triton, "ROLL_CHANNELS", 256)
    t = _inputs(strided=True, seed=5)
    _check_against_oracle(t, dt_bias=_rand(HEADS, seed=97), dt_softplus=True)


def test_a_planted_bug_is_caught(monkeypatch):
    """The comparison can fail: the kernel without its skip term D x disagrees with the oracle."""
    monkeypatch.setattr(decode_triton, "_d_mode", lambda D, d_scalar: 0)
    with pytest.raises(AssertionError):
        _check_against_oracle(_inputs(seed=7))


# -- refusals and dispatch --------------------------------------------------------------------------------------

def test_refuses_float64_with_a_reason():
    """A float64 state (the dtype the step computes in) or a float64 input: the torch backend's work."""
    t = _inputs()
    xbc32, state32 = t["xbcs"][0], t["state"]
    for xbc, state in ((xbc32, state32.double()), (xbc32.double(), state32)):
        with pytest.raises(BackendUnavailableError, match="float32 at most; float64 inputs run on the torch"):
            ssd_decode_step(xbc, t["conv_state"], t["conv_weight"], t["conv_bias"], state, t["dts"][0], t["A_log"],
                            t["D"], backend="triton")


def test_refuses_kernels_and_states_over_its_limits():
    from mixer_plugins.kernels.decode import DECODE

    t = _inputs()
    taps, d_state = decode_triton.MAX_TAPS + 1, decode_triton.MAX_D_STATE + 1
    device = torch.device(DEVICE)
    base = dict(state=t["state"], dt=None, conv_weight=t["conv_weight"], others=(t["xbcs"][0], t["conv_state"]))
    assert DECODE.why_not("triton", device, **base) is None
    long = dict(base, conv_weight=t["conv_weight"][:, :1].expand(-1, taps))
    assert "taps" in DECODE.why_not("triton", device, **long)
    wide = dict(base, state=t["state"][..., :1].expand(-1, -1, -1, d_state))
    assert "d_state" in DECODE.why_not("triton", device, **wide)


def test_the_automatic_choice_is_triton_on_cuda_only():
    from mixer_plugins import kernels

    rows = {(r.op, r.backend, r.device): r for r in kernels.backend_report(devices=["cuda", "cpu"])}
    assert rows["decode", "triton", "cuda"].automatic and not rows["decode", "triton", "cpu"].automatic
    assert kernels.resolve_backend("decode", None, "cpu") != "triton"


# -- torch.compile and the fake kernel -----------------------------------------------------------------------------

def test_compile_fullgraph_sees_one_op_and_updates_the_states():
    """Under ``torch.compile(fullgraph=True)`` (aot_eager: dynamo and AOTAutograd's functionalization, as under
    inductor) the step is one opaque op, and the compiled steps equal eager, states included."""
    t = _inputs(groups=2, D="channel", seed=11)
    seen = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, _):
            seen.extend(node.format_node() for node in g.graph.nodes)
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    def step(xbc, conv_state, state, dt):
        return ssd_decode_step(xbc, conv_state, t["conv_weight"], t["conv_bias"], state, dt, t["A_log"], t["D"],
                               bc_order="CB", dt_softplus=True, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    conv_c, state_c = t["conv_state"].clone(), t["state"].clone()
    conv_e, state_e = t["conv_state"].clone(), t["state"].clone()
    for xbc, dt in zip(t["xbcs"], t["dts"], strict=True):
        torch.testing.assert_close(compiled(xbc, conv_c, state_c, dt), step(xbc, conv_e, state_e, dt))
    assert sum("ssd_decode_step_triton" in s for s in seen) == 1, seen
    torch.testing.assert_close(conv_c, conv_e, atol=0, rtol=0)
    torch.testing.assert_close(state_c, state_e)


def test_fake_kernel_gives_the_output_and_leaves_the_states():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = _inputs(dtype=torch.bfloat16, groups=2)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in t.items()
                if not isinstance(v, list)}
        xbc = mode.from_tensor(t["xbcs"][0])
        y = torch.ops.mixer_plugins.ssd_decode_step_triton(
            xbc, fake["conv_state"], fake["conv_weight"], fake["conv_bias"], fake["state"], None, None, None, 1.0,
            None, False, 0.0, math.inf, 1.0, True, False)
    assert y.shape == (BATCH, HEADS * HEAD_DIM) and y.dtype == torch.bfloat16


# -- launch geometry ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 24, 64, 128, 4), (3, 8, 64, 64, 4), (2, 4, 6, 5, 3), (1, 1, 1, 1, 1)])
def test_layouts_cover_every_row_and_channel(shape):
    b, h, p, n, k = shape
    grid, blocks = decode_triton.step_layout(b, h, p, n, k)
    assert grid == (b * h * blocks["NPB"],) and blocks["NPB"] * blocks["BLOCK_P"] >= p
    assert (blocks["NPB"] - 1) * blocks["BLOCK_P"] < p and blocks["BLOCK_N"] >= n and blocks["BLOCK_K"] >= k
    width = h * p + 2 * n
    grid, blocks = decode_triton.roll_layout(b, width, k)
    assert grid == (b * blocks["NCB"],) and (blocks["NCB"] - 1) * blocks["BLOCK_C"] < width
    assert blocks["NCB"] * blocks["BLOCK_C"] >= width
