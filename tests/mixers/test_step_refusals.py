"""Decoding misuse, for every mixer that steps: a cache of another mixer is refused, a cache in another floating dtype
steps within that dtype's accuracy, and prefill/step refuse to run while autograd records (they would give wrong
gradients). The conformance kit's ``step`` check asserts the same for any mixer; its own catches are tested at the
end."""

from __future__ import annotations

import copy

import pytest
import torch
from test_step import build as step_build
from test_step import steppable_specs

import mixer_plugins as mp
from mixer_plugins.compat import Mamba2
from mixer_plugins.errors import MixerInputError
from mixer_plugins.mixers.attention import SoftmaxAttention
from mixer_plugins.mixers.cache import MixerCache, check_cache
from mixer_plugins.registry import MixerSpec, default_registry
from mixer_plugins.testing import MixerHarness
from mixer_plugins.testing.conformance import check_step

F32, F64 = torch.float32, torch.float64
NO_GRAD = r"torch\.no_grad\(\) or torch\.inference_mode\(\)"


SPECS = steppable_specs()


def build(spec: MixerSpec, dtype: torch.dtype = F32, seed: int = 0, **extra: object) -> mp.MatrixMixer:
    return step_build(spec.name, dtype=dtype, seed=seed, **extra)


def inputs(length: int = 12, batch: int = 2, dtype: torch.dtype = F32, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def decode(mixer: mp.MatrixMixer, x: torch.Tensor, prompt: int, cache: MixerCache) -> torch.Tensor:
    """Prefill ``x[:, :prompt]`` into ``cache``, then step the rest in pieces of 1, 2, 1, ... tokens."""
    with torch.no_grad():
        outputs = [mixer.prefill(x[:, :prompt], cache)]
        given = prompt
        for t in (1, 2, 1, 3, 1, 2):
            if given + t > x.shape[1]:
                break
            outputs.append(mixer.step(x[:, given:given + t], cache))
            given += t
    return torch.cat(outputs, dim=1)


def snapshot(cache: MixerCache) -> dict[str, torch.Tensor]:
    return {"lengths": cache.lengths.clone(), "poisoned": cache.poisoned.clone(),
            **{name: t.clone() for name, t in cache.state.items()}}


def assert_unchanged(cache: MixerCache, before: dict[str, torch.Tensor], offset: int) -> None:
    assert cache.offset == offset
    after = snapshot(cache)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), f"the refused call changed the cache's {name!r}"


# -- a cache belongs to its mixer -----------------------------------------------------------------------------------

