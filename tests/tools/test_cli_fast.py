"""The command line starts fast (arguments are checked before torch is imported), ``python -m mixer_plugins`` works,
``env`` reports, and missing extras are one line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mixer_plugins as mp
from mixer_plugins.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "pydantic", "timm", "numpy", "matplotlib", "fairseq2")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([*(extra.pop("PREPEND", "").split(os.pathsep) if "PREPEND" in extra else []), str(ROOT),
                            os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path.strip(os.pathsep), **extra)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(**env), timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["list", "--names"], ["list", "--help"], []])
def test_help_version_and_list_names_import_no_heavy_library(argv):
    """The robust check: parsing (and answering) these imports neither torch, pydantic nor timm."""
    code = ("import sys, json\nfrom mixer_plugins.tools.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            f"print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))")
    out = _run(["-c", code, *argv])
    assert out.returncode == 0, out.stderr
    rc, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert heavy == [], f"mixer-plugins {' '.join(argv)} imported {heavy}"
    assert rc == (2 if not argv else 0)


def test_help_and_version_answer_fast():
    """A generous bound (the machine may be loaded); today's cost is Python's start-up plus argparse."""
    for argv in (["--version"], ["--help"], ["list", "--names"]):
        start = time.perf_counter()
        out = _run(["-m", "mixer_plugins", *argv])
        elapsed = time.perf_counter() - start
        assert out.returncode == 0, out.stderr
        assert elapsed < 3.0, f"mixer-plugins {' '.join(argv)} took {elapsed:.1f} s"


# Every subcommand's --help, and argument errors that argparse finds (exit 2), answered without importing torch.
PARSE_ONLY = [*([name, "--help"] for name in ("list", "info", "demo", "bench", "bench-table", "show", "flops",
                                              "compare", "env", "mlm", "lm", "generate")),
              ["bench", "--lengths", "12x"], ["bench", "--mode", "sideways"], ["demo", "--epochs", "0"],
              ["demo", "--patch-size", "3"], ["show"], ["show", "quasi", "--scale", "cubic"], ["info"],
              ["flops", "--length", "-3"], ["env", "--bogus"], ["bench-table"], ["compare", "--seeds", "x"],
              ["compare", "--task-option", "no_equals_sign"], ["compare", "--steps", "0"], ["list", "--bogus"],
              ["mlm"], ["mlm", "OUT", "--config", "no_equals_sign"], ["lm", "OUT", "--config", "a=[1,"],
              ["lm", "OUT", "--bogus"], ["generate", "OUT"], ["generate", "OUT", "--prompt", "a", "--top-k", "0"],
              ["generate", "OUT", "--prompt", "a", "--top-p", "1.5"], ["generate", "OUT", "--prompt", "a",
                                                                         "--temperature", "nan"]]


def test_arguments_are_checked_before_torch_is_imported():
    """In one fresh interpreter, each command line in turn: after each, none of the heavy libraries is imported."""
    code = ("import sys, json\nfrom mixer_plugins.tools.cli import main\nout = []\n"
            f"for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        rc = main(argv)\n    except SystemExit as e:\n        rc = e.code\n"
            f"    out.append([argv, rc, [m for m in {HEAVY!r} if m in sys.modules]])\n"
            "print(json.dumps(out))")
    result = _run(["-c", code, json.dumps(PARSE_ONLY)])
    assert result.returncode == 0, result.stderr
    for argv, rc, heavy in json.loads(result.stdout.strip().splitlines()[-1]):
        assert heavy == [], f"mixer-plugins {' '.join(argv)} imported {heavy}"
        assert rc == (0 if argv[-1] == "--help" else 2), (argv, rc)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    helps = sum(argv[-1] == "--help" for argv in PARSE_ONLY)
    assert len(errors) == len(PARSE_ONLY) - helps and all(e.startswith("mixer-plugins: error: ") for e in errors)


# The fairseq2 entry points: --help and an argument error each, in a process of its own, answered without importing
# fairseq2 or torch (what Python imported is read from -X importtime).
FAIRSEQ2_ENTRY_POINTS = [
    (["mlm", "--help"], 0, "Train a BERT-style encoder"),
    (["mlm", "OUT", "--config", "mixer.name"], 2, "argument --config: expected NAME=VALUE"),
    (["lm", "--help"], 0, "next-token prediction"),
    (["lm"], 2, "required: OUT_DIR"),
    (["generate", "--help"], 0, "--prompt PROMPT"),
    (["generate", "OUT", "--prompt", "The cat", "--beam-size", "0"], 2, "argument --beam-size: expected a positive"),
]


def _answer_without_fairseq2(module: str, argv: list[str], status: int) -> str:
    """Run ``python -m module argv`` under ``-X importtime``: it exits with ``status`` having imported neither fairseq2
    nor torch; returns what it answered (stdout for status 0, else stderr without the import times)."""
    out = _run(["-X", "importtime", "-m", module, *argv])
    assert out.returncode == status, out.stderr[-2000:]
    timing = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in timing}
    assert not {m for m in imported if m.split(".")[0] in ("fairseq2", "torch")}, sorted(imported)
    return out.stdout if status == 0 else "\n".join(line for line in out.stderr.splitlines()
                                                      if not line.startswith("import time:"))


@pytest.mark.parametrize("argv, status, fragment", FAIRSEQ2_ENTRY_POINTS, ids=[" ".join(a[0][:2]) + f" {a[1]}"
                                                                                 for a in FAIRSEQ2_ENTRY_POINTS])
def test_fairseq2_entry_points_answer_before_fairseq2_is_imported(argv, status, fragment):
    answer = _answer_without_fairseq2("mixer_plugins", argv, status)
    assert fragment in answer, answer
    if status:
        assert answer.startswith("mixer-plugins: error: ") and len(answer.splitlines()) == 1, answer


# The same for the python -m forms (the package mixer_plugins.backbones.fairseq2 loads its names on first use):
# --help is the recipe's, an argument error is argparse's usage and one line.
FAIRSEQ2 = "mixer_plugins.backbones.fairseq2"
PYTHON_M_ENTRY_POINTS = [
    (FAIRSEQ2, ["--help"], 0, "Train a BERT-style encoder"),
    (FAIRSEQ2, ["OUT", "--config", "mixer.name"], 2, "argument --config: expected NAME=VALUE"),
    (f"{FAIRSEQ2}.lm", ["--help"], 0, "next-token prediction"),
    (f"{FAIRSEQ2}.lm", [], 2, "required: OUT_DIR"),
    (f"{FAIRSEQ2}.lm", ["OUT", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (f"{FAIRSEQ2}.generate", ["--help"], 0, "--prompt PROMPT"),
    (f"{FAIRSEQ2}.generate", ["OUT", "--prompt", "The cat", "--beam-size", "x"], 2, "argument --beam-size: invalid"),
]


@pytest.mark.parametrize("module, argv, status, fragment", PYTHON_M_ENTRY_POINTS,
                         ids=[f"{m.rsplit('.', 1)[-1]} {' '.join(a[:1])} {s}" for m, a, s, _ in PYTHON_M_ENTRY_POINTS])
def test_python_m_fairseq2_entry_points_answer_before_fairseq2_is_imported(module, argv, status, fragment):
    answer = _answer_without_fairseq2(module, argv, status)
    assert fragment in answer, answer
    if status:
        usage, error = answer.split(f"python -m {module}: error: ")
        assert usage.startswith(f"usage: python -m {module} ") and len(error.splitlines()) == 1, answer
    else:
        assert answer.startswith(f"usage: python -m {module} "), answer


def test_python_m_generate_checks_its_options_before_fairseq2_is_imported():
    """A value generate's own checks refuse (GenerationSettings) is one line, exit status 2, before torch too."""
    answer = _answer_without_fairseq2(f"{FAIRSEQ2}.generate", ["OUT", "--prompt", "a", "--top-k", "0"], 2)
    assert answer == "error: top_k must be at least 1 (leave it unset for top-p sampling), got 0", answer


