"""Structured softmax attention (Kuang et al. 2025) and its baselines, against references written from the formulas.

The spec's tests T1-T9 (``/shared/design/structured_attention.md`` section 8), FLOP counts against
``FlopCounterMode``, causality, and clear errors for bad options. Everything numeric runs in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins.layers.mlbtc import MLBTC
from mixer_plugins.mixers.base import strip_mixer_records
from mixer_plugins.mixers.mlr_attention import mlr_level_counts
from mixer_plugins.testing import check_mixer

F64 = torch.float64
STRUCTURED = ["btt_attention", "mlr_attention", "bilinear_mlr_attention", "sliding_window_attention",
              "global_local_attention"]


def make(name: str, dim: int = 32, **options):
    return mp.create_mixer(name, dim, **options).to(F64).eval()


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def right_padded(lengths: list[int], total: int) -> torch.Tensor:
    return torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]


def reference_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over allowed keys; rows with none (pads) are zero."""
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.nan_to_num(probs, nan=0.0)


def allowed_pairs(length: int, causal: bool, mask: torch.Tensor | None, batch: int) -> torch.Tensor:
    allowed = torch.ones(batch, 1, length, length, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask[:, None, None, :] & mask[:, None, :, None]
    return allowed


def qkv_heads(mixer, x):
    """q, k (QK-LN applied when on) and v of a q/k/v mixer, written out from its parameters."""
    b, l, d = x.shape
    h, r = mixer.num_heads, mixer.head_dim
    qkv = x @ mixer.qkv.weight.T + (mixer.qkv.bias if mixer.qkv.bias is not None else 0.0)
    q, k, v = qkv.view(b, l, 3, h, r).unbind(2)
    if mixer.q_norm is not None:
        q = F.layer_norm(q, (r,), mixer.q_norm.weight)
        k = F.layer_norm(k, (r,), mixer.k_norm.weight)
    return q, k, v


def output_from_probs(mixer, probs, v, mask=None):
    y = torch.einsum("bhij,bjhp->bihp", probs, v).flatten(2)
    out = y @ mixer.proj.weight.T + (mixer.proj.bias if mixer.proj.bias is not None else 0.0)
    return out if mask is None else out * mask[..., None]


# -- the conformance kit with the causal option on (the suite runs the defaults) --------------------------------------

@pytest.mark.parametrize("name", STRUCTURED)
def test_causal_variants_pass_the_kit(name):
    assert all(r.passed for r in check_mixer(name, options={"causal": True}))


# -- T1: standard attention's score is a rank-r bilinear form; BTT's is full rank --------------------------------------

def test_t1_mha_is_a_low_rank_bilinear_form_and_btt_is_full_rank():
    dim, heads = 24, 3
    att = make("attention", dim, num_heads=heads, qkv_bias=False)
    x = randn(2, 9, dim)
    probs = att.materialize(x)
    wq, wk, _ = att.qkv.weight.split(dim, 0)
    r = dim // heads
    for h in range(heads):
        bilinear = wq[h * r:(h + 1) * r].T @ wk[h * r:(h + 1) * r]        # D x D = W_Q^h W_K^h^T
        scores = att.scale * x @ bilinear @ x.transpose(1, 2)
        torch.testing.assert_close(probs[:, h], scores.softmax(-1), rtol=1e-10, atol=1e-12)
        assert torch.linalg.matrix_rank(bilinear) == r
    btt = make("btt_attention", dim, num_heads=heads, factors=[4, 6])
    for m_h in btt.key_matrices():
        assert torch.linalg.matrix_rank(m_h) == dim  # a Monarch (s = 1) matrix per head, generically invertible


# -- T2: one-level MLR is standard attention at tau = 1/d_head -------------------------------------------------------

@pytest.mark.parametrize("block_sizes", [[None], [64]])  # global, or one block longer than the sequence
def test_t2_one_level_mlr_equals_attention_at_scale_one_over_head_dim(block_sizes):
    att = make("attention", 32, num_heads=2, scale=1 / 16, qkv_bias=False, out_bias=False)
    mlr = make("mlr_attention", 32, num_heads=2, ranks=[16], block_sizes=block_sizes, qk_norm=False)
    mlr.load_state_dict(strip_mixer_records(att.state_dict()))  # another mixer's weights, on purpose
    x, mask = randn(3, 11, 32), right_padded([11, 7, 1], 11)
    torch.testing.assert_close(mlr(x, mask=mask), att(x, mask=mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mlr.materialize(x, mask=mask), att.materialize(x, mask=mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_divide, scale", [(False, 1 / 4), (True, 1 / 16)])
def test_t2_all_global_levels_with_equal_scales_equal_attention(block_divide, scale):
    # Four global levels of rank 4 (tau_l = 1/4 each): the level sum is attention at 1/4; block-divide divides by 4.
    att = make("attention", 32, num_heads=2, scale=scale, qkv_bias=False, out_bias=False, causal=True)
    mlr = make("mlr_attention", 32, num_heads=2, ranks=[4, 4, 4, 4], block_sizes=[None] * 4, qk_norm=False,
               block_divide=block_divide, causal=True)
    mlr.load_state_dict(strip_mixer_records(att.state_dict()))  # another mixer's weights, on purpose
    x = randn(2, 10, 32)
    torch.testing.assert_close(mlr(x), att(x), rtol=1e-10, atol=1e-12)


# -- T3: MLR block structure ----------------------------------------------------------------------------------------

def mlr_reference_scores(mixer, x):
    """S = sum_l [same level-l block] * q^(l) . k^(l) * tau_l, block-divided: the definition, looping over blocks."""
    q, k, _ = qkv_heads(mixer, x)
    length = x.shape[1]
    scores = torch.zeros(x.shape[0], mixer.num_heads, length, length, dtype=F64)
    counts = torch.zeros(length, length, dtype=F64)
    start = 0
    levels = len(mixer.ranks)
    for rank, size in zip(mixer.ranks, mixer.block_sizes):
        ql, kl = q[..., start:start + rank], k[..., start:start + rank]
        start += rank
        tau = (1.0 / rank if mixer.config.logit_scaling == "mup" else 1.0 / math.sqrt(rank))
        tau *= mixer.config.logit_multiplier / (levels if mixer.config.divide_by_levels else 1)
        step = length if size is None else size
        for lo in range(0, length, step):
            blk = slice(lo, min(lo + step, length))  # the last block may be partial
            scores[:, :, blk, blk] += tau * torch.einsum("bihe,bjhe->bhij", ql[:, blk], kl[:, blk])
            counts[blk, blk] += 1
    if mixer.block_divide:
        scores = scores / counts.clamp(min=1)
    return scores


MLR_CASES = [
    dict(ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2]),
    dict(ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2], block_divide=False, divide_by_levels=True),
    dict(ranks=[8, 4, 2, 2], block_sizes=[6, 3, 3, 1]),                 # no global level: far pairs score 0
    dict(ranks=[4, 4, 8], block_sizes=[None, None, 5], qk_norm=False, logit_scaling="standard"),
    dict(ranks=[16], block_sizes=[4]),                                  # one local level
]


@pytest.mark.parametrize("options", MLR_CASES)
@pytest.mark.parametrize("length", [1, 13, 24])
def test_t3_blockwise_scores_equal_the_definition(options, length):
    mixer = make("mlr_attention", 32, num_heads=2, **options)
    x = randn(2, length, 32)
    ctx = mixer.prepare(x, None)
    torch.testing.assert_close(mixer.scores(ctx), mlr_reference_scores(mixer, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", MLR_CASES[:3])
@pytest.mark.parametrize("causal", [False, True])
def test_t3_mlr_output_equals_the_reference(options, causal):
    mixer = make("mlr_attention", 32, num_heads=2, causal=causal, **options)
    x, mask = randn(3, 19, 32), right_padded([19, 12, 5], 19)
    probs = reference_softmax(mlr_reference_scores(mixer, x), allowed_pairs(19, causal, mask, 3))
    _, _, v = qkv_heads(mixer, x)
    torch.testing.assert_close(mixer.materialize(x, mask=mask), probs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer(x, mask=mask), output_from_probs(mixer, probs, v, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", MLR_CASES[:3])
def test_t3_blockwise_gradients_equal_the_dense_path(options):
    """The fast path merges blocks with a custom autograd Function: its gradients must match the dense formula."""
    mixer = make("mlr_attention", 32, num_heads=2, **options)
    x = randn(2, 21, 32).requires_grad_(True)
    probe = randn(2, 21, 32, seed=7)
    params = [x, *mixer.parameters()]
    fast = torch.autograd.grad((mixer(x) * probe).sum(), params)
    dense = torch.autograd.grad((mixer.forward_via_matrix(x) * probe).sum(), params)
    for a, b in zip(fast, dense):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_t3_block_divide_counts():
    counts = mlr_level_counts(16, [None, 8, 4])
    assert counts[0].tolist() == [3, 3, 3, 3, 2, 2, 2, 2] + [1] * 8
    assert counts[13].tolist() == [1] * 8 + [2] * 4 + [3] * 4
    # A last partial block is a block: at length 10 with blocks of 4, tokens 8 and 9 share only their own block.
    partial = mlr_level_counts(10, [None, 4])
    assert partial[9].tolist() == [1] * 8 + [2, 2]


def test_t3_scores_are_zero_across_blocks_without_a_global_level():
    mixer = make("mlr_attention", 32, num_heads=2, ranks=[16], block_sizes=[4])
    scores = mixer.scores(mixer.prepare(randn(1, 10, 32), None))
    block = torch.arange(10) // 4
    across = block[:, None] != block[None, :]
    assert (scores[..., across] == 0).all() and (scores[..., ~across] != 0).all()


def test_mlr_blocks_do_not_depend_on_the_length():
    """Default block sizes are fixed token counts: level 0 global, then halving down to min_block_size."""
    assert make("mlr_attention", 32, num_heads=2).block_sizes == [None, 32, 16, 8]
    eight = make("mlr_attention", 256, num_heads=4, ranks=[32, 8, 6, 4, 4, 4, 4, 2])
    assert eight.block_sizes == [None, 512, 256, 128, 64, 32, 16, 8]  # the paper's blocks at its length 1024
    # A prefix of the sequence is scored exactly like the whole sequence (causal: no look-ahead to change it).
    mixer = make("mlr_attention", 32, num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2], causal=True)
    x = randn(2, 29, 32)
    torch.testing.assert_close(mixer(x)[:, :11], mixer(x[:, :11]), rtol=1e-10, atol=1e-12)


# -- T4: causality -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, options", [
    ("btt_attention", {}),
    ("mlr_attention", {"ranks": [8, 4, 2, 2], "block_sizes": [None, 8, 4, 2]}),
    ("bilinear_mlr_attention", {"ranks": [8, 4, 4]}),
    ("sliding_window_attention", {"window": 3}),
    ("global_local_attention", {"window": 3}),
])
def test_t4_causal_outputs_ignore_the_future(name, options):
    mixer = make(name, 32, num_heads=2, causal=True, **options)
    x = randn(2, 30, 32)
    for t in (0, 7, 17, 28):
        changed = x.clone()
        changed[:, t + 1:] = randn(2, 29 - t, 32, seed=t + 5)
        torch.testing.assert_close(mixer(changed)[:, :t + 1], mixer(x)[:, :t + 1], rtol=0, atol=1e-12)


# -- T5: BTT fast path equals the materialized form --------------------------------------------------------------------

def btt_reference_matrices(mixer) -> torch.Tensor:
    """M_h[(alpha, beta), (gamma, delta)] = sum_s L[(h, beta), alpha, (gamma, s)] R[gamma, delta, (h, beta, s)], entry
    by entry from the paper's core layouts, with the RMS cap W / max(1, rms(W) / kappa)."""
    heads, c, d, s, dim = mixer.num_heads, mixer.c, mixer.d, mixer.btt_rank, mixer.dim
    a, b = c, d
    left = mixer.key_transform.left_0.detach().reshape(heads * b, a, c * s)      # (H*b, a, c*s)
    right = mixer.key_transform.right_0.detach().reshape(c, d, heads * b * s)    # (c, d, H*b*s)
    if mixer.config.rms_cap:
        def cap(w, fan_in, fan_out):
            kappa = math.sqrt(min(fan_in, fan_out)) / fan_in
            return w / max(1.0, (w.pow(2).mean() + 1e-8).sqrt().item() / kappa)  # the released code's +1e-8
        left, right = cap(left, c * s, a), cap(right, d, heads * b * s)
    mats = torch.zeros(heads, dim, dim, dtype=F64)
    for h in range(heads):
        for beta in range(b):
            for alpha in range(a):
                for gamma in range(c):
                    for sig in range(s):
                        mats[h, alpha * b + beta, gamma * d:(gamma + 1) * d] += (
                            left[h * b + beta, alpha, gamma * s + sig] * right[gamma, :, (h * b + beta) * s + sig])
    return mats


@pytest.mark.parametrize("options", [dict(btt_rank=1), dict(btt_rank=2), dict(btt_rank=3, input_norm=True),
                                     dict(btt_rank=2, rms_cap=False, logit_scaling="mup")])
def test_t5_btt_fast_path_equals_the_materialized_formula(options):
    mixer = make("btt_attention", 24, num_heads=3, factors=[4, 6], **options)
    with torch.no_grad():  # make the RMS cap bite on one core
        mixer.key_transform.left_0.mul_(3.0)
    x, mask = randn(2, 10, 24), right_padded([10, 6], 10)
    mats = btt_reference_matrices(mixer)
    torch.testing.assert_close(mixer.key_matrices(), mats, rtol=1e-12, atol=1e-12)
    ctx = mixer.prepare(x, mask)
    query = ctx.query
    if options.get("input_norm"):
        torch.testing.assert_close(query, F.layer_norm(x, (24,), mixer.input_norm.weight), rtol=1e-12, atol=1e-12)
    keys = F.layer_norm(torch.einsum("hed,bjd->bjhe", mats, query), (24,), mixer.key_norm.weight)
    torch.testing.assert_close(mixer.keys(ctx), keys, rtol=1e-12, atol=1e-12)
    tau = 1 / 24 if options.get("logit_scaling") == "mup" else 1 / math.sqrt(24)
    scores = tau * torch.einsum("bie,bjhe->bhij", query, keys)
    probs = reference_softmax(scores, allowed_pairs(10, False, mask, 2))
    v = (query @ mixer.value.weight.T).view(2, 10, 3, 8)  # values from the normalised x, as the released code
    torch.testing.assert_close(mixer.materialize(x, mask=mask), probs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer(x, mask=mask), output_from_probs(mixer, probs, v, mask), rtol=1e-10, atol=1e-12)


# -- T6: BTT expressivity --------------------------------------------------------------------------------------------

def _set_btt_cores(mixer, left, right):
    with torch.no_grad():
        mixer.key_transform.left_0.copy_(left.reshape(mixer.key_transform.left_0.shape))
        mixer.key_transform.right_0.copy_(right.reshape(mixer.key_transform.right_0.shape))


def test_t6_rank_one_btt_slices_have_rank_one():
    mixer = make("btt_attention", 24, num_heads=2, factors=[4, 6], btt_rank=1)
    for m_h in mixer.key_matrices():
        slices = m_h.view(4, 6, 4, 6)  # (alpha, beta, gamma, delta)
        for beta in range(6):
            for gamma in range(4):
                assert torch.linalg.matrix_rank(slices[:, beta, gamma, :]) <= 1


def test_t6_full_btt_rank_reproduces_any_dense_matrix():
    heads, c, d = 2, 4, 6
    a, b, s = c, d, min(c, d)
    mixer = make("btt_attention", 24, num_heads=heads, factors=[c, d], btt_rank=s, rms_cap=False)
    target = randn(heads, 24, 24, seed=3)
    left = torch.zeros(heads * b, a, c, s, dtype=F64)
    right = torch.zeros(c, d, heads * b, s, dtype=F64)
    for h in range(heads):
        for beta in range(b):
            for gamma in range(c):
                block = target[h].view(a, b, c, d)[:, beta, gamma, :]  # a x d
                u, sv, vh = torch.linalg.svd(block, full_matrices=False)
                left[h * b + beta, :, gamma, :] = u * sv
                right[gamma, :, h * b + beta, :] = vh.T
    _set_btt_cores(mixer, left, right)
    torch.testing.assert_close(mixer.key_matrices(), target, rtol=1e-12, atol=1e-12)


def test_t6_shared_cores_give_a_kronecker_product():
    heads, c, d = 2, 4, 6
    mixer = make("btt_attention", 24, num_heads=heads, factors=[c, d], btt_rank=1, rms_cap=False)
    a_mats, b_mats = randn(heads, c, c, seed=4), randn(heads, d, d, seed=5)
    left = torch.zeros(heads * d, c, c, 1, dtype=F64)
    right = torch.zeros(c, d, heads * d, 1, dtype=F64)
    for h in range(heads):
        for beta in range(d):
            left[h * d + beta, :, :, 0] = a_mats[h]              # independent of beta
            for gamma in range(c):
                right[gamma, :, h * d + beta, 0] = b_mats[h, beta]  # independent of gamma
    _set_btt_cores(mixer, left, right)
    for h in range(heads):
        torch.testing.assert_close(mixer.key_matrices()[h], torch.kron(a_mats[h], b_mats[h]), rtol=1e-12, atol=1e-12)


# -- T7: parameter and FLOP counts -------------------------------------------------------------------------------------

def test_t7_btt_parameter_and_key_transform_counts():
    mixer = make("btt_attention", 24, num_heads=3, factors=[4, 6], btt_rank=2)
    core_params = sum(p.numel() for p in mixer.key_transform.parameters())
    assert core_params == 1440 == 3 * 24 * 2 * (4 + 6)  # H * D * s * (c + d)
    x = randn(2, 5, 24)
    with FlopCounterMode(display=False) as counter:
        mixer.key_transform(x)
    assert counter.get_total_flops() == 2 * 10 * 1440 == mixer.flops_breakdown(2, 5)["key_transform"]
    assert mixer.flops_breakdown(2, 5)["scores"] == 2 * 2 * 3 * 5 * 5 * 24  # H * T^2 * D MACs per sequence


@pytest.mark.parametrize("ranks, ratio", [([64], 1.0), ([32, 32], 0.75), ([16, 16, 16, 16], 0.46875),
                                          ([32, 8, 6, 4, 4, 4, 4, 2], 0.6008)])
def test_t7_mlr_score_flop_ratios_with_halving_blocks(ranks, ratio):
    length = 1024
    blocks = [None] + [length // 2**level for level in range(1, len(ranks))]
    mlr = mp.create_mixer("mlr_attention", 256, num_heads=4, ranks=ranks, block_sizes=blocks)
    att = mp.create_mixer("attention", 256, num_heads=4)
    measured = mlr.flops_breakdown(1, length)["scores"] / att.flops_breakdown(1, length)["scores"]
    assert measured == pytest.approx(ratio, abs=5e-5)
    assert mlr.flops_breakdown(1, length)["scores"] == 2 * 4 * length * sum(
        r * (length if s is None else s) for r, s in zip(ranks, blocks))  # 2 * H * T * sum_l s_l r_l


def test_t7_mlr_score_flops_really_fall_under_flop_counter():
    """Counted, not claimed: the blockwise path performs T * sum_l s_l r_l score MACs per head."""
    length, ranks, blocks = 128, [16, 16, 16, 16], [None, 64, 32, 16]
    mlr = mp.create_mixer("mlr_attention", 256, num_heads=4, ranks=ranks, block_sizes=blocks)
    x = torch.randn(1, length, 256)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        mlr(x)
    parts = mlr.flops_breakdown(1, length)
    score_flops = counter.get_total_flops() - parts["qkv_proj"] - parts["weighted_values"] - parts["out_proj"]
    assert score_flops == 2 * 4 * length * (16 * 128 + 16 * 64 + 16 * 32 + 16 * 16)
    assert score_flops / (2 * 4 * length * length * 64) == pytest.approx(0.46875)


FLOP_CASES = {
    "btt_attention": dict(num_heads=4, btt_rank=2),
    "mlr_attention": dict(num_heads=2, ranks=[16, 8, 4, 4], block_sizes=[None, 16, 8, 4]),
    "bilinear_mlr_attention": dict(num_heads=4, ranks=[8, 4, 2, 2]),
    "sliding_window_attention": dict(num_heads=4, window=8),
    "global_local_attention": dict(num_heads=4, window=8),
}


@pytest.mark.parametrize("name", STRUCTURED)
@pytest.mark.parametrize("length", [37, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_match_the_flop_counter(name, length, causal):
    """``flops()`` counts what runs. FlopCounterMode has no formula for PyTorch's CPU flash-attention kernel, so SDPA
    is pinned to its math backend, which runs the same two matmuls through ops the counter sees."""
    mixer = mp.create_mixer(name, 64, causal=causal, **FLOP_CASES[name])
    x = torch.randn(2, length, 64)
    mask = right_padded([length, length - 9], length)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        mixer(x, mask=mask)
    assert counter.get_total_flops() == mixer.flops(2, length)  # exact (the requirement is within 10%)


def test_sliding_window_flops_are_linear_in_length():
    swa = mp.create_mixer("sliding_window_attention", 64, num_heads=4, window=16, causal=True)
    per_token = [swa.flops_breakdown(1, n)["scores"] / n for n in (256, 1024, 4096)]
    assert per_token[0] == per_token[1] == per_token[2] == 2 * 4 * 32 * 16  # 2 chunks of w keys, head dim 16


# -- T8: Bilinear MLR --------------------------------------------------------------------------------------------------

def test_t8_one_level_one_block_bilinear_mlr_equals_attention():
    att = make("attention", 32, num_heads=2, qkv_bias=False, out_bias=False, causal=True)
    bmlr = make("bilinear_mlr_attention", 32, num_heads=2, ranks=[16], num_blocks=[1], qk_norm=False, rms_cap=False,
                causal=True)
    wq, wk, wv = att.qkv.weight.detach().split(32, 0)
    with torch.no_grad():
        bmlr.q_weight_0.copy_(wq.T[None])
        bmlr.k_weight_0.copy_(wk.T[None])
        bmlr.value.weight.copy_(wv)
        bmlr.proj.weight.copy_(att.proj.weight)
    x, mask = randn(2, 9, 32), right_padded([9, 4], 9)
    torch.testing.assert_close(bmlr(x, mask=mask), att(x, mask=mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rms_cap", [False, True])
def test_t8_multi_level_bilinear_form_is_an_mlr_matrix(rms_cap):
    ranks, blocks = [8, 4, 4], [1, 2, 4]
    bmlr = make("bilinear_mlr_attention", 32, num_heads=2, ranks=ranks, num_blocks=blocks, qk_norm=False,
                rms_cap=rms_cap)
    x = randn(2, 7, 32)
    mats = bmlr.bilinear_matrices()
    scores = torch.einsum("bid,hde,bje->bhij", x, mats, x)
    torch.testing.assert_close(bmlr.materialize(x), scores.softmax(-1), rtol=1e-10, atol=1e-12)
    # W_h is the MLBTC "mlr" configuration: level l block-diagonal over p_l blocks of rank r_l.
    for h in range(2):
        mlr = MLBTC.mlr(32, 32, ranks, blocks).to(F64)
        with torch.no_grad():
            for level, (r, p) in enumerate(zip(ranks, blocks)):
                wq = bmlr.level_weight("q", level).view(p, 32 // p, 2, r)[:, :, h, :]
                wk = bmlr.level_weight("k", level).view(p, 32 // p, 2, r)[:, :, h, :]
                getattr(mlr, f"left_{level}").copy_((wq * bmlr.level_scales[level])[:, None, :, None, :])
                getattr(mlr, f"right_{level}").copy_(wk[:, None, :, None, :])
        torch.testing.assert_close(mlr.to_dense(), mats[h], rtol=1e-12, atol=1e-12)
        assert torch.linalg.matrix_rank(mats[h]) == sum(r * p for r, p in zip(ranks, blocks)) == 32  # > head dim 16
    level_params = sum(p.numel() for n, p in bmlr.named_parameters() if "_weight_" in n)
    assert level_params == 2 * 32 * 32  # the q/k parameters of dense attention


def test_t8_bilinear_mlr_reference_with_layer_norms():
    bmlr = make("bilinear_mlr_attention", 32, num_heads=2, ranks=[8, 4, 4], logit_scaling="mup", logit_multiplier=8.0)
    x = randn(2, 6, 32)
    scores = 0
    for level, (r, p) in enumerate(zip(bmlr.ranks, bmlr.num_blocks)):
        def per_head(side, level=level, r=r, p=p):
            w = getattr(bmlr, f"{side}_weight_{level}")
            w = w / max(1.0, w.pow(2).mean().sqrt().item() / (math.sqrt(min(32 // p, 2 * r)) / (32 // p)))
            out = torch.einsum("btpi,pio->btpo", x.view(2, 6, p, 32 // p), w).view(2, 6, p, 2, r)
            out = out.permute(0, 1, 3, 4, 2).reshape(2, 6, 2, r * p)  # layout rho * p + k
            norm = (bmlr.q_norms if side == "q" else bmlr.k_norms)[level]
            return F.layer_norm(out, (r * p,), norm.weight)
        scores = scores + 8.0 / (r * p) * torch.einsum("bihe,bjhe->bhij", per_head("q"), per_head("k"))
    torch.testing.assert_close(bmlr.materialize(x), scores.softmax(-1), rtol=1e-10, atol=1e-12)


# -- T9: sliding-window and global + local masks -----------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_t9_sliding_window_allows_exactly_the_window(causal):
    w = 3
    mixer = make("sliding_window_attention", 32, num_heads=2, window=w, causal=causal)
    probs = mixer.materialize(randn(2, 15, 32))
    for i in range(15):
        lo, hi = max(0, i - w), (i if causal else min(14, i + w))
        support = (probs[:, :, i] > 0).nonzero()[:, -1].unique().tolist()
        assert support == list(range(lo, hi + 1)), (i, support)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [5, 40])  # dense fallback and the blocked path
def test_t9_sliding_window_equals_the_reference(causal, length):
    mixer = make("sliding_window_attention", 32, num_heads=2, window=4, causal=causal)
    x, mask = randn(3, length, 32), right_padded([length, length - 3, 2], length)
    q, k, v = qkv_heads(mixer, x)
    pos = torch.arange(length)
    allowed = allowed_pairs(length, causal, mask, 3) & ((pos[:, None] - pos[None, :]).abs() <= 4)
    probs = reference_softmax(torch.einsum("bihe,bjhe->bhij", q, k) / 4.0, allowed)  # tau = 1/sqrt(16)
    torch.testing.assert_close(mixer(x, mask=mask), output_from_probs(mixer, probs, v, mask), rtol=1e-10, atol=1e-12)


def test_t9_a_window_covering_the_sequence_is_attention():
    att = make("attention", 32, num_heads=2, qkv_bias=False, out_bias=False, causal=True)
    swa = make("sliding_window_attention", 32, num_heads=2, window=50, qk_norm=False, causal=True)
    swa.load_state_dict(strip_mixer_records(att.state_dict()))  # another mixer's weights, on purpose
    x = randn(2, 30, 32)
    torch.testing.assert_close(swa(x), att(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_t9_global_local_is_the_sum_of_two_softmaxes(causal):
    mixer = make("global_local_attention", 32, num_heads=2, window=3, global_dim=6, causal=causal)
    x, mask = randn(2, 25, 32), right_padded([25, 17], 25)
    q, k, v = qkv_heads(mixer, x)
    allowed = allowed_pairs(25, causal, mask, 2)
    pos = torch.arange(25)
    band = (pos[:, None] - pos[None, :]).abs() <= 3
    p_global = reference_softmax(8.0 / 6 * torch.einsum("bihe,bjhe->bhij", q[..., :6], k[..., :6]), allowed)
    p_local = reference_softmax(8.0 / 10 * torch.einsum("bihe,bjhe->bhij", q[..., 6:], k[..., 6:]), allowed & band)
    probs = p_global + p_local
    torch.testing.assert_close(mixer.materialize(x, mask=mask), probs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer(x, mask=mask), output_from_probs(mixer, probs, v, mask), rtol=1e-10, atol=1e-12)
    rows = mixer.materialize(x, mask=mask).sum(-1)
    torch.testing.assert_close(rows[mask[:, None, :].expand_as(rows)], torch.full((2 * (25 + 17),), 2.0, dtype=F64))


# -- options: clear errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, options, message", [
    ("mlr_attention", dict(ranks=[8, 4]), "sum to 12, but must sum to the head dim"),
    ("mlr_attention", dict(ranks=[8, 0, 8]), "positive integers"),
    ("mlr_attention", dict(ranks=[8, 8], block_sizes=[None]), "1 entries but there are 2 levels"),
    ("mlr_attention", dict(ranks=[8, 4, 4], block_sizes=[None, 8, 3]), "3 (level 2) does not divide 8"),
    ("mlr_attention", dict(ranks=[8, 8], block_sizes=[8, None]), "global levels must come first"),
    ("mlr_attention", dict(ranks=[8, 8], block_sizes=[None, 0]), "must be positive"),
    ("mlr_attention", dict(num_heads=4, dim=24), "does not split equally over 4 levels"),
    ("bilinear_mlr_attention", dict(ranks=[8, 8], num_blocks=[1, 3]), "positive divisor of dim=32"),
    ("bilinear_mlr_attention", dict(ranks=[16], num_blocks=[1, 2]), "2 entries but there are 1 levels"),
    ("btt_attention", dict(factors=[4, 6]), "multiply to 24, not dim=32"),
    ("btt_attention", dict(btt_rank=0), "greater than 0"),
    ("btt_attention", dict(num_heads=5), "not divisible by num_heads"),
    ("sliding_window_attention", dict(window=0), "greater than 0"),
    ("global_local_attention", dict(global_dim=16), "must be smaller than the head dim"),
    ("mlr_attention", dict(logit_scaling="sqrt"), "'standard' or 'mup'"),
])
def test_bad_options_raise_clear_errors(name, options, message):
    options = {"dim": 32, "num_heads": 2, **options}
    with pytest.raises(mp.InvalidMixerOptions, match=message.replace("(", r"\(").replace(")", r"\)")):
        mp.create_mixer(name, **options)


# -- muP recognises every parameter ------------------------------------------------------------------------------------

def test_mup_knows_the_fan_in_of_every_parameter():
    from mixer_plugins.layers import mup

    btt = mp.create_mixer("btt_attention", 64, num_heads=4, btt_rank=2)  # (c, d) = (4, 16)
    fan_ins = mup.mup_fan_ins(btt)
    assert fan_ins["key_transform.right_0"] == 16 and fan_ins["key_transform.left_0"] == 4 * 2
    assert fan_ins["value.weight"] == 64 and fan_ins["key_norm.weight"] == 1
    bmlr = mp.create_mixer("bilinear_mlr_attention", 64, num_heads=4, ranks=[8, 4, 4])
    assert [mup.mup_fan_ins(bmlr)[f"q_weight_{lv}"] for lv in range(3)] == [64, 32, 16]  # D / p_l
    for name in ["mlr_attention", "sliding_window_attention", "global_local_attention"]:
        assert set(mup.mup_fan_ins(mp.create_mixer(name, 64, num_heads=4)).values()) == {1, 64}


# -- the released code's options: formulas of src/model.py, weights copied, float64 ------------------------------------

def _released_btt_scores(mixer, x):
    """The released BilinearBTTAttention up to the link: x <- LN_X(x) when the extra LN is on, then
    tau * x_i . LN(M_h x_j) with the cores capped by W / max(1, sqrt(mean W^2 + 1e-8) / kappa)."""
    if mixer.config.input_norm:
        x = F.layer_norm(x, (mixer.dim,), mixer.input_norm.weight, eps=1e-5)
    mats = btt_reference_matrices(mixer)
    keys = F.layer_norm(torch.einsum("hed,bjd->bjhe", mats, x), (mixer.dim,), mixer.key_norm.weight, eps=1e-5)
    tau = 1 / mixer.dim if mixer.config.logit_scaling == "mup" else 1 / math.sqrt(mixer.dim)
    return x, tau * torch.einsum("bie,bjhe->bhij", x, keys)


def _released_link(scores, causal, link):
    length = scores.shape[-1]
    keep = torch.ones(length, length, dtype=torch.bool)
    keep = keep.tril() if causal else keep
    if link == "softmax":
        return scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return scores.masked_fill(~keep, 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_btt_input_norm_also_normalises_the_values_like_the_released_code(causal):
    mixer = make("btt_attention", 24, num_heads=3, factors=[4, 6], btt_rank=2, input_norm=True, causal=causal)
    with torch.no_grad():
        mixer.input_norm.weight.uniform_(0.5, 1.5)
    x = randn(2, 9, 24) * 3 + 1
    xn, scores = _released_btt_scores(mixer, x)
    v = (xn @ mixer.value.weight.T).view(2, 9, 3, 8)  # c_attn_v reads the normalised x
    expected = output_from_probs(mixer, _released_link(scores, causal, "softmax"), v)
    torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer.forward_via_matrix(x), expected, rtol=1e-10, atol=1e-12)


def test_rms_cap_adds_the_released_epsilon_under_the_root():
    from mixer_plugins.layers.mup import rms_cap

    w = 1e-4 * randn(3, 5)          # RMS ~1e-4, comparable to sqrt(1e-8): the epsilon matters
    fan_in, fan_out = 10**6, 1      # kappa = 1e-6: the cap bites
    kappa = math.sqrt(min(fan_in, fan_out)) / fan_in
    released = w / max(1.0, math.sqrt(w.pow(2).mean().item() + 1e-8) / kappa)
    torch.testing.assert_close(rms_cap(w, fan_in, fan_out), released, rtol=1e-12, atol=0)


def _identity_case(name, causal):
    """(mixer, x, released weights before dropout, value heads) for the identity-link comparison."""
    x = randn(2, 12, 32)
    if name == "btt_attention":
        mixer = make(name, 32, num_heads=2, btt_rank=2, causal=causal, link_function="identity")
        _, scores = _released_btt_scores(mixer, x)
        v = (x @ mixer.value.weight.T).view(2, 12, 2, 16)
    elif name == "mlr_attention":
        mixer = make(name, 32, num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2], causal=causal,
                     link_function="identity")
        scores = mlr_reference_scores(mixer, x)
        _, _, v = qkv_heads(mixer, x)
    else:
        mixer = make(name, 32, num_heads=2, ranks=[8, 4, 4], qk_norm=False, causal=causal, link_function="identity")
        scores = torch.einsum("bid,hde,bje->bhij", x, mixer.bilinear_matrices(), x)
        v = (x @ mixer.value.weight.T).view(2, 12, 2, 16)
    return mixer, x, _released_link(scores, causal, "identity"), v


@pytest.mark.parametrize("name", ["btt_attention", "mlr_attention", "bilinear_mlr_attention"])
@pytest.mark.parametrize("causal", [False, True])
def test_identity_link_matches_the_released_code(name, causal):
    mixer, x, weights, v = _identity_case(name, causal)
    assert not torch.allclose(weights.sum(-1), torch.ones(()).to(F64))  # really not a softmax
    torch.testing.assert_close(mixer.materialize(x), weights, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mixer(x), output_from_probs(mixer, weights, v), rtol=1e-10, atol=1e-12)
    mask = right_padded([12, 7], 12)  # pads: weights to pad keys are 0, pad rows are zero
    out = mixer(x, mask=mask)
    torch.testing.assert_close(out[1:, :7], mixer(x[1:, :7]), rtol=1e-10, atol=1e-12)
    assert torch.all(out[1, 7:] == 0)


@pytest.mark.parametrize("name", ["btt_attention", "mlr_attention", "bilinear_mlr_attention"])
def test_attention_dropout_drops_the_weights_in_training_only(name):
    mixer, x, _, v = _identity_case(name, causal=True)
    weights = mixer.state_dict()
    mixer = make(name, 32, **{**mixer.config.model_dump(exclude={"dim"}), "link_function": "softmax",
                              "attn_dropout": 0.3})
    mixer.load_state_dict(strip_mixer_records(weights))  # the same weights under another link function, on purpose
    probs = mixer.materialize(x)  # eval: no dropout
    torch.testing.assert_close(mixer(x), output_from_probs(mixer, probs, v), rtol=1e-10, atol=1e-12)
    mixer.train()
    torch.manual_seed(5)
    out = mixer(x)
    torch.manual_seed(5)
    dropped = F.dropout(probs, p=0.3, training=True)
    assert (dropped == 0).any()
    torch.testing.assert_close(out, output_from_probs(mixer, dropped, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options, message", [
    (dict(link_function="sofmax"), "identity"),
    (dict(attn_dropot=0.1), "did you mean 'attn_dropout'"),
    (dict(attn_dropout=1.0), "less than 1"),
])
@pytest.mark.parametrize("name", ["btt_attention", "mlr_attention", "bilinear_mlr_attention"])
def test_link_and_dropout_options_are_validated(name, options, message):
    with pytest.raises(mp.InvalidMixerOptions, match=message):
        mp.create_mixer(name, 32, num_heads=2, **options)


# -- the mixer runs the tiled MLR op -----------------------------------------------------------------------------------

MLR_TILED_CASES = [
    dict(ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2]),
    dict(ranks=[8, 4, 2, 2], block_sizes=[12, 6, 3, 1], block_divide=False, divide_by_levels=True),
    dict(ranks=[4, 4, 4, 4], min_block_size=3, logit_scaling="standard", logit_multiplier=2.0),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("case", range(len(MLR_TILED_CASES)))
@pytest.mark.parametrize("length", [1, 23, 37])
def test_mlr_mixer_tiled_equals_the_materialized_path(case, causal, length):
    """The mixer's forward (the tiled op) equals the materialized L x L path (``forward_via_matrix``, the
    independent reference) in float64 to 1e-12, values and gradients of the input and of every parameter; right
    padding with NaN in the pads changes no real output or gradient."""
    torch.manual_seed(case)
    mixer = make("mlr_attention", causal=causal, num_heads=2, **MLR_TILED_CASES[case]).train()
    assert mixer.uses_tiled_op()
    with torch.no_grad():
        mixer.q_norm.weight.uniform_(0.5, 1.5)  # muP zero-initialises it: scores would all be 0
    x = randn(3, length, 32, seed=length)
    mask = right_padded([length, max(1, length - 7), 1], length)
    nan_x = x.masked_fill(~mask[..., None], float("nan"))
    params = list(mixer.parameters())
    cot = randn(3, length, 32, seed=99)

    def run(fn, inp):
        xr = inp.clone().requires_grad_(True)
        out = fn(xr, mask=mask)
        grads = torch.autograd.grad(out, [xr, *params], cot)
        return out.detach(), [torch.nan_to_num(grads[0].masked_fill(~mask[..., None], 0)), *grads[1:]]

    tiled, tiled_grads = run(mixer, nan_x)
    dense, dense_grads = run(mixer.forward_via_matrix, x)
    assert torch.isfinite(tiled).all()
    torch.testing.assert_close(tiled, dense, rtol=0, atol=1e-12)
    for g, dg in zip(tiled_grads, dense_grads):
        torch.testing.assert_close(g, dg, rtol=0, atol=1e-12)


def test_mlr_mixer_builds_no_quadratic_tensor():
    """Forward and backward of the mixer never hold an L x L tensor per head (the former mix built one)."""
    from helpers import LargestTensor

    length = 1024
    mixer = mp.create_mixer("mlr_attention", 32, num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 64, 32, 16],
                            causal=True)
    x = torch.randn(1, length, 32, requires_grad=True)
    with LargestTensor() as probe:
        mixer(x).sum().backward()
    assert probe.largest < length * length, probe.largest
    with LargestTensor() as probe, torch.no_grad():
        mixer.mix_materialized(mixer.prepare(x, None))
    assert probe.largest >= 2 * length * length  # the probe sees the materialized path's (1, 2, L, L)


def test_mlr_dropout_and_identity_link_fall_back_to_the_materialized_path():
    """The op has no dropout and no identity link: attention dropout in training mode (only then) and the identity
    link take the materialized path, which applies them."""
    x = randn(2, 13, 32)
    mixer = make("mlr_attention", num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2], attn_dropout=0.5)
    with torch.no_grad():
        mixer.q_norm.weight.fill_(1.0)
    assert mixer.uses_tiled_op()  # eval: no dropout
    torch.testing.assert_close(mixer(x), mixer.forward_via_matrix(x), rtol=0, atol=1e-12)
    mixer.train()
    assert not mixer.uses_tiled_op()
    torch.manual_seed(0)
    a = mixer(x)
    torch.manual_seed(0)
    b = mixer.forward_via_matrix(x)  # the matrix path applies the same dropout draw
    torch.manual_seed(1)
    c = mixer(x)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not torch.allclose(a, c)  # dropout is active
    identity = make("mlr_attention", num_heads=2, ranks=[8, 4, 2, 2], block_sizes=[None, 8, 4, 2],
                    link_function="identity", causal=True)
    assert not identity.uses_tiled_op()
    torch.testing.assert_close(identity(x), identity.forward_via_matrix(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_mlr_mixer_forward_backward_flops_are_counted(causal):
    """Forward+backward of the mixer under FlopCounterMode: the projections' (3x forward) plus the op's backward
    formula (3x the score and 2x the value FLOPs, as PyTorch counts attention's backward)."""
    mixer = mp.create_mixer("mlr_attention", 64, causal=causal, **FLOP_CASES["mlr_attention"])
    x = torch.randn(2, 45, 64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        mixer(x).sum().backward()
    parts = mixer.flops_breakdown(2, 45)
    expected = 3 * (parts["qkv_proj"] + parts["out_proj"]) + 4 * parts["scores"] + 3 * parts["weighted_values"]
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("name", ["attention", "btt_attention"])
def test_sdpa_gets_unit_stride_features(monkeypatch, name):
    """cuDNN's SDPA (bf16 on CUDA) takes its output's layout from the query's and fails on BTT's query, which is
    broadcast over the heads (stride 0): "The stride for the last dimension ... should be 1 for output O" (the H200
    check failed on btt_attention bf16). Every tensor handed to SDPA has unit feature stride and no stride-0 axis,
    and the result is unchanged."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append([(t.stride(-1), min(t.stride())) for t in (q, k, v)])
        return real(q, k, v, *args, **kwargs)

    mixer = mp.create_mixer(name, 32, num_heads=4).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    expected = mixer(x)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = mixer(x)
    assert seen and all(feature == 1 and smallest > 0 for call in seen for feature, smallest in call), seen
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
