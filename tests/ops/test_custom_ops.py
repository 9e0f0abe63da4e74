"""The custom ops under ``torch.library.opcheck`` (fake vs real kernels, strides included) and ``torch.compile``
with the inductor backend (the compiler users use) against eager."""

from __future__ import annotations

import pytest
import torch
from helpers import inductor_settings
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map_only

from mixer_plugins import kernels

F64 = torch.float64


def _scan_inputs(dtype=torch.float32, requires_grad=True, b=2, l=10, h=4, p=3, g=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen, dtype=dtype)
    dt = 0.5 * torch.rand(b, l, h, generator=gen, dtype=dtype)
    A = -torch.rand(h, generator=gen, dtype=dtype) - 0.2
    B = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    C = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (x, dt, A, B, C)]


def _native_scan_cases():
    x, dt, A, B, C = _scan_inputs()
    diag = torch.randn(2, 10, 4, requires_grad=True)
    init = torch.randn(2, 4, 3, 5, requires_grad=True)
    return {
        # length 10 in chunks of 4: a partial last chunk
        "both_directions": (x, dt, A, B, C, dt, A, B, C, diag, None, True, 4, False),
        "forward_with_states": (x, dt, A, B, C, None, None, None, None, None, init, False, 4, True),
        "backward_only": (x, None, None, None, None, dt, A, B, C, None, None, True, 3, False),
    }


def _assert_fake_kernel_matches_real(op, args):
    """The fake kernel's outputs have the real kernel's shapes, dtypes, strides and storage offsets: the
    compiler plans its buffers from the fake kernel (a mismatch fails inductor's size/stride asserts)."""
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*tree_map_only(torch.Tensor, mode.from_tensor, args))
    for r, f in zip(tree_leaves(real), tree_leaves(fake), strict=True):
        assert (r.shape, r.dtype, r.stride(), r.storage_offset()) == (f.shape, f.dtype, f.stride(), f.storage_offset())


@pytest.mark.parametrize("case", sorted(_native_scan_cases()))
def test_opcheck_native_scan(case):
    """The native engine's ops: fake kernels with the real kernels' layouts, schema, autograd registration and AOT
    dispatch; the gradients through them are checked numerically (float64)."""
    from mixer_plugins.kernels.scan.native import native_scan, native_scan_backward

    args = _native_scan_cases()[case]
    detached = tree_map_only(torch.Tensor, torch.Tensor.detach, args)
    y, final = native_scan(*detached)
    _assert_fake_kernel_matches_real(native_scan, detached)
    torch.library.opcheck(native_scan, args)
    gen = torch.Generator().manual_seed(3)
    backward_args = (torch.randn(y.shape, generator=gen), torch.randn(final.shape, generator=gen) if final.numel()
                     else None, *detached[:11], *detached[11:13])
    _assert_fake_kernel_matches_real(native_scan_backward, backward_args)
    torch.library.opcheck(native_scan_backward, backward_args)
    in64 = tree_map_only(torch.Tensor, lambda t: t.detach().double().requires_grad_(t.is_floating_point()), args)
    tensors = [i for i, a in enumerate(in64) if isinstance(a, torch.Tensor)]

    def run(*t):
        full = list(in64)
        for i, v in zip(tensors, t):
            full[i] = v
        y, final = native_scan(*full)
        return (y, final) if final.numel() else y

    assert torch.autograd.gradcheck(run, [in64[i] for i in tensors])


