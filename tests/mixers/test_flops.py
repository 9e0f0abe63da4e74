"""FLOP accounting: every registered mixer's analytic ``flops`` against PyTorch's ``FlopCounterMode``.

The counter sees matmul-like aten ops and our custom ops with registered formulas; it sees no elementwise op.
Analytic parts named ``*_elementwise`` (the Vandermonde/Cauchy matrix construction) are therefore the one
explained exception: the counted FLOPs must match the *rest* of the analytic count within 10%, and the elementwise
parts must be exactly what separates the two totals.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins.tools.benchmarking import build_mixer
from mixer_plugins.tools.cli import main
from mixer_plugins.tools.flop_report import TOLERANCE, UNCOUNTED_SUFFIX, compare_flops, flop_report, markdown_table

DIM = 32
LENGTHS = (64, 200)


def small_options(name: str) -> dict:
    """The spec's small test options (tuned for dim 32), letting the run's length set ``max_seq_len``."""
    return {k: v for k, v in mp.get_spec(name).test_options.items() if k != "max_seq_len"}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", mp.list_mixers())
def test_analytic_flops_agree_with_flop_counter(name, length):
    result = compare_flops(name, dim=DIM, length=length, batch=2, options=small_options(name), backward=False)
    mixer = build_mixer(name, DIM, length, options=small_options(name))
    assert result.analytic_total == mixer.flops(2, length) == sum(mixer.flops_breakdown(2, length).values())
    assert abs(result.counted_forward / result.analytic_counted_part - 1) <= TOLERANCE, (
        f"{name} at L={length}: FlopCounterMode counts {result.counted_forward} FLOPs, the analytic matmul-like "
        f"parts add up to {result.analytic_counted_part} (by op: {result.counted_by_op})"
    )
    # The one explained exception: declared elementwise parts, and nothing else, separate the two totals.
    for part, value in result.uncounted_parts.items():
        assert part.endswith(UNCOUNTED_SUFFIX) and value > 0, f"{name}: elementwise part {part}={value}"
    uncounted = sum(result.uncounted_parts.values())
    assert abs(result.analytic_total - uncounted - result.counted_forward) <= TOLERANCE * result.analytic_counted_part
    assert result.explanation().startswith("UNEXPLAINED") is False


def test_the_explanation_holds_flop_counter_ignores_elementwise_ops():
    # The reason *_elementwise parts are excluded: FlopCounterMode counts none of the ops that build those matrices.
    x = torch.randn(64, 64)
    with FlopCounterMode(display=False) as counter:
        torch.cos(x), torch.exp(x), torch.reciprocal(x), x * x, x + x, torch.sin(x)
    assert counter.get_total_flops() == 0
    with FlopCounterMode(display=False) as counter:
        x @ x
    assert counter.get_total_flops() == 2 * 64**3


@pytest.mark.parametrize("length", LENGTHS)
def test_attention_flops_against_the_formula(length):
    # Independent reference, written from the definition: q/k/v and output projections (4 d^2 per token, 2 FLOPs
    # per multiply-add), scores q.k and the weighted sum of values (L^2 d each).
    batch, heads = 2, 4
    expected = 2 * batch * length * DIM * 3 * DIM + 2 * batch * length * DIM * DIM + 2 * 2 * batch * length**2 * DIM
    result = compare_flops("attention", dim=DIM, length=length, batch=batch, options={"num_heads": heads},
                           backward=False)
    assert result.analytic_total == expected
    assert result.counted_forward == expected


def test_forward_backward_is_counted_too():
    result = compare_flops("dense", dim=DIM, length=64, batch=1, options=small_options("dense"))
    # matmul-only work: the backward adds two matmuls per forward matmul (the input's gradient is needed too)
    assert result.counted_forward_backward == pytest.approx(3 * result.counted_forward, rel=0.05)
    assert result.backward_ratio == pytest.approx(3.0, rel=0.05)


def test_report_survives_a_broken_mixer_and_renders_markdown():
    rows, failures = flop_report(["attention", "dense"], dim=DIM, length=64,
                                 options={"dense": {"max_seq_len": 8}}, backward=False)
    assert [r.mixer for r in rows] == ["attention"]
    assert failures and failures[0][0] == "dense" and "SequenceLengthError" in failures[0][1]
    table = markdown_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| mixer | analytic |") and lines[2].startswith("| attention |")
    assert lines[2].rstrip().endswith("| exact |")


def test_flops_command_prints_the_table(capsys):
    assert main(["flops", "--mixers", "attention,vandermonde", "--dim", "32", "--length", "64", "--no-backward",
                 "--option", "attention.num_heads=4", "--option", "vandermonde.head_dim=16"]) == 0
    out = capsys.readouterr().out
    assert "batch 1, dim 32, L 64" in out
    row = next(line for line in out.splitlines() if line.startswith("vandermonde"))
    assert "matrix_elementwise" in row and "not count" in row
    assert next(line for line in out.splitlines() if line.startswith("attention")).rstrip().endswith("exact")


def test_flops_command_markdown_and_bad_option(capsys):
    assert main(["flops", "--mixers", "attention", "--dim", "32", "--length", "32", "--markdown",
                 "--option", "num_heads=4"]) == 0
    assert "| attention |" in capsys.readouterr().out
    assert main(["flops", "--mixers", "attention", "--option", "num_head=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean 'num_heads'" in err
