"""Our native CPU kernels: C++ beside this file (``mlr_attention.cpp``, ``conv.cpp``, ``norm.cpp``, ``scan.cpp``,
``decode.cpp``, ``common.h``), compiled once per machine into one library that registers
``torch.ops.mixer_plugins_native``.

* ``mlr_forward`` / ``mlr_backward``: fused MLR attention, each group of levels at its own score width (the
  ``native`` engine of ``kernels.mlr_attention``'s ``torch`` backend, :mod:`..mlr_attention.native`);
* ``conv_forward`` / ``conv_backward``: the depthwise short convolution with SiLU fused (the ``native`` backend of
  ``kernels.depthwise_conv1d``, :mod:`..conv.native`);
* ``norm_forward`` / ``norm_backward``: the gated RMSNorm (the ``native`` backend of ``kernels.gated_rmsnorm``,
  :mod:`..norm.native`);
* ``scan_forward`` / ``scan_backward``: the chunked (bi)directional scan, every log decay summed over its own tokens
  (see :mod:`..scan.native`);
* ``ssd_decode``: one decoding step of an SSD-style block, the short convolution's and the state's updates fused
  (the ``native`` backend of ``kernels.ssd_decode_step``, :mod:`..decode.native`).

Each is called from inside our ``torch.library`` custom ops or autograd Functions, so ``torch.compile``,
``torch.export`` and ``FlopCounterMode`` see our registered ops, whichever code runs inside. Outputs are plain
torch allocations.

**Build.** The library is built once for everything that determines the binary: the sources' contents, the torch
version, the compiler (``$CXX``, else ``c++``: its resolved path and its ``--version``) and flags, and the CPU (the
kernels are compiled with ``-march=native``: vendor, family, model and instruction-set flags). These name its
folder under :func:`cache_root` (``$TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/torch_extensions``, else
``~/.cache/torch_extensions``), so another checkout of the same sources, another virtual environment with the same
torch, or a cache shared by several machines each finds the build that fits it, and never one made for another CPU.

Where that folder holds a complete build, :func:`load` checks the library against the SHA-256 recorded when it was
built and loads it with :func:`torch.ops.load_library`: no compiler or build tool runs. Otherwise one process builds
it (it says so on stderr: a minute or two) while the others wait: the build runs under an exclusive ``flock`` on
``<folder>.lock``, which the kernel releases when its holder exits however it exits, so a killed build never leaves
a lock behind. It compiles the sources (copied into a temporary folder beside the final one, in parallel, without
ninja) and links them against ``libtorch``, writes the checksum, and renames the temporary folder into place: a
folder under the final name is always complete. A library that fails its checksum or fails to load is rebuilt
once; if that fails too, or the build fails, one ``RuntimeWarning`` names the cause and the callers keep their
PyTorch code. ``mixer-plugins env --build`` builds ahead of time. ``MIXER_PLUGINS_NATIVE=0`` in the environment
never builds or loads it.

The matrix products call the BLAS that ``libtorch_cpu`` exports (``sgemm_``/``dgemm_``: MKL in the x86 wheels); the
elementwise loops use AVX-512 or AVX2 where the compiler targets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch

try:
    import fcntl
except ImportError:  # not POSIX: builds are still renamed into place, but two may run at once
    fcntl = None  # type: ignore[assignment]

__all__ = ["CFLAGS", "ENV_VAR", "HEADERS", "LIBRARY", "OPS", "SOURCES", "build_folder", "cache_root", "is_loaded",
           "load", "unavailable_reason"]

#: set to ``0`` (or ``false``/``no``/``off``) to never build or load the kernels
ENV_VAR = "MIXER_PLUGINS_NATIVE"
#: the ops the library registers under ``torch.ops.mixer_plugins_native``
OPS = ("mlr_forward", "mlr_backward", "conv_forward", "conv_backward", "norm_forward", "norm_backward", "scan_forward",
       "scan_backward", "ssd_decode")
#: the C++ sources of the library, compiled one object each
SOURCES = tuple(Path(__file__).with_name(name) for name in ("mlr_attention.cpp", "conv.cpp", "norm.cpp", "scan.cpp",
                                                                "decode.cpp"))
#: headers the sources include (part of the build's key)
HEADERS = (Path(__file__).with_name("common.h"),)
#: compiler flags besides torch's include folders and its C++ ABI
CFLAGS = ("-std=c++17", "-fPIC", "-O3", "-march=native", "-fopenmp")
#: linker flags besides torch's library folder
LDFLAGS = ("-shared", "-fopenmp", "-lc10", "-ltorch_cpu", "-ltorch")
#: the library's file name inside its build folder
LIBRARY = "libmixer_plugins_native.so"
_MANIFEST = "manifest.json"
_LOCK = threading.Lock()
_STATE: dict[str, Optional[str] | bool] = {"tried": False, "error": None}


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def is_loaded() -> bool:
    """Whether the kernels are built and registered in this process (never builds; safe under ``torch.compile``)."""
    return bool(_STATE["tried"]) and _STATE["error"] is None


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` failed (None if it succeeded or was not tried)."""
    return _STATE["error"]  # type: ignore[return-value]


