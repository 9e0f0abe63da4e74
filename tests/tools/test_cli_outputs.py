"""The command line never prints a traceback for output paths or sizes, never loses measurements, and reports the
files it really wrote; bench and flops agree on exit statuses; the numbers ``docs/cli.md`` states that do not depend
on the machine are what the code computes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
from pathlib import Path

import pytest

from mixer_plugins.tools.cli import main

SMALL_BENCH = ["bench", "--mixers", "attention", "--lengths", "8,16", "--dim", "16", "--baseline", "none",
               "--repeats", "1", "--warmup", "0", "--no-memory", "--no-progress", "--option", "num_heads=2"]


def _error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture
def read_only_dir(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(folder, os.W_OK):  # root ignores permissions
        folder.chmod(0o755)
        pytest.skip("running as root: permissions are not enforced")
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("bad", ["plot_is_a_folder", "plot_bad_type", "json_is_a_folder", "json_under_a_file"])
def test_bench_bad_output_paths_fail_before_the_sweep_in_one_line(tmp_path, capsys, monkeypatch, bad):
    import mixer_plugins.tools.benchmarking as benchmarking

    monkeypatch.setattr(benchmarking, "sweep", lambda *a, **k: pytest.fail(
        "the sweep ran before the paths were checked"))
    (tmp_path / "a_file").write_text("x")
    argv = {
        "plot_is_a_folder": ["--plot", str(tmp_path)],
        "plot_bad_type": ["--plot", str(tmp_path / "plot.notanimage")],
        "json_is_a_folder": ["--no-plot", "--json", str(tmp_path)],
        "json_under_a_file": ["--no-plot", "--json", str(tmp_path / "a_file" / "b.json")],
    }[bad]
    assert main(SMALL_BENCH + argv) == 2
    assert _error(capsys).startswith("mixer-plugins: error: --")


def test_bench_unwritable_folder_is_one_line(read_only_dir, capsys):
    assert main(SMALL_BENCH + ["--no-plot", "--json", str(read_only_dir / "sub" / "b.json")]) == 2
    assert "--json" in _error(capsys)


def test_bench_writes_json_before_the_plot(tmp_path, capsys, monkeypatch):
    import mixer_plugins.tools.plotting as plotting

    def broken_plot(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plotting, "save_scaling_plot", broken_plot)
    out = tmp_path / "b.json"
    assert main(SMALL_BENCH + ["--plot", str(tmp_path / "p.png"), "--json", str(out)]) == 2
    assert "--plot" in _error(capsys)
    data = json.loads(out.read_text())
    assert data["complete"] is True and len(data["measurements"]) == 2


def test_bench_json_is_written_after_every_run(tmp_path, capsys, monkeypatch):
    import mixer_plugins.tools.benchmarking as benchmarking

    out = tmp_path / "b.json"
    seen: list[int] = []
    real = benchmarking.measure

    def measure(*args, **kwargs):
        if out.exists():
            seen.append(len(json.loads(out.read_text())["measurements"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(benchmarking, "measure", measure)
    assert main(SMALL_BENCH + ["--no-plot", "--json", str(out)]) == 0
    assert seen == [0, 1]  # the first run's numbers were on disk before the second started


def test_bench_exits_non_zero_when_a_run_failed(tmp_path, capsys):
    # dense has free L-sized parameters: with max_seq_len 8 it fails at L=16 (measured at 8), like flops would.
    argv = ["bench", "--mixers", "dense", "--lengths", "8,16", "--dim", "16", "--baseline", "none", "--repeats", "1",
            "--warmup", "0", "--no-memory", "--no-progress", "--no-plot", "--option", "max_seq_len=8",
            "--option", "head_dim=16", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "failed: dense at L=16" in err and "1 run(s) failed" in err
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["measurements"]) == 1 and data["problems"][0]["kind"] == "failed"


def test_show_reports_the_file_it_really_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["show", "toeplitz", "--length", "8", "--out", "noext"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "noext.png").is_file() and not (tmp_path / "noext").exists()
    assert "wrote noext.png" in out


@pytest.mark.parametrize("bad", ["folder", "type", "save_matrix_folder"])
def test_show_bad_output_paths_are_one_line(tmp_path, capsys, bad):
    argv = {"folder": ["--out", str(tmp_path)], "type": ["--out", str(tmp_path / "m.notanimage")],
            "save_matrix_folder": ["--save-matrix", str(tmp_path)]}[bad]
    assert main(["show", "toeplitz", "--length", "8", *argv]) == 2
    assert _error(capsys).startswith("mixer-plugins: error: --")


def test_show_unwritable_out_is_one_line(read_only_dir, capsys):
    assert main(["show", "toeplitz", "--length", "8", "--out", str(read_only_dir / "m.png")]) == 2
    assert "--out" in _error(capsys)


def test_show_size_that_cannot_be_allocated_is_one_line(tmp_path, capsys):
    # A 2^22 x 2^22 float64 matrix is 128 TiB.
    argv = ["show", "attention", "--length", str(2**22), "--dim", "8", "--out", str(tmp_path / "m.png")]
    assert main(argv) == 2
    assert "cannot be allocated" in _error(capsys)


def test_huge_mixer_size_is_one_line(tmp_path, capsys):
    assert main(["show", "attention", "--length", "4", "--dim", str(2**40), "--out", str(tmp_path / "m.png")]) == 2
    assert "cannot be allocated" in _error(capsys)


# -- docs/cli.md: its machine-independent numbers come from the code ---------------------------------------------

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _benchmark_module(name: str):
    path = CLI_DOC.parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_doc_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_table_states_the_parameters_and_flops_the_code_counts():
    """Parameters and FLOPs per image of the documented demo run: what ``demo`` counts for each default mixer."""
    import torch

    from mixer_plugins.tools.benchmarking import count_flops, format_flops
    from mixer_plugins.tools.demo import DEFAULT_MIXERS, DemoConfig, build_model, load_digits_data

    text = CLI_DOC.read_text()
    table = text[text.index("| mixer | test accuracy | parameters | FLOPs / image |"):]
    documented = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        documented[cells[0]] = (cells[2], cells[3])
    assert list(documented) == list(DEFAULT_MIXERS)
    config = DemoConfig()
    image = load_digits_data(config.seed, config.test_fraction).test_x[:1]
    for name in DEFAULT_MIXERS:
        model = build_model(name, config).eval()
        with torch.no_grad():
            flops = count_flops(lambda model=model: model(image))
        counted = (f"{sum(p.numel() for p in model.parameters()):,}", format_flops(flops))
        assert documented[name] == counted, f"docs/cli.md says {documented[name]} for {name}; the code: {counted}"


def test_the_settings_docs_cli_states_are_the_codes():
    from mixer_plugins.tools.cli import bench as bench_cli
    from mixer_plugins.tools.cli import build_parser
    from mixer_plugins.tools.cli import demo as demo_cli
    from mixer_plugins.tools.demo import DemoConfig

    text = " ".join(CLI_DOC.read_text().split())
    mixers = _benchmark_module("test_bench_mixers")
    assert (f"times every registered mixer × length ({', '.join(map(str, mixers.LENGTHS))}) × batch "
            f"({', '.join(map(str, mixers.BATCHES))}) × forward / forward+backward at dim 128") in text
    assert "dim=128" in (CLI_DOC.parents[1] / "benchmarks" / "test_bench_mixers.py").read_text()
    scaling = _benchmark_module("test_bench_scaling")
    assert f"L ∈ {{{', '.join(map(str, scaling.LENGTHS))}}}" in text
    quick = f"--quick # smoke run (what CI runs): {demo_cli.QUICK_EPOCHS} epochs on {demo_cli.QUICK_TRAIN_LIMIT} "
    assert quick in text and not re.search(r"--quick[^.]*\d+ s\b", text)  # no stated duration
    d = DemoConfig()
    assert (f"width {d.embed_dim}, {d.depth} blocks, {d.num_heads} heads, MLP ratio {d.mlp_ratio:g}, "
            f"{d.patch_size}×{d.patch_size} patches ({(8 // d.patch_size) ** 2} tokens)") in text
    lr = f"{d.lr:.0e}".replace("e-0", "e-")  # 3e-3, as the page writes it
    assert (f"AdamW (lr {lr}, weight decay {d.weight_decay:g}, one-cycle schedule), batch {d.batch_size}, "
            f"{d.epochs} epochs") in text
    parser = build_parser("bench")
    bench = parser._subparsers._group_actions[0].choices["bench"].parse_args([])
    assert bench.lengths == [256, 1024, 4096] and "at 256, 1024, 4096" in text
    assert tuple(bench.mixers) == bench_cli.DEFAULT_MIXERS
    flops = build_parser("flops")._subparsers._group_actions[0].choices["flops"].parse_args([])
    assert f"batch {flops.batch}, dim {flops.dim}, L {flops.length}, default options" in text