#: Every custom op of ours -> the test that puts it under opcheck and the fake-vs-real stride check.
OP_CHECKS = {
    "mixer_plugins::native_scan": "test_opcheck_native_scan",
    "mixer_plugins::native_scan_backward": "test_opcheck_native_scan",
    "mixer_plugins::depthwise_conv1d": "test_opcheck_depthwise_conv1d",
    "mixer_plugins::depthwise_conv1d_backward": "test_opcheck_depthwise_conv1d",
    "mixer_plugins::depthwise_conv1d_native": "test_opcheck_depthwise_conv1d",
    "mixer_plugins::depthwise_conv1d_native_backward": "test_opcheck_depthwise_conv1d",
    "mixer_plugins::toeplitz_fft": "test_opcheck_toeplitz_fft",
    "mixer_plugins::toeplitz_fft_backward": "test_opcheck_toeplitz_fft",
    "mixer_plugins::toeplitz_causal": "test_opcheck_toeplitz_causal",
    "mixer_plugins::mlr_attention_tiled": "test_opcheck_mlr_attention_tiled",
    "mixer_plugins::mlr_attention_tiled_backward": "test_opcheck_mlr_attention_tiled",
    "mixer_plugins::local_attention_blocked": "test_opcheck_local_attention_blocked",
    "mixer_plugins::local_attention_blocked_backward": "test_opcheck_local_attention_blocked",
    # the Triton scan (CUDA, or CPU under TRITON_INTERPRET=1 in a fresh interpreter)
    "mixer_plugins::quasiseparable_triton": "test_opcheck_triton_scan_ops_under_the_interpreter",
    "mixer_plugins::quasiseparable_triton_backward": "test_opcheck_triton_scan_ops_under_the_interpreter",
    "mixer_plugins::quasiseparable_triton_one_chunk": "test_opcheck_triton_scan_ops_under_the_interpreter",
    "mixer_plugins::quasiseparable_triton_one_chunk_backward": "test_opcheck_triton_scan_ops_under_the_interpreter",
    # the Triton norm and convolution (likewise)
    "mixer_plugins::gated_rmsnorm_triton": "test_opcheck_triton_norm_conv_ops_under_the_interpreter",
    "mixer_plugins::gated_rmsnorm_triton_backward": "test_opcheck_triton_norm_conv_ops_under_the_interpreter",
    "mixer_plugins::depthwise_conv1d_triton": "test_opcheck_triton_norm_conv_ops_under_the_interpreter",
    "mixer_plugins::depthwise_conv1d_triton_backward": "test_opcheck_triton_norm_conv_ops_under_the_interpreter",
}


@pytest.mark.parametrize("window,num_global,causal,masked", [(2, 0, False, True), (3, 2, True, True),
                                                            (1, 1, False, False), (20, 0, True, False)])
def test_opcheck_local_attention_blocked(window, num_global, causal, masked):
    """The blocked sliding-window op (band chunks, global tokens, dense fallback) and its backward op: fake kernels
    and strides, schema, autograd registration and AOT dispatch."""
    from mixer_plugins.kernels.local_attention.torch import local_attention_blocked, local_attention_blocked_backward

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 11, 2, 4, generator=g) for _ in range(2))
    v = torch.randn(2, 11, 2, 3, generator=g)
    key_real = None
    if masked:
        key_real = torch.ones(2, 11, dtype=torch.bool)
        key_real[1, 8:] = False
    args = (q, k, v, key_real, window, num_global, causal, 0.5)
    _, probs, row_probs = local_attention_blocked(*args)
    bwd_args = (torch.randn(2, 11, 2, 3, generator=g), q, k, v, key_real, probs, row_probs, *args[4:])
    _assert_fake_kernel_matches_real(local_attention_blocked, args)
    _assert_fake_kernel_matches_real(local_attention_blocked_backward, bwd_args)
    torch.library.opcheck(local_attention_blocked_backward, bwd_args)
    torch.library.opcheck(local_attention_blocked, tuple(a.detach().requires_grad_(True) if isinstance(
        a, torch.Tensor) and a.is_floating_point() else a for a in args))


def test_every_custom_op_is_opchecked():
    """A new custom op must be added to :data:`OP_CHECKS` with a test (the registry of ops is read from torch)."""
    import importlib

    import mixer_plugins as mp

    for name in mp.list_mixers():  # every mixer's module, and the kernels they import
        mp.get_spec(name)
    for module in ("scan.triton_kernels", "scan.triton_one_chunk", "norm.triton_kernels", "conv.triton_kernels"):
        with __import__("contextlib").suppress(ImportError):
            importlib.import_module(f"mixer_plugins.kernels.{module}")
    ops = {op for op in torch._C._dispatch_get_all_op_names() if op.startswith("mixer_plugins::")}
    assert ops - set(OP_CHECKS) == set(), f"custom ops without an opcheck test: {sorted(ops - set(OP_CHECKS))}"
    assert {op for op in OP_CHECKS if "triton" not in op} <= ops
    for test in set(OP_CHECKS.values()):
        assert test in globals(), test


