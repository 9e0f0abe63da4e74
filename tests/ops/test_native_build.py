"""Building and loading the native CPU kernels (:mod:`mixer_plugins.kernels._native`): one build per key, shared by
processes that start together, checkouts, virtual environments and build tools; a killed build never hangs a later
process nor leaves a library that is later loaded; a truncated or corrupt cache is rebuilt once, else the PyTorch
code runs after one warning.

The process tests build a small stand-in library (two C++ files, about a second to build) through the same code,
each in its own cache under ``TORCH_EXTENSIONS_DIR``, so that they are quick and never touch the real cache; the
test of other checkouts and environments loads the real kernels."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixer_plugins.kernels import _native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "c++") is None,
                                reason="no C++ compiler: the native kernels cannot be built here")

ROOT = Path(__file__).resolve().parents[2]
BUILDING = "mixer_plugins: building the native CPU kernels"

STUB_SOURCES = {
    "stub_a.cpp": '#include <map>\n#include <string>\n\nint stub_part();\n\n'
                  'extern "C" int stub_answer() {\n  std::map<std::string, int> m{{"a", 40}};\n'
                  '  return m["a"] + stub_part();\n}\n',
    "stub_b.cpp": "#include <vector>\n\nint stub_part() {\n  std::vector<int> v{1, 1};\n  return v[0] + v[1];\n}\n",
}

# Run in each process: load (stand-in sources unless "real"), then check the result of the loaded code.
SCRIPT = """
import ctypes, json, sys, warnings
from pathlib import Path
import torch
from mixer_plugins.kernels import _native

sources, failing = sys.argv[1], "--failing-compiler" in sys.argv
if sources != "real":
    _native.SOURCES = tuple(sorted(Path(sources).glob("*.cpp")))
    _native.HEADERS = tuple(sorted(Path(sources).glob("*.h")))
    _native.OPS = () if sources.endswith("stub") else _native.OPS
if failing:
    def _compile(build, folder):
        raise RuntimeError("c++: error: a compiler that fails")
    _native._compile = _compile
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = _native.load()
correct = None
if ok and not _native.OPS:
    correct = ctypes.CDLL(str(_native.build_folder() / _native.LIBRARY)).stub_answer() == 42
elif ok:
    from mixer_plugins.kernels.norm.reference import gated_rmsnorm_reference
    y, z, w = torch.randn(5, 16), torch.randn(5, 16), torch.rand(16) + 0.5
    out = torch.ops.mixer_plugins_native.norm_forward(y, z, w, 1e-5, True)
    correct = bool(torch.allclose(out, gated_rmsnorm_reference(y, z, w, 1e-5, True), atol=1e-5, rtol=1e-5))