def test_help_and_argument_errors_return_within_a_second_and_a_half():
    """Wall time of the whole process (Python's start included); the best of three tries, as the machine may be
    busy. Importing torch alone takes longer than the bound."""
    for argv, status in ((["info", "quasi", "--help"], 0), (["bench", "--lengths", "12x"], 2)):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            out = _run(["-m", "mixer_plugins.tools.cli", *argv])
            times.append(time.perf_counter() - start)
            assert out.returncode == status, out.stderr
            if times[-1] < 1.5:
                break
        assert min(times) < 1.5, f"mixer-plugins {' '.join(argv)} took {min(times):.2f} s"


def test_the_parsers_constants_are_the_librarys():
    """The subcommands repeat a few constants so that parsing imports no torch; they must stay equal."""
    import dataclasses

    from mixer_plugins.tools import benchmarking, demo, plotting
    from mixer_plugins.tools.cli import bench as bench_cli
    from mixer_plugins.tools.cli import demo as demo_cli
    from mixer_plugins.tools.cli import show as show_cli

    assert bench_cli.DIRECTIONS == show_cli.DIRECTIONS == benchmarking.DIRECTIONS
    assert bench_cli.MODES == benchmarking.MODES and show_cli.SCALES == plotting.SCALES
    assert demo_cli.DEFAULT_MIXERS == demo.DEFAULT_MIXERS
    defaults = {f.name: f.default for f in dataclasses.fields(demo.DemoConfig)}
    assert demo_cli.DEFAULTS == {name: defaults[name] for name in demo_cli.DEFAULTS}


