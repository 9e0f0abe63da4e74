"""Builds mixer-plugins with its native CPU kernels (``mixer_plugins/kernels/_native/*.cpp``) compiled into the
extension ``mixer_plugins.kernels._native._C`` by ``torch.utils.cpp_extension``; the metadata is in pyproject.toml.

The extension is optional: an install without torch in the build environment (pip's default build isolation), without
a C++17 compiler with OpenMP, or with ``MIXER_PLUGINS_NATIVE=0`` is pure Python, and the kernels' PyTorch code runs.
Build against the installed torch with ``pip install --no-build-isolation -e .`` (``make setup`` does). The kernels are
compiled with ``-march=native`` on x86-64: the build is for the machine it runs on.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
NATIVE = Path("mixer_plugins", "kernels", "_native")


def _say(message: str) -> None:
    print(f"mixer-plugins: {message}", file=sys.stderr, flush=True)


def _native_extension() -> tuple[list, dict]:
    """The extension and the build command that compiles it, or nothing (and why, on stderr)."""
    if os.environ.get("MIXER_PLUGINS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        _say("MIXER_PLUGINS_NATIVE=0: the native CPU kernels are not built")
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say("torch is not installed in the build environment: the native CPU kernels are not built (install torch "
             "first, then this package with pip's --no-build-isolation)")
        return [], {}
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    if not compiler or shutil.which(compiler[0]) is None:
        _say("no C++ compiler ($CXX or c++): the native CPU kernels are not built")
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """A failed compile leaves the package without the kernels instead of failing the install."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as err:  # noqa: BLE001  (a compiler or linker failure of any kind)
                _say(f"the native CPU kernels could not be built ({type(err).__name__}: {err}); the PyTorch code "
                     "runs instead")

    flags = ["-O3", "-std=c++17", "-fopenmp", "-Wno-unknown-pragmas"]  # (pragmas for other compilers in ATen)
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")  # AVX-512 or AVX2 + FMA: ATen's vectors at this machine's width (common.h)
    extension = CppExtension(
        name="mixer_plugins.kernels._native._C",
        sources=sorted(str(p.relative_to(HERE)) for p in (HERE / NATIVE).glob("*.cpp")),
        depends=[str(NATIVE / "common.h")],
        extra_compile_args={"cxx": flags},
        extra_link_args=["-fopenmp"],
    )
    return [extension], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _native_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
