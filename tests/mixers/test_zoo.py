"""The Hydra matrix-mixer zoo against independent naive formulas (float64), and the matrix classes.

The naive side re-implements the block from the paper's description (in_proj, centred depthwise conv,
SiLU, gated RMSNorm, out_proj) and every matrix entry by entry with explicit loops, so it shares no code
with the library beyond reading the module's weights.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixer_plugins as mp
from mixer_plugins.layers import GatedRMSNorm
from mixer_plugins.testing import check_mixer

F64 = torch.float64
DIM, LEN = 16, 9


# -- naive block ------------------------------------------------------------------------------------------

def naive_parts(mixer, x):
    """in_proj -> split -> conv (centred, or causal) -> SiLU, following the paper's §3 table."""
    proj = x @ mixer.in_proj.weight.T
    z, rest = proj[..., : mixer.out_width], proj[..., mixer.out_width:]
    names, widths = [g.name for g in mixer.groups], [g.width for g in mixer.groups]
    parts = dict(zip(names, rest.split(widths, dim=-1)))
    conv_names = [g.name for g in mixer.groups if g.conv]
    if conv_names:
        u = torch.cat([parts[n] for n in conv_names], dim=-1).transpose(1, 2)
        k = mixer.conv1d.kernel_size[0]
        pad = (k - 1, 0) if mixer.causal_conv else ((k - 1) // 2, (k - 1) // 2)
        u = F.conv1d(F.pad(u, pad), mixer.conv1d.weight, mixer.conv1d.bias, groups=u.shape[1]).transpose(1, 2)
        for n, part in zip(conv_names, u.split([parts[n].shape[-1] for n in conv_names], dim=-1)):
            parts[n] = part
    for g in mixer.groups:
        if g.activation:
            parts[g.name] = F.silu(parts[g.name])
    return z, parts


def naive_finish(mixer, z, y):
    y = y.flatten(2)
    g = mixer.norm.weight * y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + mixer.config.norm_eps) * F.silu(z)
    return g @ mixer.out_proj.weight.T


def heads(t, h):
    return t.unflatten(-1, (h, -1))


def queries_and_keys(m, parts, data_dependent):
    """(q, k) per head: projected from x (data-dependent), or the free L-sized parameters' first LEN rows."""
    if data_dependent:
        return heads(parts["q"], m.num_heads), heads(parts["k"], m.num_heads)
    return m.q_param[:LEN].expand(2, -1, -1, -1), m.k_param[:LEN].expand(2, -1, -1, -1)


def check_against_naive(mixer, x, naive_matrix, values):
    """materialize == naive matrix, and forward == naive finish(naive matrix @ values)."""
    z, _ = naive_parts(mixer, x)
    with torch.no_grad():
        torch.testing.assert_close(mixer.materialize(x), naive_matrix, rtol=1e-9, atol=1e-10)
        y = torch.einsum("bhij,bjhp->bihp", naive_matrix, values)
        torch.testing.assert_close(mixer(x), naive_finish(mixer, z, y), rtol=1e-9, atol=1e-10)


def build(name, **options):
    torch.manual_seed(0)
    return mp.create_mixer(name, DIM, head_dim=8, **options).double().eval()


def inputs(length=LEN, batch=2, seed=1):
    return torch.randn(batch, length, DIM, generator=torch.Generator().manual_seed(seed), dtype=F64)


def eye(n):
    return torch.eye(n, dtype=F64)


# -- the einsum mixers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_dense(causal):
    m = build("dense", max_seq_len=12, causal=causal)
    x = inputs()
    _, parts = naive_parts(m, x)
    w = m.weight[:, :LEN, :LEN]
    if causal:
        w = torch.tril(w)
    M = (w / math.sqrt(12) + eye(LEN)).expand(2, -1, -1, -1)
    check_against_naive(m, x, M, heads(parts["v"], m.num_heads))


