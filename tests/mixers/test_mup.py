"""muP: logit scaling, RMS cap, fan-in learning rates, init, and the coordinate check (muP passes, SP fails)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mixer_plugins as mp
from mixer_plugins.layers import mup
from mixer_plugins.testing import MixerCoordCheckModel

# -- logit scale and RMS cap -------------------------------------------------------------------------------------------

def test_attention_logit_scale_rules():
    assert mup.attention_logit_scale(64) == 1 / 8
    assert mup.attention_logit_scale(64, "mup", 8.0) == 1 / 8  # 8/d equals 1/sqrt(d) at d = 64 ...
    assert mup.attention_logit_scale(256, "mup", 8.0) == 1 / 32  # ... and shrinks like 1/d beyond it
    assert mup.attention_logit_scale(256) == 1 / 16
    with pytest.raises(ValueError, match="'standard' or 'mup'"):
        mup.attention_logit_scale(8, "sqrt")
    with pytest.raises(ValueError, match="positive"):
        mup.attention_logit_scale(0)


def test_rms_cap_is_about_one_at_init_and_clips_an_inflated_core_to_kappa():
    btt = mp.create_mixer("btt_attention", 256, num_heads=8, btt_rank=1)  # (c, d) = (8, 32)
    right = btt.key_transform.right_0.detach()                            # fan-in d = 32, fan-out H * b * s
    kappa = mup.rms_cap_target(32, 8 * 32)
    assert kappa == pytest.approx(1 / math.sqrt(32))
    capped = mup.rms_cap(right, 32, 8 * 32)
    assert capped.pow(2).mean().sqrt() / right.pow(2).mean().sqrt() > 0.98  # s = 1 init: factor about 1
    inflated = 10 * right
    clipped = mup.rms_cap(inflated, 32, 8 * 32)
    assert clipped.pow(2).mean().sqrt().item() == pytest.approx(kappa, rel=1e-6)
    small = 0.1 * right
    assert torch.equal(mup.rms_cap(small, 32, 8 * 32), small)  # below the cap: untouched
    weight = inflated.clone().requires_grad_(True)
    mup.rms_cap(weight, 32, 8 * 32).sum().backward()
    assert weight.grad.abs().sum() > 0  # gradients flow through the rescale


# -- fan-ins and learning rates ----------------------------------------------------------------------------------------

def _model(width: int, mixer: str, **options) -> nn.Module:
    return MixerCoordCheckModel(width, mixer, depth=1, in_dim=8, mlp_ratio=2, mixer_options=options)


@pytest.mark.parametrize("mixer, options", [
    ("attention", dict(num_heads=4)),
    ("btt_attention", dict(num_heads=4, btt_rank=2)),
    ("bilinear_mlr_attention", dict(num_heads=4, ranks=[16, 8, 4, 4])),
    ("mlr_attention", dict(num_heads=4)),
    ("global_local_attention", dict(num_heads=4, window=4)),
])
def test_group_learning_rates_follow_the_fan_in_rule(mixer, options):
    model = _model(128, mixer, **options)
    lr, base = 3e-3, 64
    groups = mup.mup_param_groups(model, lr, base_width=base, weight_decay=0.1)
    seen = {}
    for group in groups:
        for name, p in zip(group["names"], group["params"]):
            seen[name] = (group["lr"], group["weight_decay"], p)
    assert set(seen) == {n for n, _ in model.named_parameters()}
    fan_ins = mup.mup_fan_ins(model)
    for name, (group_lr, wd, p) in seen.items():
        if p.dim() >= 2:
            assert group_lr == pytest.approx(lr * base / fan_ins[name]), name
            assert wd == 0.1
        else:
            assert group_lr == lr and wd == 0.0, name
    # Spot-check the table of the spec: dense hidden matrices, read-in, and the structured cores' own fan-ins.
    assert seen["blocks.0.mlp.fc.weight"][0] == pytest.approx(lr * 64 / 128)
    assert seen["blocks.0.mlp.out.weight"][0] == pytest.approx(lr * 64 / 256)
    assert seen["read_in.weight"][0] == pytest.approx(lr * 64 / 8)
    if mixer == "btt_attention":  # D = 128 -> (c, d) = (8, 16)
        assert seen["blocks.0.mixer.key_transform.right_0"][0] == pytest.approx(lr * 64 / 16)       # d
        assert seen["blocks.0.mixer.key_transform.left_0"][0] == pytest.approx(lr * 64 / (8 * 2))   # c * s
    if mixer == "bilinear_mlr_attention":
        for level, p in enumerate([1, 2, 4, 8]):
            assert seen[f"blocks.0.mixer.q_weight_{level}"][0] == pytest.approx(lr * 64 * p / 128)  # lr w0 p_l / D


def test_param_groups_drive_any_optimizer():
    model = _model(64, "mlr_attention", num_heads=4)
    groups = mup.mup_param_groups(model, 0.1, base_width=32)
    optimizer = torch.optim.SGD(groups, lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(2, 6, 8)).pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    lr_of = {n: g["lr"] for g in groups for n in g["names"]}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] - lr_of[name] * grads[name])
    torch.optim.AdamW(mup.mup_param_groups(model, 1e-3, base_width=32))  # accepted as is


def test_embeddings_frozen_and_tied_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.head = nn.Linear(32, 50, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.frozen = nn.Linear(32, 32)
            self.frozen.requires_grad_(False)

    groups = mup.mup_param_groups(Net(), 1e-3, base_width=32)
    names = [n for g in groups for n in g["names"]]
    assert names == ["embed.weight"]  # tied counted once; frozen left out
    assert groups[0]["lr"] == 1e-3 and groups[0]["weight_decay"] == 0.0  # an embedding table is vector-like


def test_unknown_matrices_raise_and_overrides_fix_them():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(4, 6))

    with pytest.raises(ValueError, match=r"fan-in of parameter 'table'.*mup_fan_in.*fan_in_overrides"):
        mup.mup_param_groups(Odd(), 1e-3, base_width=8)
    groups = mup.mup_param_groups(Odd(), 1e-3, base_width=8, fan_in_overrides={"table": 4})
    assert groups[0]["lr"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="does not have"):
        mup.mup_param_groups(Odd(), 1e-3, base_width=8, fan_in_overrides={"tabel": 4})
    with pytest.raises(ValueError, match="base_width must be positive"):
        mup.mup_param_groups(Odd(), 1e-3, base_width=0, fan_in_overrides={"table": 4})


# -- init --------------------------------------------------------------------------------------------------------------

def test_mup_init_scales_zeros_and_unit_gains():
    torch.manual_seed(0)
    model = _model(256, "btt_attention", num_heads=4, btt_rank=2)  # (c, d) = (8, 32)
    for p in model.parameters():
        nn.init.uniform_(p, 0.5, 1.5)  # garbage, so that every init below is visible
    mup.mup_init(model, zero_init=["blocks.*.mixer.proj.weight"])
    fan_ins = mup.mup_fan_ins(model)
    params = dict(model.named_parameters())
    for name in ["blocks.0.mlp.fc.weight", "blocks.0.mixer.value.weight", "blocks.0.mixer.key_transform.right_0",
                 "blocks.0.mixer.key_transform.left_0", "read_in.weight"]:
        std = params[name].std().item()
        assert std == pytest.approx(1 / math.sqrt(fan_ins[name]), rel=0.1), name
    # Exactly zero at step 0: the readout (declared by the model), the BTT key-LN gain (logits 0 at init), the glob.
    for name in ["readout.weight", "blocks.0.mixer.key_norm.weight", "blocks.0.mixer.proj.weight"]:
        assert (params[name] == 0).all(), name
    assert (params["norm.weight"] == 1).all() and (params["blocks.0.mlp.fc.bias"] == 0).all()
    with pytest.raises(ValueError, match="matches no parameter"):
        mup.mup_init(model, zero_init=["no.such.*"])


def test_mup_init_zeroes_only_the_declared_rows():
    att = mp.create_mixer("attention", 32, num_heads=4)
    att.mup_zero_init = (("qkv.weight", slice(0, 32)), ("qkv.bias", slice(0, 32)))  # the query rows of fused q/k/v
    mup.mup_init(att)
    assert (att.qkv.weight[:32] == 0).all() and (att.qkv.bias[:32] == 0).all()
    assert (att.qkv.weight[32:] != 0).all()


def test_mlr_queries_start_at_zero_logits_under_mup():
    mixer = mp.create_mixer("mlr_attention", 32, num_heads=2)
    mup.mup_init(mixer)
    assert (mixer.q_norm.weight == 0).all()
    probs = mixer.materialize(torch.randn(1, 9, 32))
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / 9))  # uniform: every logit is 0


def test_standard_init_uses_one_std():
    model = _model(128, "attention", num_heads=4)
    mup.standard_init(model, std=0.02)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.15), name


# -- coordinate check --------------------------------------------------------------------------------------------------

def test_coord_check_result_spreads():
    widths = [64, 128, 256, 512]
    w = torch.tensor(widths, dtype=torch.float64)
    result = mup.CoordCheckResult(
        widths=widths, steps=1, parametrization="mup",
        rms={"grows": torch.stack([w.sqrt(), 2 * w.sqrt()], 1), "flat": torch.ones(4, 2),
             "zero_at_init": torch.stack([torch.zeros(4), torch.ones(4)], 1)},
        delta={"vanishes": torch.stack([1 / w], 1)}, losses=torch.zeros(4, 2))
    spreads = {(name, step): (ratio, trend) for name, step, ratio, trend in result.spreads()}
    assert spreads[("grows", 0)] == pytest.approx((1.5, 1.5))
    assert spreads[("vanishes (change)", 0)] == pytest.approx((-3.0, -3.0))
    assert spreads[("flat", 1)] == (0.0, 0.0)
    assert ("zero_at_init", 0) not in spreads  # all zero: a zero-initialised output, skipped
    assert result.max_spread() == 3.0 and not result.passes()
    assert "vanishes" in result.table(1)


def test_coord_check_validates_its_arguments():
    batch = (torch.randn(1, 4, 8), torch.randn(1, 4, 1))
    build = lambda w: _model(w, "attention", num_heads=2)  # noqa: E731
    with pytest.raises(ValueError, match="two distinct widths"):
        mup.coord_check(build, [32], 1, data=batch)
    with pytest.raises(ValueError, match="'mup' or 'sp'"):
        mup.coord_check(build, [16, 32], 1, data=batch, parametrization="ntk")
    with pytest.raises(ValueError, match="seeds"):
        mup.coord_check(build, [16, 32], 1, data=batch, seeds=0)


def test_coord_check_records_every_module_and_step():
    batch = (torch.randn(2, 5, 8), torch.randn(2, 5, 1))
    result = mup.coord_check(lambda w: _model(w, "btt_attention", num_heads=2), [16, 32], 3, data=batch)
    assert result.rms["blocks.0.mixer.key_transform"].shape == (2, 4)   # BTT Z before its LN
    assert result.delta["blocks.0.mixer"].shape == (2, 3)
    assert result.losses.shape == (2, 4)
    assert (result.rms["readout"][:, 0] == 0).all() and (result.rms["readout"][:, 1:] > 0).all()


B, T, IN = 8, 16, 8
_TARGET = torch.randn(IN, generator=torch.Generator().manual_seed(123))


def regression_stream(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh batch per step: predict a fixed projection of the running mean of the inputs (needs mixing)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, T, IN, generator=g)
    y = (x.cumsum(1) / torch.arange(1, T + 1)[:, None]) @ _TARGET
    return x, y[..., None]


def _builder(kind: str, mup_on: bool):
    """The spec's section 5.4 models: MLR with a fixed head dim (LM), attention with fixed heads (ICL), and BTT."""
    def build(width: int) -> nn.Module:
        if kind == "mlr_lm":
            mixer, options = "mlr_attention", dict(
                num_heads=width // 16, ranks=[8, 4, 2, 2], block_sizes=[None, 4, 2, 1],
                logit_scaling="mup" if mup_on else "standard", logit_multiplier=4.0 if mup_on else 1.0)
        elif kind == "btt":
            mixer, options = "btt_attention", dict(
                num_heads=4, logit_scaling="mup" if mup_on else "standard", logit_multiplier=8.0 if mup_on else 1.0)
        else:
            head_dim = width // 4
            mixer, options = "attention", dict(num_heads=4, scale=4.0 / head_dim if mup_on else head_dim**-0.5)
        model = MixerCoordCheckModel(width, mixer, depth=2, in_dim=IN, mlp_ratio=2, mixer_options=options)
        if mixer == "attention":  # zero-init its query rows under muP (logits 0 at init), see the docs
            for block in model.blocks:
                rows = slice(0, block.mixer.num_heads * block.mixer.head_dim)
                block.mixer.mup_zero_init = (("qkv.weight", rows), ("qkv.bias", rows))
        return model
    return build


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlr_lm", "btt", "attention_icl"])
def test_coordinate_check_passes_for_mup_and_fails_for_standard_parametrization(kind):
    widths = [64, 128, 256, 512]
    mup_result = mup.coord_check(_builder(kind, True), widths, 10, data=regression_stream, lr=1e-3,
                                 parametrization="mup")
    assert mup_result.passes(0.5), mup_result.table()
    sp_result = mup.coord_check(_builder(kind, False), widths, 10, data=regression_stream, lr=1e-3,
                                parametrization="sp")
    assert not sp_result.passes(0.5)
    # The negative control fails the way SP does: activations *grow* with width, by far more than the tolerance.
    worst_name, worst_step, ratio, trend = sp_result.spreads()[0]
    assert ratio > 2.0 and trend > 2.0, sp_result.table()
    mixer_outputs = [r for n, s, r, _ in sp_result.spreads() if n.endswith(".mixer") and s >= 2]
    assert max(mixer_outputs) > 1.0  # the attention block's output itself blows up under SP