#: what both interpreter scripts start with: the interpreter's speed shims (tests/helpers.py, semantics unchanged)
#: for the whole script, and a check that an op's real and fake outputs have the same layout
_SAME_LAYOUT = """
import torch
from helpers import interpreter_shims
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map_only

shims = interpreter_shims()   # kept: the shims stay on until the process ends
shims.__enter__()

def same_layout(op, args):
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*tree_map_only(torch.Tensor, mode.from_tensor, args))
    for r, f in zip(tree_leaves(real), tree_leaves(fake), strict=True):
        assert (r.shape, r.dtype, r.stride(), r.storage_offset()) == (f.shape, f.dtype, f.stride(),
                                                                       f.storage_offset()), (op, r.shape, f.shape)
    return real
"""

_TRITON_OPCHECK = _SAME_LAYOUT + """
import mixer_plugins.kernels.scan.triton_kernels  # registers the ops (kernels defined in interpreter mode)

g = torch.Generator().manual_seed(0)
b, l, h, p, n = 1, 9, 2, 2, 3
x = torch.randn(b, l, h, p, generator=g)
dt, dt_b = (0.5 * torch.rand(b, l, h, generator=g) for _ in range(2))
A, A_b = (-torch.rand(h, generator=g) - 0.2 for _ in range(2))
B, C, B_b, C_b = (torch.randn(b, l, 1, n, generator=g) for _ in range(4))
diag = torch.randn(b, l, h, generator=g)
seg = torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32)

fwd = torch.ops.mixer_plugins.quasiseparable_triton.default
bwd = torch.ops.mixer_plugins.quasiseparable_triton_backward.default
bias = 0.1 * torch.randn(h, generator=g)
args = (x, dt, A, B, C, dt_b, A_b, B_b, C_b, diag, None, seg, bias, 0.0, float("inf"), True, True, 4, True)
y, hs, lg, cb, dtc, final = same_layout(fwd, args)
bargs = (torch.randn(y.shape, generator=g), torch.randn(final.shape, generator=g), x, dt, A, B, C, dt_b, A_b, B_b,
         C_b, diag, seg, bias, 0.0, float("inf"), True, True, 4, hs, lg, cb, dtc, False)
same_layout(bwd, bargs)
torch.library.opcheck(bwd, bargs, test_utils=("test_schema", "test_faketensor"))
import mixer_plugins.kernels.scan.triton_one_chunk  # the one-chunk kernels' ops
one = torch.ops.mixer_plugins.quasiseparable_triton_one_chunk.default
one_bwd = torch.ops.mixer_plugins.quasiseparable_triton_one_chunk_backward.default
oargs = (x, dt, A, B, C, dt_b, A_b, B_b, C_b, diag, seg, bias, 0.0, float("inf"), True, True)
y, cb, dtc = same_layout(one, oargs)
obargs = (torch.randn(y.shape, generator=g), *oargs, cb, dtc)
same_layout(one_bwd, obargs)
torch.library.opcheck(one_bwd, obargs, test_utils=("test_schema", "test_faketensor"))
print("ok")
"""


def _run_script_under_the_interpreter(script: str) -> None:
    """Run ``script`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton reads it when its kernels are
    defined); it must print ``ok`` last."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


_TRITON_NORM_CONV_OPCHECK = _SAME_LAYOUT + """
import mixer_plugins.kernels.conv.triton_kernels  # registers the ops (kernels defined in interpreter mode)
import mixer_plugins.kernels.norm.triton_kernels

g = torch.Generator().manual_seed(0)
ops = torch.ops.mixer_plugins
# the norm on strided rows (a slice of wider ones), in bfloat16 with a float32 gain
y = torch.randn(3, 4, 12, generator=g)[..., :9].to(torch.bfloat16)
z, w = torch.randn(3, 4, 9, generator=g).to(torch.bfloat16), torch.randn(9, generator=g)
for before in (True, False):
    args = (y.requires_grad_(), z.requires_grad_(), w.requires_grad_(), 1e-5, before)
    same_layout(ops.gated_rmsnorm_triton.default, args)
    torch.library.opcheck(ops.gated_rmsnorm_triton.default, args)
    bargs = (torch.randn(3, 4, 9, generator=g).to(torch.bfloat16), y.detach(), z.detach(), w.detach(), 1e-5, before)
    same_layout(ops.gated_rmsnorm_triton_backward.default, bargs)
    torch.library.opcheck(ops.gated_rmsnorm_triton_backward.default, bargs)
