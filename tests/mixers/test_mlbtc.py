"""MLBTC: every named configuration equals its direct construction (written here from its own definition)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mixer_plugins.layers import mup
from mixer_plugins.layers.mlbtc import MLBTC, BTCLevel, factorize


@pytest.fixture(autouse=True)
def _float64():
    """Every test here compares matrices in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _check_matvec(module: MLBTC, dense: torch.Tensor) -> None:
    """``module.to_dense()`` and ``module(x)`` both agree with ``dense``."""
    torch.testing.assert_close(module.to_dense(), dense, rtol=1e-12, atol=1e-12)
    x = torch.randn(3, 5, module.in_features)
    torch.testing.assert_close(module(x), x @ dense.T, rtol=1e-12, atol=1e-12)


def _permutation(rows: int, cols: int) -> torch.Tensor:
    """The permutation matrix taking a vector laid out (a, b) (index a * cols + b) to (b, a) (index b * rows + a)."""
    perm = torch.zeros(rows * cols, rows * cols)
    for a in range(rows):
        for b in range(cols):
            perm[b * rows + a, a * cols + b] = 1.0
    return perm


def test_low_rank_is_u_v_transpose():
    module = MLBTC.low_rank(7, 5, rank=2)
    u = module.left_0[0, 0, :, 0, :]   # (n, r)
    v = module.right_0[0, 0, :, 0, :]  # (m, r)
    _check_matvec(module, u @ v.T)
    assert torch.linalg.matrix_rank(module.to_dense()) == 2


def test_dense_configuration_reproduces_any_matrix():
    target = torch.randn(6, 4)
    module = MLBTC.dense(6, 4)
    u, s, vh = torch.linalg.svd(target, full_matrices=False)
    with torch.no_grad():
        module.left_0.copy_((u * s)[None, None, :, None, :])
        module.right_0.copy_(vh.T[None, None, :, None, :])
    _check_matvec(module, target)


def test_kronecker_is_kron():
    module = MLBTC.kronecker((2, 3), (4, 5))
    a = module.left_0[0, 0, :, :, 0].contiguous()      # (n1, m1)
    b = module.right_0[0, 0, :, :, 0].T.contiguous()   # (n2, m2); kron needs dense strides
    _check_matvec(module, torch.kron(a, b))
    # The tied cores are smaller than an untied BTC's.
    assert module.left_0.shape == (1, 1, 2, 3, 1) and module.right_0.shape == (1, 1, 5, 4, 1)


@pytest.mark.parametrize("rank", [1, 2])  # rank 1: Monarch; rank 2: BTT
def test_monarch_and_btt_equal_permuted_block_diagonal_products(rank):
    """W = P_L blockdiag(L) P_R blockdiag(R), the classical Monarch form generalised to rank s (BTT)."""
    (n1, n2), (m1, m2) = (3, 4), (2, 5)
    module = MLBTC.monarch((n1, n2), (m1, m2)) if rank == 1 else MLBTC.btt((n1, n2), (m1, m2), rank)
    left, right = module.left_0[0], module.right_0[0]  # (n2, n1, m1, s), (m1, m2, n2, s)
    s = rank
    # R: block-diagonal over the m1 input blocks; block j1 maps m2 inputs to (i2, sigma) = n2 * s values.
    r_blocks = [right[j1].permute(1, 2, 0).reshape(n2 * s, m2) for j1 in range(m1)]
    big_r = torch.block_diag(*r_blocks)                      # rows (j1, i2, sigma)
    # P_R regroups (j1; i2, sigma) into (i2; j1, sigma).
    p_r = torch.zeros(m1 * n2 * s, m1 * n2 * s)
    for j1 in range(m1):
        for i2 in range(n2):
            for sig in range(s):
                p_r[(i2 * m1 + j1) * s + sig, (j1 * n2 + i2) * s + sig] = 1.0
    # L: block-diagonal over the n2 output blocks; block i2 maps (j1, sigma) to n1 outputs.
    l_blocks = [left[i2].reshape(n1, m1 * s) for i2 in range(n2)]
    big_l = torch.block_diag(*l_blocks)                      # rows (i2, i1)
    p_l = _permutation(n2, n1)                               # (i2, i1) -> (i1, i2)
    direct = p_l @ big_l @ p_r @ big_r
    _check_matvec(module, direct)
    if rank == 1:
        # Monarch: every (i2, j1) slice W[(., i2), (j1, .)] has rank 1.
        w = module.to_dense().view(n1, n2, m1, m2)
        for i2 in range(n2):
            for j1 in range(m1):
                assert torch.linalg.matrix_rank(w[:, i2, j1, :]) <= 1


