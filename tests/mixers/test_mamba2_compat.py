"""The Mamba-2 drop-in (``mixer_plugins.compat.Mamba2``) against the released module's math, whole-sequence and step
by step, in float64.

The oracle is written here from the released module's definition (``state-spaces/mamba``,
``mamba_ssm/modules/mamba2.py``: its non-fused forward and its pure-PyTorch ``step``), token by token with plain
loops, on a ``state_dict`` built by hand in the released layout:

    zxbcdt = in_proj(u) = [z0, x0, z, xBC, dt]            (z0, x0: d_mlp = d_inner - d_ssm channels each)
    xBC    = silu(causal depthwise conv1d(xBC) + bias)     (kernel d_conv, zeros before the start)
    x, B, C = split(xBC);  dt = clamp(softplus(dt + dt_bias), dt_limit);  A = -exp(A_log)
    h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T;  y_t = h_t C_t + D x_t     (head h reads group h // (nheads/ngroups))
    y = rmsnorm_gated(y, z) per group of d_ssm / ngroups channels   (or y * silu(z) without rmsnorm)
    out = out_proj([silu(z0) * x0, y])

and the released step: ``conv_state`` (batch, conv_dim, d_conv) rolled left by one with the new input in the last
slot, the conv output ``sum(conv_state * w) + b``, then the same recurrence on ``ssm_state``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mixer_plugins.compat import Mamba2
from mixer_plugins.errors import MixerInputError, NotMaterializableError

F64 = torch.float64


def released_config(d_model=32, d_state=8, d_conv=4, expand=2, headdim=8, d_ssm=None, ngroups=1, D_has_hdim=False,
                    rmsnorm=True, norm_before_gate=False, dt_limit=(0.0, math.inf), bias=False, conv_bias=True):
    d_inner = expand * d_model
    d_ssm = d_inner if d_ssm is None else d_ssm
    return SimpleNamespace(d_model=d_model, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim,
                           d_inner=d_inner, d_ssm=d_ssm, ngroups=ngroups, nheads=d_ssm // headdim,
                           D_has_hdim=D_has_hdim, rmsnorm=rmsnorm, norm_before_gate=norm_before_gate,
                           dt_limit=dt_limit, bias=bias, conv_bias=conv_bias,
                           conv_dim=d_ssm + 2 * ngroups * d_state)


def released_state_dict(cfg, seed=0):
    """Random weights in the released layout (keys and shapes of ``Mamba2.__init__``)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=0.3: scale * torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    d_in_proj = 2 * cfg.d_inner + 2 * cfg.ngroups * cfg.d_state + cfg.nheads
    sd = {
        "in_proj.weight": rnd(d_in_proj, cfg.d_model),
        "conv1d.weight": rnd(cfg.conv_dim, 1, cfg.d_conv),
        "dt_bias": rnd(cfg.nheads, scale=1.0) - 1.0,
        "A_log": rnd(cfg.nheads, scale=0.5),
        "D": 1.0 + rnd(cfg.d_ssm if cfg.D_has_hdim else cfg.nheads, scale=0.2),
        "out_proj.weight": rnd(cfg.d_model, cfg.d_inner),
    }
    if cfg.conv_bias:
        sd["conv1d.bias"] = rnd(cfg.conv_dim, scale=0.1)
    if cfg.rmsnorm:
        sd["norm.weight"] = 1.0 + rnd(cfg.d_ssm, scale=0.1)
    if cfg.bias:
        sd["in_proj.bias"] = rnd(d_in_proj, scale=0.1)
        sd["out_proj.bias"] = rnd(cfg.d_model, scale=0.1)
    return sd


def _split(cfg, zxbcdt):
    d_mlp = cfg.d_inner - cfg.d_ssm
    return zxbcdt.split([d_mlp, d_mlp, cfg.d_ssm, cfg.conv_dim, cfg.nheads], dim=-1)


def _linear(sd, name, x):
    y = x @ sd[f"{name}.weight"].T
    return y + sd[f"{name}.bias"] if f"{name}.bias" in sd else y


def _ssm_token(cfg, sd, state, xBC, dt_raw):
    """One token of the SSM for one row: returns (y (d_ssm,), new state (nheads, headdim, d_state))."""
    x, B, C = xBC.split([cfg.d_ssm, cfg.ngroups * cfg.d_state, cfg.ngroups * cfg.d_state])
    dt = F.softplus(dt_raw + sd["dt_bias"])
    lo, hi = cfg.dt_limit
    dt = dt.clamp(min=lo, max=hi)
    A = -torch.exp(sd["A_log"])
    y = torch.zeros(cfg.d_ssm, dtype=F64)
    new = torch.zeros_like(state)
    per_group = cfg.nheads // cfg.ngroups
    for head in range(cfg.nheads):
        grp = head // per_group
        b_vec = B[grp * cfg.d_state:(grp + 1) * cfg.d_state]
        c_vec = C[grp * cfg.d_state:(grp + 1) * cfg.d_state]
        xh = x[head * cfg.headdim:(head + 1) * cfg.headdim]
        new[head] = torch.exp(A[head] * dt[head]) * state[head] + dt[head] * torch.outer(xh, b_vec)
        if cfg.D_has_hdim:
            skip = sd["D"][head * cfg.headdim:(head + 1) * cfg.headdim] * xh
        else:
            skip = sd["D"][head] * xh
        y[head * cfg.headdim:(head + 1) * cfg.headdim] = new[head] @ c_vec + skip
    return y, new


