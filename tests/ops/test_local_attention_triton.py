"""``kernels.local_attention``'s Triton backend (the MLR kernel with a band and global tokens) against the dense
reference: forward and every gradient, tiles skipped outside the band.

Like ``tests/ops/test_mlr_attention_triton_kernels.py``, the CPU checks run under ``TRITON_INTERPRET=1`` in a fresh
interpreter (``MIXER_PLUGINS_TRITON_FRESH=1``), started by :func:`test_local_attention_kernels_under_the_interpreter`;
with CUDA the checks run in this process.
"""

from __future__ import annotations

import os

import pytest
import torch

FRESH = os.environ.get("MIXER_PLUGINS_TRITON_FRESH") == "1"
IN_PROCESS = FRESH or torch.cuda.is_available()

pytestmark = pytest.mark.triton


@pytest.mark.skipif(IN_PROCESS, reason="the checks run in this process")
@pytest.mark.slow  # a Triton-interpreter suite in a fresh process
def test_local_attention_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from helpers import assert_passes_fresh

    assert_passes_fresh("ops/test_local_attention_triton.py",
                        {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=600)


if IN_PROCESS:
    pytest.importorskip("triton")
    from helpers import fast_interpreter  # noqa: F401  (autouse fixture: interpreter speed shims)

DEVICE = "cuda" if torch.cuda.is_available() and not FRESH else "cpu"
needs_kernels = pytest.mark.skipif(not IN_PROCESS, reason="runs under the interpreter in a fresh process")


def _inputs(L, *, masked, seed=0, e=4, p=3):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, L, 2, e, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, L, 2, p, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.ones(2, L, dtype=torch.bool)
        mask[1, L - 4:] = False
        for t in (q, k, v):
            t[~mask] = float("nan")  # pads must never reach a real output or gradient
    return q, k, v, mask


def _triton(q, k, v, *, window, causal, mask, scale, num_global, tile, kernel_window=None):
    """The backend on float32 copies; ``kernel_window`` plants a wrong band in the kernel (the test's own check)."""
    from mixer_plugins.kernels.local_attention import triton as backend

    zero = torch.zeros((), dtype=q.dtype)
    if mask is not None:  # as the op does before any backend
        q, k, v = (torch.where(mask[:, :, None, None], t, zero) for t in (q, k, v))
    args = [t.float().to(DEVICE) for t in (q, k, v)]
    m = None if mask is None else mask.to(DEVICE)
    y = backend.local_attention_triton(*args, window=window if kernel_window is None else kernel_window,
                                       causal=causal, mask=m, scale=scale, num_global=num_global, tile_size=tile)
    if m is not None:
        y = torch.where(m[:, :, None, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.double().cpu()


def _check(L, window, num_global, causal, masked, tile, kernel_window=None):
    from mixer_plugins.kernels import local_attention

    q, k, v, mask = _inputs(L, masked=masked)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(window=window, causal=causal, mask=mask, scale=0.7, num_global=num_global)
    want = local_attention(*leaves, backend="reference", **kw)
    got = _triton(*leaves, tile=tile, kernel_window=kernel_window, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g_want = torch.autograd.grad(want, leaves, cot)
    g_got = torch.autograd.grad(got, leaves, cot)
    for name, a, b in zip("qkv", g_got, g_want):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5, msg=lambda m, name=name: f"d{name}: {m}")


CASES = {
    # L, window, num_global, causal, masked, tile: odd lengths, windows that are no multiple of the tile
    "band": (13, 3, 0, False, True, 4),
    "band-causal": (13, 3, 0, True, True, 4),
    "one-global": (11, 5, 1, False, False, 4),
    "globals-causal": (11, 2, 3, True, True, 4),
    "globals-over-tiles": (17, 2, 6, False, True, 4),
    "window-0": (10, 0, 2, False, False, 4),
    "window>=L": (9, 20, 0, True, False, 4),
    "window>=L-bidir": (9, 9, 0, False, True, 8),
}


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_local_attention_triton_matches_reference(case):
    _check(*CASES[case])


@needs_kernels
@pytest.mark.parametrize("delta", [1, -1])
def test_planted_off_by_one_band_is_caught(delta):
    """The checks above fail on a band one token too wide or too narrow."""
    L, window, num_global, causal, masked, tile = CASES["globals-causal"]
    with pytest.raises(AssertionError):
        _check(L, window, num_global, causal, masked, tile, kernel_window=window + delta)


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_outside_the_band_are_never_visited(causal):
    """NaN in a key tile that is outside the band of a query tile (and holds no global token): a visited tile would
    put ``0 * NaN`` into that query tile's output (the per-entry mask zeroes probabilities, not values), so finite
    outputs and gradients there show the tile was skipped in the forward, the dq and the dk/dv loops."""
    L, window, tile, bad = 24, 2, 4, 21
    q, k, v, _ = _inputs(L, masked=False)
    for t in (q, k, v):
        t[:, bad] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # causal: global token 0 (its key tile is visited by every query tile; as a query it sees only itself)
    num_global = 1 if causal else 0
    y = _triton(*leaves, window=window, causal=causal, mask=None, scale=0.7, num_global=num_global, tile=tile)
    # query tiles 0-3 (tokens 0-15) reach key tile 4 at most; token 21 lies in key tile 5
    assert torch.isfinite(y[:, :16]).all()
    assert torch.isnan(y[:, 20:]).any()  # ... and the band does see it
    dq, dk, dv = torch.autograd.grad(y[:, :16].sum(), leaves)
    assert torch.isfinite(dq[:, :16]).all()
    # key tiles 0-2 are seen by query tiles 0-3 only (whose rows are finite), except key tile 0 when it holds a
    # global key (then every query tile sees it, the NaN rows included)
    lo = 4 if num_global else 0
    assert torch.isfinite(dk[:, lo:12]).all() and torch.isfinite(dv[:, lo:12]).all()


@needs_kernels
def test_dispatcher_picks_triton_on_cuda_and_torch_for_float64():
    from mixer_plugins import kernels

    rows = {(r.op, r.backend): r for r in kernels.backend_report(devices=["cuda"])}
    assert rows["local_attention", "triton"].automatic
    q, k, v, mask = _inputs(9, masked=True)
    with pytest.raises(kernels.BackendUnavailableError, match="float64"):
        kernels.local_attention(q, k, v, window=2, mask=mask, backend="triton")
    got = kernels.local_attention(q.float(), k.float(), v.float(), window=2, mask=mask, backend="triton")
    want = kernels.local_attention(q, k, v, window=2, mask=mask, backend="reference")
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("name", ["sliding_window_attention", "global_local_attention"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixers_run_on_the_triton_kernel(name, causal, monkeypatch):
    """The windowed mixers through the Triton backend (float32) equal their own matrix (float64)."""
    from mixer_plugins import create_mixer, kernels
    from mixer_plugins.kernels.local_attention import triton as backend

    calls = []
    original = backend.local_attention_triton
    monkeypatch.setattr(backend, "local_attention_triton", lambda *a, **kw: calls.append(1) or original(*a, **kw))

    torch.manual_seed(0)
    mixer = create_mixer(name, dim=16, num_heads=2, window=3, causal=causal).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False
    want = mixer.forward_via_matrix(x, mask=mask)
    with kernels.use_backend("triton"):
        got = mixer.float()(x.float(), mask=mask)
    assert calls, "the mixer did not reach the Triton kernel"
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