# -- `mixer-plugins list` (the table) ---------------------------------------------------------------------------

def test_list_table_shows_every_mixer_with_its_aliases_and_names_other_distributions(capsys):
    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert any(line.startswith("ema ") for line in table)
    assert "from other distributions: ema (mixer-plugins-example)" in table
    assert any(line.startswith("attention ") and "softmax_attention, mha" in line for line in table)


def test_list_reports_a_broken_plugin_every_time(tmp_path):
    from helpers import make_fake_distribution

    site = make_fake_distribution(tmp_path / "site", "broken-mixers", {"broken": "fake_mixer_cli_broken:SPEC"},
                                  {"fake_mixer_cli_broken": "raise ImportError('needs a GPU library')"})
    for _ in range(2):  # reported each time
        out = _run(["-m", "mixer_plugins", "list"], PREPEND=str(site))
        assert out.returncode == 0, out.stderr
        assert "attention" in out.stdout and "ema" in out.stdout and "broken " not in out.stdout
        assert "broken-mixers" in out.stderr and "needs a GPU library" in out.stderr


def test_catalog_is_the_specs_and_the_problems():
    from mixer_plugins.registry import MixerRegistry

    registry = MixerRegistry()
    specs, problems = registry.catalog()
    assert specs == registry.specs() and [s.name for s in specs] == sorted(s.name for s in specs)
    assert problems == registry.problems()


def test_python_dash_m_mixer_plugins():
    out = _run(["-m", "mixer_plugins", "--version"])
    assert out.returncode == 0 and out.stdout.strip() == mp.__version__
    out = _run(["-m", "mixer_plugins", "list", "--names"])
    assert out.returncode == 0 and "attention" in out.stdout.split()
    out = _run(["-m", "mixer_plugins", "frobnicate"])
    assert out.returncode == 2 and out.stderr.strip().startswith("mixer-plugins: error:")


def test_list_names_are_the_registrys_names(capsys):
    from mixer_plugins.registry import ENTRY_POINT_GROUP
    from mixer_plugins.tools.cli import list_mixers

    assert list_mixers.ENTRY_POINT_GROUP == ENTRY_POINT_GROUP
    assert list_mixers.entry_point_names() == mp.default_registry.names()
    assert main(["list", "--names"]) == 0
    assert capsys.readouterr().out.split() == mp.default_registry.names()


def test_help_lines_are_the_commands_own():
    """``--help`` lists the subcommands from a static table (no imports); it must say what each module says."""
    cli_main = importlib.import_module("mixer_plugins.tools.cli.main")
    fresh = cli_main._Commands(cli_main._SUBCOMMANDS)
    for name in fresh:
        assert fresh.help(name) == fresh[name].help, name


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("list", "info", "demo", "bench", "bench-table", "show", "flops", "env", "mlm", "lm", "generate"):
        assert name in out
    # the fairseq2 recipes and generation, with how to run them both ways
    module = "python -m mixer_plugins.backbones.fairseq2"
    for fragment in ("mixer-plugins mlm OUT_DIR --config mixer.name=", "mixer-plugins lm OUT_DIR",
                     "mixer-plugins generate OUT_DIR/checkpoints --prompt", module, f"{module}.lm",
                     f"{module}.generate"):
        assert fragment in " ".join(out.split()), fragment