def _gate(cfg, sd, y, z, z0, x0):
    if cfg.rmsnorm:
        size = cfg.d_ssm // cfg.ngroups
        out = torch.zeros_like(y)
        for grp in range(cfg.ngroups):
            s = slice(grp * size, (grp + 1) * size)
            if cfg.norm_before_gate:
                out[s] = y[s] / torch.sqrt((y[s] ** 2).mean() + 1e-5) * F.silu(z[s])
            else:
                u = y[s] * F.silu(z[s])
                out[s] = u / torch.sqrt((u ** 2).mean() + 1e-5)
        y = out * sd["norm.weight"]
    else:
        y = y * F.silu(z)
    if z0.numel():
        y = torch.cat([F.silu(z0) * x0, y])
    return _linear(sd, "out_proj", y)


def released_forward(cfg, sd, u):
    """The released forward (non-fused path), row by row and token by token. Returns (out, conv_state, ssm_state)
    as the released forward leaves them after a prompt (``inference_params`` with ``seqlen_offset == 0``)."""
    b, length, _ = u.shape
    out = torch.zeros(b, length, cfg.d_model, dtype=F64)
    conv_states = torch.zeros(b, cfg.conv_dim, cfg.d_conv, dtype=F64)
    ssm_states = torch.zeros(b, cfg.nheads, cfg.headdim, cfg.d_state, dtype=F64)
    w = sd["conv1d.weight"][:, 0]
    for row in range(b):
        z0, x0, z, xBC_in, dt = _split(cfg, _linear(sd, "in_proj", u[row]))
        state = torch.zeros(cfg.nheads, cfg.headdim, cfg.d_state, dtype=F64)
        for t in range(length):
            acc = sd.get("conv1d.bias", torch.zeros(cfg.conv_dim, dtype=F64)).clone()
            for k in range(cfg.d_conv):
                src = t - (cfg.d_conv - 1) + k
                if src >= 0:
                    acc = acc + w[:, k] * xBC_in[src]
            y, state = _ssm_token(cfg, sd, state, F.silu(acc), dt[t])
            out[row, t] = _gate(cfg, sd, y, z[t], z0[t], x0[t])
        padded = F.pad(xBC_in.T, (cfg.d_conv - length, 0)) if length < cfg.d_conv else xBC_in.T[:, -cfg.d_conv:]
        conv_states[row] = padded
        ssm_states[row] = state
    return out, conv_states, ssm_states


def released_step(cfg, sd, hidden, conv_state, ssm_state):
    """The released pure-PyTorch ``step`` for one token: (out (b, 1, d), new conv_state, new ssm_state)."""
    b = hidden.shape[0]
    out = torch.zeros(b, 1, cfg.d_model, dtype=F64)
    conv_state, ssm_state = conv_state.clone(), ssm_state.clone()
    for row in range(b):
        z0, x0, z, xBC, dt = _split(cfg, _linear(sd, "in_proj", hidden[row, 0]))
        conv_state[row] = torch.roll(conv_state[row], shifts=-1, dims=-1)
        conv_state[row, :, -1] = xBC
        acc = (conv_state[row] * sd["conv1d.weight"][:, 0]).sum(-1)
        if "conv1d.bias" in sd:
            acc = acc + sd["conv1d.bias"]
        y, ssm_state[row] = _ssm_token(cfg, sd, ssm_state[row], F.silu(acc), dt)
        out[row, 0] = _gate(cfg, sd, y, z, z0, x0)
    return out, conv_state, ssm_state


CONFIGS = {
    "default": {},
    "groups_bias": {"ngroups": 2, "bias": True},
    "mlp_branch": {"d_ssm": 48},
    "per_channel_D": {"D_has_hdim": True, "norm_before_gate": True},
    "no_rmsnorm": {"rmsnorm": False, "conv_bias": False},
    "dt_limit": {"dt_limit": (0.05, 0.4)},
}


def built(cfg, sd, **extra):
    module = Mamba2(cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand, headdim=cfg.headdim,
                    d_ssm=None if cfg.d_ssm == cfg.d_inner else cfg.d_ssm, ngroups=cfg.ngroups,
                    D_has_hdim=cfg.D_has_hdim, rmsnorm=cfg.rmsnorm, norm_before_gate=cfg.norm_before_gate,
                    dt_limit=cfg.dt_limit, bias=cfg.bias, conv_bias=cfg.conv_bias, chunk_size=4, dtype=F64, **extra)
    module.load_state_dict(sd)  # strict: exactly the released keys
    return module.eval()


