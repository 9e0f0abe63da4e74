"""ONNX export (``torch.onnx.export(..., dynamo=True)``) of mixers and of timm ViTs built with them.

While ``torch.export`` traces (which the dynamo-based exporter runs), the ops' ``torch`` backends trace their plain
formulas instead of our custom ops, and the dispatcher picks the ``torch`` backend on every device: the ONNX graph
holds standard ops only, and onnxruntime gives the eager output. The TorchScript-based exporter (``dynamo=False``) is
refused with an error that says what to use. Needs the dev extra's ``onnx``, ``onnxscript`` and ``onnxruntime``.
"""

from __future__ import annotations

import functools
import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins import BackendUnavailableError
from mixer_plugins.kernels import _dispatch
from mixer_plugins.testing import MixerHarness

pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript (the dev extra installs it)")
ort = pytest.importorskip("onnxruntime", reason="the ONNX round trip needs onnxruntime (the dev extra installs it)")
timm = pytest.importorskip("timm")

ATOL = 1e-4  # float32: onnxruntime against eager PyTorch


@pytest.fixture(scope="module", autouse=True)
def _torchlib_table_built_once():
    """``torch.onnx.export`` rebuilds its table of ATen-to-ONNX translations (torchlib) on every call, about a second
    of parsing onnxscript sources. The table comes out the same each time and only a ``custom_translation_table``
    (which no test here passes) adds to it, so this module builds it once and every export reads that one."""
    try:  # torch's own (private) registry: on a torch without it, every export builds its table as usual
        from torch.onnx._internal.exporter import _registration

        registry = _registration.ONNXRegistry
        registry.from_torchlib  # noqa: B018
    except (ImportError, AttributeError):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "from_torchlib", staticmethod(functools.cache(registry.from_torchlib)))
        yield


def _export(module: torch.nn.Module, *inputs: torch.Tensor, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own notes (deprecations, annotations)
        return torch.onnx.export(module, inputs, dynamo=True, verbose=False, **kwargs)


def _run(program, *inputs: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {arg.name: t.numpy() for arg, t in zip(session.get_inputs(), inputs)}
    return torch.from_numpy(session.run(None, feeds)[0])


def _standard_ops_only(program) -> None:
    """No node of ours in the exported program, and only ONNX's own domain in the model."""
    ours = {str(n.target) for n in program.exported_program.graph.nodes if "mixer_plugins" in str(n.target)}
    assert not ours, ours
    assert {node.domain for node in program.model_proto.graph.node} <= {"", "ai.onnx"}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# Four of our mixers in a small ViT (16 patch tokens; the scans in chunks of 8, so more than one chunk). One block
# takes every path of the adapter and the mixer; a second would only repeat them in the graph.
VIT_MIXERS = {
    "quasi": dict(chunk_size=8),
    "semiseparable": dict(chunk_size=8),
    "mlr_attention": {},
    "toeplitz": {},
}


def _vit(mixer: str, options: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny", mixer=mixer, mixer_options=options, img_size=32, patch_size=8, depth=1,
                             num_classes=5, class_token=False, global_pool="avg").eval()


@pytest.mark.parametrize("mixer", list(VIT_MIXERS))
def test_vit_round_trip(mixer):
    model = _vit(mixer, VIT_MIXERS[mixer])
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
    program = _export(model, images)
    _standard_ops_only(program)
    got = _run(program, images)
    assert got.shape == expected.shape
    assert _max_err(got, expected) <= ATOL
    with torch.no_grad():  # exporting leaves the eager model as it was
        assert torch.equal(model(images), expected)


def test_dynamic_batch():
    """Exported with a symbolic batch (at least 2 while tracing: see docs/onnx.md), the graph runs at any batch."""
    model = _vit("quasi", VIT_MIXERS["quasi"])
    program = _export(model, torch.randn(2, 3, 32, 32),
                      dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2)}})
    for batch in (1, 3):
        images = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            expected = model(images)
        assert _max_err(_run(program, images), expected) <= ATOL


BUILT_IN = [name for name in mp.list_mixers() if mp.get_spec(name).distribution == "mixer-plugins"]


@pytest.mark.slow  # one export per built-in mixer, about a second each
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_mixer_exports_with_a_padding_mask(name):
    """Each built-in mixer, with its test options and a right-padded mask whose pads hold NaN, past one chunk."""
    harness = MixerHarness(spec=mp.get_spec(name))
    module = harness.build(dtype=torch.float32)
    length = harness.lengths(module)["past_chunk"]
    x = harness.inputs(length, dtype=torch.float32)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, length - 3:] = False
    x[1, length - 3:] = float("nan")
    with torch.no_grad():
        expected = module(x, mask=mask)
    assert torch.isfinite(expected).all()
    program = _export(module, x, kwargs={"mask": mask})
    _standard_ops_only(program)
    assert _max_err(_run(program, x, mask), expected) <= ATOL


def test_built_in_mixers_are_found():
    assert {"quasiseparable", "semiseparable", "mlr_attention", "toeplitz", "attention"} <= set(BUILT_IN)


# Mixer-level round trips for the other paths the export takes: causal forms and the blocked local attention.
MIXER_CASES = [
    ("toeplitz", dict(causal=True)),
    ("mlr_attention", dict(causal=True, block_sizes=[None, 8, 4], ranks=[4, 2, 2], num_heads=4)),
    ("sliding_window_attention", dict(window=3, num_heads=4)),
    ("global_local_attention", dict(window=3, num_heads=4)),
]