print(json.dumps({"ok": ok, "correct": correct, "folder": str(_native.build_folder()),
                  "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("script") / "load_native.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def stub(tmp_path_factory) -> Path:
    """The stand-in sources (the folder's name ends in ``stub``: the script then expects no ops)."""
    folder = tmp_path_factory.mktemp("sources") / "stub"
    folder.mkdir()
    for name, text in STUB_SOURCES.items():
        (folder / name).write_text(text)
    return folder


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != _native.ENV_VAR}
    env.update(TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                        env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def _start(script: Path, sources: Path | str, cache: Path, *args: str, python: str = sys.executable,
           **env: str) -> subprocess.Popen:
    return subprocess.Popen([python, str(script), str(sources), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(cache, **env), start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[dict, str]:
    """The process's report and stderr; fails (after killing it) when it does not finish within ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"a process loading the native kernels hung for {timeout} s")
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _load(script: Path, sources: Path | str, cache: Path, *args: str, timeout: float = 300, **env: str):
    return _finish(_start(script, sources, cache, *args, **env), timeout)


def _builds(*stderrs: str) -> int:
    return sum(err.count(BUILDING) for err in stderrs)


def _valid(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        return manifest["sha256"] == _native._sha256(folder / _native.LIBRARY)
    except (OSError, ValueError, KeyError):
        return False


def _lock_is_free(folder: Path) -> bool:
    import fcntl

    lock = folder.parent / (folder.name + ".lock")
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def built(script, stub, tmp_path_factory) -> tuple[Path, Path, float]:
    """One build of the stand-in: (its cache, its folder, the seconds from the build's first line to its last)."""
    cache = tmp_path_factory.mktemp("built")
    proc = _start(script, stub, cache)
    assert _wait_for_line(proc, BUILDING, timeout=120)
    start = time.perf_counter()
    assert _wait_for_line(proc, "built the native CPU kernels", timeout=120)
    seconds = max(0.5, time.perf_counter() - start)
    report, err = _finish(proc)
    assert report["ok"] and report["correct"] and _builds(err) == 0, (report, err)  # (its lines were read above)
    folder = Path(report["folder"])
    assert folder.parent == cache and _valid(folder)
    assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, folder.name + ".lock"])  # no leftovers
    return cache, folder, seconds


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> bool:
    """Read ``proc``'s stderr until it holds ``text`` (True), or it ends or ``timeout`` passes (False). What was read
    is kept in ``proc.seen`` (and not returned by ``communicate``)."""
    seen = getattr(proc, "seen", "")
    deadline = time.monotonic() + timeout
    fd = proc.stderr.fileno()
    while text not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk.decode(errors="replace")
    proc.seen = seen  # type: ignore[attr-defined]
    return text in seen


# -- the key --------------------------------------------------------------------------------------------------


def test_the_key_follows_what_determines_the_binary_and_nothing_else(tmp_path, monkeypatch):
    name = _native._module_name()
    assert name.startswith("mixer_plugins_native_") and _native.build_folder() == _native.cache_root() / name

    # another checkout of the same sources, another ninja (or none) on PATH, another working folder: the same build
    copy = tmp_path / "checkout"
    copy.mkdir()
    for path in (*_native.SOURCES, *_native.HEADERS):
        shutil.copy(path, copy / path.name)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    with monkeypatch.context() as m:
        m.setattr(_native, "SOURCES", tuple(copy / p.name for p in _native.SOURCES))
        m.setattr(_native, "HEADERS", tuple(copy / p.name for p in _native.HEADERS))
        m.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
        m.chdir(tmp_path)
        assert _native._module_name() == name
        (copy / "common.h").write_bytes((copy / "common.h").read_bytes() + b"\n// changed\n")
        assert _native._module_name() != name                 # the sources' contents (a header's too)

    for attribute, value in [("_cpu_identity", lambda: "vendor_id : OtherVendor\nflags : sse2 avx2"),
                             ("_compiler_version", lambda compiler: "g++ (Other) 99.1"),
                             ("CFLAGS", (*_native.CFLAGS, "-ffast-math"))]:
        with monkeypatch.context() as m:
            m.setattr(_native, attribute, value)
            assert _native._module_name() != name, attribute
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "9.9.9")
        assert _native._module_name() != name
    with monkeypatch.context() as m:
        m.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
        assert _native.build_folder() == tmp_path / "elsewhere" / name


# -- processes ------------------------------------------------------------------------------------------------


def test_processes_started_together_build_once_and_all_load_it(script, stub, tmp_path):
    procs = [_start(script, stub, tmp_path) for _ in range(4)]
    results = [_finish(p) for p in procs]
    assert all(report["ok"] and report["correct"] for report, _ in results), results
    assert _builds(*(err for _, err in results)) == 1, [err for _, err in results]
    report, err = _load(script, stub, tmp_path)                # a later process loads it, building nothing
    assert report["correct"] and _builds(err) == 0 and not err.strip(), err


def test_a_killed_build_never_hangs_a_later_process_nor_leaves_a_broken_library(script, stub, built, tmp_path):
    """SIGKILL and SIGTERM at random points of the build (to the process alone, or to its group as ``timeout``,
    Slurm and ``docker stop`` do), then fresh processes with a timeout: they finish, with the right result."""
    seconds = built[2]
    rng = random.Random(0)
    killed = 0
    kills = [(signal.SIGKILL, False, 0.0), (signal.SIGTERM, True, None), (signal.SIGKILL, True, None),
             (signal.SIGTERM, False, None), (signal.SIGKILL, False, None), (signal.SIGTERM, True, 0.0)]
    for sig, group, delay in kills:  # (signal, to the process group, seconds after the build's first line)
        proc = _start(script, stub, tmp_path)
        assert _wait_for_line(proc, BUILDING, timeout=120)
        time.sleep(rng.uniform(0.0, 1.1 * seconds) if delay is None else delay)
        if proc.poll() is None:
            (os.killpg if group else os.kill)(proc.pid, sig)
            killed += 1
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
        folder = next(p for p in tmp_path.iterdir() if p.suffix == ".lock").with_suffix("")
        assert _lock_is_free(folder), "a killed build left its lock held"
        if folder.exists():           # the build was complete when the signal came: it must be whole; start again
            assert _valid(folder), "a folder under the final name holds a broken library"
            shutil.rmtree(folder)
    assert killed >= 4
    procs = [_start(script, stub, tmp_path) for _ in range(2)]
    results = [_finish(p, timeout=120) for p in procs]
    assert all(report["ok"] and report["correct"] for report, _ in results), results
    assert _builds(*(err for _, err in results)) == 1  # (a complete build was removed after each kill)


def _copy(built: tuple[Path, Path, float], to: Path) -> Path:
    cache, folder, _ = built
    shutil.copytree(cache, to)
    return to / folder.name


def test_a_truncated_or_corrupt_cached_library_is_rebuilt_once(script, stub, built, tmp_path):
    folders = {kind: _copy(built, tmp_path / kind) for kind in ("truncated", "garbage", "unloadable", "manifest")}
    library = _native.LIBRARY
    data = (folders["truncated"] / library).read_bytes()
    (folders["truncated"] / library).write_bytes(data[: len(data) // 2])
    (folders["garbage"] / library).write_bytes(random.Random(1).randbytes(len(data)))
    # garbage whose checksum was recorded: it passes the check and fails to load
    (folders["unloadable"] / library).write_bytes(b"\x7fELF" + random.Random(2).randbytes(len(data)))
    manifest = json.loads((folders["unloadable"] / "manifest.json").read_text())
    manifest["sha256"] = _native._sha256(folders["unloadable"] / library)
    (folders["unloadable"] / "manifest.json").write_text(json.dumps(manifest))
    (folders["manifest"] / "manifest.json").write_text("{not json")
    procs = {kind: _start(script, stub, folder.parent) for kind, folder in folders.items()}
    for kind, proc in procs.items():
        report, err = _finish(proc, timeout=120)
        assert report["ok"] and report["correct"] and not report["warnings"], (kind, report, err)
        assert _builds(err) == 1 and _valid(folders[kind]), (kind, err)


def test_a_cached_library_whose_rebuild_fails_falls_back_with_one_warning_naming_the_cause(script, stub, built,
                                                                                          tmp_path):
    folder = _copy(built, tmp_path / "cache")
    data = (folder / _native.LIBRARY).read_bytes()
    (folder / _native.LIBRARY).write_bytes(data[:100])
    report, err = _load(script, stub, folder.parent, "--failing-compiler", timeout=120)
    assert not report["ok"] and len(report["warnings"]) == 1, report
    warning = report["warnings"][0]
    assert "failed its checksum" in warning and "a compiler that fails" in warning and "PyTorch" in warning
    assert not folder.exists()                                  # the broken library is never loaded later


def test_another_checkout_venv_or_ninja_loads_the_existing_build(script, tmp_path):
    """The real kernels: once built (here, by this process, in the usual cache), a process of another checkout of
    the same sources, through a symlinked virtual environment, with a failing ``ninja`` first on PATH, loads them
    without building anything."""
    assert _native.load(), _native.unavailable_reason()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for path in (*_native.SOURCES, *_native.HEADERS):
        shutil.copy(path, checkout / path.name)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\necho 'not this ninja' >&2\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    python = sys.executable
    if sys.prefix != sys.base_prefix:  # in a virtual environment: reach it through a symlink
        (tmp_path / "venv").symlink_to(sys.prefix, target_is_directory=True)
        python = str(tmp_path / "venv" / Path(sys.executable).relative_to(sys.prefix))
    cache = _native.cache_root()
    report, err = _load(script, checkout, cache, python=python, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert report["ok"] and report["correct"] and _builds(err) == 0, (report, err)
    assert Path(report["folder"]) == _native.build_folder()
