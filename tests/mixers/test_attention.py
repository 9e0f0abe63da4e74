"""The ``attention`` mixer against an independent naive softmax-attention formula."""

from __future__ import annotations

import math

import pytest
import torch

import mixer_plugins as mp


def naive_attention(mixer, x, mask=None):
    """Reference written from the definition, in float64, with explicit loops over heads."""
    b, l, d = x.shape
    h, hd = mixer.num_heads, mixer.head_dim
    qkv = x @ mixer.qkv.weight.T + (mixer.qkv.bias if mixer.qkv.bias is not None else 0)
    q, k, v = qkv.split(h * hd, dim=-1)
    out = torch.zeros(b, l, h * hd, dtype=x.dtype)
    probs = torch.zeros(b, h, l, l, dtype=x.dtype)
    for head in range(h):
        sl = slice(head * hd, (head + 1) * hd)
        scores = q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(hd)
        allowed = torch.ones(b, l, l, dtype=torch.bool)
        if mixer.causal:
            allowed &= torch.ones(l, l, dtype=torch.bool).tril()
        if mask is not None:
            allowed &= mask[:, None, :]
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        probs[:, head] = p
        out[..., sl] = p @ v[..., sl]
    y = out @ mixer.proj.weight.T + mixer.proj.bias
    if mask is not None:
        y = y * mask[..., None]
        probs = probs * (mask[:, None, :, None] & mask[:, None, None, :])
    return y, probs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_naive_formula(causal, masked):
    mixer = mp.create_mixer("attention", 24, num_heads=3, causal=causal).double().eval()
    x = torch.randn(3, 10, 24, dtype=torch.float64)
    mask = torch.arange(10)[None] < torch.tensor([10, 6, 1])[:, None] if masked else None
    y_ref, probs_ref = naive_attention(mixer, x, mask)
    torch.testing.assert_close(mixer(x, mask=mask), y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer.materialize(x, mask=mask), probs_ref, rtol=1e-10, atol=1e-12)


def test_attention_rows_sum_to_one_and_are_causal():
    mixer = mp.create_mixer("mha", 16, num_heads=2, causal=True).double()
    probs = mixer.materialize(torch.randn(2, 9, 16, dtype=torch.float64))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 9, dtype=torch.float64))
    assert (probs.triu(1) == 0).all()


def test_explicit_head_dim_and_scale():
    mixer = mp.create_mixer("attention", 10, num_heads=3, head_dim=4, scale=0.5)
    assert mixer.qkv.out_features == 36 and mixer.proj.in_features == 12 and mixer.scale == 0.5
    assert mixer(torch.randn(1, 5, 10)).shape == (1, 5, 10)


def test_flops_formula():
    mixer = mp.create_mixer("attention", 64, num_heads=4)
    b, l, d = 2, 50, 64
    expected = 2 * b * l * d * 3 * d + 2 * 2 * b * l * l * d + 2 * b * l * d * d
    assert mixer.flops(b, l) == expected
