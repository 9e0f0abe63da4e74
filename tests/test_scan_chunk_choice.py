"""The chunked scan's automatic chunk length (issue 14): balanced chunks, and one chunk without any state work for
short sequences. Both must give the reference backend's float64 results and gradients (1e-12), and the FLOP formula
must keep equalling FlopCounterMode's count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mixer_plugins import kernels
from mixer_plugins.kernels._scan import chunked_scan_flops
from mixer_plugins.kernels._scan.chunked import AUTO_CHUNK_MIN_STATE, chunk_length

F64 = torch.float64
# per-token state h * p * n = 4 * 16 * 64 = 4096: large enough for the automatic choice
H, P, G, N = 4, 16, 1, 64


def test_chunk_length_rule():
    # the ViT-S/16 scan (197 tokens, Hydra's defaults at dim 384: 12 heads of 64, state 64): 4 chunks of 50
    assert chunk_length(197, 64, 12, 64, 1, 64, 2) == 50
    assert chunk_length(197, 64, 12, 64, 1, 64, 1) == 50
    # Hydra at dim 256 and 1024 or 16384 tokens keeps chunks of 64
    assert chunk_length(1024, 64, 8, 64, 1, 64, 2) == 64
    assert chunk_length(16384, 64, 8, 64, 1, 64, 2) == 64
    # a sequence shorter than a chunk is one chunk; small scans keep the requested chunk size
    assert chunk_length(40, 64, 12, 64, 1, 64, 2) == 40
    assert chunk_length(37, 8, 4, 3, 2, 5, 2) == 8
    assert 4 * 3 * 5 < AUTO_CHUNK_MIN_STATE <= H * P * N


def _leaves(b, length, seed=0):
    torch.manual_seed(seed)
    return [t.requires_grad_(True) for t in (
        torch.randn(b, length, H, P, dtype=F64), torch.rand(b, length, H, dtype=F64) * 0.5,
        -torch.rand(H, dtype=F64) - 0.1, torch.randn(b, length, G, N, dtype=F64) * 0.3,
        torch.randn(b, length, G, N, dtype=F64) * 0.3, torch.rand(b, length, H, dtype=F64) * 0.5,
        torch.randn(b, length, G, N, dtype=F64) * 0.3, torch.randn(b, length, G, N, dtype=F64) * 0.3,
        torch.randn(b, length, H, dtype=F64))]


def _check_against_reference(fn, leaves):
    y = fn("torch")
    y_ref = fn("reference")
    ys, ys_ref = (y, y_ref) if isinstance(y, tuple) else ((y,), (y_ref,))
    for a, r in zip(ys, ys_ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    loss = sum((a * a.cos()).sum() for a in ys)
    loss_ref = sum((r * r.cos()).sum() for r in ys_ref)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads_ref = torch.autograd.grad(loss_ref, leaves, allow_unused=True)
    for g, r in zip(grads, grads_ref):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [40, 120])   # one chunk (40 at chunk 64), 8 balanced chunks of 15 (120 at 16)
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("segments", [False, True])
def test_quasiseparable_with_the_chosen_chunks_matches_the_reference(length, shift, segments):
    chunk = {40: 64, 120: 16}[length]
    assert chunk_length(length, chunk, H, P, G, N, 2) == {40: 40, 120: 15}[length]
    leaves = _leaves(2, length)
    x, dt, A, B, C, dt_b, B_b, C_b, diag = leaves
    seq_idx = None
    if segments:
        seq_idx = torch.zeros(2, length, dtype=torch.long)
        seq_idx[0, 11:] = 1
        seq_idx[1, 30:] = 2
    _check_against_reference(
        lambda backend: kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag,
                                               shift=shift, chunk_size=chunk, seq_idx=seq_idx, backend=backend),
        leaves)


@pytest.mark.parametrize("length", [13, 45, 100])
def test_ssd_initial_and_final_states_with_the_chosen_chunks(length):
    assert chunk_length(length, 16, H, P, G, N, 1) == {13: 13, 45: 15, 100: 15}[length]
    leaves = _leaves(2, length)
    x, dt, A, B, C, *_ = leaves
    init = torch.randn(2, H, P, N, dtype=F64, requires_grad=True)
    _check_against_reference(
        lambda backend: kernels.ssd(x, dt, A, B, C, 16, initial_states=init, return_final_states=True,
                                    backend=backend), [*leaves[:5], init])
    _check_against_reference(lambda backend: kernels.ssd(x, dt, A, B, C, 64, backend=backend), leaves[:5])


@pytest.mark.parametrize("reverse", [False, True])
def test_directional_scan_in_one_chunk(reverse):
    leaves = _leaves(1, 40)
    x, dt, A, B, C, *_ = leaves
    _check_against_reference(lambda backend: kernels.directional_scan(x, dt, A, B, C, reverse=reverse, shift=True,
                                                                      chunk_size=64, backend=backend), leaves[:5])


def test_a_short_sequence_is_one_chunk_without_state_products():
    b, length = 2, 40
    x, dt, A, B, C, dt_b, B_b, C_b, diag = (t.detach().float() for t in _leaves(b, length))
    with FlopCounterMode(display=False) as counter:
        kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag, chunk_size=64,
                               backend="torch")
    # only the two C.B products and the block times x: no chunk states, read-outs or state pass
    only_quadratic = 2 * b * length * length * (2 * G * N + H * P)
    assert counter.get_total_flops() == only_quadratic == chunked_scan_flops(b, length, H, P, G, N, 2, 64)
    with FlopCounterMode(display=False) as counter:   # the final state needs the forward direction's states
        kernels.ssd(x, dt, A, B, C, 64, return_final_states=True, backend="torch")
    assert counter.get_total_flops() == chunked_scan_flops(b, length, H, P, G, N, 1, 64, final_state=True)
    with FlopCounterMode(display=False) as counter:   # balanced chunks: 100 tokens at chunk 16 are 7 chunks of 15
        x100, dt100, A100, B100, C100, *_ = (t.detach().float() for t in _leaves(b, 100))
        kernels.ssd(x100, dt100, A100, B100, C100, 16, backend="torch")
    assert counter.get_total_flops() == chunked_scan_flops(b, 100, H, P, G, N, 1, 16)


@pytest.fixture
def one_chunk_per_tile(monkeypatch):
    """Tiles of one chunk each (what a large batch gets): the state pass's one-chunk path."""
    import mixer_plugins.kernels._scan.chunked as chunked

    monkeypatch.setattr(chunked, "TILE_ELEMENTS", 1)