# the convolution on a channel slice, centred with a bias and causal without
x = torch.randn(2, 11, 8, generator=g)[..., 1:6]
for k, left, bias in ((3, 1, torch.randn(5, generator=g)), (4, 3, None)):
    wk = torch.randn(5, k, generator=g)
    args = (x.requires_grad_(), wk.requires_grad_(), None if bias is None else bias.requires_grad_(), left,
            k - 1 - left, True)
    same_layout(ops.depthwise_conv1d_triton.default, args)
    torch.library.opcheck(ops.depthwise_conv1d_triton.default, args)
    bargs = (torch.randn(2, 11, 5, generator=g), x.detach(), wk.detach(), None if bias is None else bias.detach(),
             left, k - 1 - left, True)
    same_layout(ops.depthwise_conv1d_triton_backward.default, bargs)
    torch.library.opcheck(ops.depthwise_conv1d_triton_backward.default, bargs)
print("ok")
"""


@pytest.mark.triton
@pytest.mark.slow
def test_opcheck_triton_norm_conv_ops_under_the_interpreter():
    """The Triton norm's and convolution's forward and backward ops under opcheck (schema, fake kernels, autograd
    registration, AOT dispatch), their fake kernels with the real kernels' strides."""
    _run_script_under_the_interpreter(_TRITON_NORM_CONV_OPCHECK)


@pytest.mark.triton
@pytest.mark.slow
def test_opcheck_triton_scan_ops_under_the_interpreter():
    """The Triton scan's forward and backward ops: fake kernels with the real kernels' strides, and the backward
    under opcheck (the forward's opcheck is in tests/ops/test_scan_triton.py). A fresh interpreter: Triton reads
    ``TRITON_INTERPRET`` when its kernels are defined."""
    _run_script_under_the_interpreter(_TRITON_OPCHECK)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_depthwise_conv1d(silu, with_bias):
    x = torch.randn(2, 16, 12, 6)[..., 1, 1:6].requires_grad_()   # a strided view, as the block passes it
    w = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if with_bias else None
    args = (x, w, b, 1, 1, silu)
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.depthwise_conv1d, args)
    torch.library.opcheck(torch.ops.mixer_plugins.depthwise_conv1d, args)
    g = torch.randn(2, 16, 5)
    args = (g, x.detach(), w.detach(), b.detach() if b is not None else None, 1, 1, with_bias, silu)
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.depthwise_conv1d_backward, args)
    torch.library.opcheck(torch.ops.mixer_plugins.depthwise_conv1d_backward, args)
    # the native kernel's ops (CPU, float32/float64)
    native = (x, w, b, 1, silu)
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.depthwise_conv1d_native, native)
    torch.library.opcheck(torch.ops.mixer_plugins.depthwise_conv1d_native, native)
    native_backward = (g, x.detach(), w.detach(), b.detach() if b is not None else None, 1, silu, with_bias)
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.depthwise_conv1d_native_backward, native_backward)
    torch.library.opcheck(torch.ops.mixer_plugins.depthwise_conv1d_native_backward, native_backward)


@pytest.mark.parametrize("tap_batch", [1, 2])
def test_opcheck_toeplitz_fft(tap_batch):
    taps = torch.randn(tap_batch, 3, 13, requires_grad=True)
    v = torch.randn(2, 7, 3, 4, requires_grad=True)
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.toeplitz_fft, (taps.detach(), v.detach()))
    backward_args = (torch.randn(2, 7, 3, 4), taps.detach(), v.detach())
    _assert_fake_kernel_matches_real(torch.ops.mixer_plugins.toeplitz_fft_backward, backward_args)
    torch.library.opcheck(torch.ops.mixer_plugins.toeplitz_fft, (taps, v))
    torch.library.opcheck(torch.ops.mixer_plugins.toeplitz_fft_backward, backward_args)


