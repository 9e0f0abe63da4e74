"""A converter for the released structured-attention checkpoints (Kuang et al. 2025, ``src/model.py`` of the paper's
code): each attention module's ``state_dict`` in our mixers' layout.

The released GPT blocks hold their attention under ``attn``; pass that module's own entries (the keys after
``transformer.h.<i>.attn.``). Which of our mixers takes each kind, and with which options:

==============================  ================================================================================
released module                 ours
==============================  ================================================================================
``CausalSelfAttention`` (MHA)   ``mlr_attention`` with one global level: ``ranks=[head_dim]``,
                                ``block_sizes=[None]``, ``logit_scaling="mup", logit_multiplier=8`` (the code's
                                ``k * 8/sqrt(r)`` then ``/ sqrt(r)``; ``"standard"``, 1 with
                                ``mha_SP_attn_logits_scaling``)
``CausalSelfSlidingWindow...``  ``sliding_window_attention`` (``window`` = ``sliding_block_size``; same scale)
``CausalSelfGlobalSliding...``  ``global_local_attention`` (``global_dim`` = the first entry of ``gswa_rank_list``)
``AttentionMLR``                ``mlr_attention`` (``ranks``, ``block_sizes``, ``block_divide`` from the config)
``BilinearMLRAttention``        ``bilinear_mlr_attention`` (``ranks``; ``logit_scaling="mup",
                                logit_multiplier=8`` with ``bilinear_mlr_muP_attn_logits_scaling``)
``BilinearBTTAttention``        ``btt_attention`` (``btt_rank``; ``input_norm`` with ``bilinearBTT_use_extra_LN_on_X``;
                                ``logit_scaling="mup"`` with ``bilinear_btt_muP_attn_logits_scaling``)
==============================  ================================================================================

Every kind takes ``causal=True`` (the GPT's attention is causal), ``qk_norm`` = ``do_qk_ln`` and, when the released
config had ``bias=True`` (the default of its ``GPTConfig`` and ViT; its training scripts set ``bias=False``),
``ln_bias=True, proj_bias=True``. The separate ``c_attn_q/k/v`` (or the fused ``c_attn``) become our fused ``qkv``;
the causal and block masks the released modules keep as buffers (``bias``, ``bias_global``, ``bias_SWA``,
``mlr_block_mask``) are dropped: ours are built per call. Unknown keys raise rather than load silently.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["RELEASED_ATTENTION_KINDS", "convert_structured_attention_state_dict"]

#: The released attention modules, by the names this converter takes.
RELEASED_ATTENTION_KINDS = ("mha", "swa", "gswa", "mlr", "bilinear_mlr", "bilinear_btt")

_MASK_BUFFERS = ("bias", "bias_global", "bias_SWA", "mlr_block_mask")


def convert_structured_attention_state_dict(state_dict: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """A released structured-attention module's ``state_dict`` (keys relative to the module) in our mixer's layout.

    ``kind`` is one of :data:`RELEASED_ATTENTION_KINDS`; see the module docstring for the mixer and options each one
    loads into (``load_state_dict`` strict).
    """
    if kind not in RELEASED_ATTENTION_KINDS:
        raise ValueError(f"unknown released attention kind {kind!r}; kinds: {', '.join(RELEASED_ATTENTION_KINDS)}")
    state = dict(state_dict)
    out: dict[str, Tensor] = {}
    for name in _MASK_BUFFERS:
        if name in state and not isinstance(state[name], Tensor):
            raise KeyError(f"{name!r} is not a tensor")
        state.pop(name, None)

    def take(theirs: str, ours: str) -> None:
        if theirs in state:
            out[ours] = state.pop(theirs)

    take("c_proj.weight", "proj.weight")
    take("c_proj.bias", "proj.bias")
    take("c_attn_v.weight", "value.weight" if kind.startswith("bilinear") else "v.weight")
    take("c_attn_v.bias", "value.bias" if kind.startswith("bilinear") else "v.bias")
    if kind in ("mha", "swa", "gswa", "mlr"):
        for side in ("weight", "bias"):
            if f"c_attn.{side}" in state:  # fused q, k, v (split_qkv=False): the same order as ours
                out[f"qkv.{side}"] = state.pop(f"c_attn.{side}")
            elif f"c_attn_q.{side}" in state:
                parts = [state.pop(f"c_attn_q.{side}"), state.pop(f"c_attn_k.{side}"), out.pop(f"v.{side}")]
                if len({p.shape for p in parts}) != 1:
                    raise ValueError(f"c_attn_q/k/v.{side} have shapes {[tuple(p.shape) for p in parts]}: a query/key "
                                     "width other than the value's (d_qk_head != d_head) has no image in our mixers")
                out[f"qkv.{side}"] = torch.cat(parts, dim=0)
        for side in ("q", "k"):
            take(f"ln_{side}.weight", f"{side}_norm.weight")
            take(f"ln_{side}.bias", f"{side}_norm.bias")
    elif kind == "bilinear_mlr":
        for key in [k for k in state if k.startswith(("bilinear_mlr_wq.", "bilinear_mlr_wk."))]:
            prefix, level, leaf = key.split(".")
            if leaf == "weight":
                out[f"{'q' if prefix.endswith('wq') else 'k'}_weight_{level}"] = state.pop(key)
        for key in [k for k in state if k.startswith(("bilinear_mlr_ln_wq.", "bilinear_mlr_ln_wk."))]:
            prefix, level, leaf = key.split(".")
            out[f"{'q' if prefix.endswith('wq') else 'k'}_norms.{level}.{leaf}"] = state.pop(key)
    else:  # bilinear_btt
        right, left = state.pop("bilinear_btt_wk.weight", None), state.pop("bilinear_btt_wq.weight", None)
        if right is None or left is None:
            raise KeyError("a released BTT attention state_dict has bilinear_btt_wk.weight and bilinear_btt_wq.weight")
        c, d = right.shape[0], right.shape[1]
        heads_b, a = left.shape[0], left.shape[1]
        s = left.shape[2] // c
        # R-core (c, d, (H b s)) and L-core ((H b), a, (c s)): our MLBTC cores with a leading level axis
        out["key_transform.right_0"] = right.reshape(1, c, d, heads_b, s)
        out["key_transform.left_0"] = left.reshape(1, heads_b, a, c, s)
        take("bilinear_btt_ln_PLPRXT.weight", "key_norm.weight")
        take("bilinear_btt_ln_PLPRXT.bias", "key_norm.bias")
        take("bilinear_btt_ln_X.weight", "input_norm.weight")
        take("bilinear_btt_ln_X.bias", "input_norm.bias")
    stray = sorted(state) + sorted(k for k in out if k.startswith("v."))
    if stray:
        raise KeyError(f"unexpected key(s) {stray} in a released {kind} attention state_dict")
    return out