@pytest.mark.parametrize("segments", [False, True])
def test_one_chunk_per_tile_matches_the_reference(one_chunk_per_tile, segments):
    leaves = _leaves(2, 45)
    x, dt, A, B, C, dt_b, B_b, C_b, diag = leaves
    seq_idx = None
    if segments:
        seq_idx = torch.zeros(2, 45, dtype=torch.long)
        seq_idx[0, 15:] = 1          # on a chunk boundary (chunks of 15)
        seq_idx[1, 20:] = 2
    _check_against_reference(
        lambda backend: kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag,
                                               chunk_size=16, seq_idx=seq_idx, backend=backend), leaves)
    init = torch.randn(2, H, P, N, dtype=F64, requires_grad=True)
    _check_against_reference(
        lambda backend: kernels.ssd(x, dt, A, B, C, 16, initial_states=init, return_final_states=True,
                                    seq_idx=seq_idx, backend=backend), [*leaves[:5], init])
    _check_against_reference(
        lambda backend: kernels.directional_scan(x, dt, A, B, C, reverse=True, chunk_size=16, seq_idx=seq_idx,
                                                 backend=backend), leaves[:5])


def test_flop_formula_with_one_chunk_per_tile(one_chunk_per_tile):
    b, length = 2, 45
    x, dt, A, B, C, dt_b, B_b, C_b, diag = (t.detach().float() for t in _leaves(b, length))
    init = torch.randn(b, H, P, N)
    cases = [
        (lambda: kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, chunk_size=16,
                                        backend="torch"), dict(directions=2)),
        (lambda: kernels.ssd(x, dt, A, B, C, 16, initial_states=init, backend="torch"),
         dict(directions=1, initial_state=True)),
        (lambda: kernels.ssd(x, dt, A, B, C, 16, return_final_states=True, backend="torch"),
         dict(directions=1, final_state=True)),
        (lambda: kernels.directional_scan(x, dt, A, B, C, reverse=True, chunk_size=16, backend="torch"),
         dict(directions=1)),
    ]
    for call, options in cases:
        directions = options.pop("directions")
        with FlopCounterMode(display=False) as counter:
            call()
        assert counter.get_total_flops() == chunked_scan_flops(b, length, H, P, G, N, directions, 16, **options)