@pytest.mark.parametrize("data_dependent", [True, False])
def test_toeplitz(data_dependent):
    opts = {} if data_dependent else {"data_dependent": False, "max_seq_len": 12}
    m = build("toeplitz", **opts)
    x = inputs()
    _, parts = naive_parts(m, x)
    h = m.num_heads
    M = torch.zeros(2, h, LEN, LEN, dtype=F64)
    for i in range(LEN):
        for j in range(LEN):
            if data_dependent:  # token t generates the taps of offsets +t (fw_t) and -t (rv_t)
                M[:, :, i, j] = parts["fw"][:, i - j] if i >= j else parts["rv"][:, j - i]
            else:
                M[:, :, i, j] = m.taps[:, i - j + 12 - 1]
    scale = 0.5 / math.sqrt(128 if data_dependent else 12)
    check_against_naive(m, x, scale * M + eye(LEN), heads(parts["v"], h))


@pytest.mark.parametrize("form", ["dd", "dft", "learned"])
def test_vandermonde(form):
    opts = {"qk_dim": 3}
    if form != "dd":
        opts.update(data_dependent=False, max_seq_len=12, di_form=form)
    m = build("vandermonde", **opts)
    x = inputs()
    _, parts = naive_parts(m, x)
    h, eps = m.num_heads, 1e-3
    M = torch.zeros(2, h, LEN, LEN, dtype=F64)
    if form == "dft":
        for i in range(LEN):
            for j in range(LEN):
                M[:, :, i, j] = math.cos(2 * math.pi * i * j / 12)
        scale = 1 / math.sqrt(12)
    else:
        q, k = queries_and_keys(m, parts, form == "dd")
        for i in range(LEN):
            for j in range(LEN):
                M[:, :, i, j] = (torch.cos(2 * math.pi * eps * q[:, i] * j)
                                 - torch.cos(2 * math.pi * eps * k[:, j] * i)).sum(-1)
        scale = 1 / math.sqrt(2 * (128 if form == "dd" else 12) * 3)
    check_against_naive(m, x, scale * M + eye(LEN), heads(parts["v"], h))


@pytest.mark.parametrize("data_dependent", [True, False])
def test_cauchy(data_dependent):
    opts = {"qk_dim": 3} if data_dependent else {"qk_dim": 3, "data_dependent": False, "max_seq_len": 12}
    m = build("cauchy", **opts)
    x = inputs()
    _, parts = naive_parts(m, x)
    h = m.num_heads
    q, k = queries_and_keys(m, parts, data_dependent)
    c = F.softplus(m.shift_raw)
    M = torch.zeros(2, h, LEN, LEN, dtype=F64)
    for i in range(LEN):
        for j in range(LEN):
            M[:, :, i, j] = (1 / (q[:, i].exp() + k[:, j].exp() + c + 1e-8)).sum(-1)
    scale = 1 / math.sqrt((128 if data_dependent else 12) * 3)
    check_against_naive(m, x, scale * M + eye(LEN), heads(parts["v"], h))
    assert (M > 0).all()  # positive denominators by construction


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("data_dependent", [True, False])
def test_low_rank(causal, data_dependent):
    opts = {"qk_dim": 3, "causal": causal}
    if not data_dependent:
        opts.update(data_dependent=False, max_seq_len=12)
    m = build("linear_attention", **opts)
    x = inputs()
    _, parts = naive_parts(m, x)
    h = m.num_heads
    q, k = queries_and_keys(m, parts, data_dependent)
    M = torch.einsum("bihd,bjhd->bhij", q, k)
    if causal:
        M = torch.tril(M)
    scale = 1 / math.sqrt((128 if data_dependent else 12) * 3)
    check_against_naive(m, x, scale * M + eye(LEN), heads(parts["v"], h))
    if not causal:  # the matrix minus the identity has rank <= qk_dim
        assert _rank(m.materialize(x)[0, 0] - eye(LEN)) <= 3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("data_dependent", [True, False])