@pytest.mark.parametrize("variant,prompt", [(v, 6) for v in CONFIGS] + [("groups_bias", 2)])
def test_whole_sequence_and_steps_equal_the_released_math(variant, prompt):
    """A prompt shorter than the conv kernel leaves zeros in the conv state's oldest slots."""
    cfg = released_config(**CONFIGS[variant])
    sd = released_state_dict(cfg, seed=len(variant))
    module = built(cfg, sd, layer_idx=0)
    u = torch.randn(2, 11, cfg.d_model, generator=torch.Generator().manual_seed(1), dtype=F64)
    expected, conv_ref, ssm_ref = released_forward(cfg, sd, u)
    with torch.no_grad():
        torch.testing.assert_close(module(u), expected, rtol=0, atol=1e-12)
        # the released inference flow: prefill the states through inference_params, then step token by token
        params = SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
        _, conv_p, ssm_p = released_forward(cfg, sd, u[:, :prompt])
        torch.testing.assert_close(module(u[:, :prompt], inference_params=params), expected[:, :prompt], rtol=0,
                                   atol=1e-12)
        conv_state, ssm_state = params.key_value_memory_dict[0]
        torch.testing.assert_close(conv_state, conv_p, rtol=0, atol=1e-12)
        torch.testing.assert_close(ssm_state, ssm_p, rtol=0, atol=1e-12)
        conv_o, ssm_o = conv_p, ssm_p
        for t in range(prompt, u.shape[1]):
            params.seqlen_offset = t
            out = module(u[:, t:t + 1], inference_params=params)
            out_o, conv_o, ssm_o = released_step(cfg, sd, u[:, t:t + 1], conv_o, ssm_o)
            torch.testing.assert_close(out, out_o, rtol=0, atol=1e-12)
            torch.testing.assert_close(out, expected[:, t:t + 1], rtol=0, atol=1e-12)
        torch.testing.assert_close(conv_state, conv_o, rtol=0, atol=1e-12)
        torch.testing.assert_close(ssm_state, ssm_o, rtol=0, atol=1e-12)
        torch.testing.assert_close(ssm_state, ssm_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=1e-12)


def test_released_step_signature_and_cache_layout():
    cfg = released_config()
    sd = released_state_dict(cfg, seed=3)
    module = built(cfg, sd)
    conv_state, ssm_state = module.allocate_inference_cache(3, 100)
    assert conv_state.shape == (3, cfg.conv_dim, cfg.d_conv) and conv_state.stride(1) == 1  # a transposed view
    assert ssm_state.shape == (3, cfg.nheads, cfg.headdim, cfg.d_state) and conv_state.dtype == F64
    u = torch.randn(3, 5, cfg.d_model, generator=torch.Generator().manual_seed(2), dtype=F64)
    expected = released_forward(cfg, sd, u)[0]
    with torch.no_grad():
        for t in range(5):  # from empty states: steps alone give the whole forward
            out, c, s = module.step(u[:, t:t + 1], conv_state, ssm_state)
            assert c is conv_state and s is ssm_state
            torch.testing.assert_close(out, expected[:, t:t + 1], rtol=0, atol=1e-12)


def test_state_dict_is_the_released_one():
    cfg = released_config(ngroups=2, bias=True)
    sd = released_state_dict(cfg)
    module = built(cfg, sd)
    assert set(module.state_dict()) == set(sd)
    for key, value in module.state_dict().items():
        assert value.shape == sd[key].shape, key


def test_the_library_api_works_on_it():
    """It is a MatrixMixer: the mask, the matrix and the library's own decoding API."""
    cfg = released_config(ngroups=2)
    module = built(cfg, released_state_dict(cfg, seed=5))
    u = torch.randn(2, 9, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=F64)
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])
    with torch.no_grad():
        full = module(u)
        torch.testing.assert_close(module.forward_via_matrix(u), full, rtol=0, atol=1e-12)
        torch.testing.assert_close(module(u, mask=mask)[1, :5], module(u[1:, :5])[0], rtol=0, atol=1e-12)
        cache = module.allocate_cache(2, 9)
        module.prefill(u[:, :4], cache)
        torch.testing.assert_close(module.step(u[:, 4:7], cache), full[:, 4:7], rtol=0, atol=1e-12)
    with pytest.raises(NotMaterializableError, match="D_has_hdim"):
        cfg2 = released_config(D_has_hdim=True)
        built(cfg2, released_state_dict(cfg2)).materialize(u)


def test_refusals():
    with pytest.raises(ValueError, match="process_group"):
        Mamba2(32, process_group=object())
    with pytest.raises(Exception, match="headdim"):
        Mamba2(32, headdim=7)
    module = Mamba2(32, d_state=8, headdim=8)
    with pytest.raises(MixerInputError, match="seq_idx"):
        module(torch.randn(1, 4, 32), seq_idx=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="layer_idx"):
        module(torch.randn(1, 4, 32), inference_params=SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0))


def test_flattened_input_with_seqlen():
    cfg = released_config()
    module = built(cfg, released_state_dict(cfg))
    u = torch.randn(2, 5, cfg.d_model, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(module(u.flatten(0, 1), seqlen=5), module(u).flatten(0, 1), rtol=0, atol=0)