# -- attention logits in the coordinate check --------------------------------------------------------------------------

LOGIT_MIXERS = ["attention", "mlr_attention", "btt_attention", "bilinear_mlr_attention"]


def _logit_builder(kind: str, right_rule: bool, depth: int = 1):
    """Two heads at every width, so the head dim (MLR, attention) or the dot width (BTT: dim) grows with width.
    ``right_rule``: muP's ``multiplier / d``; otherwise ``1 / sqrt(d)`` (the rule muP must reject)."""
    def build(width: int) -> nn.Module:
        head_dim = width // 2
        if kind == "attention":
            options = dict(num_heads=2, scale=4.0 / head_dim if right_rule else head_dim**-0.5)
        else:
            options = dict(num_heads=2, logit_scaling="mup" if right_rule else "standard",
                           logit_multiplier=4.0 if right_rule else 1.0)
            if kind == "mlr_attention":
                options.update(qk_norm=False, block_sizes=[None, 4, 2, 1])
        model = MixerCoordCheckModel(width, kind, depth=depth, in_dim=IN, mlp_ratio=2, mixer_options=options)
        for block in model.blocks:
            if kind in ("attention", "mlr_attention"):  # zero-init the query rows under muP (logits 0 at init)
                rows = slice(0, block.mixer.num_heads * block.mixer.head_dim)
                block.mixer.mup_zero_init = (("qkv.weight", rows),)
        return model
    return build