def test_a_cache_of_another_window_is_refused_naming_both():
    spec = default_registry.get_spec("sliding_window_attention")
    narrow, wide = build(spec, window=3), build(spec, window=5)
    x = inputs()
    cache = narrow.allocate_cache(2, 12)
    with pytest.raises(MixerInputError, match=r"window=3.*window=5"):
        with torch.no_grad():
            wide.prefill(x[:, :6], cache)
    assert cache.offset == 0
    with torch.no_grad():
        narrow.prefill(x[:, :6], cache)
    before = snapshot(cache)
    with pytest.raises(MixerInputError, match=r"window=3.*window=5"):
        with torch.no_grad():
            wide.step(x[:, 6:7], cache)
    assert_unchanged(cache, before, 6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_cache_of_another_mixer_is_refused(spec):
    """Every stepping mixer refuses the cache of another kind of mixer (a MixerInputError naming both, before the
    cache is touched), in prefill and in step."""
    other_spec = next(s for s in SPECS[SPECS.index(spec) + 1:] + SPECS if s.builder is not spec.builder)
    mixer, other = build(spec), build(other_spec)
    x = inputs()
    foreign = other.allocate_cache(2, 12)
    with pytest.raises(MixerInputError, match="another mixer") as err:
        with torch.no_grad():
            mixer.prefill(x[:, :5], foreign)
    assert type(other).__name__ in str(err.value) and type(mixer).__name__ in str(err.value)
    with torch.no_grad():
        other.prefill(x[:, :5], foreign)
    before = snapshot(foreign)
    with pytest.raises(MixerInputError, match="another mixer"):
        with torch.no_grad():
            mixer.step(x[:, 5:6], foreign)
    assert_unchanged(foreign, before, 5)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_cache_of_the_same_mixer_at_another_width_is_refused(spec):
    mixer = build(spec)
    torch.manual_seed(0)
    options = dict(spec.test_options, **({"causal": True} if "causal" in spec.config.model_fields else {}))
    wider = spec.build(spec.make_config(64, **options)).eval()
    with pytest.raises(MixerInputError, match="dim=64.*dim=32"):
        with torch.no_grad():
            mixer.prefill(inputs()[:, :4], wider.allocate_cache(2, 12))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_identically_configured_mixers_share_caches(spec):
    """A copy of the module (beam search, a deepcopy) and another build of the same options use each other's caches;
    options that do not change the state (chunk size, dropout) do not matter."""
    mixer = build(spec)
    x = inputs()
    expected = decode(mixer, x, 5, mixer.allocate_cache(2, 12))
    twin = copy.deepcopy(mixer)
    torch.testing.assert_close(decode(twin, x, 5, mixer.allocate_cache(2, 12)), expected, rtol=0, atol=0)
    rebuilt = build(spec, seed=3)                    # other weights, same options: the cache is accepted
    decode(rebuilt, x, 5, mixer.allocate_cache(2, 12))
    if "chunk_size" in spec.config.model_fields:
        other_chunk = build(spec, chunk_size=4)
        decode(other_chunk, x, 5, mixer.allocate_cache(2, 12))


def test_reorder_keeps_the_owner():
    spec = default_registry.get_spec("attention")
    mixer, other = build(spec), build(default_registry.get_spec("sliding_window_attention"))
    cache = mixer.allocate_cache(2, 12)
    with torch.no_grad():
        mixer.prefill(inputs()[:, :4], cache)
        cache.reorder(torch.tensor([1, 1, 0]))
        assert mixer.step(inputs(batch=3)[:, 4:5], cache).shape == (3, 1, 32)
        with pytest.raises(MixerInputError, match="another mixer"):
            other.step(inputs(batch=3)[:, 5:6], cache)


def test_mamba2_states_of_the_released_api_are_its_own():
    """compat.Mamba2's released API wraps raw state tensors in a cache of its own: it keeps working, and its library
    caches are refused by a Mamba2 of other options."""
    layer = Mamba2(d_model=32, d_state=8, headdim=16).double().eval()
    x = inputs(6, dtype=F64)
    conv_state, ssm_state = layer.allocate_inference_cache(2, 6)
    with torch.no_grad():
        steps = torch.cat([layer.step(x[:, t:t + 1], conv_state, ssm_state)[0] for t in range(6)], dim=1)
        torch.testing.assert_close(steps, layer(x), rtol=0, atol=1e-12)
    other = Mamba2(d_model=32, d_state=16, headdim=16).double().eval()
    with pytest.raises(MixerInputError, match="d_state=8.*d_state=16"):
        with torch.no_grad():
            other.prefill(x, layer.allocate_cache(2, 6))


# -- a cache in another dtype ---------------------------------------------------------------------------------------

#: Tolerance, relative to the outputs' scale, of steps with a cache in each dtype against a float32 cache.
_CACHE_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, F64: 1e-6}


@pytest.mark.parametrize("cache_dtype", list(_CACHE_TOL), ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_cache_in_another_dtype_steps_within_its_accuracy(spec, cache_dtype):
    mixer = build(spec)
    x = inputs(14)
    expected = decode(mixer, x, 5, mixer.allocate_cache(2, 14))
    cache = mixer.allocate_cache(2, 14, dtype=cache_dtype)
    assert all(t.dtype == cache_dtype for t in cache.state.values() if t.is_floating_point())
    got = decode(mixer, x, 5, cache)
    assert got.dtype == F32
    tol = _CACHE_TOL[cache_dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_float32_cache_under_a_bfloat16_mixer_steps(spec):
    """The other way round: a wider state than the model (the cache read in bfloat16, or a recurrent state kept in
    float32); outputs are bfloat16, within bfloat16's accuracy of the float32 model."""
    mixer, reference = build(spec, dtype=torch.bfloat16), build(spec)
    x = inputs(14)
    expected = decode(reference, x, 5, reference.allocate_cache(2, 14))
    got = decode(mixer, x.bfloat16(), 5, mixer.allocate_cache(2, 14, dtype=F32))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.complex64, torch.float8_e4m3fn, "float32"], ids=str)
def test_a_cache_dtype_that_is_not_a_float_is_refused(dtype):
    mixer = build(default_registry.get_spec("attention"))
    with pytest.raises(MixerInputError, match="dtype"):
        mixer.allocate_cache(2, 8, dtype=dtype)


# -- prefill and step refuse to record autograd ---------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_prefill_and_step_under_grad_are_refused(spec):
    """With grad enabled and parameters that require grad, prefill and step raise a MixerInputError that says to use
    no_grad/inference_mode, before touching the cache: decoding then continues correctly."""
    mixer = build(spec, dtype=F64)
    x = inputs(9, dtype=F64)
    with torch.no_grad():
        full = mixer(x)
    cache = mixer.allocate_cache(2, 9)
    with pytest.raises(MixerInputError, match=NO_GRAD):
        mixer.prefill(x[:, :5], cache)
    assert cache.offset == 0
    with torch.no_grad():
        mixer.prefill(x[:, :5], cache)
    before = snapshot(cache)
    with pytest.raises(MixerInputError, match=NO_GRAD):
        mixer.step(x[:, 5:7], cache)
    assert_unchanged(cache, before, 5)
    with torch.inference_mode():
        y = mixer.step(x[:, 5:7], cache)
    torch.testing.assert_close(y, full[:, 5:7], rtol=0, atol=1e-10)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_an_input_that_requires_grad_is_refused(spec):
    mixer = build(spec, dtype=F64).requires_grad_(False)
    x = inputs(6, dtype=F64).requires_grad_(True)
    with pytest.raises(MixerInputError, match=NO_GRAD):
        mixer.prefill(x[:, :4], mixer.allocate_cache(2, 6))