def test_block_attention(causal, data_dependent):
    opts = {"qk_dim": 3, "causal": causal}
    if not data_dependent:
        opts.update(data_dependent=False, max_seq_len=12)
    m = build("block_attention", **opts)
    x = inputs()
    _, parts = naive_parts(m, x)
    h = m.num_heads
    q, k = queries_and_keys(m, parts, data_dependent)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(3)
    if causal:
        scores = scores.masked_fill(~torch.ones(LEN, LEN, dtype=torch.bool).tril(), float("-inf"))
    M = scores.softmax(-1)
    check_against_naive(m, x, M + eye(LEN), heads(parts["v"], h))
    torch.testing.assert_close(M.sum(-1), torch.ones(2, h, LEN, dtype=F64))


# -- the SSM mixers -----------------------------------------------------------------------------------------

def _decay_product(a, lo, hi):
    """prod_{k=lo..hi} exp(a_k) (empty product = 1)."""
    return torch.exp(a[..., lo: hi + 1].sum(-1)) if hi >= lo else torch.ones_like(a[..., 0])


def naive_direction(C, B, dt, A, *, upper, shift):
    """Entry-by-entry matrix of one direction (b, h, L, L); C, B (b, L, h, n) already per head."""
    b, length, h = dt.shape
    a = (dt * A).transpose(1, 2)  # (b, h, L)
    M = torch.zeros(b, h, length, length, dtype=F64)
    for i in range(length):
        for j in range(length):
            if not upper and (j < i or (j == i and not shift)):
                if shift:
                    M[:, :, i, j] = (C[:, i - 1] * B[:, j]).sum(-1) * _decay_product(a, j + 1, i - 1) * dt[:, j]
                else:
                    M[:, :, i, j] = (C[:, i] * B[:, j]).sum(-1) * _decay_product(a, j + 1, i) * dt[:, j]
            if upper and (j > i or (j == i and not shift)):
                if shift:
                    M[:, :, i, j] += (C[:, i + 1] * B[:, j]).sum(-1) * _decay_product(a, i + 1, j - 1) * dt[:, j]
                else:
                    M[:, :, i, j] += (C[:, i] * B[:, j]).sum(-1) * _decay_product(a, i, j - 1) * dt[:, j]
    return M