@pytest.mark.parametrize("kind", LOGIT_MIXERS)
def test_attention_logits_probe_gives_the_pre_softmax_logits(kind):
    mixer = _logit_builder(kind, True)(32).blocks[0].mixer.double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    mask = torch.arange(9)[None] < torch.tensor([9, 5])[:, None]
    logits = mixer.attention_logits(x, mask=mask)
    assert logits.shape == (2, 2, 9, 9)
    allowed = mask[:, None, None, :] & mask[:, None, :, None]
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    torch.testing.assert_close(mixer.materialize(x, mask=mask), probs, rtol=1e-10, atol=1e-12)


def test_coord_check_records_logits_without_double_counting_the_probe():
    batch = (torch.randn(2, 5, IN), torch.randn(2, 5, 1))
    result = mup.coord_check(_logit_builder("mlr_attention", True), [16, 32], 3, data=batch, logits=True)
    logits = result.rms["blocks.0.mixer.logits"]
    assert logits.shape == (2, 4) and result.delta["blocks.0.mixer.logits"].shape == (2, 3)
    # muP: zero query, zero logits; the first update reaches only the zero readout, the second the query
    assert (logits[:, :2] == 0).all() and (logits[:, 2:] > 0).all()
    # the probe's own calls of the q/k/v projection are not recorded: its RMS is the plain forward's
    plain = mup.coord_check(_logit_builder("mlr_attention", True), [16, 32], 3, data=batch, logits=True,
                            include=lambda name, module: name.endswith("qkv"))
    torch.testing.assert_close(plain.rms["blocks.0.mixer.qkv"], result.rms["blocks.0.mixer.qkv"])


