"""The GPU check's first step after the install: can this Python import mixer_plugins and build what the check
measures? Fails fast, with one line saying what is missing and which carried wheel provides it.

    python benchmarks/gpu/import_check.py --out OUT [--wheels .whl] [--dry]

Checks, in order: the versions of the distributions the check uses; a CUDA device (not with ``--dry``);
``import mixer_plugins`` from this checkout (it needs ``wrapt``, and ``pydantic`` for the mixers' configs: the
GPU machine lacks both, ``run.sh`` installs them from the carried wheels); the built-in mixers the check measures,
found through the entry points of mixer-plugins' own wheel; a Hydra mixer and a tiny ``vit_base`` with
``mixer='quasi'`` built through timm. Writes ``OUT/environment.json`` (versions, GPU, Python, and the problem if
any) and exits 3 on the first problem, printing ``IMPORT CHECK FAILED: ...``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the distributions whose versions are recorded
DISTRIBUTIONS = ("torch", "triton", "timm", "pydantic", "pydantic-core", "wrapt", "einops", "mamba-ssm",
                 "mixer-plugins", "pytest")
#: a module that may be missing -> the distribution (and carried wheel) that provides it
WHEEL_OF = {"pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
            "typing_inspection": "typing-inspection", "typing_extensions": "typing-extensions", "wrapt": "wrapt",
            "einops": "einops"}
#: the mixers the check measures
MIXERS = ("quasi", "attention", "mlr_attention", "sliding_window_attention")


class Problem(Exception):
    """What stops the check, said in one line."""


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _missing_module(name: str, wheels: Path) -> str:
    """Why module ``name`` cannot be imported, and what provides it."""
    top = name.split(".")[0]
    dist = WHEEL_OF.get(top)
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if dist is None:
        return (f"cannot import {top!r}: it is not one of the carried wheels (.whl/ carries "
                f"{', '.join(sorted(set(WHEEL_OF.values())))}); this machine's Python ({sys.executable}) must have it")
    found = sorted(wheels.glob(f"{dist.replace('-', '_')}-*.whl"))
    if not found:
        return (f"cannot import {top!r}: the wheel of {dist} is missing from {wheels}/ (fill it with "
                f"'PYTHON=python3.12 bash benchmarks/gpu/fetch_wheels.sh {wheels}' on a machine with network access)")
    wheel = found[-1].name
    tags = wheel.removesuffix(".whl").split("-")[-3:]
    if tags[0].startswith("cp") and tags[0] != here:
        return (f"cannot import {top!r}: the carried wheel {wheel} is for {tags[0]}, this Python is {here} "
                f"({sys.executable}): run with PYTHON= a Python {tags[0][2]}.{tags[0][3:]}, or fetch wheels for "
                f"this one")
    return f"cannot import {top!r} although {wheels}/{wheel} is carried: its install failed (see install.log)"


def check(dry: bool, wheels: Path, info: dict) -> None:
    """Raises :class:`Problem` at the first thing the check would fail on; fills ``info`` as it goes."""
    import torch

    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    elif not dry:
        raise Problem("no CUDA device: torch.cuda.is_available() is False (run with --dry to check the script "
                      "on the CPU)")
    try:
        import mixer_plugins as mp

        names = mp.list_mixers()
        mp.create_mixer("quasi", 64)
        import timm

        timm.create_model("vit_base", mixer="quasi", img_size=32, patch_size=16, embed_dim=32, depth=1,
                          num_heads=2)
    except ModuleNotFoundError as err:
        raise Problem(_missing_module(err.name or str(err), wheels)) from err
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else ""
        # a mixer missing from the registry: its entry points come from mixer-plugins' own wheel
        hint = (" (the built-in mixers are found through the entry points of mixer-plugins' own wheel: is "
                f"mixer_plugins-*.whl in {wheels}/ and installed?)" if "mixer" in text.lower() else "")
        raise Problem(f"mixer_plugins does not work here: {type(err).__name__}: {text}{hint}") from err
    info["mixer_plugins_file"] = mp.__file__
    if not Path(mp.__file__).resolve().is_relative_to(ROOT):
        raise Problem(f"mixer_plugins is imported from {mp.__file__}, not from this checkout ({ROOT}): put the "
                      f"checkout first on PYTHONPATH")
    missing = []
    for name in MIXERS:
        try:
            mp.get_spec(name)   # aliases too ('quasi')
        except Exception:
            missing.append(name)
    if missing:
        raise Problem(f"mixers {missing} are not registered ({len(names)} are): the built-in mixers are found "
                      f"through the entry points of mixer-plugins' own wheel; put mixer_plugins-*.whl in {wheels}/ "
                      f"(benchmarks/gpu/fetch_wheels.sh builds it)")
    info["mixers"] = len(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for environment.json")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels' folder")
    parser.add_argument("--dry", action="store_true", help="no CUDA device needed")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info: dict = {"dry": args.dry, "python": platform.python_version(), "executable": sys.executable,
                  "versions": {name: _version(name) for name in DISTRIBUTIONS}, "gpu": None, "problem": None}
    try:
        check(args.dry, args.wheels, info)
    except Problem as problem:
        info["problem"] = str(problem)
    except ModuleNotFoundError as err:   # torch itself
        info["problem"] = _missing_module(err.name or str(err), args.wheels)
    (args.out / "environment.json").write_text(json.dumps(info, indent=2))
    print("versions: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in info["versions"].items()))
    gpu = info["gpu"] or ("none (dry run)" if args.dry else "none")
    print(f"python {info['python']} ({info['executable']}); GPU: {gpu}")
    if info["problem"]:
        print(f"IMPORT CHECK FAILED: {info['problem']}", flush=True)
        return 3
    print(f"import check: mixer_plugins from {info['mixer_plugins_file']}, {info['mixers']} mixers registered, "
          f"Hydra and vit_base(mixer='quasi') build")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
