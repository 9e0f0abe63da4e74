"""``kernels.local_attention`` (sliding window + global tokens): the blocked ``torch`` backend against the dense
reference (float64, values and gradients), NaN pads, argument checks, ``torch.compile(fullgraph=True)`` with
inductor, and the FLOPs ``FlopCounterMode`` counts. (The Triton backend: tests/ops/test_local_attention_triton.py.)"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mixer_plugins import kernels
from mixer_plugins.kernels.local_attention.reference import allowed_pairs


def _inputs(L, *, masked, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, L, 2, 4, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(2, L, 2, 3, generator=g, dtype=dtype)
    mask = None
    if masked:
        mask = torch.ones(2, L, dtype=torch.bool)
        mask[1, max(1, L - 3):] = False
        for t in (q, k, v):
            t[~mask] = float("nan")
    return q, k, v, mask


CASES = [c for c in itertools.product([1, 7, 30], [0, 3, 40], [0, 1, 3], [False, True], [False, True])
         if c[2] <= c[0]]


@pytest.mark.parametrize("L,window,num_global,causal,masked", CASES)
def test_torch_backend_matches_reference(L, window, num_global, causal, masked):
    q, k, v, mask = _inputs(L, masked=masked)
    kw = dict(window=window, causal=causal, mask=mask, scale=0.6, num_global=num_global)
    results = []
    for backend in ("torch", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = kernels.local_attention(*leaves, backend=backend, **kw)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
        results.append((y, *torch.autograd.grad(y, leaves, cot)))
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_reference_is_an_independent_oracle():
    """The reference's allowed pairs, written out for one case, and its rows equal a hand softmax."""
    allowed = allowed_pairs(6, 1, causal=True, num_global=1)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0],
                             [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    q, k, v, _ = _inputs(6, masked=False)
    y = kernels.local_attention(q, k, v, window=1, causal=True, scale=0.5, num_global=1, backend="reference")
    i = 4
    s = torch.einsum("he,jhe->hj", q[0, i], k[0]) * 0.5
    p = s.masked_fill(~expected[i], float("-inf")).softmax(-1)
    torch.testing.assert_close(y[0, i], torch.einsum("hj,jhp->hp", p, v[0]), atol=1e-14, rtol=0)


def test_planted_band_bug_is_caught(monkeypatch):
    """A band one token too wide in the blocked path fails the comparison above."""
    from mixer_plugins.kernels.local_attention import torch as backend

    original = backend._Blocks
    monkeypatch.setattr(backend, "_Blocks", lambda q, kr, plan, w, causal: original(q, kr, plan, w + 1, causal))
    with pytest.raises(AssertionError):
        test_torch_backend_matches_reference(30, 3, 1, True, True)


@pytest.mark.parametrize("bad,match", [
    (dict(window=-1), "window"), (dict(window=1.5), "window"), (dict(num_global=99), "num_global"),
    (dict(mask=torch.tensor([[True, False, True]] * 2)), "right-padded"),
])
def test_argument_errors(bad, match):
    q, k, v, _ = _inputs(3, masked=False)
    kw = dict(window=1) | bad
    with pytest.raises(ValueError, match=match):
        kernels.local_attention(q, k, v, **kw)


@pytest.mark.slow  # inductor compiles
def test_compiles_fullgraph_with_inductor():
    q, k, v, mask = _inputs(13, masked=True, dtype=torch.float32)

    def f(q, k, v, mask):
        return kernels.local_attention(q, k, v, window=3, causal=True, mask=mask, num_global=1)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.compile(f, fullgraph=True, backend="inductor")(*leaves, mask)
    got.sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = f(*ref_leaves, mask)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("L,window,num_global,causal", [(64, 8, 0, True), (64, 8, 2, False), (16, 20, 0, False)])
def test_flop_counter_counts_the_executed_pairs(L, window, num_global, causal):
    """FlopCounterMode counts the op by the executed chunk pairs (O(L * window), not L^2), backward included."""
    q, k = (torch.randn(1, L, 2, 4, requires_grad=True) for _ in range(2))
    v = torch.randn(1, L, 2, 3, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y = kernels.local_attention(q, k, v, window=window, causal=causal, num_global=num_global, backend="torch")
    parts = kernels.local_attention_flops(1, 2, L, window, causal, 4, 3, num_global=num_global)
    assert counter.get_total_flops() == sum(parts.values())
    c = min(window, L)
    pairs = L * L if c >= L else -(-L // c) * c * ((2 if causal else 3) * c) + num_global * (-(-L // c) * c + L)
    assert parts["scores"] == 2 * 2 * pairs * 4
    with FlopCounterMode(display=False) as counter:
        y.sum().backward()
    # the kept probabilities are not recomputed: dQ, dK (2x the score FLOPs), dP, dV (2x the value FLOPs)
    assert counter.get_total_flops() == 2 * parts["scores"] + 2 * parts["weighted_values"]
