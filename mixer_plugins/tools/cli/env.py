"""``mixer-plugins env``: versions, devices, and which kernel backend of each op can run here (and why not).

What a bug report needs in one paste: the versions of Python and of every library the mixers may use (read from
the installed metadata, so a missing or broken one is reported, not fatal), the devices torch sees, and per kernel
op and device every backend with either "yes" (``auto`` when the automatic choice may pick it) or the
dispatcher's reason why it cannot run; and whether our native CPU kernels (built at install) load here, or why not.
``env --native`` says only that (``make`` runs it after installing).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

from ..._text import format_table
from .args import Command

__all__ = ["COMMAND", "EXTRAS", "backend_rows", "device_info", "native_status", "versions"]

#: Distribution -> the extra of ours that installs it ("" for a core dependency).
EXTRAS: dict[str, str] = {
    "mixer-plugins": "",
    "torch": "",
    "pydantic": "",
    "timm": "",
    "triton": "",
    "fairseq2": "fairseq2",
    "mamba-ssm": "cuda",
    "matplotlib": "demo",
    "tqdm": "demo",
    "scikit-learn": "demo",
}


def versions() -> dict[str, str | None]:
    """Python's version and each distribution of :data:`EXTRAS` (None when not installed); imports none."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": f"{platform.python_version()} ({sys.executable})"}
    for dist in EXTRAS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _missing(dist: str) -> str:
    extra = EXTRAS.get(dist, "")
    return f"not installed (pip install 'mixer-plugins[{extra}]')" if extra else "not installed"


def device_info() -> dict[str, Any]:
    """What torch sees: CUDA availability and build, and each CUDA device's name and capability."""
    import torch

    info: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "cuda_build": torch.version.cuda,
        "devices": [],
    }
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            info["devices"].append({"device": f"cuda:{index}", "name": torch.cuda.get_device_name(index),
                                    "capability": f"{major}.{minor}"})
    return info


def backend_rows(devices: list[str] | None = None) -> list[dict[str, Any]]:
    """Per device, op and backend the op has: ``available``, ``automatic`` and ``reason`` (why it cannot run), from
    the kernels' :func:`~mixer_plugins.kernels.backend_report`. ``devices``: the CPU, plus CUDA when present."""
    import mixer_plugins.kernels as kernels

    rows: list[dict[str, Any]] = []
    for status in kernels.backend_report(devices):
        if "has no" in status.reason and "implementation" in status.reason:
            continue  # backends the op does not have at all
        rows.append({"device": str(status.device), "op": status.op, "backend": status.backend,
                     "available": bool(status.available), "automatic": bool(status.automatic),
                     "reason": status.reason})
    return rows


def native_status() -> dict[str, Any]:
    """Whether the native CPU kernels (:mod:`mixer_plugins.kernels._native`, built at install) load here, from which
    file and at which vector width, and why not."""
    import torch

    from mixer_plugins.kernels import _native

    ok = _native.load()
    return {"available": ok, "reason": "" if ok else (_native.unavailable_reason() or ""),
            "ops": sorted(_native.OPS) if ok else [], "library": _native.library_path(),
            "vector_lanes": int(torch.ops.mixer_plugins_native.vector_lanes()) if ok else None}


def _native_line(native: dict[str, Any]) -> str:
    if native["available"]:
        return (f"native CPU kernels: loaded ({', '.join(native['ops'])}; float32 vectors of {native['vector_lanes']} "
                f"lanes) from {native['library']}")
    return f"native CPU kernels: unavailable ({native['reason']}); the PyTorch code runs instead"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--native", action="store_true",
                        help="only say whether the native CPU kernels (built at install) load here; exit status 1 "
                             "when they do not")


def run(args: argparse.Namespace) -> int:
    if args.native:
        status = native_status()
        print(json.dumps(status, indent=2) if args.json else _native_line(status))
        return 0 if status["available"] else 1
    found = versions()
    try:
        devices: dict[str, Any] | None = device_info()
        kernels: list[dict[str, Any]] | None = backend_rows()
        native: dict[str, Any] | None = native_status()
        problem = ""
    except ImportError as err:  # torch itself missing or broken: still report the versions
        devices, kernels, native, problem = None, None, None, f"{type(err).__name__}: {err}"
    if args.json:
        print(json.dumps({"versions": found, "devices": devices, "kernels": kernels, "native": native,
                          "problem": problem or None}, indent=2))
        return 0
    print(format_table(("package", "version"),
                       [(name, version or _missing(name)) for name, version in found.items()]))
    print()
    if devices is None:
        print(f"torch cannot be imported: {problem}")
        return 0
    cuda = "yes" if devices["cuda_available"] else "no"
    print(f"CUDA available: {cuda} (torch built with CUDA {devices['cuda_build'] or 'none'})")
    for dev in devices["devices"]:
        print(f"  {dev['device']}: {dev['name']} (compute capability {dev['capability']})")
    print()
    print(format_table(
        ("device", "op", "backend", "can run"),
        [(r["device"], r["op"], r["backend"],
          ("yes, automatic" if r["automatic"] else "yes") if r["available"] else f"no: {r['reason']}")
         for r in kernels or []],
    ))
    print()
    if native:
        print(_native_line(native))
    return 0


COMMAND = Command("versions, devices and which kernel backends can run here (and why not)", run, add_arguments)
