"""The native CPU kernels (:mod:`mixer_plugins.kernels._native`) are built at install and only loaded at run time:
a fresh process runs them without compiling anything; where they were not built (or cannot load) the callers say
why and keep their PyTorch code; ``setup.py`` leaves them out, without failing, where they cannot be built."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mixer_plugins.kernels import _native
from mixer_plugins.kernels._native_check import native_unavailable

ROOT = Path(__file__).resolve().parents[2]


def _require_installed() -> None:
    if not _native.load():
        pytest.skip(f"the native CPU kernels are not installed here ({_native.unavailable_reason()})")


@pytest.fixture
def fresh_state(monkeypatch):
    """:func:`_native.load` tried anew in this test (the process's own state restored afterwards)."""
    monkeypatch.setattr(_native, "_STATE", {"tried": False, "error": None})


# Run in a fresh process: a quasiseparable mixer's first forward and backward, under the profiler.
FIRST_CALL = """
import json, sys
import torch
import mixer_plugins as mp

torch.manual_seed(0)
mixer = mp.create_mixer("quasiseparable", 64)
x = torch.randn(2, 48, 64, requires_grad=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    mixer(x).square().sum().backward()
ops = sorted({e.key for e in prof.key_averages() if e.key.startswith("mixer_plugins_native::")})
print(json.dumps({"ops": ops, "finite": bool(torch.isfinite(x.grad).all()),
                  "modules": [m for m in sys.modules if m.startswith("torch.utils.cpp_extension")]}))
"""


def test_a_fresh_process_runs_the_native_kernels_without_building(tmp_path):
    """An empty ``TORCH_EXTENSIONS_DIR``, compilers on ``PATH`` that record any call and fail: the first
    quasiseparable forward and backward run the native scan, nothing is compiled and nothing written there."""
    _require_installed()
    extensions, bin_dir, calls = tmp_path / "torch_extensions", tmp_path / "bin", tmp_path / "compiler_calls"
    extensions.mkdir()
    bin_dir.mkdir()
    for name in ("c++", "g++", "gcc", "cc", "clang++", "ninja"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {calls}\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (_native.ENV_VAR, "MIXER_PLUGINS_BACKEND")}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), CXX=str(bin_dir / "c++"), PATH=f"{bin_dir}{os.pathsep}"
               f"{env.get('PATH', '')}", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"mixer_plugins_native::scan_forward", "mixer_plugins_native::scan_backward"} <= set(report["ops"]), report
    assert report["finite"]
    assert not calls.exists(), calls.read_text()            # no compiler, no ninja
    assert not any(extensions.iterdir())                    # nothing built into torch's extension folder
    assert report["modules"] == [], report                  # torch's extension builder never imported


def test_the_vector_code_is_as_wide_as_the_machine():
    """ATen's vectors in the kernels are as wide as torch's own CPU kernels here: 16 float32 lanes with AVX-512,
    8 with AVX2 (the extension is compiled for the machine it is installed on)."""
    _require_installed()
    lanes = torch.ops.mixer_plugins_native.vector_lanes()
    capability = torch.backends.cpu.get_cpu_capability()
    expected = {"AVX512": 16, "AVX2": 8}.get(capability)
    if expected is None:
        pytest.skip(f"torch's CPU capability here is {capability}: no x86 vector width to compare with")
    assert lanes == expected, (lanes, capability)


def test_not_built_says_why_and_how_without_a_warning(fresh_state, monkeypatch):
    def not_built():
        raise ModuleNotFoundError("No module named 'mixer_plugins.kernels._native._C'",
                                  name="mixer_plugins.kernels._native._C")

    monkeypatch.setattr(_native, "_import", not_built)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _native.load() and not _native.is_loaded()
    reason = native_unavailable(torch.device("cpu"))
    assert reason is not None and "not built" in reason and "--no-build-isolation" in reason, reason
    assert _native.library_path() is None


def test_a_library_that_cannot_load_warns_once_naming_the_cause(fresh_state, monkeypatch):
    def stale():
        raise ImportError("_C.so: undefined symbol: _ZN2at4_ops10empty_like4callE")

    monkeypatch.setattr(_native, "_import", stale)
    with pytest.warns(RuntimeWarning, match="cannot be loaded.*undefined symbol"):
        assert not _native.load()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # once only
        assert not _native.load()
    assert "undefined symbol" in native_unavailable(torch.device("cpu"))


def test_the_environment_variable_keeps_them_unloaded(fresh_state, monkeypatch):
    monkeypatch.setenv(_native.ENV_VAR, "0")
    monkeypatch.setattr(_native, "_import", lambda: pytest.fail("loaded although disabled"))
    assert not _native.load()
    assert _native.ENV_VAR in _native.unavailable_reason()


@pytest.mark.parametrize("case", ["here", "disabled", "no compiler"])
def test_setup_leaves_the_kernels_out_where_they_cannot_be_built(case, tmp_path):
    """``setup.py`` declares the extension where torch and a compiler are at hand; without them (switched off, or no
    compiler) the package is pure Python, and it says why."""
    env = {k: v for k, v in os.environ.items() if k != _native.ENV_VAR}
    if case == "here" and shutil.which(shlex.split(env.get("CXX") or "c++")[0]) is None:
        pytest.skip("no C++ compiler here")
    if case == "disabled":
        env[_native.ENV_VAR] = "0"
    elif case == "no compiler":
        env["CXX"] = str(tmp_path / "no-such-compiler")
    code = ("import runpy, setuptools; seen = {}; setuptools.setup = lambda **kw: seen.update(kw); "
            "runpy.run_path('setup.py', run_name='__main__'); print(len(seen['ext_modules']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("1" if case == "here" else "0")
    if case != "here":
        assert ("MIXER_PLUGINS_NATIVE=0" if case == "disabled" else "no C++ compiler") in out.stderr
