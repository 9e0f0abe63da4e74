"""The kernels' layout and backend choice: one folder per op whose ``__init__`` names its forms, the report."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mixer_plugins.errors as errors
from mixer_plugins import kernels
from mixer_plugins.kernels import _dispatch
from mixer_plugins.kernels._requirements import triton_unavailable

KERNELS = Path(kernels.__file__).parent
OPS = ("scan", "toeplitz", "conv", "norm", "mlr_attention", "local_attention", "decode")
#: the ops with a native (C++) backend, the CPU default where it applies
NATIVE = {"scan", "conv", "norm", "decode", "mlr_attention"}


def _module(name: str):
    """A module by dotted name (``import a.b as m`` would give the function a package is shadowed by)."""
    return importlib.import_module(name)


# -- layout -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_every_op_is_a_folder_with_a_reference_and_a_torch_backend(op, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU without the interpreter: no triton backend runs
    folder = KERNELS / op
    assert (folder / "__init__.py").is_file() and (folder / "reference.py").is_file()
    assert (folder / ("chunked.py" if op == "scan" else "torch.py")).is_file()
    assert {"reference", "torch"} <= set(_dispatch.OPS[op].backends)
    assert set(kernels.available_backends(op)) == {"reference", "torch"} | ({"native"} if op in NATIVE else set())


def test_ops_name_their_forms_in_plain_sight():
    """No discovery by module name: each op's ``__init__`` imports its forms and names them; only the optional
    dependencies (Triton, mamba-ssm) are looked up without importing them."""
    for path in KERNELS.rglob("*.py"):
        if "_native" in path.parts[-2:] or path.name == "_native_check.py":
            continue
        text = path.read_text()
        assert "import_module" not in text and "discover" not in text, path
        assert "find_spec" not in text or path.name == "_requirements.py", path
        assert "ScanArgs" not in text and "ScanInputs" not in text, path


def test_kernels_import_nothing_of_ours_outside_kernels_and_the_leaves():
    allowed = ("mixer_plugins.kernels", "mixer_plugins.errors", "mixer_plugins._text")
    for path in KERNELS.rglob("*.py"):
        package = ".".join(("mixer_plugins", "kernels", *path.relative_to(KERNELS).parent.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
            elif isinstance(node, ast.Import):
                target = node.names[0].name
            else:
                continue
            if target.startswith("mixer_plugins"):
                assert target.startswith(allowed), f"{path}: imports {target}"
            assert not target.startswith(("timm", "fairseq2", "matplotlib")), f"{path}: imports {target}"


def test_backend_modules_never_import_their_package_at_the_top():
    for path in KERNELS.rglob("mamba_ssm.py"):
        top_level = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [getattr(n, "module", None) or n.names[0].name for n in top_level]
        assert not any(name and name.startswith("mamba_ssm") for name in names), path
    assert "mamba_ssm" not in sys.modules


# -- the dispatcher -----------------------------------------------------------------------------------------

def test_backend_report_lists_every_op_and_backend_with_reasons():
    rows = kernels.backend_report(["cpu"])
    assert {(r.op, r.backend) for r in rows} == {(op, b) for op in OPS for b in kernels.BACKENDS}
    for row in rows:
        assert row.available == (row.reason == ""), row
        assert row.available == (row.backend in kernels.available_backends(row.op, "cpu")), row
    by_key = {(r.op, r.backend): r for r in rows}
    assert "mamba-ssm" in by_key["scan", "mamba_ssm"].reason
    assert not by_key["scan", "mamba_ssm"].automatic and not by_key["scan", "reference"].automatic   # (on CPU)
    assert by_key["scan", "native"].automatic and by_key["scan", "torch"].automatic
    assert "no 'triton' implementation" in by_key["toeplitz", "triton"].reason
    cuda = {(r.op, r.backend): r for r in kernels.backend_report(["cuda"])}
    assert cuda["scan", "triton"].automatic and cuda["scan", "mamba_ssm"].automatic
    assert not cuda["scan", "native"].available and "CPU" in cuda["scan", "native"].reason


def test_the_automatic_choice_and_named_backends():
    x = torch.randn(2, 5, 3)
    w = torch.randn(3, 3)
    assert kernels.resolve_backend("conv", None, "cpu", x=x, weight=w) == "native"
    assert kernels.resolve_backend("conv", None, "cpu", x=x.double(), weight=w) == "torch"  # mixed dtypes
    assert kernels.resolve_backend("conv", "reference", "cpu") == "reference"
    with kernels.use_backend("reference"):
        assert kernels.resolve_backend("scan", None, x.device) == "reference"
        torch.testing.assert_close(kernels.depthwise_conv1d(x, w, None, causal=False),
                                   kernels.depthwise_conv1d(x, w, None, causal=False, backend="torch"))
    with pytest.raises(kernels.BackendUnavailableError, match="did you mean 'reference'"):
        kernels.resolve_backend("scan", "referense", "cpu")
    with pytest.raises(kernels.BackendUnavailableError, match="unknown op"):
        kernels.resolve_backend("no_such_op", None, "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        with kernels.use_backend("nope"):
            pass


def test_a_preferred_backend_applies_to_the_ops_that_have_it(monkeypatch):
    v = torch.randn(1, 4, 2, 3)
    taps = torch.randn(1, 2, 7)
    x, dt, A, B, C = torch.randn(1, 4, 2, 3), torch.rand(1, 4, 2), -torch.rand(2), *torch.randn(2, 1, 4, 1, 5)

    def check_preference():
        # toeplitz has no mamba_ssm backend: its automatic choice runs ...
        torch.testing.assert_close(kernels.toeplitz_mix(taps, v), kernels.toeplitz_mix(taps, v, backend="reference"))
        # ... while the scan has one, which cannot run here: that is an error, never a silent fallback
        with pytest.raises(kernels.BackendUnavailableError, match="mamba-ssm"):
            kernels.ssd(x, dt, A, B, C, 4)

    with kernels.use_backend("mamba_ssm"):
        check_preference()
    monkeypatch.setenv("MIXER_PLUGINS_BACKEND", "mamba_ssm")
    check_preference()
    monkeypatch.delenv("MIXER_PLUGINS_BACKEND")
    with pytest.raises(kernels.BackendUnavailableError, match="no 'mamba_ssm' implementation"):
        kernels.toeplitz_mix(taps, v, backend="mamba_ssm")  # named in the call: strict


def test_adding_a_backend_is_one_name_in_the_op(monkeypatch):
    """An op is an :class:`Op` naming its forms, their automatic order and why each cannot run; a new backend is a
    name in that list and a branch in the op's function."""
    def why_not(backend, device, **call):
        return triton_unavailable(device, call.get("dtype")) if backend == "triton" else None

    def fake_op(x, backend=None):
        name = op.choose(backend, x.device, dtype=x.dtype)
        return x + (2 if name == "triton" else 1)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    op = _dispatch.Op("fake_op", backends=("reference", "triton"), automatic={"cuda": ("triton",), "cpu": ()},
                      why_not=why_not)
    try:
        x = torch.zeros(2)
        with pytest.raises(kernels.BackendUnavailableError, match="no backend can run"):
            fake_op(x)                       # the reference is never automatic, triton needs CUDA here
        assert fake_op(x, backend="reference").tolist() == [1, 1]
        with pytest.raises(kernels.BackendUnavailableError, match="TRITON_INTERPRET"):
            fake_op(x, backend="triton")
        if importlib.util.find_spec("triton") is not None:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            assert fake_op(x, backend="triton").tolist() == [2, 2]
            with pytest.raises(kernels.BackendUnavailableError, match="float64"):
                fake_op(x.double(), backend="triton")
            assert kernels.available_backends("fake_op") == ["reference", "triton"]
            rows = {r.backend: r for r in kernels.backend_report(["cpu"]) if r.op == "fake_op"}
            assert rows["triton"].available and not rows["triton"].automatic
    finally:
        _dispatch.OPS.pop("fake_op", None)


