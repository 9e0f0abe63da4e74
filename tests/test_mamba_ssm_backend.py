"""The ``mamba_ssm`` backends: mamba-ssm's Triton SSD loaded without its CUDA extensions, and clear reasons.

CI has no mamba-ssm: the loader is checked on a fake installed package built in ``tmp_path`` (its ``__init__``
fails like mamba-ssm's without ``selective_scan_cuda``). Where mamba-ssm's files are importable (a wheel built with
``MAMBA_SKIP_CUDA_BUILD=TRUE`` on the path), its own kernels run on CPU under ``TRITON_INTERPRET=1`` against our
``reference`` backend, in a fresh interpreter (``tests/test_mamba_ssm_kernels.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_helpers import assert_passes_fresh

from mixer_plugins import kernels
from mixer_plugins.kernels import _mamba_loader
from mixer_plugins.kernels._requirements import mamba_ssm_unavailable

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    return importlib.import_module(name)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


INIT_FAILS = """
    import mamba_ssm.utils.early          # imported before the failure: left in sys.modules by Python
    import mamba_ssm_missing_cuda_extension   # like `import selective_scan_cuda` without the CUDA build
"""
MUST_NOT_RUN = "raise RuntimeError('a package __init__ ran')\n"
COMBINED = """
    from mamba_ssm.ops.triton.helper import twice
    from mamba_ssm.utils.early import MARK


    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, **kwargs):
        return twice(x) + MARK
