"""``mixer-plugins bench``, ``show`` and ``bench-table`` on tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.tools.benchmarking import build_mixer, format_seconds, sweep
from mixer_plugins.tools.cli import main
from mixer_plugins.tools.tables import load_benchmark_rows, results_table

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000, f"{path} is not a non-trivial PNG ({len(data)} bytes)"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mixer-plugins: error:"), err
    return err


# -- bench -----------------------------------------------------------------------------------------------------

def test_bench_prints_table_writes_plot_and_json(tmp_path, capsys):
    plot, out_json = tmp_path / "bench.png", tmp_path / "bench.json"
    argv = ["bench", "--mixers", "quasi,toeplitz", "--lengths", "32,16", "--dim", "32", "--batch", "2",
            "--repeats", "1", "--warmup", "0", "--option", "attention.num_heads=4", "--option", "quasi.head_dim=16",
            "--option", "toeplitz.head_dim=16",
            "--plot", str(plot), "--json", str(out_json), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("mixer"))
    for column in ("time", "tokens/s", "FLOPs", "peak mem", "time / attention", "mem / attention"):
        assert column in header
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            ("attention", "quasiseparable", "toeplitz")]
    assert [(r[0], r[1]) for r in rows] == [(m, L) for L in ("16", "32") for m in
                                            ("attention", "quasiseparable", "toeplitz")]
    assert all(r[-2] == "1.00x" for r in rows if r[0] == "attention")  # the baseline's own time ratio
    assert_png(plot)

    data = json.loads(out_json.read_text())
    assert data["settings"]["options"]["quasiseparable"] == {"head_dim": 16}
    by_key = {(m["mixer"], m["length"]): m for m in data["measurements"]}
    assert set(by_key) == {(m, L) for m in ("attention", "quasiseparable", "toeplitz") for L in (16, 32)}
    for (_name, length), m in by_key.items():
        assert m["batch"] == 2 and m["dim"] == 32 and m["mode"] == "forward"
        assert m["tokens_per_second"] == pytest.approx(2 * length / m["seconds"])
        assert m["flops_per_second"] == pytest.approx(m["flops"] / m["seconds"])
    # Counted FLOPs against the attention formula (2 FLOPs per multiply-add: 4 d^2 per token, 2 L^2 d)
    for length in (16, 32):
        expected = 2 * 2 * length * 4 * 32 * 32 + 2 * 2 * 2 * length**2 * 32
        assert by_key[("attention", length)]["flops"] == expected
    # The table prints what the JSON holds.
    m = by_key[("toeplitz", 32)]
    row = next(r for r in rows if r[0] == "toeplitz" and r[1] == "32")
    assert " ".join(row[2:4]) == format_seconds(m["seconds"])


def test_bench_direction_skips_mixers_that_cannot(tmp_path, capsys):
    argv = ["bench", "--mixers", "quasiseparable,semiseparable", "--lengths", "16", "--dim", "32",
            "--direction", "causal", "--baseline", "none", "--repeats", "1", "--no-plot", "--no-progress",
            "--no-memory", "--option", "head_dim=16", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "skipped: quasiseparable at L=16: mixer 'quasiseparable' is bidirectional only" in captured.err
    data = json.loads((tmp_path / "b.json").read_text())
    assert [(m["mixer"], m["direction"]) for m in data["measurements"]] == [("semiseparable", "causal")]
    assert data["measurements"][0]["peak_memory_bytes"] is None  # --no-memory


def test_sweep_reports_failures_and_goes_on():
    results, problems = sweep(["attention", "dense"], [8, 16], dim=32, repeats=1, warmup=0, memory=False,
                              options={"attention": {"num_heads": 2}, "dense": {"max_seq_len": 8, "head_dim": 16}})
    assert [(m.mixer, m.length) for m in results] == [("attention", 8), ("attention", 16), ("dense", 8)]
    assert len(problems) == 1 and problems[0].mixer == "dense" and problems[0].length == 16
    assert problems[0].kind == "failed" and "SequenceLengthError" in problems[0].reason


def test_sweep_direction_causal_builds_causal_mixers():
    results, problems = sweep(["attention"], [8], dim=16, direction="causal", repeats=1, warmup=0, memory=False,
                              options={"attention": {"num_heads": 2}})
    assert results[0].direction == "causal" and not problems


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--lengths", "0"], "positive integer"),
    (["bench", "--lengths", "a,b"], "positive integer"),
    (["bench", "--mixers", "attentoin"], "did you mean 'attention'"),
    (["bench", "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["bench", "--mode", "backward"], "invalid choice"),
    (["bench", "--direction", "sideways"], "invalid choice"),
    (["bench", "--option", "quasi.d_stat=3"], "did you mean 'd_state'"),
    (["bench", "--option", "quasi.d_state=many"], "invalid value 'many' for option 'd_state'"),
    (["bench", "--option", "quasi.d_state=0"], "greater than 0"),
    (["bench", "--option", "semiseparable.d_state=8"], "not among"),
    (["bench", "--option", "nonsense=1"], "has an option 'nonsense'"),
    (["bench", "--option", "novalue"], "KEY=VALUE"),
    (["bench", "--repeats", "-1"], "positive integer"),
])
def test_bench_bad_arguments(capsys, argv, fragment):
    assert main(argv) == 2
    assert fragment in one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_bench_cuda_without_cuda(capsys):
    assert main(["bench", "--device", "cuda"]) == 2
    assert "CUDA is not available" in one_line_error(capsys)


# -- show ------------------------------------------------------------------------------------------------------

def show_matrix(tmp_path, capsys, *argv: str) -> tuple[torch.Tensor, str]:
    png, saved = tmp_path / "m.png", tmp_path / "m.pt"
    assert main(["show", *argv, "--out", str(png), "--save-matrix", str(saved)]) == 0
    out = capsys.readouterr().out
    assert_png(png)
    return torch.load(saved), out


def test_show_toeplitz_has_constant_diagonals(tmp_path, capsys):
    matrix, out = show_matrix(tmp_path, capsys, "toeplitz", "--length", "24")
    heads, length = matrix.shape[0], matrix.shape[-1]
    assert matrix.shape == (heads, 24, 24) and matrix.dtype == torch.float64
    for offset in range(-length + 1, length):
        diagonal = torch.diagonal(matrix, offset, dim1=-2, dim2=-1)
        assert torch.allclose(diagonal, diagonal[..., :1].expand_as(diagonal)), f"diagonal {offset} is not constant"
    assert "Toeplitz" in out and "wrote" in out


def test_show_semiseparable_is_lower_triangular_quasiseparable_is_not(tmp_path, capsys):
    semi, out = show_matrix(tmp_path, capsys, "ssd", "--length", "20")
    assert semi.triu(1).abs().max() == 0 and semi.tril(-1).abs().max() > 0
    assert out.splitlines()[0].endswith("above it 0")
    quasi, _ = show_matrix(tmp_path, capsys, "quasi", "--length", "20", "--scale", "log")
    assert quasi.triu(1).abs().max() > 0 and quasi.tril(-1).abs().max() > 0  # both halves


def test_show_matches_the_api_for_a_given_input(tmp_path, capsys):
    x = torch.randn(12, 32, dtype=torch.float64)
    torch.save(x, tmp_path / "x.pt")
    matrix, _ = show_matrix(tmp_path, capsys, "attention", "--input", str(tmp_path / "x.pt"),
                            "--option", "num_heads=2", "--seed", "3")
    torch.manual_seed(3)
    mixer = build_mixer("attention", 32, 12, options={"num_heads": 2}, dtype=torch.float64).eval()
    # Independent reference: softmax(q k^T / sqrt(d_head)) from the mixer's own projection weights.
    qkv = x @ mixer.qkv.weight.T + mixer.qkv.bias
    q, k, _ = qkv.view(12, 3, 2, 16).unbind(1)
    expected = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / 16**0.5, dim=-1)
    assert matrix.shape == (2, 12, 12)
    torch.testing.assert_close(matrix, expected)


def test_show_dense_uses_the_requested_length(tmp_path, capsys):
    # dense's test options cap max_seq_len at 40; show sizes it to --length instead
    matrix, _ = show_matrix(tmp_path, capsys, "dense", "--length", "48", "--head", "1")
    assert matrix.shape[-1] == 48


def test_show_causal_direction(tmp_path, capsys):
    matrix, out = show_matrix(tmp_path, capsys, "attention", "--length", "10", "--direction", "causal")
    assert matrix.triu(1).abs().max() == 0 and "causal" in out


@pytest.mark.parametrize("argv, fragment", [
    (["show", "bidirectional_mult"], "not linear in its values"),
    (["show", "atention"], "did you mean 'attention'"),
    (["show", "attention", "--head", "9"], "--head 9: mixer 'attention' has 4 head(s)"),
    (["show", "attention", "--head", "first"], "head index"),
    (["show", "attention", "--option", "num_heads=3"], "not divisible by num_heads"),
    (["show", "attention", "--option", "num_heads=two"], "invalid value 'two'"),
    (["show", "attention", "--option", "heads=2"], "has no option 'heads'"),
    (["show", "semiseparable", "--direction", "bidirectional"], "causal only"),
    (["show", "quasiseparable", "--direction", "causal"], "bidirectional only"),
    (["show", "attention", "--input", "missing.pt"], "no such file"),
    (["show", "attention", "--scale", "cubic"], "invalid choice"),
])
def test_show_bad_arguments(capsys, argv, fragment):
    assert main(argv) == 2
    assert fragment in one_line_error(capsys)


def test_show_bad_inputs(tmp_path, capsys):
    torch.save(torch.randn(2, 8, 32), tmp_path / "batch.pt")
    torch.save(torch.ones(8, 32, dtype=torch.long), tmp_path / "ints.pt")
    torch.save({"x": torch.randn(8, 32)}, tmp_path / "dict.pt")
    torch.save(torch.randn(8, 32), tmp_path / "x.pt")
    (tmp_path / "junk.pt").write_text("not a tensor")
    cases = [
        (["--input", str(tmp_path / "batch.pt")], "shape (L, dim) or (1, L, dim)"),
        (["--input", str(tmp_path / "ints.pt")], "floating-point"),
        (["--input", str(tmp_path / "dict.pt")], "not a tensor"),
        (["--input", str(tmp_path / "junk.pt")], "not a tensor saved with torch.save"),
        (["--input", str(tmp_path / "x.pt"), "--length", "9"], "--length 9 disagrees with the input's length 8"),
        (["--input", str(tmp_path / "x.pt"), "--dim", "16"], "--dim 16 disagrees with the input's width 32"),
    ]
    for extra, fragment in cases:
        assert main(["show", "attention", *extra]) == 2
        assert fragment in one_line_error(capsys)


# -- bench-table -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_benchmark_json(tmp_path_factory) -> Path:
    """A real pytest-benchmark JSON: two tests of benchmarks/test_bench_mixers.py, timed, in a subprocess."""
    out = tmp_path_factory.mktemp("bench") / "run.json"
    ids = [f"benchmarks/test_bench_mixers.py::test_mixer[{name}-128-1-forward]" for name in ("attention", "toeplitz")]
    # A fresh pytest: drop the xdist worker variables (under `make test` this runs inside an xdist worker, and
    # pytest-benchmark then disables timing, which --benchmark-only refuses).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(MIXER_PLUGINS_BENCH_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *ids,
                           "--benchmark-only", f"--benchmark-json={out}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_benchmark_suite_records_flops_and_memory(saved_benchmark_json):
    data = json.loads(saved_benchmark_json.read_text())
    infos = {b["extra_info"]["mixer"]: (b["extra_info"], b["stats"]["median"]) for b in data["benchmarks"]}
    assert set(infos) == {"attention", "toeplitz"}
    for name, (info, median) in infos.items():
        assert (info["length"], info["batch"], info["dim"], info["mode"]) == (128, 1, 128, "forward")
        mixer = build_mixer(name, 128, 128)
        # forward: FlopCounterMode counts exactly the analytic matmul-like FLOPs (see tests/mixers/test_flops.py)
        assert info["flops"] == info["analytic_flops"] == mixer.flops(1, 128)
        assert info["flops_per_second"] == pytest.approx(info["flops"] / median)
        assert info["tokens_per_second"] == pytest.approx(128 / median)
        assert info["peak_memory_bytes"] is None or info["peak_memory_bytes"] >= 0


def test_bench_table_renders_saved_json(saved_benchmark_json, capsys):
    assert main(["bench-table", str(saved_benchmark_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward, dim 128, batch 1")
    data = json.loads(saved_benchmark_json.read_text())
    medians = {b["extra_info"]["mixer"]: b["stats"]["median"] for b in data["benchmarks"]}
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in medians}
    assert set(lines) == {"attention", "toeplitz"}
    assert f" {format_seconds(medians['toeplitz'])} " in lines["toeplitz"]
    assert f"{medians['toeplitz'] / medians['attention']:.2f}x" in lines["toeplitz"]
    assert "1.00x" in lines["attention"]


def test_bench_table_folders_markdown_and_runs(saved_benchmark_json, tmp_path, capsys):
    folder = tmp_path / ".benchmarks" / "Linux-CPython-3.11-64bit"
    folder.mkdir(parents=True)
    data = json.loads(saved_benchmark_json.read_text())
    (folder / "0001_old.json").write_text(json.dumps(data))
    slower = json.loads(json.dumps(data))
    for bench in slower["benchmarks"]:
        bench["stats"]["median"] *= 2
    slower["benchmarks"].append({"name": "test_target", "stats": {"median": 1.0}, "extra_info": {"speedup": 5}})
    newer = folder / "0002_new.json"
    newer.write_text(json.dumps(slower))
    os.utime(newer, (newer.stat().st_atime, newer.stat().st_mtime + 10))
    assert main(["bench-table", str(tmp_path / ".benchmarks"), "--markdown"]) == 0
    captured = capsys.readouterr()
    assert "| mixer | L | time |" in captured.out and "run " not in captured.out  # newest run only
    assert "1 benchmark(s) without mixer/length information left out: test_target" in captured.err
    assert main(["bench-table", str(tmp_path / ".benchmarks"), "--all-runs"]) == 0
    out = capsys.readouterr().out
    assert "run 0001_old" in out and "run 0002_new" in out


def test_bench_table_bad_paths(tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty").mkdir()
    (tmp_path / "disabled.json").write_text(json.dumps({"benchmarks": [
        {"name": "t", "stats": None, "extra_info": {"mixer": "attention", "length": 8}}]}))
    for path, fragment in [
        ("missing.json", "no such file or directory"),
        (tmp_path / "other.json", "is not pytest-benchmark JSON"),
        (tmp_path / "broken.json", "cannot read"),
        (tmp_path / "empty", "no benchmark JSON under"),
        (tmp_path / "disabled.json", "no mixer benchmarks with timings"),
    ]:
        assert main(["bench-table", str(path)]) == 2
        assert fragment in one_line_error(capsys)


def test_results_table_ratios_by_size():
    rows = [
        {"mixer": "attention", "length": 8, "batch": 1, "dim": 4, "mode": "forward", "seconds": 2.0,
         "flops": 100, "peak_memory_bytes": 1000},
        {"mixer": "quasiseparable", "length": 8, "batch": 1, "dim": 4, "mode": "forward", "seconds": 0.5,
         "flops": 50, "peak_memory_bytes": 250},
        {"mixer": "quasiseparable", "length": 16, "batch": 1, "dim": 4, "mode": "forward", "seconds": 1.0,
         "flops": 100, "peak_memory_bytes": None},
    ]
    text = results_table(rows)
    line8 = next(line for line in text.splitlines() if line.startswith("quasiseparable  8 "))
    assert line8.split()[-2:] == ["0.25x", "0.25x"]
    line16 = next(line for line in text.splitlines() if line.startswith("quasiseparable  16"))
    assert line16.split()[-2:] == ["-", "-"]  # no attention at L=16, no memory


def test_load_rows_keeps_suites_without_mode(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"benchmarks": [{"name": "t", "group": "mlr", "stats": {"median": 0.5},
                                                "extra_info": {"mixer": "mlr_attention", "length": 1024}}]}))
    rows, left_out = load_benchmark_rows([path])
    assert rows[0]["mode"] == "group mlr" and rows[0]["batch"] is None and "tokens_per_second" not in rows[0]
    assert not left_out and mp.get_spec(rows[0]["mixer"]).name == "mlr_attention"