def test_block_diagonal():
    module = MLBTC.block_diagonal(6, 9, blocks=3)
    blocks = []
    for k in range(3):
        u = module.left_0[k, 0, :, 0, :]
        v = module.right_0[k, 0, :, 0, :]
        blocks.append(u @ v.T)
    _check_matvec(module, torch.block_diag(*blocks))


def test_mlr_is_a_sum_of_block_diagonal_low_rank_levels():
    ranks, blocks = [3, 2, 1], [1, 2, 4]
    module = MLBTC.mlr(8, 12, ranks)  # default blocks 2^l
    direct = torch.zeros(8, 12)
    for level, (r, p) in enumerate(zip(ranks, blocks)):
        left, right = getattr(module, f"left_{level}"), getattr(module, f"right_{level}")
        assert left.shape == (p, 1, 8 // p, 1, r) and right.shape == (p, 1, 12 // p, 1, r)
        direct += torch.block_diag(*[left[k, 0, :, 0, :] @ right[k, 0, :, 0, :].T for k in range(p)])
    _check_matvec(module, direct)


def test_parameters_and_macs_equal_s_times_n_m1_plus_m_n2():
    level = BTCLevel((3, 4), (2, 5), rank=2, blocks=2)  # n = 24, m = 20
    module = MLBTC([level])
    expected = 2 * 2 * (3 * 4 * 2 + 2 * 5 * 4)  # blocks * s * (n_block * m1 + m_block * n2)
    assert sum(p.numel() for p in module.parameters()) == expected
    assert module.macs_per_vector() == expected
    x = torch.randn(7, module.in_features)
    with FlopCounterMode(display=False) as counter:
        module(x)
    assert counter.get_total_flops() == 2 * 7 * expected


def test_forward_applies_to_the_last_axis_and_rejects_a_wrong_width():
    module = MLBTC.btt((2, 3), (3, 2), rank=2)
    x = torch.randn(2, 3, 4, 6)
    assert module(x).shape == (2, 3, 4, 6)
    with pytest.raises(ValueError, match="last axis of 6"):
        module(torch.randn(2, 5))


def test_invalid_levels_are_rejected_with_clear_messages():
    with pytest.raises(ValueError, match="same shape"):
        MLBTC([BTCLevel((2, 2), (2, 2)), BTCLevel((3, 1), (2, 2))])
    with pytest.raises(ValueError, match="rank must be positive"):
        BTCLevel((2, 2), (2, 2), rank=0)
    with pytest.raises(ValueError, match="two positive integers"):
        BTCLevel((2, 0), (2, 2))
    with pytest.raises(ValueError, match="divide"):
        MLBTC.mlr(6, 6, [1, 1, 1])  # 4 blocks do not divide 6
    with pytest.raises(ValueError, match="at least one level"):
        MLBTC([])


def test_rms_cap_rescales_inflated_cores_to_kappa():
    module = MLBTC.btt((4, 6), (4, 6), rank=2, rms_cap=True)
    level = module.levels[0]
    with torch.no_grad():
        module.right_0.mul_(10.0)
    left, right = module.cores(0)
    kappa_right = mup.rms_cap_target(level.right_fan_in(), 6 * 2)  # d_in = m2, d_out = n2 * s
    torch.testing.assert_close(right.pow(2).mean().sqrt(), torch.tensor(kappa_right))
    # The dense matrix uses the capped cores too.
    uncapped = MLBTC([level])
    uncapped.load_state_dict(module.state_dict())
    assert not torch.allclose(uncapped.to_dense(), module.to_dense())


def test_mup_fan_ins_are_the_cores_own():
    module = MLBTC.btt((4, 24), (4, 6), rank=2)
    fan_ins = mup.mup_fan_ins(module)
    assert fan_ins == {"left_0": 4 * 2, "right_0": 6}  # m1 * s and m2


@pytest.mark.parametrize("n, expected", [(64, (4, 16)), (128, (8, 16)), (256, (8, 32)), (512, (16, 32)),
                                         (768, (24, 32)), (1024, (16, 64)), (32, (4, 8)), (7, (1, 7)), (1, (1, 1))])
def test_factorize_matches_the_reference_rule(n, expected):
    assert factorize(n) == expected
