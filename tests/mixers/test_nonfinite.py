"""Pads and the future never leak, even when they hold NaN, Inf or huge values;
batch 0; torch.export leaves later eager calls unchanged."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.layers.masks import causal_nonfinite_guard, poison_after, set_nonfinite_guard, zero_pads
from mixer_plugins.testing import run_check

MIXERS = sorted(mp.list_mixers())
CAUSAL_OPTIONS = [(n, {"causal": True}) for n in MIXERS if "causal" in mp.get_spec(n).option_names()]


def test_zero_pads_selects_rather_than_multiplies():
    out = torch.tensor([[[1.0], [float("nan")], [float("inf")]]])
    mask = torch.tensor([[True, False, False]])
    assert torch.equal(zero_pads(out, mask), torch.tensor([[[1.0], [0.0], [0.0]]]))


def test_causal_nonfinite_guard_zeroes_bad_tokens_and_poisons_from_the_first():
    x = torch.ones(2, 4, 3)
    x[0, 2, 1] = float("nan")
    x[1, 3, 0] = float("-inf")
    clean, poisoned = causal_nonfinite_guard(x)
    assert torch.isfinite(clean).all() and clean[0, 2].eq(0).all() and clean[0, 3].eq(1).all()
    assert poisoned.tolist() == [[False, False, True, True], [False, False, False, True]]
    y = poison_after(torch.zeros(2, 4, 3), poisoned)
    assert torch.isnan(y[0, 2:]).all() and not torch.isnan(y[0, :2]).any()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("name", MIXERS)
def test_pad_contents_never_reach_real_tokens(name, value):
    spec = mp.get_spec(name)
    torch.manual_seed(0)
    mixer = mp.create_mixer(name, 32, **spec.test_options).eval()
    x = torch.randn(2, 10, 32)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        y = mixer(x, mask=mask)
        y_bad = mixer(x.masked_fill(~mask[..., None], value), mask=mask)
    assert torch.isfinite(y_bad).all()
    torch.testing.assert_close(y_bad, y)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name, options", CAUSAL_OPTIONS + [("semiseparable", {}), ("ema", {})])
def test_nonfinite_last_token_leaves_the_past_unchanged(name, options, value):
    torch.manual_seed(0)
    mixer = set_nonfinite_guard(mp.create_mixer(name, 32, **{**mp.get_spec(name).test_options, **options}).eval())
    assert mixer.causal
    x = torch.randn(2, 10, 32)
    bad = x.clone()
    bad[:, -1] = value
    with torch.no_grad():
        y, y_bad = mixer(x), mixer(bad)
    torch.testing.assert_close(y_bad[:, :-1], y[:, :-1])
    assert torch.isnan(y_bad[:, -1]).all()


@pytest.mark.parametrize(
    "name, options",
    CAUSAL_OPTIONS + [("semiseparable", {}),
                      ("toeplitz", {"causal": True, "data_dependent": False, "max_seq_len": 16})],
)
def test_huge_future_token_leaves_the_past_unchanged(name, options):
    torch.manual_seed(0)
    mixer = set_nonfinite_guard(mp.create_mixer(name, 32, **{**mp.get_spec(name).test_options, **options}).eval())
    x = torch.randn(2, 10, 32)
    bad = x.clone()
    bad[:, -1] = 1e30
    with torch.no_grad():
        y, y_bad = mixer(x), mixer(bad)
    torch.testing.assert_close(y_bad[:, :-1], y[:, :-1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["toeplitz", "mlr_attention"])
def test_batch_zero_gives_an_empty_output(name):
    run_check(name, "empty_batch")
    run_check(name, "empty_batch", options={"causal": True})


def test_export_first_then_eager_mlr_attention_is_unchanged():
    """In a fresh process (no cache warmed by an earlier eager call): export, then eager == the matrix oracle."""
    code = textwrap.dedent("""
        import torch, mixer_plugins as mp
        torch.manual_seed(0)
        m = mp.create_mixer("mlr_attention", 32, num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2],
                            block_divide=True).eval()
        x = torch.randn(2, 12, 32)
        torch.export.export(m, (x,))
        with torch.no_grad():
            err = (m(x) - m.forward_via_matrix(x)).abs().max().item()
        print(err)
        assert err < 1e-5, err
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
