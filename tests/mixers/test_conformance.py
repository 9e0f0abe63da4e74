"""The conformance kit, run on every registered mixer, and tests that the kit catches broken mixers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixer_plugins as mp
from mixer_plugins.mixers.attention import AttentionConfig, SoftmaxAttention
from mixer_plugins.mixers.base import check_mixer_input
from mixer_plugins.testing import CHECKS, ConformanceError, MixerHarness, check_mixer, conformance_test, run_check

# Every registered mixer (built-ins and installed plugins, e.g. the example plugin) x every check.
test_every_registered_mixer = conformance_test()


# -- the kit must fail mixers that break the contract -------------------------------------------------

class _FastPathBug(SoftmaxAttention):
    """forward drifts from the mixer's own matrix."""

    def mix(self, ctx):
        return super().mix(ctx) * 1.001


class _LeaksPads(SoftmaxAttention):
    """ignores the mask in the fast path: pad keys leak into real positions."""

    def mix(self, ctx):
        ctx.mask = None
        return super().mix(ctx)


class _FalselyCausal(SoftmaxAttention):
    causal = True

    def __init__(self, config):
        super().__init__(config)
        self.causal = True

    def matrix(self, ctx):
        scores = torch.einsum("bihd,bjhd->bhij", ctx.q, ctx.k) * self.scale
        return scores.softmax(-1)

    def mix(self, ctx):
        return torch.einsum("bhij,bjhp->bihp", self.matrix(ctx), ctx.values)


class _DeadParameter(SoftmaxAttention):
    def __init__(self, config):
        super().__init__(config)
        self.unused = nn.Parameter(torch.zeros(3))


class _SilentInput(SoftmaxAttention):
    """accepts anything: no input checks."""

    def forward(self, x, *, mask=None):
        ctx = self.prepare(x.reshape(x.shape[0], -1, self.dim).to(self.qkv.weight.dtype), None)
        return self.finish(ctx, self.mix(ctx))


class _ForgetsReset(SoftmaxAttention):
    """has a randomly initialised parameter of its own that reset_parameters() does not re-draw."""

    def __init__(self, config):
        super().__init__(config)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(config.dim))

    def finish(self, ctx, y):
        return super().finish(ctx, y) * self.gain


class _PadsEnterUnselected(SoftmaxAttention):
    """the old base class: pad inputs reach prepare as they are (NaN pads then leak through 0 * NaN)."""

    def _begin(self, x, mask):
        x, mask = check_mixer_input(self, x, mask, self.dim)
        return x, mask, None


class _FutureLeaksNonFinite(_PadsEnterUnselected):
    def __init__(self, config):
        super().__init__(config.model_copy(update={"causal": True}))


class _CrashesOnEmptyBatch(SoftmaxAttention):
    def mix(self, ctx):
        if ctx.values.shape[0] == 0:
            raise RuntimeError("cannot reshape tensor of 0 elements")
        return super().mix(ctx)


@pytest.mark.parametrize(
    "cls, failing_check",
    [
        (_PadsEnterUnselected, "nonfinite_pads"),
        (_FutureLeaksNonFinite, "nonfinite_future"),
        (_CrashesOnEmptyBatch, "empty_batch"),
        (_ForgetsReset, "reset_parameters"),
        (_FastPathBug, "materialize"),
        (_LeaksPads, "padding"),
        (_FalselyCausal, "causality"),
        (_DeadParameter, "gradients"),
        (_SilentInput, "bad_input"),
    ],
)
def test_kit_catches_contract_violations(cls, failing_check):
    spec = mp.MixerSpec(name="broken_" + failing_check, config=AttentionConfig, builder=cls,
                        test_options={"num_heads": 2})
    with pytest.raises(AssertionError):
        CHECKS[failing_check](MixerHarness(spec=spec))
    with pytest.raises(ConformanceError, match=failing_check):
        check_mixer(spec)


def test_kit_catches_a_config_without_validation():
    from mixer_plugins import MixerConfig

    class Loose(MixerConfig):
        dim: int = 8  # no positivity constraint: dim=0 would be accepted

    spec = mp.MixerSpec(name="loose", config=Loose, builder=lambda c: SoftmaxAttention(AttentionConfig(dim=8)))
    with pytest.raises(AssertionError, match="dim=0"):
        run_check(spec, "bad_config")


def test_check_mixer_reports_every_check_by_name():
    results = check_mixer("attention", options={"causal": True})
    assert [r.check for r in results] == list(CHECKS)
    assert all(r.passed for r in results)


_BUILT_IN = [name for name in mp.list_mixers() if mp.get_spec(name).builder.__module__.startswith("mixer_plugins.")]


@pytest.mark.parametrize("name", _BUILT_IN)
def test_reset_parameters_restores_every_parameter(name):
    """Stronger than the kit's check for our own mixers: after every parameter moved (as in training), a reset under
    a seed gives exactly the fresh build under that seed, deterministic initial values (ones, constants) included."""
    harness = MixerHarness(spec=mp.get_spec(name))
    fresh = harness.build(seed=5, dtype=torch.float32).state_dict()
    mixer = harness.build(seed=5, dtype=torch.float32)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(1.0)
    assert any(not torch.equal(v, fresh[k]) for k, v in mixer.state_dict().items())
    torch.manual_seed(5)
    mixer.reset_parameters()
    state = mixer.state_dict()
    assert [k for k in fresh if not torch.equal(state[k], fresh[k])] == []


def test_registry_build_equals_reset_under_the_same_seed():
    torch.manual_seed(3)
    first = mp.create_mixer("quasiseparable", 32, head_dim=16, d_state=8)
    torch.manual_seed(3)
    second = mp.create_mixer("quasiseparable", 32, head_dim=16, d_state=8)
    other = mp.create_mixer("quasiseparable", 32, head_dim=16, d_state=8)  # the stream moved on: new draws
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.in_proj.weight, other.in_proj.weight)


# -- the kit at other widths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [16, 48, 64])
@pytest.mark.parametrize("name", mp.list_mixers())
def test_kit_runs_every_mixer_at_other_dims(name, dim):
    """A spec's test options fit any width divisible by 8 (sizes as divisors or defaults, not widths that add up at
    one dim only): the forward and the matrix checks pass at these widths."""
    for check in ("output", "materialize"):
        run_check(name, check, dim=dim)


@pytest.mark.parametrize("name", ["mlr_attention", "bilinear_mlr_attention"])
def test_kit_passes_every_check_of_the_multi_level_mixers_at_dim_64(name):
    results = check_mixer(name, dim=64, raise_on_failure=False)
    assert [r for r in results if not r.passed] == []


def test_kit_says_when_options_do_not_fit_the_dim():
    with pytest.raises(ValueError, match=r"mixer 'attention' do not fit dim=30 .*not divisible by num_heads"):
        run_check("attention", "output", dim=30)
    with pytest.raises(ValueError, match="do not fit dim=64"):
        check_mixer("mlr_attention", dim=64, options={"ranks": [8, 4, 2, 2]})