def test_quasiseparable_compiles_with_inductor():
    # length 10 in chunks of 4: a partial last chunk (the torch backend is traced)
    x, dt, A, B, C = _scan_inputs(l=10, requires_grad=False)

    def f(x, dt, A, B, C):
        return kernels.quasiseparable(x, dt, A, B, C, chunk_size=4) * 2

    with inductor_settings():
        compiled = torch.compile(f, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x, dt, A, B, C), f(x, dt, A, B, C))


@pytest.mark.parametrize("causal", [False, True])
def test_depthwise_conv1d_compiles_with_inductor(causal):
    x = torch.randn(2, 11, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)

    def f(x, w, b):
        return kernels.depthwise_conv1d(x, w, b, causal=causal, silu=True) + 1

    with inductor_settings():
        compiled = torch.compile(f, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x, w, b), f(x, w, b))
        grads = torch.autograd.grad(compiled(x, w, b).square().sum(), (x, w, b))
    expected = torch.autograd.grad(f(x, w, b).square().sum(), (x, w, b))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_opcheck_toeplitz_causal():
    """The causal Toeplitz op (direct tiles + causal FFT blocks): fake kernel and strides, schema, autograd
    registration, and AOT dispatch; its values equal the explicit causal sum (an independent reference)."""
    op = torch.ops.mixer_plugins.toeplitz_causal
    for tap_batch in (1, 2):
        taps = torch.randn(tap_batch, 3, 70, dtype=F64, requires_grad=True)  # longer than one causal tile (64)
        v = torch.randn(2, 70, 3, 4, dtype=F64, requires_grad=True)
        _assert_fake_kernel_matches_real(op, (taps.detach(), v.detach()))
        torch.library.opcheck(op, (taps, v))
        expected = torch.zeros_like(v)
        for i in range(70):
            for d in range(i + 1):
                expected[:, i] += taps[:, :, d, None].expand(2, 3, 1) * v[:, i - d]
        torch.testing.assert_close(op(taps, v), expected, rtol=1e-10, atol=1e-10)


def _mlr_op_calls(engine):
    """The arguments the ``mlr_attention`` native or torch backend passes to its custom ops, recorded while it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixer_plugins.kernels import mlr_attention

    calls = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "mlr_attention_tiled" in str(func):
                calls.setdefault(str(func.overloadpacket).split(".")[-1], (args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    ranks, sizes = [4, 2, 1], [None, 8, 4]
    q, k = (torch.randn(2, 19, 2, sum(ranks), generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 19, 2, 5, generator=gen, requires_grad=True)
    mask = torch.arange(19)[None, :] < torch.tensor([19, 11])[:, None]
    backend = "native" if engine == "native" else "torch"   # the torch backend is the matmul engine
    with Record():
        out = mlr_attention(q, k, v, ranks=ranks, block_sizes=sizes, causal=True, mask=mask, backend=backend)
        out.sum().backward()
    return calls


@pytest.mark.parametrize("engine", ["native", "matmul"])
def test_opcheck_mlr_attention_tiled(engine):
    """The tiled MLR op and its backward op, with the arguments the backend really passes: fake kernels and
    strides, schema, autograd registration and AOT dispatch."""
    calls = _mlr_op_calls(engine)
    assert {"mlr_attention_tiled", "mlr_attention_tiled_backward"} <= set(calls), sorted(calls)
    fwd_args, fwd_kwargs = calls["mlr_attention_tiled"]
    assert engine in fwd_args, fwd_args[-1]  # the engine this case meant to check ran
    bwd_args, bwd_kwargs = calls["mlr_attention_tiled_backward"]
    detach = lambda args: tree_map_only(torch.Tensor, torch.Tensor.detach, args)  # noqa: E731
    fwd = torch.ops.mixer_plugins.mlr_attention_tiled
    bwd = torch.ops.mixer_plugins.mlr_attention_tiled_backward
    _assert_fake_kernel_matches_real(fwd, detach(fwd_args))
    _assert_fake_kernel_matches_real(bwd, detach(bwd_args))
    grad_args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                      for a in fwd_args)
    torch.library.opcheck(fwd, grad_args, fwd_kwargs)
    torch.library.opcheck(bwd, detach(bwd_args), bwd_kwargs)
