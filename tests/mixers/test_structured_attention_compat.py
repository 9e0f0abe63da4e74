"""The released structured-attention checkpoints (Kuang et al. 2025, the paper's ``src/model.py``) convert to our
mixers and give the released outputs, and the LN-bias option those checkpoints need.

Every reference here is written from the released forward passes (documented in the structured-attention design
note), on state dicts built by hand with the released key sets and shapes, in float64, with ``bias=True`` (the default
of the released ``GPTConfig`` and ViT): biases in every Linear and LayerNorm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mixer_plugins as mp
from mixer_plugins.compat import RELEASED_ATTENTION_KINDS, convert_structured_attention_state_dict

F64 = torch.float64
C, H, T = 32, 2, 16
HD = C // H


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rnd(g, *shape, scale=0.3):
    return scale * torch.randn(*shape, generator=g, dtype=F64)


def _linear(sd, g, name, d_out, d_in):
    sd[f"{name}.weight"] = _rnd(g, d_out, d_in)
    sd[f"{name}.bias"] = _rnd(g, d_out, scale=0.1)


def _ln(sd, g, name, width):
    sd[f"{name}.weight"] = 1.0 + _rnd(g, width, scale=0.2)
    sd[f"{name}.bias"] = _rnd(g, width, scale=0.2)


def _mask_buffer(length):
    return torch.tril(torch.ones(length, length)).view(1, 1, length, length)


def released_state_dict(kind, seed=0, *, ranks=(8, 4, 4), btt_rank=2, extra_ln=True):
    g = gen(seed)
    sd = {}
    if kind in ("mha", "swa", "gswa", "mlr"):
        for side in ("q", "k", "v"):
            _linear(sd, g, f"c_attn_{side}", C, C)
        _ln(sd, g, "ln_q", HD)
        _ln(sd, g, "ln_k", HD)
        if kind == "gswa":
            sd["bias_global"], sd["bias_SWA"] = _mask_buffer(T), _mask_buffer(T)
        else:
            sd["bias"] = _mask_buffer(T)
        if kind == "mlr":
            sd["mlr_block_mask"] = torch.ones(1, 1, T, T)
    elif kind == "bilinear_mlr":
        for level, r in enumerate(ranks):
            p = 2 ** level
            for side in ("wq", "wk"):
                sd[f"bilinear_mlr_{side}.{level}.weight"] = _rnd(g, p, C // p, H * r, scale=1.0 / math.sqrt(C // p))
                _ln(sd, g, f"bilinear_mlr_ln_{side}.{level}", r * p)
        _linear(sd, g, "c_attn_v", C, C)
        sd["bias"] = _mask_buffer(T)
    else:
        c, d, s = 4, 8, btt_rank  # factorize(32) = (4, 8)
        sd["bilinear_btt_wk.weight"] = _rnd(g, c, d, H * d * s, scale=1.0 / math.sqrt(d))
        sd["bilinear_btt_wq.weight"] = _rnd(g, H * d, c, c * s, scale=1.0 / math.sqrt(c * s))
        _ln(sd, g, "bilinear_btt_ln_PLPRXT", C)
        if extra_ln:
            _ln(sd, g, "bilinear_btt_ln_X", C)
        _linear(sd, g, "c_attn_v", C, C)
        sd["bias"] = _mask_buffer(T)
    _linear(sd, g, "c_proj", C, C)
    return sd


def _layer_norm(x, sd, name):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-5)


def _lin(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def _capped(weight, d_in, d_out, square_out):
    """The released forward-time RMS cap: ``W / max(1, rms(W) / kappa)``."""
    rms = torch.sqrt(torch.mean(weight ** 2) + 1e-8)
    kappa = (min(d_in, d_out) * (d_out if square_out else 1) / ((d_out if square_out else 1) * d_in * d_in)) ** 0.5
    return weight / max(1.0, float(rms / kappa))


def released_forward(sd, x, kind, *, window=3, gswa=(8, 8), ranks=(8, 4, 2, 2), block_sizes=(16, 8, 4, 2),
                     bmlr_ranks=(8, 4, 4)):
    """The released modules' forward (causal, softmax, eval), from ``src/model.py``'s formulas."""
    B = x.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    pos = torch.arange(T)
    if kind == "bilinear_btt":
        if "bilinear_btt_ln_X.weight" in sd:
            x = _layer_norm(x, sd, "bilinear_btt_ln_X")
        wk, wq = sd["bilinear_btt_wk.weight"], sd["bilinear_btt_wq.weight"]
        c, d = wk.shape[:2]
        s = wq.shape[2] // c
        wk = _capped(wk, wk.shape[-2], wk.shape[-1], False)
        wq = _capped(wq, wq.shape[-1], wq.shape[-2], False)
        att = x.reshape(B * T, c, d).permute(1, 0, 2)
        att = torch.bmm(att, wk)
        att = att.reshape(c, B * T, H * d, s).permute(0, 3, 1, 2).reshape(c * s, B * T, H * d).permute(2, 0, 1)
        att = torch.bmm(wq, att)
        att = att.reshape(H, d, c, B, T).permute(3, 0, 4, 2, 1).reshape(B, H * T, c * d)
        att = torch.bmm(x, _layer_norm(att, sd, "bilinear_btt_ln_PLPRXT").transpose(-2, -1)) / math.sqrt(C)
        scores = [att.reshape(B, T, H, T).permute(0, 2, 1, 3)]
        v = _lin(x, sd, "c_attn_v")
    elif kind == "bilinear_mlr":
        att = 0
        for level, r in enumerate(bmlr_ranks):
            p = 2 ** level
            chunks = torch.stack(torch.split(x, C // p, dim=-1), 0).reshape(p, B * T, C // p)
            qk = []
            for side in ("wq", "wk"):
                w = sd[f"bilinear_mlr_{side}.{level}.weight"]
                w = _capped(w, w.size(-2), w.size(-1), True)
                t = torch.bmm(chunks, w).reshape(p, B, T, H, r).permute(1, 3, 2, 4, 0).reshape(B, H, T, r * p)
                qk.append(_layer_norm(t, sd, f"bilinear_mlr_ln_{side}.{level}"))
            att = att + qk[0] @ qk[1].transpose(-2, -1) / math.sqrt(r * p)
        scores = [att]
        v = _lin(x, sd, "c_attn_v")
    else:
        q, k, v = (_lin(x, sd, f"c_attn_{side}").view(B, T, H, HD).transpose(1, 2) for side in "qkv")
        q, k = _layer_norm(q, sd, "ln_q"), _layer_norm(k, sd, "ln_k")
        v = v.transpose(1, 2).reshape(B, T, C)
        if kind == "mha":
            scores = [q @ k.transpose(-2, -1) * 8 / HD]
        elif kind == "swa":
            band = (pos[:, None] - pos[None, :]) <= window
            scores = [(q @ k.transpose(-2, -1) * 8 / HD).masked_fill(~band, float("-inf"))]
        elif kind == "gswa":
            a, b = gswa
            qa, qb = q.split([a, b], -1)
            ka, kb = k.split([a, b], -1)
            band = (pos[:, None] - pos[None, :]) <= window
            scores = [qa @ ka.transpose(-2, -1) * 8 / a, (qb @ kb.transpose(-2, -1) * 8 / b).masked_fill(~band,
                                                                                                      float("-inf"))]
        else:  # mlr, block-divide on
            att, count = 0, 0
            offset = 0
            for r, size in zip(ranks, block_sizes):
                same = (pos[:, None] // size) == (pos[None, :] // size)
                ql, kl = q[..., offset:offset + r], k[..., offset:offset + r]
                att = att + (ql @ kl.transpose(-2, -1) / r) * same
                count = count + same.to(F64)
                offset += r
            scores = [att / count]
    probs = sum(torch.softmax(sc.masked_fill(~causal, float("-inf")), -1) for sc in scores)
    y = (probs @ v.view(B, T, H, HD).transpose(1, 2)).transpose(1, 2).reshape(B, T, C)
    return _lin(y, sd, "c_proj")


OURS = {
    "mha": ("mlr_attention", dict(ranks=[HD], block_sizes=[None], logit_scaling="mup", logit_multiplier=8.0)),
    "swa": ("sliding_window_attention", dict(window=3, logit_scaling="mup", logit_multiplier=8.0)),
    "gswa": ("global_local_attention", dict(window=3, global_dim=8)),
    "mlr": ("mlr_attention", dict(ranks=[8, 4, 2, 2], block_sizes=[16, 8, 4, 2])),
    "bilinear_mlr": ("bilinear_mlr_attention", dict(ranks=[8, 4, 4])),
    "bilinear_btt": ("btt_attention", dict(btt_rank=2, input_norm=True)),
}


@pytest.mark.parametrize("kind", RELEASED_ATTENTION_KINDS)
def test_released_attention_checkpoints_convert_and_give_the_released_output(kind):
    released = released_state_dict(kind, seed=3)
    name, options = OURS[kind]
    mixer = mp.create_mixer(name, C, num_heads=H, causal=True, ln_bias=True, proj_bias=True, **options).to(F64).eval()
    result = mixer.load_state_dict(convert_structured_attention_state_dict(released, kind))  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(2, T, C, generator=gen(4), dtype=F64)
    expected = released_forward(released, x, kind)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), expected, rtol=1e-9, atol=1e-11)
        if mixer.materializable:
            torch.testing.assert_close(mixer.forward_via_matrix(x), expected, rtol=1e-9, atol=1e-11)


def test_fused_c_attn_and_bias_free_checkpoints_convert():
    released = released_state_dict("mlr", seed=5)
    fused = {k: v for k, v in released.items() if not k.startswith("c_attn_")}
    for side in ("weight", "bias"):
        fused[f"c_attn.{side}"] = torch.cat([released[f"c_attn_{s}.{side}"] for s in "qkv"])
    converted = convert_structured_attention_state_dict(fused, "mlr")
    assert torch.equal(converted["qkv.weight"], convert_structured_attention_state_dict(released, "mlr")["qkv.weight"])
    # the paper's runs: bias=False everywhere, our defaults (no LN bias, no projection bias)
    bias_free = {k: v for k, v in released.items() if not k.endswith(".bias")}
    mixer = mp.create_mixer("mlr_attention", C, num_heads=H, causal=True, ranks=[8, 4, 2, 2], block_sizes=[16, 8, 4, 2])
    mixer.load_state_dict(convert_structured_attention_state_dict(bias_free, "mlr"))


def test_unknown_keys_and_kinds_are_refused():
    released = released_state_dict("swa")
    with pytest.raises(KeyError, match="unexpected key"):
        convert_structured_attention_state_dict({**released, "c_attn_x.weight": torch.zeros(1)}, "swa")
    with pytest.raises(ValueError, match="kinds: mha"):
        convert_structured_attention_state_dict(released, "monarch")
    narrow = {**released, "c_attn_q.weight": torch.zeros(16, C), "c_attn_k.weight": torch.zeros(16, C)}
    with pytest.raises(ValueError, match="d_qk_head"):
        convert_structured_attention_state_dict(narrow, "mha")


@pytest.mark.parametrize("name, norms", [
    ("mlr_attention", ["q_norm", "k_norm"]),
    ("sliding_window_attention", ["q_norm", "k_norm"]),
    ("global_local_attention", ["q_norm", "k_norm"]),
    ("bilinear_mlr_attention", ["q_norms.0", "k_norms.3"]),
    ("btt_attention", ["key_norm", "input_norm"]),
])
def test_ln_bias_option_defaults_to_the_papers_runs(name, norms):
    extra = {"window": 3} if "window" in name or "local" in name else {}
    extra.update({"input_norm": True} if name == "btt_attention" else {})
    default = mp.create_mixer(name, C, num_heads=H, **extra)
    assert not any(f"{n}.bias" in default.state_dict() for n in norms)  # the paper's runs: bias=False
    biased = mp.create_mixer(name, C, num_heads=H, ln_bias=True, **extra)
    state = biased.state_dict()
    assert all(torch.equal(state[f"{n}.bias"], torch.zeros_like(state[f"{n}.bias"])) for n in norms)
    if name != "btt_attention":  # BTT always has its key LayerNorm; the others' norms can be off
        with pytest.raises(mp.InvalidMixerOptions, match="ln_bias=True needs qk_norm=True"):
            mp.create_mixer(name, C, num_heads=H, ln_bias=True, qk_norm=False, **extra)