def _logit_spreads(result) -> list[tuple[int, float, float]]:
    return [(step, ratio, trend) for name, step, ratio, trend in result.spreads() if name.endswith(".logits")]


@pytest.mark.parametrize("kind", ["attention", "mlr_attention", "btt_attention"])
def test_coord_check_logits_fail_for_the_wrong_logit_rule(kind):
    """Head dim grows with width; under muP (init and learning rates) the ``1/sqrt(d)`` rule lets the logits grow
    with width once queries and keys align, which the recorded logits show; the ``multiplier/d`` rule does not.

    The widths are those of the coordinate check above, 64 to 512: BTT needs them. Its zero-initialised part of the
    logit path is a vector (the key LN gain ``g``), not a matrix, so after ``t`` updates its logits are
    ``tau * sum_e x_ie g_e LN(M x_j)_e`` with ``|g_e| ~ t * lr``: a part that does not align with the pair, about
    ``sqrt(D)`` in size, plus an aligned part, about ``c * D``. Fitted here, ``c`` is about 0.09, so the aligned part
    (the one the logit rule is for) dominates only above ``D ~ 1 / c**2 ~ 120``. Measured as below (log2, 6 steps):
    at widths 16 to 128 the wrong rule grows by only 0.33 and the right rule shrinks by 1.17; at 64 to 512 the
    wrong rule grows by 0.89 and the right one shrinks by 0.61. Attention and MLR align through a matrix (the zero
    query rows) and show it at either range.
    """
    widths, steps = [64, 128, 256, 512], 6
    only_mixers = lambda name, module: name.endswith("mixer")  # noqa: E731
    wrong = mup.coord_check(_logit_builder(kind, False), widths, steps, data=regression_stream, lr=3e-3,
                            include=only_mixers, logits=True)
    right = mup.coord_check(_logit_builder(kind, True), widths, steps, data=regression_stream, lr=3e-3,
                            include=only_mixers, logits=True)
    wrong_growth = max(min(ratio, trend) for _, ratio, trend in _logit_spreads(wrong))
    right_growth = max(min(ratio, trend) for _, ratio, trend in _logit_spreads(right))
    assert not wrong.passes(0.5) and wrong_growth > 0.5, wrong.table()   # logits grow with width: caught
    assert right_growth < 0.5, right.table()                            # never grow with width under the muP rule
    assert right_growth < wrong_growth - 0.5