def test_requirements_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if importlib.util.find_spec("triton") is None:  # pragma: no cover
        assert "not installed" in triton_unavailable(torch.device("cpu"))
        return
    assert "TRITON_INTERPRET" in triton_unavailable(torch.device("cpu"))
    assert triton_unavailable(torch.device("cuda")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_unavailable(torch.device("cpu")) is None


@pytest.mark.parametrize("op", ["mlr_attention", "local_attention"])
def test_attention_inputs_too_long_for_the_triton_offsets_run_on_torch(op, monkeypatch):
    """The attention Triton kernels offset within a batch's slice in 32 bits: from a call whose span reaches 2^31
    the op runs the torch backend on CUDA (a shape rule, no value read); asked for by name, the triton backend says
    why it cannot."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, found = torch.device("cuda"), _dispatch.OPS[op]
    q, q16 = torch.empty(0, device="meta"), torch.empty(0, dtype=torch.bfloat16, device="meta")
    assert found.reason("triton", cuda, q=q, span=2**31 - 1) is None
    reason = found.reason("triton", cuda, q=q16, span=2**31)
    assert reason is not None and "32 bits" in reason
    assert kernels.resolve_backend(op, None, cuda, q=q, span=2**31) == "torch"
    with pytest.raises(errors.BackendUnavailableError, match="32 bits"):
        kernels.resolve_backend(op, "triton", cuda, q=q, span=2**31)


@pytest.mark.parametrize("op", ["mlr_attention", "local_attention"])
def test_attention_ops_pass_their_inputs_span_to_the_dispatcher(op, monkeypatch):
    """The span is the largest offset + 1 a kernel forms within one batch of q, k, v (views of a fused projection
    included) or of their contiguous gradients."""
    seen = []
    public = getattr(kernels, op)
    real = _dispatch.Op.choose

    def spy(self, backend, device, **call):
        seen.append(call)
        return real(self, backend, device, **call)

    monkeypatch.setattr(_dispatch.Op, "choose", spy)
    qkv = torch.randn(1, 12, 3, 2, 6)  # (b, l, q/k/v, h, e): views with strides (36, 6, 1) within a batch
    q, k, v = qkv.unbind(2)
    if op == "mlr_attention":
        public(q, k, v, ranks=[4, 2], block_sizes=[None, 4])
    else:
        public(q, k, v, window=3)
    assert seen[-1]["span"] == 11 * 36 + 1 * 6 + 5 * 1 + 1  # the last element of a view, counted from its base


def test_the_span_counts_a_head_major_layout():
    """Head-major views (b, H, L, 3E).transpose(1, 2): the head stride, not the row stride, is the large one."""
    heads, length, e = 16, 2**20, 64
    base = torch.empty(1, heads, length, 3 * e, device="meta")
    q = base.transpose(1, 2)[..., :e]
    assert q.stride(1) * length < 2**31 <= (heads - 1) * q.stride(2)  # length x row stride alone would pass
    assert _dispatch.row_span(q, q, q) >= 2**31


def test_the_triton_attention_launcher_refuses_rows_past_32_bit_offsets():
    pytest.importorskip("triton")
    from mixer_plugins.kernels.mlr_attention.triton_kernels import MLRSpec, mlr_triton

    q = torch.zeros(1, 1, 1, 8).expand(1, 2**28, 1, 8)  # 2^28 rows of 8 features: a span of 2^31, no memory
    spec = MLRSpec(ranks=(8,), sizes=(0,), taus=(1.0,), block_divide=False, causal=False)
    with pytest.raises(ValueError, match="32 bits"):
        mlr_triton(q, q, q, spec)


def test_every_check_reads_no_tensor_value():
    """The ops choose from devices, dtypes, shapes and options: no check may run an op that reads values (on a GPU
    each such read would be a device sync)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"a check ran {func}")

    x, dt, A, B, C = torch.randn(1, 4, 2, 3), torch.rand(1, 4, 2), -torch.rand(2), *torch.randn(2, 1, 4, 1, 5)
    call = dict(x=x, others=(dt, A, B, C, dt, A, B, C), carries_state=False, causal=False)
    scan = _dispatch.OPS["scan"]
    scan.choose(None, x.device, **call)  # the native library is loaded before the mode is entered
    with NoOps():
        for device in ("cpu", "cuda", "meta"):
            for backend in scan.backends:
                scan.why_not(backend, torch.device(device), **call)


