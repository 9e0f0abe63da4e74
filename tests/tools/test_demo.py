"""``mixer-plugins demo``: the digits experiment end to end (``--quick``), its parts, and its errors."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from mixer_plugins.tools.cli import main
from mixer_plugins.tools.demo import (
    DEFAULT_MIXERS,
    DemoConfig,
    adapted_mixer_options,
    build_model,
    capture_first_block_matrix,
    load_digits_data,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHANCE = 0.1  # ten balanced classes


def read_png(path: Path):
    import matplotlib.image

    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes().startswith(PNG_MAGIC)
    return matplotlib.image.imread(path)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``mixer-plugins demo --quick`` once, in a temporary folder: (exit status, stdout, stderr, out folder)."""
    out = tmp_path_factory.mktemp("demo")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(["demo", "--quick", "--out", str(out)])
    return status, stdout.getvalue(), stderr.getvalue(), out


def test_quick_demo_prints_the_table(quick_run):
    status, stdout, stderr, out = quick_run
    assert status == 0, stderr[-2000:]
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mixer "))
    for column in ("test accuracy", "parameters", "FLOPs / image", "train time"):
        assert column in lines[header]
    rows = [line.split()[0] for line in lines[header + 2: header + 2 + len(DEFAULT_MIXERS)]]
    assert rows == list(DEFAULT_MIXERS)
    assert "16 tokens" in lines[0] and "3 epochs" in lines[0] and "640 training / 360 test" in lines[0]
    assert "%|" in stderr  # tqdm progress bars


def test_quick_demo_learns_above_chance(quick_run):
    _, _, _, out = quick_run
    results = {r["mixer"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert list(results) == list(DEFAULT_MIXERS)
    for name, r in results.items():
        assert r["error"] is None, f"{name} failed: {r['error']}"
        assert len(r["history"]) == 3 and r["test_accuracy"] == r["history"][-1]["test_accuracy"]
        assert r["parameters"] > 0 and r["flops_per_image"] > 0 and r["train_seconds"] > 0
        assert r["matrix_shape"][-2:] == [16, 16]
    assert results["attention"]["test_accuracy"] > 2 * CHANCE
    assert results["quasiseparable"]["test_accuracy"] > 2 * CHANCE
    # training reduced the loss
    history = results["attention"]["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]


def test_quick_demo_writes_plots(quick_run):
    _, stdout, _, out = quick_run
    curves = read_png(out / "learning_curves.png")
    matrices = read_png(out / "matrices.png")
    assert curves.shape[0] > 300 and curves.shape[1] > 600
    # input image + 4 heat maps in 3 columns: 2 rows, taller than wide / 3 * 2
    assert matrices.shape[0] > 600 and matrices.shape[1] > 900
    for image in (curves, matrices):
        assert image[..., :3].std() > 0.05, "the plot is blank"
    assert "| attention |" in (out / "results.md").read_text()
    assert not (out / "errors.log").exists()
    assert f"wrote {out / 'results.md'}" in stdout


def test_failing_mixer_is_reported_and_the_others_still_run(tmp_path, capsys):
    # dense with max_seq_len=4 cannot take the model's 16 tokens
    status = main(["demo", "--mixers", "attention,dense", "--option", "dense.max_seq_len=4", "--epochs", "1",
                   "--train-limit", "128", "--out", str(tmp_path), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 1
    dense_row = next(line for line in captured.out.splitlines() if line.startswith("dense "))
    assert "FAILED: SequenceLengthError" in dense_row
    assert "1 of 2 mixer(s) failed: dense" in captured.err
    assert "SequenceLengthError" in (tmp_path / "errors.log").read_text()
    results = {r["mixer"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert results["attention"]["error"] is None and results["attention"]["test_accuracy"] is not None
    read_png(tmp_path / "matrices.png")


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--mixers", "atention"], "did you mean 'attention'"),
    (["demo", "--width", "30"], "must be divisible by the head count"),
    (["demo", "--patch-size", "3"], "invalid choice"),
    (["demo", "--epochs", "0"], "positive integer"),
    (["demo", "--option", "quasi.d_state=x"], "invalid value 'x' for option 'd_state'"),
    (["demo", "--mixers", "attention", "--option", "quasi.d_state=8"], "not among attention"),
    (["demo", "--head", "avg"], "head index"),
    (["demo", "--train-limit", "10"], "at least the batch size"),
])
def test_demo_bad_arguments(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err


def test_demo_bad_sample_index(tmp_path, capsys):
    assert main(["demo", "--mixers", "attention", "--sample", "5000", "--out", str(tmp_path)]) == 2
    assert "sample must be an index into the 360 test images" in capsys.readouterr().err


def test_digits_split_is_fixed_by_the_seed_stratified_and_normalized():
    a, b, c = load_digits_data(0), load_digits_data(0), load_digits_data(1)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.test_y, c.test_y)
    assert a.train_x.shape == (1437, 1, 8, 8) and a.test_x.shape == (360, 1, 8, 8)
    assert torch.bincount(a.test_y, minlength=10).min() >= 35  # stratified: every class about 36 times
    assert abs(a.train_x.mean().item()) < 1e-5 and abs(a.train_x.std().item() - 1) < 1e-5
    assert len(load_digits_data(0, train_limit=100).train_x) == 100


def test_mixer_options_are_adapted_to_the_model_size():
    config = DemoConfig(options={"quasiseparable": {"d_state": 8}})
    quasi = adapted_mixer_options("quasi", config)
    assert quasi["head_dim"] == 2 * 64 // 4 and quasi["chunk_size"] == 16 and quasi["d_state"] == 8  # user wins
    assert adapted_mixer_options("attention", config) == {}
    model = build_model("quasiseparable", config)
    mixer = model.blocks[0].attn.mixer
    assert mixer.num_heads == config.num_heads and model.patch_embed.num_patches == config.tokens == 16


def test_captured_matrix_is_attention_of_the_first_block():
    config = DemoConfig(mixers=("attention",))
    model = build_model("attention", config).double().eval()
    image = torch.randn(1, 8, 8, dtype=torch.float64)
    matrix = capture_first_block_matrix(model, image)
    # Independent reference: the first block's input (patch embedding + position embedding, then norm1), and
    # softmax(q k^T / sqrt(d_head)) per head from the mixer's q/k projection weights.
    with torch.no_grad():
        tokens = model.patch_embed(image[None]) + model.pos_embed
        h = model.blocks[0].norm1(tokens)[0]
        mixer = model.blocks[0].attn.mixer
        q, k, _ = (h @ mixer.qkv.weight.T + mixer.qkv.bias).view(16, 3, 4, 16).unbind(1)
        expected = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / 4.0, dim=-1)
    assert matrix.shape == (1, 4, 16, 16)
    torch.testing.assert_close(matrix[0], expected)
    assert model.training is False and not model.blocks[0].attn._forward_pre_hooks  # hook removed