def load() -> bool:
    """Load the kernels (building them first where this machine has no build yet); True when
    ``torch.ops.mixer_plugins_native`` is ready.

    Thread-safe and tried once per process: a failure warns once and returns False from then on."""
    if _STATE["tried"]:
        return _STATE["error"] is None
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["error"] is None
        error = None
        if _disabled():
            error = f"disabled by {ENV_VAR}={os.environ.get(ENV_VAR)}"
        else:
            try:
                _build()
            except Exception as exc:  # noqa: BLE001  (a compiler, linker, file system or loader failure of any kind)
                error = f"{type(exc).__name__}: {_summary(str(exc))}"
                warnings.warn(f"mixer_plugins: the native CPU kernels (fused MLR attention, the scan, the short "
                              f"convolution, the gated norm) could not be built or loaded ({error}); their PyTorch "
                              f"code runs instead (MLR attention about 1.4x slower, the SSM blocks 10-20%). They "
                              f"need a C++17 compiler with OpenMP; set {ENV_VAR}=0 to skip the build.",
                              RuntimeWarning, stacklevel=3)
        _STATE["error"] = error
        _STATE["tried"] = True
        return error is None


def _summary(message: str) -> str:
    """The line of a build failure that says what went wrong (a compiler's ``error:`` line if any), shortened."""
    lines = [" ".join(line.split()) for line in message.splitlines() if line.strip()]
    causes = [line for line in lines if re.search(r"error:|not found|no such file|undefined symbol", line, re.I)]
    wanted = [line for line in lines if "error" in line.lower() and not line.startswith("ninja: build stopped")]
    line = (causes or wanted or lines or [repr(message)])[0]
    return line if len(line) <= 300 else line[:297] + "..."


# -- the build's key -------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """The folder that holds the builds: torch's extension folder (``$TORCH_EXTENSIONS_DIR``, else
    ``$XDG_CACHE_HOME/torch_extensions``, else ``~/.cache/torch_extensions``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's vendor, family, model and instruction-set flags (Linux's
    ``/proc/cpuinfo``; elsewhere what :mod:`platform` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first processor's entry
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("vendor_id", "cpu family", "model", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in keys)


def _compiler() -> list[str]:
    """The C++ compiler command (``$CXX``, else ``c++``, as torch's extensions choose it), its program resolved to
    a real path; RuntimeError when there is none."""
    command = shlex.split(os.environ.get("CXX") or "c++")
    found = shutil.which(command[0]) if command else None
    if found is None:
        raise RuntimeError(f"C++ compiler not found: {command[0] if command else '$CXX'!r} is not on PATH "
                           "(install g++, or set CXX)")
    return [os.path.realpath(found), *command[1:]]


def _compiler_version(compiler: list[str]) -> str:
    out = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or out.stderr.strip()


@dataclasses.dataclass(frozen=True)
class _Build:
    """One build: the sources' bytes (read once: what is hashed is what is compiled), the compiler and the key."""

    sources: dict[str, bytes]
    compiler: list[str]
    key: dict[str, str]

    @classmethod
    def here(cls) -> _Build:
        sources = {path.name: path.read_bytes() for path in (*SOURCES, *HEADERS)}
        compiler = _compiler()
        digest = hashlib.sha256()
        for name in sorted(sources):
            digest.update(name.encode() + b"\0" + hashlib.sha256(sources[name]).digest())
        key = {
            "sources": digest.hexdigest(),
            "torch": f"{torch.__version__} {torch.version.git_version}",
            "compiler": " ".join(compiler) + "\n" + _compiler_version(compiler),
            "flags": " ".join((*CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                               *LDFLAGS)),
            "cpu": _cpu_identity(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
        }
        return cls(sources, compiler, key)

    @property
    def name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        return "mixer_plugins_native_" + re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__).lower() + "_" + digest

    @property
    def folder(self) -> Path:
        return cache_root() / self.name


def _module_name() -> str:
    """The name of this machine's build of the current sources (its folder's name under :func:`cache_root`)."""
    return _Build.here().name


def build_folder() -> Path:
    """The folder that holds (or will hold) the build that fits this machine, torch, compiler and the sources."""
    return _Build.here().folder


# -- loading, and building under the lock ----------------------------------------------------------------------


def _registered() -> bool:
    return bool(OPS) and all(hasattr(torch.ops.mixer_plugins_native, op) for op in OPS)