"""


@pytest.fixture
def fake_mamba(tmp_path, monkeypatch):
    """A fake installed mamba-ssm whose package ``__init__`` files fail; returns its site folder."""
    _write(tmp_path, {
        "mamba_ssm/__init__.py": INIT_FAILS,
        "mamba_ssm/utils/__init__.py": "",
        "mamba_ssm/utils/early.py": "MARK = 0.0\n",
        "mamba_ssm/ops/__init__.py": MUST_NOT_RUN,
        "mamba_ssm/ops/triton/__init__.py": MUST_NOT_RUN,
        "mamba_ssm/ops/triton/helper.py": "def twice(x):\n    return 2 * x\n",
        "mamba_ssm/ops/triton/ssd_combined.py": COMBINED,
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_mamba_loader, "REQUIRED", ("torch",))  # CI has neither einops nor mamba-ssm's other needs
    saved = {n: m for n, m in sys.modules.items() if n == "mamba_ssm" or n.startswith("mamba_ssm.")}
    for name in saved:
        del sys.modules[name]
    importlib.invalidate_caches()
    _mamba_loader.forget()
    yield tmp_path
    _mamba_loader.forget()
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]
    sys.modules.update(saved)
    importlib.invalidate_caches()


def test_the_loader_loads_the_kernels_without_running_any_package_init(fake_mamba):
    with pytest.raises(ImportError, match="mamba_ssm_missing_cuda_extension"):
        import mamba_ssm  # noqa: F401  (the ordinary import fails, as mamba-ssm's does without its extensions)
    left_over = sys.modules["mamba_ssm.utils.early"]   # what Python keeps of the failed import
    before = {n: m for n, m in sys.modules.items() if n.startswith("mamba_ssm")}

    module = _mamba_loader.load()
    assert module.__file__ == str(fake_mamba / "mamba_ssm" / "ops" / "triton" / "ssd_combined.py")
    assert _mamba_loader.loaded_without_init("ops.triton.ssd_combined")
    assert module.mamba_chunk_scan_combined(torch.ones(2), None, None, None, None, 4).tolist() == [2.0, 2.0]
    assert _mamba_loader.load() is module  # cached
    # sys.modules is as it was: a later ordinary import fails as it did, and finds the same left-overs
    assert {n: m for n, m in sys.modules.items() if n.startswith("mamba_ssm")} == before
    assert sys.modules["mamba_ssm.utils.early"] is left_over
    assert not any(isinstance(f, _mamba_loader._Finder) for f in sys.meta_path)
    with pytest.raises(ImportError, match="mamba_ssm_missing_cuda_extension"):
        import mamba_ssm  # noqa: F401,F811


def test_the_backends_run_the_loaded_kernels(fake_mamba):
    from mixer_plugins.kernels.quasiseparable import QuasiseparableArgs
    from mixer_plugins.kernels.ssd import SSDArgs

    x, dt, A, B, C = torch.randn(1, 5, 2, 3), torch.rand(1, 5, 2), -torch.rand(2), *torch.randn(2, 1, 5, 1, 4)
    ssd_backend = _module("mixer_plugins.kernels.ssd.mamba_ssm").BACKEND
    torch.testing.assert_close(ssd_backend.impl(SSDArgs(x, dt, A, B, C, chunk_size=4)), 2 * x)
    qs_backend = _module("mixer_plugins.kernels.quasiseparable.mamba_ssm").BACKEND
    # the fake kernel doubles its input: run on the sequence and on its flip, shifted, the parts are 2x[i-1], 2x[i+1]
    y = qs_backend.impl(QuasiseparableArgs(x, dt, A, B, C, dt, A, B, C, shift=True, chunk_size=4))
    expected = torch.zeros_like(x)
    expected[:, 1:] += 2 * x[:, :-1]
    expected[:, :-1] += 2 * x[:, 1:]
    torch.testing.assert_close(y, expected)
    # one direction, shifted, packed: the shift never carries a token into the next segment
    from mixer_plugins.kernels.directional_scan import DirectionalScanArgs

    ds_backend = _module("mixer_plugins.kernels.directional_scan.mamba_ssm").BACKEND
    seq_idx = torch.tensor([[0, 0, 1, 1, 1]])
    for reverse, source, cut in ((False, [None, 0, None, 2, 3], 2), (True, [1, None, 3, 4, None], 1)):
        y = ds_backend.impl(DirectionalScanArgs(x, dt, A, B, C, reverse=reverse, shift=True, chunk_size=4,
                                                seq_idx=seq_idx))
        expected = torch.stack([2 * x[:, j] if j is not None else torch.zeros_like(x[:, 0]) for j in source], 1)
        torch.testing.assert_close(y, expected, msg=f"reverse={reverse}")
        assert y[:, cut].abs().sum() == 0
    # both directions, shifted, packed: neither direction's shift crosses the segment boundary
    y = qs_backend.impl(QuasiseparableArgs(x, dt, A, B, C, dt, A, B, C, shift=True, chunk_size=4, seq_idx=seq_idx))
    expected = torch.zeros_like(x)
    for i, j in ((1, 0), (3, 2), (4, 3)):      # forward part: x[i-1] within a segment
        expected[:, i] += 2 * x[:, j]
    for i, j in ((0, 1), (2, 3), (3, 4)):      # backward part: x[i+1] within a segment
        expected[:, i] += 2 * x[:, j]
    torch.testing.assert_close(y, expected)
    # installed and loadable, but CPU tensors: refused, saying why
    with pytest.raises(kernels.BackendUnavailableError, match="need CUDA tensors"):
        kernels.ssd(x, dt, A, B, C, 4, backend="mamba_ssm")


def test_an_ordinary_import_is_used_when_the_package_imports(fake_mamba):
    (fake_mamba / "mamba_ssm" / "__init__.py").write_text("IMPORTED = True\n")
    for name in ("ops", "ops/triton"):
        (fake_mamba / "mamba_ssm" / name / "__init__.py").write_text("")
    module = _mamba_loader.load()
    assert not _mamba_loader.loaded_without_init("ops.triton.ssd_combined")
    assert sys.modules["mamba_ssm.ops.triton.ssd_combined"] is module and sys.modules["mamba_ssm"].IMPORTED


def test_a_load_that_fails_both_ways_says_why_and_is_remembered(fake_mamba):
    (fake_mamba / "mamba_ssm" / "ops" / "triton" / "helper.py").write_text("import einops_missing_here\n")
    with pytest.raises(ImportError) as info:
        _mamba_loader.load()
    text = str(info.value)
    assert "mamba_ssm_missing_cuda_extension" in text and "einops_missing_here" in text
    (fake_mamba / "mamba_ssm" / "ops" / "triton" / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    with pytest.raises(ImportError, match="einops_missing_here"):
        _mamba_loader.load()  # remembered: no second attempt
    assert not any(n.startswith("mamba_ssm.ops") for n in sys.modules)


def test_the_reasons_name_what_is_missing(fake_mamba, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "need CUDA tensors" in mamba_ssm_unavailable(cpu)
    if not torch.cuda.is_available():
        assert "no CUDA device" not in mamba_ssm_unavailable(cuda) and "finds none" in mamba_ssm_unavailable(cuda)
    monkeypatch.setattr(_mamba_loader, "REQUIRED", ("torch", "triton_not_here_either", "einops_not_here"))
    reason = mamba_ssm_unavailable(cuda)
    assert "triton_not_here_either" in reason and "einops_not_here" in reason and "torch," not in reason
    monkeypatch.setattr(_mamba_loader, "distribution_folder", lambda: None)
    assert "mamba-ssm is not installed" in mamba_ssm_unavailable(cuda)
    x, dt, A, B, C = torch.randn(1, 4, 2, 3), torch.rand(1, 4, 2), -torch.rand(2), *torch.randn(2, 1, 4, 1, 5)
    with pytest.raises(kernels.BackendUnavailableError, match="mamba-ssm is not installed"):
        kernels.ssd(x, dt, A, B, C, 4, backend="mamba_ssm")
    with pytest.raises(kernels.BackendUnavailableError, match="mamba-ssm is not installed"):
        kernels.quasiseparable(x, dt, A, B, C, backend="mamba_ssm")
    with pytest.raises(kernels.BackendUnavailableError, match="mamba-ssm is not installed"):
        kernels.directional_scan(x, dt, A, B, C, backend="mamba_ssm")


def test_probing_on_the_cpu_imports_no_mamba_ssm():
    before = {n for n in sys.modules if n.startswith("mamba_ssm")}
    kernels.backend_report(["cpu"])
    kernels.available_backends("ssd", "cpu")
    assert {n for n in sys.modules if n.startswith("mamba_ssm")} == before


# -- mamba-ssm's own kernels, where its files are here ---------------------------------------------------

def _why_not_runnable() -> str | None:
    reason = _mamba_loader.unavailable_reason()
    if reason is not None:
        return reason
    if torch.cuda.is_available():
        return "with CUDA, tests/test_gpu.py runs mamba-ssm's kernels on the GPU"
    return None


@pytest.mark.triton
def test_mamba_ssm_kernels_match_the_reference_under_the_interpreter():
    reason = _why_not_runnable()
    if reason is not None:
        pytest.skip(reason)
    assert_passes_fresh("test_mamba_ssm_kernels.py", {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_MAMBA_FRESH": "1"},
                        timeout=1500, allow_skips=False)