def per_head(t, h, n):
    """(b, L, g*n) -> (b, L, h, n): head h reads group h // (h_total / g)."""
    g = t.shape[-1] // n
    return t.unflatten(-1, (g, n)).repeat_interleave(h // g, dim=2)


def test_semiseparable():
    m = build("ssd", d_state=3, chunk_size=4)
    x = inputs()
    _, parts = naive_parts(m, x)
    h, n = m.num_heads, 3
    dt = F.softplus(parts["dt"] + m.ssm.dt_bias)
    A = -torch.exp(m.ssm.A_log)
    M = naive_direction(per_head(parts["C"], h, n), per_head(parts["B"], h, n), dt, A, upper=False, shift=False)
    M = M + torch.diag_embed(m.ssm.D.expand(2, LEN, h).transpose(1, 2))
    check_against_naive(m, x, M, heads(parts["x"], h))
    assert m.causal_conv and m.conv1d.kernel_size == (4,)


def _hydra_naive(m, x, *, shift=True, use_diag=True, shared=False):
    _, parts = naive_parts(m, x)
    h, n = m.config.num_heads, m.d_state
    raw_f, raw_b = parts["dt"].chunk(2, dim=-1)
    dt_f, dt_b = F.softplus(raw_f + m.ssm.dt_bias), F.softplus(raw_b + m.ssm.dt_bias)
    A = -torch.exp(m.ssm.A_log)
    names = ("B", "C", "B", "C") if shared else ("B_f", "C_f", "B_b", "C_b")
    B_f, C_f, B_b, C_b = (per_head(parts[k], h, n) for k in names)
    lower = naive_direction(C_f, B_f, dt_f, A, upper=False, shift=shift)
    upper = naive_direction(C_b, B_b, dt_b, A, upper=True, shift=shift)
    M = lower + upper
    if use_diag:
        diag = parts["x"] @ m.fc_D.weight.T + m.ssm.D
        M = M + torch.diag_embed(diag.transpose(1, 2))
    return M, lower, upper, heads(parts["x"], h)


@pytest.mark.parametrize("shared_bc", [False, True])
def test_quasiseparable_is_hydra_entry_by_entry(shared_bc):
    m = build("hydra", d_state=3, chunk_size=4, shared_bc=shared_bc)
    x = inputs()
    M, _, _, values = _hydra_naive(m, x, shared=shared_bc)
    check_against_naive(m, x, M, values)


def test_quasiseparable_data_independent():
    m = build("quasi", d_state=3, chunk_size=4, data_dependent=False, max_seq_len=12)
    x = inputs()
    _, parts = naive_parts(m, x)
    h, n = m.num_heads, 3
    bc = m.BC[:LEN].expand(2, -1, -1)
    B, C = (per_head(t, h, n) for t in bc.chunk(2, dim=-1))
    dt = F.softplus(m.ssm.dt_bias).expand(2, LEN, h)            # time-invariant step
    A = -torch.exp(m.ssm.A_log)
    M = naive_direction(C, B, dt, A, upper=False, shift=True) + naive_direction(C, B, dt, A, upper=True,
                                                                                   shift=True)
    M = M + torch.diag_embed((parts["x"] @ m.fc_D.weight.T + m.ssm.D).transpose(1, 2))  # diagonal stays DD
    check_against_naive(m, x, M, heads(parts["x"], h))


@pytest.mark.parametrize("name, shift, use_diag", [
    ("bidirectional_add", False, False),
    ("quasiseparable_no_shift", False, True),
    ("quasiseparable_no_diag", True, False),
])
def test_additive_ablations(name, shift, use_diag):
    m = build(name, d_state=3, chunk_size=4)
    x = inputs()
    M, _, _, values = _hydra_naive(m, x, shift=shift, use_diag=use_diag)
    check_against_naive(m, x, M, values)


def test_concat_ablation_has_a_forward_and_a_backward_block_of_heads():
    m = build("concat", d_state=3, chunk_size=4)
    x = inputs()
    _, lower, upper, values = _hydra_naive(m, x, shift=False, use_diag=False)
    M = torch.cat([lower, upper], dim=1)
    check_against_naive(m, x, M, torch.cat([values, values], dim=2))
    assert m.out_proj.in_features == 2 * m.d_inner and m.num_heads == 2 * m.config.num_heads


def test_mult_ablation_multiplies_the_two_directions_and_has_no_matrix():
    m = build("mult", d_state=3, chunk_size=4)
    x = inputs()
    z, _ = naive_parts(m, x)
    _, lower, upper, values = _hydra_naive(m, x, shift=False, use_diag=False)
    y = torch.einsum("bhij,bjhp->bihp", lower, values) * torch.einsum("bhij,bjhp->bihp", upper, values)
    with torch.no_grad():
        torch.testing.assert_close(m(x), naive_finish(m, z, y), rtol=1e-9, atol=1e-10)
    with pytest.raises(mp.NotMaterializableError, match="not linear"):
        m.materialize(x)
    assert not m.materializable


# -- matrix-class properties ----------------------------------------------------------------------------------

def _rank(block):
    return int(torch.linalg.matrix_rank(block, atol=1e-9 * max(1.0, block.abs().max().item())))


def test_toeplitz_is_constant_along_diagonals():
    for opts in ({}, {"data_dependent": False, "max_seq_len": 20}):
        M = build("toeplitz", **opts).materialize(inputs(16))
        torch.testing.assert_close(M[..., 1:, 1:], M[..., :-1, :-1])


def test_dft_is_symmetric():
    M = build("vandermonde", data_dependent=False, max_seq_len=16).materialize(inputs(16))
    torch.testing.assert_close(M, M.transpose(-1, -2))


def test_semiseparable_blocks_have_rank_at_most_the_state_size():
    m = build("ssd", d_state=2, chunk_size=4)
    x = inputs(16)
    M = m.materialize(x)[0, 0] - torch.diag(m.ssm.D[0].expand(16))
    assert (M.triu(1) == 0).all()
    for k in range(1, 16):
        assert _rank(M[k - 1:, :k]) <= 2  # on-and-below-diagonal blocks


def test_quasiseparable_off_diagonal_blocks_have_rank_at_most_the_state_size():
    m = build("quasi", d_state=2, chunk_size=4)
    M = m.materialize(inputs(16))[0, 0]
    ranks_with_diagonal = []
    for k in range(1, 16):
        assert _rank(M[k:, :k]) <= 2 and _rank(M[:k, k:]) <= 2
        ranks_with_diagonal.append(_rank(M[k - 1:, :k]))
    assert max(ranks_with_diagonal) > 2  # the free diagonal is not tied to the generators


# -- Hydra's structure ------------------------------------------------------------------------------------------

def _permute_hydra_to_mirror(m):
    """Swap the forward and backward generators (B, C, dt) and mirror the conv taps."""
    d, gn, h = m.d_inner, m.ngroups * m.d_state, m.config.num_heads
    z, xs = torch.arange(d), torch.arange(d, 2 * d)
    bf, cf, bb, cb = (torch.arange(2 * d + i * gn, 2 * d + (i + 1) * gn) for i in range(4))
    dtf = torch.arange(2 * d + 4 * gn, 2 * d + 4 * gn + h)
    dtb = dtf + h
    rows = torch.cat([z, xs, bb, cb, bf, cf, dtb, dtf])
    conv_rows = torch.cat([xs, bb, cb, bf, cf]) - d
    with torch.no_grad():
        m.in_proj.weight.copy_(m.in_proj.weight[rows])
        m.conv1d.weight.copy_(m.conv1d.weight[conv_rows].flip(-1))
        m.conv1d.bias.copy_(m.conv1d.bias[conv_rows])


def test_hydra_flip_equivariance():
    m = build("hydra", d_state=3, chunk_size=4)
    x = inputs(11)
    with torch.no_grad():
        y = m(x)
        _permute_hydra_to_mirror(m)
        y_mirror = m(x.flip(1))
    torch.testing.assert_close(y_mirror, y.flip(1), rtol=1e-9, atol=1e-10)


def test_hydra_backward_off_leaves_only_the_lower_part_and_diagonal():
    m = build("hydra", d_state=3, chunk_size=4)
    d, gn = m.d_inner, m.d_state
    bb = slice(2 * d + 2 * gn, 2 * d + 3 * gn)
    with torch.no_grad():
        m.in_proj.weight[bb] = 0
        m.conv1d.weight[bb.start - d: bb.stop - d] = 0
        m.conv1d.bias[bb.start - d: bb.stop - d] = 0
    assert (m.materialize(inputs()).triu(1) == 0).all()


def test_hydra_diagonal_only():
    m = build("hydra", d_state=3, chunk_size=4)
    d = m.d_inner
    with torch.no_grad():
        m.in_proj.weight[2 * d: 2 * d + 4 * m.d_state] = 0     # every B and C
        m.conv1d.weight[d:] = 0
        m.conv1d.bias[d:] = 0
        m.fc_D.weight.zero_()
    M = m.materialize(inputs())
    torch.testing.assert_close(M, eye(LEN).expand_as(M))     # W_D = 0 and D = 1: y = x


def test_hydra_sam_locality():
    m = build("hydra", d_state=3, chunk_size=4)
    x = inputs(20, batch=1)
    x2 = x.clone()
    a, b = 7, 12
    x2[:, : a - 3] = torch.randn_like(x2[:, : a - 3])
    x2[:, b + 4:] = torch.randn_like(x2[:, b + 4:])
    M, M2 = m.materialize(x), m.materialize(x2)
    torch.testing.assert_close(M[..., a: b + 1, a: b + 1], M2[..., a: b + 1, a: b + 1])
    assert (M - M2).abs().max() > 1e-3


def test_hydra_parameter_count_matches_the_paper():
    m = mp.create_mixer("hydra", 768)   # d_state 64, head_dim 64, expand 2, d_conv 7
    total = sum(p.numel() for p in m.parameters())
    assert m.in_proj.weight.shape == (3376, 768)
    assert abs(total - 3.83e6) / 3.83e6 < 0.005, total


def test_gated_rmsnorm_formula():
    norm = GatedRMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    y, z = torch.randn(3, 6, dtype=F64), torch.randn(3, 6, dtype=F64)
    expected = norm.weight * y / torch.sqrt((y ** 2).mean(-1, keepdim=True) + 1e-5) * z * torch.sigmoid(z)
    torch.testing.assert_close(norm(y, z), expected)
    mamba_order = GatedRMSNorm(6, norm_before_gate=False).double()
    u = y * F.silu(z)
    torch.testing.assert_close(mamba_order(y, z), u / torch.sqrt((u ** 2).mean(-1, keepdim=True) + 1e-5))


# -- options, errors and extendability --------------------------------------------------------------------------

@pytest.mark.parametrize("name, options, fragment", [
    ("quasi", {"head_dim": 5}, "not divisible by head_dim"),
    ("quasi", {"d_conv": 4, "head_dim": 8}, "must be odd"),
    ("quasi", {"data_dependent": False}, "needs max_seq_len"),
    ("quasi", {"ngroups": 3, "head_dim": 8}, "multiple of ngroups"),
    ("quasi", {"A_init_range": (2.0, 1.0), "head_dim": 8}, "0 < lo <= hi"),
    ("dense", {}, "max_seq_len: required"),
    ("vandermonde", {"di_form": "chebyshev"}, "di_form"),
    ("toeplitz", {"causl": True}, "did you mean 'causal'"),
    ("ssd", {"causal": False}, "unknown option 'causal'"),
])
def test_invalid_options_are_explained(name, options, fragment):
    with pytest.raises(mp.InvalidMixerOptions, match=fragment):
        mp.create_mixer(name, DIM, **options)


@pytest.mark.parametrize("name", ["toeplitz", "vandermonde", "cauchy", "low_rank", "block_attention", "quasi", "ssd"])
def test_data_dependent_mixers_extend_to_long_sequences(name):
    m = build(name)
    with torch.no_grad():
        y = m(inputs(300, batch=1))
    assert y.shape == (1, 300, DIM) and torch.isfinite(y).all()


@pytest.mark.parametrize("name, options", [
    ("toeplitz", {"data_dependent": False, "max_seq_len": 24}),
    ("vandermonde", {"data_dependent": False, "max_seq_len": 24}),
    ("vandermonde", {"data_dependent": False, "max_seq_len": 24, "di_form": "learned"}),
    ("cauchy", {"data_dependent": False, "max_seq_len": 24}),
    ("low_rank", {"data_dependent": False, "max_seq_len": 24}),
    ("low_rank", {"data_dependent": False, "max_seq_len": 24, "causal": True}),
    ("block_attention", {"data_dependent": False, "max_seq_len": 24}),
    ("quasiseparable", {"data_dependent": False, "max_seq_len": 24}),
    ("quasiseparable", {"shared_bc": True}),
    ("toeplitz", {"causal": True}),
    ("cauchy", {"causal": True}),
    ("dense", {"max_seq_len": 24, "causal": True}),
])
def test_variants_pass_the_conformance_kit(name, options):
    assert all(r.passed for r in check_mixer(name, options=options))
