"""mamba-ssm's own Triton SSD kernels through our ``mamba_ssm`` backend, on CPU under ``TRITON_INTERPRET=1``.

Run in a fresh interpreter by ``tests/ops/test_scan_mamba_ssm_suite.py`` (``MIXER_PLUGINS_MAMBA_FRESH=1`` marks that
run) when mamba-ssm's files, Triton and einops are importable; collected in any other process it is skipped.
mamba-ssm is imported through ``tests/mamba_files.py`` (test-only), so a wheel built with ``MAMBA_SKIP_CUDA_BUILD=TRUE``
(no CUDA extensions) is enough.

mamba-ssm's kernels need three things the CPU does not give them, which this module supplies (test-only, in this
process): ``MAMBA_DETERMINISTIC=1`` before loading (each autotuned kernel keeps one config: the autotuner would
otherwise time the configs with the GPU driver); ``torch.cuda.device(None)`` and
``torch.cuda.get_device_properties(cpu)`` answered on CPU tensors (its host code asks for the current device and the
SM count; without a CUDA driver both raise); and, for triton 3.5's interpreter with NumPy >= 2.4, ``__index__`` of a
scalar tensor taken from its single element (the interpreter stores scalars as 1-element arrays, which NumPy 2.4
no longer converts with ``int()``; mamba-ssm's kernels loop ``range(0, scalar_tensor, ...)``). Kernel semantics are
unchanged. Our backend's CPU check is opened for the run: it refuses CPU tensors otherwise, saying why.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch

FRESH = os.environ.get("MIXER_PLUGINS_MAMBA_FRESH") == "1"
if not FRESH:
    pytest.skip("mamba-ssm's kernels' CPU checks run in a fresh interpreter (tests/ops/test_scan_mamba_ssm_suite.py)",
                allow_module_level=True)

os.environ["MAMBA_DETERMINISTIC"] = "1"
import mamba_files  # noqa: E402

MODULE = mamba_files.install()
if MODULE is None:
    pytest.skip("mamba-ssm is not installed", allow_module_level=True)

from mixer_plugins import kernels  # noqa: E402
from mixer_plugins.kernels.scan import mamba_ssm as mamba_backend  # noqa: E402


def _cpu_shims() -> None:
    """Lets mamba-ssm's host code run on CPU tensors (see the module notes)."""
    cuda_device = torch.cuda.device

    class device(cuda_device):  # noqa: N801 - replaces torch.cuda.device
        def __enter__(self):
            if self.idx is None or self.idx < 0:  # documented as a no-op; raises without a driver
                return None
            return super().__enter__()

        def __exit__(self, *exc):
            if self.idx is None or self.idx < 0:
                return False
            return super().__exit__(*exc)

    properties = torch.cuda.get_device_properties

    def get_device_properties(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return types.SimpleNamespace(multi_processor_count=4, name="cpu")
        return properties(device)

    torch.cuda.device = device
    torch.cuda.get_device_properties = get_device_properties
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:  # pragma: no cover - other interpreter internals
        return

    def patch_lang_tensor(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patch_lang_tensor


pytestmark = pytest.mark.filterwarnings("ignore:Deterministic mode")

_cpu_shims()


@pytest.fixture(autouse=True)
def _open_the_cpu_check(monkeypatch):
    # the backend on CPU tensors (the interpreter stands in for CUDA)
    monkeypatch.setattr(importlib.import_module("mixer_plugins.kernels.scan"), "mamba_ssm_unavailable",
                        lambda device, **kw: None)


def test_the_backend_imports_the_ssd_module_the_ordinary_way():
    assert mamba_backend.load() is MODULE.mamba_chunk_scan_combined


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _compare(run, inputs: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    """``run(backend, **tensors)`` through mamba_ssm in float32 against the reference in float64: the output
    (and the final states when it returns a pair) and the gradient of every input."""
    leaves32 = {k: v.detach().float().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    leaves64 = {k: v.detach().double().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    out32 = run("mamba_ssm", **leaves32)
    out64 = run("reference", **leaves64)
    out32 = out32 if isinstance(out32, tuple) else (out32,)
    out64 = out64 if isinstance(out64, tuple) else (out64,)
    for a, b in zip(out32, out64):
        assert _relative_error(a, b) < tol
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out64]
    sum(((o.double() * w).sum() for o, w in zip(out32, weights)), torch.zeros((), dtype=torch.float64)).backward()
    sum(((o * w).sum() for o, w in zip(out64, weights)), torch.zeros((), dtype=torch.float64)).backward()
    for name in inputs:
        if leaves64[name].grad is None:
            continue
        assert leaves32[name].grad is not None, name
        assert _relative_error(leaves32[name].grad, leaves64[name].grad) < tol * 10, name


def _rand(*shape, generator, scale=1.0):
    return torch.randn(*shape, generator=generator) * scale


def test_ssd_matches_the_reference_values_and_gradients():
    """Odd length, a chunk size that does not divide it, groups, D, dt_bias + softplus, initial and final states."""
    g = torch.Generator().manual_seed(0)
    b, l, h, p, groups, n = 1, 21, 4, 4, 2, 8
    inputs = dict(x=_rand(b, l, h, p, generator=g), dt=_rand(b, l, h, generator=g, scale=0.5),
                  A=-torch.rand(h, generator=g) - 0.5, B=_rand(b, l, groups, n, generator=g, scale=0.5),
                  C=_rand(b, l, groups, n, generator=g, scale=0.5), D=_rand(h, generator=g),
                  dt_bias=_rand(h, generator=g, scale=0.1), init=_rand(b, h, p, n, generator=g, scale=0.5))

    def run(backend, x, dt, A, B, C, D, dt_bias, init):
        return kernels.ssd(x, dt, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True,
                           initial_states=init, return_final_states=True, backend=backend)

    _compare(run, inputs)


def test_ssd_with_packed_sequences_matches_the_reference():
    g = torch.Generator().manual_seed(2)
    b, l, h, p, groups, n = 1, 20, 2, 4, 1, 4
    seq_idx = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4], dtype=torch.int32)
    inputs = dict(x=_rand(b, l, h, p, generator=g), dt=torch.rand(b, l, h, generator=g) * 0.5,
                  A=-torch.rand(h, generator=g) - 0.5, B=_rand(b, l, groups, n, generator=g, scale=0.5),
                  C=_rand(b, l, groups, n, generator=g, scale=0.5))

    def run(backend, x, dt, A, B, C):
        return kernels.ssd(x, dt, A, B, C, chunk_size=8, seq_idx=seq_idx, backend=backend)

    _compare(run, inputs)


def test_quasiseparable_run_twice_the_hydra_way_matches_the_reference():
    """Separate backward generators, the shift and a free diagonal: what Hydra's released code computes."""
    g = torch.Generator().manual_seed(3)
    b, l, h, p, groups, n = 1, 19, 2, 4, 1, 4
    inputs = dict(x=_rand(b, l, h, p, generator=g), dt=_rand(b, l, h, generator=g, scale=0.5),
                  dt_bwd=_rand(b, l, h, generator=g, scale=0.5), A=-torch.rand(h, generator=g) - 0.5,
                  B=_rand(b, l, groups, n, generator=g, scale=0.5), C=_rand(b, l, groups, n, generator=g, scale=0.5),
                  B_bwd=_rand(b, l, groups, n, generator=g, scale=0.5),
                  C_bwd=_rand(b, l, groups, n, generator=g, scale=0.5), diag=_rand(b, l, h, generator=g),
                  dt_bias=_rand(h, generator=g, scale=0.1))

    def run(backend, x, dt, dt_bwd, A, B, C, B_bwd, C_bwd, diag, dt_bias):
        return kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_bwd, B_bwd=B_bwd, C_bwd=C_bwd, diag=diag,
                                      shift=True, chunk_size=8, dt_bias=dt_bias, dt_softplus=True, backend=backend)

    _compare(run, inputs)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_directional_scan_with_shift_and_packed_sequences_matches_the_reference(reverse):
    """The flipped segment labels and the shift cut at segment boundaries."""
    g = torch.Generator().manual_seed(4)
    b, l, h, p, groups, n = 2, 13, 2, 4, 1, 4
    seq_idx = torch.tensor([[0] * 5 + [1] * 8, [3] * 9 + [7] * 4])
    inputs = dict(x=_rand(b, l, h, p, generator=g), dt=_rand(b, l, h, generator=g, scale=0.5),
                  A=-torch.rand(h, generator=g) - 0.5, B=_rand(b, l, groups, n, generator=g, scale=0.5),
                  C=_rand(b, l, groups, n, generator=g, scale=0.5))

    def run(backend, x, dt, A, B, C):
        return kernels.directional_scan(x, dt, A, B, C, reverse=reverse, shift=True, chunk_size=8, seq_idx=seq_idx,
                                        dt_softplus=True, backend=backend)

    _compare(run, inputs)


def test_quasiseparable_with_packed_sequences_matches_the_reference():
    """Both directions with the segment labels (flipped for the backward one), shift cut at the boundaries, a
    diagonal and separate backward generators: equal to the reference, values and every gradient."""
    g = torch.Generator().manual_seed(5)
    b, l, h, p, groups, n = 2, 13, 2, 4, 1, 4
    seq_idx = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [3] * 9 + [7] * 4])
    inputs = dict(x=_rand(b, l, h, p, generator=g), dt=_rand(b, l, h, generator=g, scale=0.5),
                  A=-torch.rand(h, generator=g) - 0.5, B=_rand(b, l, groups, n, generator=g, scale=0.5),
                  C=_rand(b, l, groups, n, generator=g, scale=0.5), dt_bwd=_rand(b, l, h, generator=g, scale=0.5),
                  B_bwd=_rand(b, l, groups, n, generator=g, scale=0.5), diag=_rand(b, l, h, generator=g))

    def run(backend, x, dt, A, B, C, dt_bwd, B_bwd, diag):
        return kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_bwd, B_bwd=B_bwd, diag=diag, shift=True,
                                      chunk_size=8, seq_idx=seq_idx, dt_softplus=True, backend=backend)

    _compare(run, inputs)