def _build() -> None:
    """Load this machine's build, building it first where there is none, or where the cached one fails its checksum
    or fails to load (once: a second failure raises, naming both causes)."""
    if _registered():  # loaded already (e.g. ``load`` retried after its state was reset)
        return
    build = _Build.here()
    folder = build.folder
    problem = _try_load(folder)
    if problem is None:
        return
    seen = _stamp(folder)
    with _build_lock(folder):
        now = _stamp(folder)
        if now is not None and now != seen:  # another process built it while this one waited
            problem = _try_load(folder)
            if problem is None:
                return
        _discard(folder)
        try:
            _compile_into(folder, build)
        except Exception as err:
            if seen is None:
                raise
            raise RuntimeError(f"the cached library in {folder} {problem}; rebuilding it failed: "
                               f"{_summary(str(err))}") from err
    second = _try_load(folder)
    if second is not None:
        raise RuntimeError(f"the library built in {folder} {second}"
                           + (f" (the cached one {problem})" if seen is not None else ""))


def _stamp(folder: Path) -> tuple[int, int] | None:
    """Which copy of the build folder is there (its inode and change time; None when there is none)."""
    try:
        st = folder.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _try_load(folder: Path) -> str | None:
    """Load the library in ``folder`` after checking it against the checksum recorded at build time; None when it
    loaded, else what is wrong with it. Raises when it loaded but lacks an op (a rebuild cannot help that)."""
    library = folder / LIBRARY
    try:
        recorded = json.loads((folder / _MANIFEST).read_text())["sha256"]
        actual = _sha256(library)
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"cannot be read ({type(err).__name__}: {err})"
    if actual != recorded:
        return "failed its checksum (truncated or corrupt)"
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        return f"failed to load ({err})"
    missing = [op for op in OPS if not hasattr(torch.ops.mixer_plugins_native, op)]
    if missing:
        raise RuntimeError(f"the native library {library} loaded but registered no {', '.join(missing)} op")
    return None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``folder``'s builds: ``flock`` on ``<folder>.lock``. The kernel releases it when
    the holder closes the file or exits, however it exits; the compilers it starts do not inherit it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(folder.parent / (folder.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say("waiting for another process to finish building the native CPU kernels")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _say(message: str) -> None:
    print(f"mixer_plugins: {message}", file=sys.stderr, flush=True)


def _discard(folder: Path) -> None:
    """Remove a broken build of ``folder`` and what killed builds left beside it (called under the lock). The
    folder is renamed away first, so no process ever sees it half-removed."""
    if folder.exists():
        gone = folder.with_name(f"{folder.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(folder, gone)
    for stale in folder.parent.glob(folder.name + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in folder.parent.glob(folder.name + ".tmp-*"):  # builds that were killed: their lock is free
        shutil.rmtree(stale, ignore_errors=True)


def _compile_into(folder: Path, build: _Build) -> None:
    """Build the library in a temporary folder beside ``folder`` and rename it into place (called under the lock)."""
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's folder is private; a build is readable as torch's own extension builds are
        _say(f"building the native CPU kernels (once per machine, torch version and compiler: a minute or two) in "
             f"{folder}")
        start = time.perf_counter()
        library = _compile(build, tmp)
        manifest = {"library": LIBRARY, "sha256": _sha256(library), "key": build.key}
        _write_synced(tmp / _MANIFEST, json.dumps(manifest, indent=2).encode())
        os.rename(tmp, folder)
        _fsync_folder(folder.parent)
        _say(f"built the native CPU kernels in {time.perf_counter() - start:.0f} s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_folder(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _compile(build: _Build, folder: Path) -> Path:
    """Compile the sources (in parallel, one object each) and link them against libtorch in ``folder``; returns the
    library's path. RuntimeError with the compiler's output when a step fails."""
    import concurrent.futures

    for name, data in build.sources.items():
        (folder / name).write_bytes(data)
    # torch's extension module warns at import that a CUDA build finds no CUDA runtime: not our business here
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension

        includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
        libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    finally:
        cpp_logger.setLevel(level)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    sources = sorted((p.name for p in SOURCES), key=lambda n: -len(build.sources[n]))  # longest first
    objects = [Path(name).with_suffix(".o").name for name in sources]

    def run(command: list[str]) -> None:
        out = subprocess.run(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{shlex.join(command[:1] + command[-4:])} failed:\n{out.stdout}")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(cores, len(sources)))) as pool:
        jobs = [pool.submit(run, [*build.compiler, *CFLAGS, abi, *includes, "-c", src, "-o", obj])
                for src, obj in zip(sources, objects)]
        for job in jobs:
            job.result()
    library = folder / LIBRARY
    run([*build.compiler, *objects, *libraries, *LDFLAGS, "-o", LIBRARY])
    for obj in objects:
        (folder / obj).unlink()
    with open(library, "rb+") as f:
        os.fsync(f.fileno())
    return library
