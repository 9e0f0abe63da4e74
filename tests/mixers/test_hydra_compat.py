"""Hydra's released options and the drop-in for the released code.

Every reference here is written from the released code's formulas (``goombalab/hydra``, ``hydra/modules/hydra.py``
and ``matrix_mixer.py``; the layout is documented in the Hydra design note), on a ``state_dict`` built by hand in the
released layout, in float64: the naive SSD recurrence with initial states, batch-stacked directions, roll-based shift,
``dt_limit`` clamp, gated RMSNorm (norm before gate, over the whole width).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixer_plugins as mp
from mixer_plugins.compat import Hydra, convert_matrix_mixer_state_dict

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def released_hydra_state_dict(d_model, d_state, headdim, ngroups=1, d_conv=7, expand=2, bias=False,
                              init_states=False, seed=0, shared_bc=False):
    """Random weights in the released Hydra layout (keys and shapes of ``hydra/modules/hydra.py``)."""
    g = gen(seed)
    d_inner = expand * d_model
    nheads = d_inner // headdim
    bc = (1 if shared_bc else 2) * 2 * ngroups * d_state
    rnd = lambda *s, scale=0.3: scale * torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    sd = {
        "in_proj.weight": rnd(2 * d_inner + bc + 2 * nheads, d_model),
        "conv1d.weight": rnd(d_inner + bc, 1, d_conv),
        "conv1d.bias": rnd(d_inner + bc, scale=0.1),
        "dt_bias": rnd(nheads, scale=1.0) - 2.0,
        "A_log": rnd(nheads, scale=0.5),
        "D": 1.0 + rnd(nheads, scale=0.1),
        "fc_D.weight": rnd(nheads, d_inner),
        "norm.weight": 1.0 + rnd(d_inner, scale=0.1),
        "out_proj.weight": rnd(d_model, d_inner),
    }
    if bias:
        sd["in_proj.bias"] = rnd(2 * d_inner + bc + 2 * nheads, scale=0.1)
        sd["out_proj.bias"] = rnd(d_model, scale=0.1)
    if init_states:
        sd["init_states"] = rnd(nheads, headdim, d_state)
    return sd


def naive_ssd(x, dt, A, B, C, init=None):
    """The kernel's semantics by recurrence: h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, h_{-1} = S0.
    x (b, l, h, p), dt (b, l, h), A (h,), B/C (b, l, g, n), init (b, h, p, n)."""
    b, l, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype) if init is None else init.clone()
    ys = []
    for t in range(l):
        state = torch.exp(A * dt[:, t])[..., None, None] * state + \
            (dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(ys, 1)


def released_hydra(sd, u, *, d_state, headdim, ngroups=1, d_conv=7, expand=2, dt_limit=(0.0, math.inf),
                   shared_bc=False):
    """The released Hydra forward (default path) on a released-layout ``sd``; ``shared_bc`` gives the released
    quasiseparable matrix mixer (one B, C flipped for the backward half)."""
    batch, length, d_model = u.shape
    d_inner = expand * d_model
    H = d_inner // headdim
    gN = ngroups * d_state
    bc = (1 if shared_bc else 2) * 2 * gN
    proj = u @ sd["in_proj.weight"].T + sd.get("in_proj.bias", 0.0)
    z, xBC, dt = proj.split([d_inner, d_inner + bc, 2 * H], -1)
    A = -torch.exp(sd["A_log"])
    dt = torch.cat([dt[..., :H], dt[..., H:].flip(1)], 0)
    dt = F.softplus(dt + sd["dt_bias"]).clamp(*dt_limit)
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), sd["conv1d.weight"], sd["conv1d.bias"], padding=d_conv // 2,
                          groups=xBC.shape[-1]).transpose(1, 2))
    x, BC = xBC.split([d_inner, bc], -1)
    x_og = x
    x = torch.cat([x, x.flip(1)], 0)
    BC = torch.cat([BC, BC.flip(1)], 0) if shared_bc else torch.cat([BC[..., :2 * gN], BC[..., 2 * gN:].flip(1)], 0)
    B, C = BC.split([gN, gN], -1)
    init = sd["init_states"][None].expand(2 * batch, -1, -1, -1) if "init_states" in sd else None
    y = naive_ssd(x.unflatten(-1, (H, headdim)), dt, A, B.unflatten(-1, (ngroups, d_state)),
                  C.unflatten(-1, (ngroups, d_state)), init).flatten(2)
    y = torch.roll(y, 1, 1)
    y[:, 0] = 0.0
    y = y[:batch] + y[batch:].flip(1) + x_og * (x_og @ sd["fc_D.weight"].T + sd["D"]).repeat_interleave(headdim, -1)
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["norm.weight"] * F.silu(z)
    return y @ sd["out_proj.weight"].T + sd.get("out_proj.bias", 0.0)


CASES = [
    dict(),
    dict(ngroups=2, init_states=True, dt_limit=(0.05, 0.3), bias=True),
    dict(ngroups=2, init_states=True, d_conv=3, expand=1),
]


@pytest.mark.parametrize("case", CASES)
def test_released_hydra_checkpoint_loads_unchanged_and_gives_the_same_output(case):
    d_model, d_state, headdim = 16, 4, 8
    ngroups, d_conv, expand = case.get("ngroups", 1), case.get("d_conv", 7), case.get("expand", 2)
    sd = released_hydra_state_dict(d_model, d_state, headdim, ngroups, d_conv, expand, bias=case.get("bias", False),
                                   init_states=case.get("init_states", False))
    hydra = Hydra(d_model, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim, ngroups=ngroups,
                  dt_limit=case.get("dt_limit", (0.0, float("inf"))),
                  learnable_init_states=case.get("init_states", False),
                  bias=case.get("bias", False), chunk_size=4, dtype=F64)
    assert set(hydra.state_dict()) == set(sd)              # the released keys, no more, no fewer
    hydra.load_state_dict(sd)                              # strict
    u = torch.randn(2, 11, d_model, generator=gen(3), dtype=F64)
    expected = released_hydra(sd, u, d_state=d_state, headdim=headdim, ngroups=ngroups, d_conv=d_conv,
                              expand=expand, dt_limit=case.get("dt_limit", (0.0, math.inf)))
    torch.testing.assert_close(hydra(u), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hydra.forward_via_matrix(u), expected, rtol=1e-10, atol=1e-12)
    again = {k: v.clone() for k, v in hydra.state_dict().items()}
    assert all(torch.equal(again[k], sd[k]) for k in sd)   # saves in the released layout


def test_hydra_has_the_released_constructor_and_attributes():
    hydra = Hydra(32, d_state=8, headdim=16, conv_init=0.05, layer_idx=3, use_mem_eff_path=True)
    assert (hydra.d_inner, hydra.nheads, hydra.headdim, hydra.layer_idx) == (64, 4, 16, 3)
    assert hydra.conv1d.weight.abs().max() <= 0.05
    assert torch.equal(hydra.A_log, torch.zeros(4)) and torch.equal(hydra.D, torch.ones(4))
    assert hydra.in_proj.weight.shape == (2 * 64 + 4 * 8 + 2 * 4, 32)
    with pytest.raises(ValueError, match="activation"):
        Hydra(32, activation="gelu")
    with pytest.raises(mp.MixerInputError, match="seq_idx"):
        hydra(torch.randn(1, 4, 32), seq_idx=torch.zeros(1, 4, dtype=torch.long))


# -- the options on the quasiseparable mixer itself (item 3) -----------------------------------------------------------

def _ours(sd):
    return {{"A_log": "ssm.A_log", "dt_bias": "ssm.dt_bias", "D": "ssm.D"}.get(k, k): v for k, v in sd.items()}


def test_quasiseparable_mixer_dt_limit_and_learnable_initial_states_match_the_released_code():
    sd = released_hydra_state_dict(16, 4, 8, ngroups=2, init_states=True, seed=4)
    mixer = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4, ngroups=2, chunk_size=4,
                            dt_limit=(0.05, 0.3), learnable_init_states=True).to(F64).eval()
    mixer.load_state_dict(_ours(sd))
    u = torch.randn(3, 9, 16, generator=gen(5), dtype=F64)
    expected = released_hydra(sd, u, d_state=4, headdim=8, ngroups=2, dt_limit=(0.05, 0.3))
    torch.testing.assert_close(mixer(u), expected, rtol=1e-10, atol=1e-12)
    # right padding: a padded row equals the unpadded one (the initial state enters at the last real token)
    mask = torch.arange(9)[None] < torch.tensor([9, 6, 2])[:, None]
    out = mixer(u, mask=mask)
    for row, n in enumerate([9, 6, 2]):
        torch.testing.assert_close(out[row, :n], mixer(u[row:row + 1, :n])[0], rtol=1e-10, atol=1e-12)


def test_initial_states_start_at_zero_and_get_gradients():
    mixer = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4, learnable_init_states=True)
    assert torch.equal(mixer.init_states, torch.zeros(4, 8, 4))
    mixer(torch.randn(2, 5, 16)).square().sum().backward()
    assert mixer.init_states.grad is not None and mixer.init_states.grad.abs().sum() > 0


def test_conv_init_draws_bounded_conv_weights_and_reset_equals_a_fresh_build():
    torch.manual_seed(0)
    fresh = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4, conv_init=0.01)
    assert fresh.conv1d.weight.abs().max() <= 0.01
    default = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4)
    assert default.conv1d.weight.abs().max() > 0.01
    torch.manual_seed(0)
    other = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4, conv_init=0.01)
    with torch.no_grad():
        other.conv1d.weight.fill_(1.0)
    other.reset_parameters()
    assert 0 < other.conv1d.weight.abs().max() <= 0.01          # a reset re-draws within the bound
    torch.manual_seed(0)
    again = mp.create_mixer("quasiseparable", 16, head_dim=8, d_state=4, conv_init=0.01)
    for k, v in again.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)


@pytest.mark.parametrize("name", ["quasiseparable", "semiseparable"])
@pytest.mark.parametrize("before", [True, False])
def test_norm_per_group_is_mamba2_grouped_gated_rmsnorm(name, before):
    opts = dict(head_dim=8, d_state=4, ngroups=2, norm_before_gate=before)
    if name == "semiseparable":
        opts["d_conv"] = 4
    grouped = mp.create_mixer(name, 16, norm_per_group=True, **opts).to(F64)
    whole = mp.create_mixer(name, 16, **opts).to(F64)
    with torch.no_grad():
        grouped.norm.weight.uniform_(0.5, 1.5)
    y, z = torch.randn(2, 5, 32, generator=gen(1), dtype=F64), torch.randn(2, 5, 32, generator=gen(2), dtype=F64)

    def reference(y, z, groups):  # mamba-ssm's rms_norm_ref with group_size = width / groups
        u = y if before else y * F.silu(z)
        ug = u.unflatten(-1, (groups, -1))
        out = (ug / torch.sqrt(ug.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * grouped.norm.weight
        return out * F.silu(z) if before else out

    torch.testing.assert_close(grouped.gated_norm(y, z), reference(y, z, 2), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(grouped.gated_norm(y, z), reference(y, z, 1))
    with torch.no_grad():
        whole.norm.weight.copy_(grouped.norm.weight)
    torch.testing.assert_close(whole.gated_norm(y, z), reference(y, z, 1), rtol=1e-12, atol=1e-12)  # default


@pytest.mark.parametrize("options, message", [
    (dict(dt_limit=(0.5, 0.1)), "dt_limit"),
    (dict(conv_init=-1.0), "greater than 0"),
    (dict(learnable_init_state=True), "did you mean 'learnable_init_states'"),
    (dict(norm_per_grup=True), "did you mean 'norm_per_group'"),
])
def test_hydra_options_are_validated(options, message):
    with pytest.raises(mp.InvalidMixerOptions, match=message):
        mp.create_mixer("quasiseparable", 16, head_dim=8, **options)


# -- the released matrix-mixer checkpoints (item 7) --------------------------------------------------------------------

def test_released_data_independent_toeplitz_taps_are_rolled_by_one():
    lmax, d_model, headdim = 6, 16, 8
    H, K = 2 * d_model // headdim, 2 * lmax - 1
    g = gen(7)
    released = {
        "in_proj.weight": 0.3 * torch.randn(4 * d_model, d_model, generator=g, dtype=F64),
        "conv1d.weight": 0.3 * torch.randn(2 * d_model, 1, 7, generator=g, dtype=F64),
        "conv1d.bias": 0.1 * torch.randn(2 * d_model, generator=g, dtype=F64),
        "norm.weight": torch.ones(2 * d_model, dtype=F64),
        "out_proj.weight": 0.3 * torch.randn(d_model, 2 * d_model, generator=g, dtype=F64),
        "matrix_mixer.conv_params": torch.randn(H, K, generator=g, dtype=F64),
    }
    mixer = mp.create_mixer("toeplitz", d_model, head_dim=headdim, max_seq_len=lmax, data_dependent=False).to(F64)
    mixer.load_state_dict(convert_matrix_mixer_state_dict(released, "toeplitz", is_data_dependent=False))
    # the released matrix: circular convolution, m_ij = c[(i - j + Lmax) mod K], scaled by 0.5/sqrt(Lmax), + identity
    idx = (torch.arange(lmax)[:, None] - torch.arange(lmax)[None, :] + lmax) % K
    expected = 0.5 / math.sqrt(lmax) * released["matrix_mixer.conv_params"][:, idx] + torch.eye(lmax, dtype=F64)
    x = torch.randn(2, lmax, d_model, generator=g, dtype=F64)
    torch.testing.assert_close(mixer.materialize(x), expected.expand(2, -1, -1, -1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="rotated"):
        convert_matrix_mixer_state_dict(released, "toeplitz", is_data_dependent=True)


def test_released_quasiseparable_matrix_mixer_checkpoint_converts():
    d_model, headdim, qk = 16, 8, 2
    H = 2 * d_model // headdim
    N = H * qk  # the released MatrixMixer sets d_state = nheads * qk_dim, one group
    hydra_like = released_hydra_state_dict(d_model, N, headdim, shared_bc=True, seed=9)
    released = {k: v for k, v in hydra_like.items() if k.split(".")[0] in ("in_proj", "conv1d", "norm", "out_proj")}
    released.update({f"matrix_mixer.{k}": v for k, v in hydra_like.items()
                     if k in ("A_log", "dt_bias", "D", "fc_D.weight")})
    mixer = mp.create_mixer("quasiseparable", d_model, head_dim=headdim, d_state=N, shared_bc=True,
                            chunk_size=4).to(F64)
    mixer.load_state_dict(convert_matrix_mixer_state_dict(released, "quasiseparable"))
    u = torch.randn(2, 10, d_model, generator=gen(11), dtype=F64)
    expected = released_hydra(hydra_like, u, d_state=N, headdim=headdim, shared_bc=True)
    torch.testing.assert_close(mixer(u), expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(KeyError, match="unexpected key"):
        convert_matrix_mixer_state_dict({**released, "matrix_mixer.bogus": torch.zeros(1)}, "quasiseparable")
    with pytest.raises(ValueError, match="supported"):
        convert_matrix_mixer_state_dict(released, "butterfly")


# -- every other released matrix-mixer checkpoint kind -----------------------------------------------------------------

def released_matrix_mixer_state_dict(kind, dd, d_model, qk, headdim, lmax, seed=0, d_conv=7, expand=2):
    """Random weights with the released ``MatrixMixer`` key set and shapes (``hydra/modules/matrix_mixer.py``)."""
    g = gen(seed)
    rnd = lambda *s, scale=0.3: scale * torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    d_inner = expand * d_model
    H = d_inner // headdim
    N = H * qk
    extra = 2 * N if dd else 0
    sd = {
        "in_proj.weight": rnd(2 * d_inner + extra, d_model),
        "conv1d.weight": rnd(d_inner + extra, 1, d_conv),
        "conv1d.bias": rnd(d_inner + extra, scale=0.1),
        "norm.weight": 1.0 + rnd(d_inner, scale=0.1),
        "out_proj.weight": rnd(d_model, d_inner),
    }
    if kind == "dense":
        sd["matrix_mixer.M"] = rnd(H, lmax, lmax, scale=1.0)
    elif kind == "vandermonde" and not dd:
        t = torch.arange(lmax, dtype=F64)
        sd["matrix_mixer.dft_matrix"] = torch.cos(2 * torch.pi * t[:, None] * t[None, :] / lmax)
    elif kind == "cauchy" and dd:
        sd["matrix_mixer.bias"] = torch.tensor(0.3, dtype=F64)
    elif kind in ("cauchy", "low_rank", "attention") and not dd:
        sd["matrix_mixer.q_matrix"] = rnd(lmax, H, qk, scale=0.5)
        sd["matrix_mixer.k_matrix"] = rnd(lmax, H, qk, scale=0.5)
    return sd


def released_matrix_mixer(sd, u, kind, dd, *, qk, headdim, d_conv=7, expand=2, lmax):
    """The released ``MatrixMixer`` forward (in_proj, conv, activations, ``y = s M v + v``, gated RMSNorm, out_proj)
    written from the released formulas; DI attention is the intended softmax(Q K^T / sqrt(qk)) (the released einsum
    cannot run it)."""
    batch, L, d_model = u.shape
    d_inner = expand * d_model
    H = d_inner // headdim
    N = H * qk
    proj = u @ sd["in_proj.weight"].T

    def conv(t):
        return F.conv1d(t.transpose(1, 2), sd["conv1d.weight"], sd["conv1d.bias"], padding=d_conv // 2,
                        groups=t.shape[-1]).transpose(1, 2)

    if dd:
        z, vqk = proj.split([d_inner, d_inner + 2 * N], -1)
        vqk = conv(vqk)
        if kind == "low_rank":
            vqk = F.silu(vqk)
        v, q, k = vqk.split([d_inner, N, N], -1)
        if kind != "low_rank":
            v = F.silu(v)
        q, k = q.unflatten(-1, (H, qk)), k.unflatten(-1, (H, qk))  # (b, L, n, d)
    else:
        z, x = proj.split([d_inner, d_inner], -1)
        v = F.silu(conv(x))
        if "matrix_mixer.q_matrix" in sd:
            q, k = sd["matrix_mixer.q_matrix"][None], sd["matrix_mixer.k_matrix"][None]
    t = torch.arange(L, dtype=F64)
    if kind == "dense":
        M, s = sd["matrix_mixer.M"][None], 1 / math.sqrt(lmax)
    elif kind == "vandermonde" and dd:
        eps = 1e-3
        # m_ij = sum_d cos(2 pi eps q_{i,d} j) - cos(2 pi eps k_{j,d} i)
        Mq = torch.cos(2 * math.pi * eps * q[..., None] * t).sum(3).permute(0, 2, 1, 3)   # (b, n, i, j)
        Mk = torch.cos(2 * math.pi * eps * k[..., None] * t).sum(3).permute(0, 2, 3, 1)   # (b, n, i, j)
        M = Mq - Mk
        s = 1 / math.sqrt(2 * lmax * qk)
    elif kind == "vandermonde":
        M, s = torch.cos(2 * math.pi * t[:, None] * t[None, :] / lmax)[None, None], 1 / math.sqrt(lmax)
    elif kind == "cauchy":
        beta = sd.get("matrix_mixer.bias", 0.0)
        M = (1 / (torch.exp(q)[:, :, None] + beta + torch.exp(k)[:, None] + beta + 1e-8)).sum(-1).permute(0, 3, 1, 2)
        s = 1 / math.sqrt(lmax * qk)
    elif kind == "low_rank":
        M, s = torch.einsum("bind,bjnd->bnij", q, k), 1 / math.sqrt(lmax * qk)
    else:  # attention
        M, s = torch.softmax(torch.einsum("bind,bjnd->bnij", q, k) / math.sqrt(qk), -1), 1.0
    vh = v.unflatten(-1, (H, headdim))
    y = (s * torch.einsum("bnij,bjnp->binp", M.expand(batch, -1, -1, -1), vh) + vh).flatten(2)
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["norm.weight"] * F.silu(z)
    return y @ sd["out_proj.weight"].T


RELEASED_KINDS = [("dense", False), ("vandermonde", True), ("vandermonde", False), ("cauchy", True),
                  ("cauchy", False), ("low_rank", True), ("low_rank", False), ("attention", True),
                  ("attention", False)]


@pytest.mark.parametrize("kind, dd", RELEASED_KINDS)
def test_every_released_matrix_mixer_checkpoint_converts_and_gives_the_released_output(kind, dd):
    from mixer_plugins.compat import matrix_mixer_options

    d_model, qk, headdim, lmax = 16, 2, 8, 10
    released = released_matrix_mixer_state_dict(kind, dd, d_model, qk, headdim, lmax, seed=13)
    name, options = matrix_mixer_options(kind, dd, d_model, qk, max_seq_len=lmax, headdim=headdim)
    mixer = mp.create_mixer(name, d_model, **options).to(F64).eval()
    converted = convert_matrix_mixer_state_dict(released, kind, is_data_dependent=dd)
    result = mixer.load_state_dict(converted)                        # strict: every key, no more
    assert result.missing_keys == [] and result.unexpected_keys == []
    u = torch.randn(2, lmax, d_model, generator=gen(14), dtype=F64)
    expected = released_matrix_mixer(released, u, kind, dd, qk=qk, headdim=headdim, lmax=lmax)
    with torch.no_grad():
        torch.testing.assert_close(mixer(u), expected, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(mixer.forward_via_matrix(u), expected, rtol=1e-9, atol=1e-11)


def test_released_matrix_mixer_checkpoints_without_an_image_are_refused():
    released = released_matrix_mixer_state_dict("cauchy", True, 16, 2, 8, 10)
    released["matrix_mixer.bias"] = torch.tensor(-0.2, dtype=F64)
    with pytest.raises(ValueError, match="not positive"):
        convert_matrix_mixer_state_dict(released, "cauchy")
    released = released_matrix_mixer_state_dict("vandermonde", False, 16, 2, 8, 10)
    released["matrix_mixer.dft_matrix"] = released["matrix_mixer.dft_matrix"] * 2
    with pytest.raises(ValueError, match="not the real DFT"):
        convert_matrix_mixer_state_dict(released, "vandermonde", is_data_dependent=False)
    released = released_matrix_mixer_state_dict("vandermonde", True, 16, 2, 8, 10)
    released["matrix_mixer.q_bias"] = torch.zeros(4, 2, 10, dtype=F64)
    with pytest.raises(ValueError, match="diagonal"):
        convert_matrix_mixer_state_dict(released, "vandermonde", is_data_dependent=False)




def test_converter_names_is_data_dependent_for_a_checkpoint_of_the_other_form():
    """A data-independent quasiseparable checkpoint (its generators B, C in one learned ``BC``) converted with the
    default is_data_dependent=True: the KeyError says to pass is_data_dependent=False, which converts it."""
    released = {"out_proj.weight": torch.zeros(16, 32), "matrix_mixer.A_log": torch.zeros(4),
                "matrix_mixer.dt_bias": torch.zeros(4), "matrix_mixer.D": torch.zeros(4),
                "matrix_mixer.fc_D.weight": torch.zeros(4, 32), "matrix_mixer.BC": torch.zeros(12, 16)}
    with pytest.raises(KeyError, match=r"'matrix_mixer\.BC'.*data-dependent.*is_data_dependent=False"):
        convert_matrix_mixer_state_dict(released, "quasiseparable")
    assert "BC" in convert_matrix_mixer_state_dict(released, "quasiseparable", is_data_dependent=False)