def test_a_frozen_mixer_steps_with_grad_enabled():
    """Nothing requires grad: nothing is recorded, so nothing is refused (a frozen model outside no_grad)."""
    mixer = build(default_registry.get_spec("semiseparable"), dtype=F64).requires_grad_(False)
    x = inputs(8, dtype=F64)
    with torch.no_grad():
        expected = mixer(x)
    got = decode(mixer, x, 4, mixer.allocate_cache(2, 8))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    cache = mixer.allocate_cache(2, 8)
    mixer.prefill(x[:, :4], cache)
    torch.testing.assert_close(mixer.step(x[:, 4:6], cache), expected[:, 4:6], rtol=0, atol=1e-10)


def test_the_released_mamba2_step_under_grad_is_refused():
    layer = Mamba2(d_model=32, d_state=8, headdim=16).double()
    conv_state, ssm_state = layer.allocate_inference_cache(2, 4)
    with pytest.raises(MixerInputError, match=NO_GRAD):
        layer.step(inputs(1, dtype=F64), conv_state, ssm_state)


# -- the kit catches steppers that break these rules ----------------------------------------------------------------

class _ReadsTheCacheRaw(SoftmaxAttention):
    """attends over the cached keys and values in the cache's dtype, not the compute dtype."""

    def mix_step(self, ctx, cache):
        from mixer_plugins.mixers.cache import append_kv

        _, allowed = append_kv(cache, ctx.k, ctx.values)
        y = torch.nn.functional.scaled_dot_product_attention(
            ctx.q.transpose(1, 2), cache.state["k"].transpose(1, 2), cache.state["v"].transpose(1, 2),
            attn_mask=allowed[:, None], scale=self.scale)
        return y.transpose(1, 2)


class _AcceptsAnyCache(SoftmaxAttention):
    """does not check whose cache it is given."""

    def _check_call(self, x, cache, prefill=False):
        cache.owner = None
        super()._check_call(x, cache, prefill)


class _StepsUnderGrad(SoftmaxAttention):
    """records autograd through steps (whose gradients are wrong)."""

    def _check_call(self, x, cache, prefill=False):
        check_cache(cache, x, self._owner_key(), None, empty=prefill)


@pytest.mark.parametrize("broken, message", [
    (_ReadsTheCacheRaw, "bfloat16 cache"),
    (_AcceptsAnyCache, "another width"),
    (_StepsUnderGrad, "grad"),
])
def test_the_kit_catches_steppers_that_break_the_rules(broken, message):
    spec = default_registry.get_spec("attention")
    fake = MixerSpec(name="broken", config=spec.config, builder=broken, direction="either", stepping=True,
                     test_options=spec.test_options)
    with pytest.raises(AssertionError, match=message):
        check_step(MixerHarness(spec=fake))


class _Recomputes(SoftmaxAttention):
    """keeps its inputs and reruns forward over each row's prefix, out of place: correct gradients under grad."""

    def _check_call(self, x, cache, prefill=False):
        check_cache(cache, x, self._owner_key(), None, empty=prefill)

    def init_cache(self, cache, batch, max_len, dtype, device):
        cache.state["x"] = torch.zeros(batch, max_len, self.dim, dtype=dtype, device=device)

    def fill_cache(self, cache, ctx, x, lengths):
        stored = cache.state["x"]
        cache.state["x"] = torch.cat([x.to(stored.dtype), stored[:, x.shape[1]:]], dim=1)
        return self.mix(ctx)

    def step(self, x, cache):
        self._check_call(x, cache)
        b, t, d = x.shape
        index = cache.positions(t)[..., None].expand(b, t, d)
        cache.state["x"] = cache.state["x"].scatter(1, index, x.to(cache.state["x"].dtype))
        cache.lengths = cache.lengths + t
        cache.offset += t
        mask = torch.arange(cache.offset)[None, :] < cache.lengths[:, None]
        return self.forward(cache.state["x"][:, :cache.offset].to(x.dtype), mask=mask).gather(1, index)


def test_the_kit_accepts_correct_gradients_through_steps():
    """A stepper may give correct gradients under grad instead of refusing: the kit compares them with forward's."""
    spec = default_registry.get_spec("attention")
    fake = MixerSpec(name="recomputes", config=spec.config, builder=_Recomputes, direction="either", stepping=True,
                     test_options=spec.test_options)
    check_step(MixerHarness(spec=fake))