@pytest.mark.parametrize("mixer, options", MIXER_CASES, ids=[f"{m}-{'-'.join(o)}" for m, o in MIXER_CASES])
def test_mixer_round_trip(mixer, options):
    torch.manual_seed(0)
    module = mp.create_mixer(mixer, 32, **options).eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        expected = module(x)
    program = _export(module, x)
    _standard_ops_only(program)
    assert _max_err(_run(program, x), expected) <= ATOL


# A dynamic sequence length: the mixers whose graph came out with the example's length fixed (the scans: the chunked
# scan loops over its chunks, and the exporter silently retried with the length it suggested) or that failed to export
# (the blocked local attention), and one that always exported it.
_SLOW = pytest.mark.slow
DYNAMIC_LENGTH_MIXERS = [
    pytest.param(name, options, id=f"{name}-{'-'.join(f'{k}{v}' for k, v in options.items())}".rstrip("-"))
    for name, options in (("quasiseparable", {}), ("semiseparable", {}), ("sliding_window_attention", {}),
                          ("global_local_attention", {}), ("toeplitz", {}),
                          ("sliding_window_attention", {"window": 40, "causal": True}))  # a window past the length
] + [pytest.param(name, {}, id=name, marks=_SLOW) for name in ("bidirectional_add", "bidirectional_mult",
                                                               "bidirectional_concat", "quasiseparable_no_shift",
                                                               "quasiseparable_no_diag")]


@pytest.mark.parametrize("name, options", DYNAMIC_LENGTH_MIXERS)
def test_dynamic_sequence_length_is_exported(name, options):
    """Exported at one length with a symbolic length axis (the input and its right-padded mask, pads holding NaN),
    the graph keeps the axis symbolic and runs at two other lengths (other remainders modulo the scans' chunk and
    the local window) with the eager output."""
    harness = MixerHarness(spec=mp.get_spec(name), options=options)
    module = harness.build(dtype=torch.float32)
    length = harness.lengths(module)["past_chunk"]

    def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = harness.inputs(n, dtype=torch.float32, seed=n)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n - 3:] = False
        x[1, n - 3:] = float("nan")
        return x, mask

    x, mask = inputs(length)
    axis = torch.export.Dim("length", min=2, max=module.max_seq_len or 4096)
    program = _export(module, x, kwargs={"mask": mask}, dynamic_shapes={"x": {1: axis}, "mask": {1: axis}})
    _standard_ops_only(program)
    sizes = [d.dim_param or d.dim_value for d in program.model_proto.graph.input[0].type.tensor_type.shape.dim]
    assert isinstance(sizes[1], str), f"the length axis was exported as the fixed size {sizes[1]}"
    for n in (length - 4, length + 7):
        x, mask = inputs(n)
        with torch.no_grad():
            expected = module(x, mask=mask)
        assert _max_err(_run(program, x, mask), expected) <= ATOL, n


def test_onnx_export_takes_the_torch_backend_on_every_device(monkeypatch):
    """A backend the automatic choice prefers (here the convolution's reference form, put first on CPU as a
    stand-in for Triton on CUDA) runs eagerly, but while the ONNX exporter traces, the ``torch`` backend is taken: its
    exported form is made of standard ops."""
    calls = []
    conv = importlib.import_module("mixer_plugins.kernels.conv")
    reference = conv.conv_reference

    def preferred(*args):
        calls.append(torch.compiler.is_exporting())
        return reference(*args)

    monkeypatch.setattr(conv, "conv_reference", preferred)
    monkeypatch.setitem(_dispatch.OPS["conv"].automatic, "cpu", ("reference", "torch"))
    module = mp.create_mixer("quasi", 32, chunk_size=8).eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        expected = module(x)
    assert calls == [False]  # eagerly, the preferred backend runs
    program = _export(module, x)
    assert calls == [False]  # the exporter never called it
    _standard_ops_only(program)
    assert _max_err(_run(program, x), expected) <= ATOL


_LOAD_AND_RUN = """
import sys, torch
program = torch.export.load(sys.argv[1])
x, expected = torch.load(sys.argv[2])
assert "mixer_plugins" not in sys.modules
print((program.module()(x) - expected).abs().max().item())
"""


def test_saved_export_runs_where_the_library_is_not_imported(tmp_path):
    """A ``torch.export`` program of a mixer, saved, loads and runs in a fresh process that never imports us."""
    torch.manual_seed(0)
    module = mp.create_mixer("quasi", 32, chunk_size=8).eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        expected = module(x)
    torch.export.save(torch.export.export(module, (x,)), tmp_path / "quasi.pt2")
    torch.save((x, expected), tmp_path / "io.pt")
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(tmp_path / "quasi.pt2"), str(tmp_path / "io.pt")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) <= 1e-5


def test_torchscript_exporter_is_refused_with_a_clear_error(tmp_path):
    model = _vit("quasi", {})
    images = torch.randn(2, 3, 32, 32)
    with pytest.raises(BackendUnavailableError, match=r"dynamo=False.*export with dynamo=True"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (images,), str(tmp_path / "m.onnx"), dynamo=False)
    with torch.no_grad():  # and the refusal leaves nothing behind: eager runs as before
        assert torch.isfinite(model(images)).all()


def test_torchscript_exporter_refuses_a_bare_mixer_with_the_documented_error(tmp_path):
    module = mp.create_mixer("quasi", 32, chunk_size=8).eval()
    with pytest.raises(BackendUnavailableError, match=r"dynamo=False.*export with dynamo=True"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.randn(2, 16, 32),), str(tmp_path / "m.onnx"), dynamo=False)