def test_env_reports_versions_devices_and_backends(capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("python", "torch", "triton", "timm", "fairseq2", "pydantic", "mamba-ssm", "CUDA available",
                 "native CPU kernels"):
        assert word in out, word
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    from mixer_plugins.kernels import _native

    assert report["native"]["available"] == _native.is_loaded()
    assert report["native"]["available"] or report["native"]["reason"]  # a refusal says why
    if report["native"]["available"]:
        assert "conv_forward" in report["native"]["ops"] and "loaded" in out
        assert report["native"]["library"] == _native.library_path() and report["native"]["library"] in out
    assert "threads" not in report and "output pool" not in out
    assert report["versions"]["torch"] == torch.__version__.split("+")[0]
    assert report["devices"]["cuda_available"] == torch.cuda.is_available()
    rows = report["kernels"]
    assert {"scan", "toeplitz", "conv", "norm"} <= {r["op"] for r in rows}
    for row in rows:
        assert row["available"] or row["reason"], row          # every refusal says why
    cpu_ops = {r["op"] for r in rows if r["device"] == "cpu"}
    for op in cpu_ops:  # on the CPU the torch backend runs every op, and the automatic choice may pick it
        cpu = [r for r in rows if r["op"] == op and r["device"] == "cpu"]
        assert any(r["backend"] == "torch" and r["available"] and r["automatic"] for r in cpu), op
        assert not any(r["backend"] == "reference" and r["automatic"] for r in cpu), op  # never picked by itself
    if report["versions"]["mamba-ssm"] is None:
        assert "not installed (pip install 'mixer-plugins[cuda]')" in out  # the table names the extra
        mamba = [r for r in rows if r["backend"] == "mamba_ssm"]
        assert all(not r["available"] and "mamba" in r["reason"] for r in mamba)


def test_env_native_says_only_whether_the_native_kernels_load(capsys):
    from mixer_plugins.kernels import _native

    rc = main(["env", "--native"])
    out = capsys.readouterr().out
    assert rc == (0 if _native.is_loaded() else 1)
    assert out.count("\n") == 1 and out.startswith("native CPU kernels: ")
    assert main(["env", "--native", "--json"]) == rc
    report = json.loads(capsys.readouterr().out)
    assert report["available"] == _native.is_loaded() and report["library"] == _native.library_path()
    assert report["vector_lanes"] in ((1, 8, 16) if report["available"] else (None,))


def test_env_uses_the_kernels_backend_report_when_there_is_one(capsys, monkeypatch):
    import dataclasses

    import mixer_plugins.kernels as kernels

    @dataclasses.dataclass
    class Status:
        op: str
        backend: str
        device: str
        available: bool
        reason: str
        automatic: bool

    def backend_report(devices=None):
        return [Status("fake_op", "torch", "cpu", True, "", True),
                Status("fake_op", "triton", "cpu", False, "Triton needs CUDA tensors", False),
                Status("fake_op", "mamba_ssm", "cpu", False, "op 'fake_op' has no 'mamba_ssm' implementation", False)]

    monkeypatch.setattr(kernels, "backend_report", backend_report, raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "yes, automatic" in out and "no: Triton needs CUDA tensors" in out
    assert "mamba_ssm" not in out.split("can run", 1)[1]  # backends an op does not have are left out


def test_env_names_the_extra_of_a_missing_package(capsys, monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(dist):
        if dist == "fairseq2":
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert main(["env"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fairseq2"))
    assert "not installed (pip install 'mixer-plugins[fairseq2]')" in line


# -- missing extras: one line naming the install command ---------------------------------------------------------

def _blocker(tmp_path: Path, module: str) -> str:
    """A folder whose sitecustomize makes ``module`` look uninstalled in a fresh interpreter."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    return str(tmp_path)


def test_fairseq2_recipe_without_fairseq2_is_one_line(tmp_path):
    out = _run(["-m", "mixer_plugins.backbones.fairseq2", str(tmp_path / "out")],
               PREPEND=_blocker(tmp_path, "fairseq2"))
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "pip install 'mixer-plugins[fairseq2]'" in err


def test_importing_the_fairseq2_adapter_without_fairseq2_raises_missing_extra(tmp_path):
    code = ("import mixer_plugins as mp\ntry:\n    import mixer_plugins.backbones.fairseq2\n"
            "except ImportError as e:\n    print(isinstance(e, mp.MissingExtraError), e)\n")
    out = _run(["-c", code], PREPEND=_blocker(tmp_path, "fairseq2"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ") and "pip install 'mixer-plugins[fairseq2]'" in out.stdout


@pytest.mark.parametrize("blocked, argv", [
    ("matplotlib", ["show", "attention", "--length", "8"]),
    ("sklearn", ["demo", "--mixers", "attention", "--quick"]),
])
def test_cli_missing_demo_extra_is_one_line(capsys, monkeypatch, tmp_path, blocked, argv):
    monkeypatch.setitem(sys.modules, blocked, None)
    for name in [m for m in sys.modules if m.startswith(blocked + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mixer-plugins: error:")
    assert "pip install 'mixer-plugins[demo]'" in err


# -- the benchmark suites honour OMP_NUM_THREADS --------------------------------------------------------------

def _bench_threads():
    spec = importlib.util.spec_from_file_location("_bench_conftest", ROOT / "benchmarks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    import torch

    before = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
    finally:
        torch.set_num_threads(before)  # loading it sets the threads of this process
    return module.bench_threads


@pytest.mark.parametrize("environ, expected", [
    ({"OMP_NUM_THREADS": "3"}, 3),
    ({"OMP_NUM_THREADS": "3", "PYTEST_XDIST_WORKER": "gw0"}, 3),
    ({"OMP_NUM_THREADS": "3", "MIXER_PLUGINS_BENCH_THREADS": "2"}, 2),
    ({"PYTEST_XDIST_WORKER": "gw1"}, 1),
    ({}, os.cpu_count() or 1),
])
def test_benchmarks_honour_omp_num_threads(environ, expected):
    assert _bench_threads()(environ) == expected


def test_benchmarks_refuse_a_bad_thread_count():
    with pytest.raises(pytest.UsageError, match="OMP_NUM_THREADS"):
        _bench_threads()({"OMP_NUM_THREADS": "many"})