# -- arguments ----------------------------------------------------------------------------------------------

def test_conv_and_norm_check_their_arguments_and_match_their_references():
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    w = torch.randn(4, 3, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    with pytest.raises(errors.MixerInputError, match="must be odd"):
        kernels.depthwise_conv1d(x, torch.randn(4, 4, dtype=torch.float64), None, causal=False)
    with pytest.raises(errors.MixerInputError, match="weight must be"):
        kernels.depthwise_conv1d(x, w[:3], None, causal=True)
    with pytest.raises(errors.MixerInputError, match="bias must be"):
        kernels.depthwise_conv1d(x, w, b[:3], causal=True)
    for causal in (True, False):
        for silu in (True, False):
            torch.testing.assert_close(kernels.depthwise_conv1d(x, w, b, causal=causal, silu=silu),
                                       kernels.depthwise_conv1d(x, w, b, causal=causal, silu=silu,
                                                                backend="reference"))
    y, z = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    wn = torch.randn(8, dtype=torch.float64)
    expected = F.rms_norm(y, (8,), eps=1e-5) * F.silu(z) * wn
    torch.testing.assert_close(kernels.gated_rmsnorm(y, z, wn, backend="reference"), expected)
    torch.testing.assert_close(kernels.gated_rmsnorm(y, z, wn), expected)


def test_a_preference_holds_while_torch_compile_traces(monkeypatch):
    """``use_backend`` set around a compiled call is the preference the traced ops see (a per-thread value that
    ``torch.compile`` reads while tracing, not a default in its place)."""
    import mixer_plugins.kernels.norm as norm_op

    calls = []
    reference = norm_op.gated_rmsnorm_reference

    def counted(*args):
        calls.append(1)
        return reference(*args)

    monkeypatch.setattr(norm_op, "gated_rmsnorm_reference", counted)
    y, z, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)

    def f(y, z, w):
        return kernels.gated_rmsnorm(y, z, w)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    compiled(y, z, w)
    assert not calls, "no preference: the automatic choice"
    torch._dynamo.reset()
    with kernels.use_backend("reference"):
        torch.testing.assert_close(compiled(y, z, w), reference(y, z, w, 1e-5, True))
    assert calls, "the preference reached the traced op"
