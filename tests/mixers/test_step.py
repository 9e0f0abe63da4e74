"""Decoding: the step ops against independent references, the cache's bookkeeping (reorder, errors, non-finite
tokens, fixed-size states), the absence of value-dependent control flow, and that the kit's ``step`` check catches
broken steppers. (prefill + steps == forward for every registered mixer is the kit's ``step`` check, run by
``tests/mixers/test_conformance.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixer_plugins as mp
from mixer_plugins.errors import MixerInputError, SequenceLengthError
from mixer_plugins.kernels import depthwise_conv1d, ssd
from mixer_plugins.kernels.conv.step import causal_conv1d_state, causal_conv1d_step
from mixer_plugins.kernels.scan.step import ssd_step
from mixer_plugins.layers.masks import set_nonfinite_guard
from mixer_plugins.mixers.cache import MixerCache, StepNotSupportedError
from mixer_plugins.mixers.semiseparable import SemiseparableMixer
from mixer_plugins.registry import MixerSpec, default_registry
from mixer_plugins.testing import MixerHarness
from mixer_plugins.testing.conformance import check_step

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def steppable_specs() -> list[MixerSpec]:
    return [default_registry.get_spec(n) for n in default_registry.names() if default_registry.get_spec(n).stepping]


def build(name: str, dtype=F64, seed: int = 0, **extra):
    spec = default_registry.get_spec(name)
    options = dict(spec.test_options)
    if "causal" in spec.config.model_fields:
        options["causal"] = True
    options.update(extra)
    torch.manual_seed(seed)
    return spec.build(spec.make_config(32, **options)).to(dtype).eval()


# -- the step ops ---------------------------------------------------------------------------------------------------

def naive_ssd_steps(x, dt, A, B, C, state, D):
    """h <- exp(A dt) h + dt x B^T; y = h C + D x, token by token, head by head (written out)."""
    b, t, h, p = x.shape
    g = B.shape[2]
    state = state.clone()
    y = torch.zeros_like(x)
    for i in range(t):
        for head in range(h):
            grp = head // (h // g)
            for row in range(b):
                a = torch.exp(A[head] * dt[row, i, head])
                state[row, head] = a * state[row, head] + dt[row, i, head] * torch.outer(x[row, i, head],
                                                                                        B[row, i, grp])
                d = D[head] if D.dim() == 1 else D[head][:, None]
                y[row, i, head] = state[row, head] @ C[row, i, grp] + (d * x[row, i, head, :, None])[:, 0]
    return y, state


@pytest.mark.parametrize("d_shape", ["per_head", "per_channel"])
def test_ssd_step_matches_the_recurrence_and_the_chunked_scan(d_shape):
    g = gen(0)
    b, t, h, p, groups, n = 2, 5, 4, 3, 2, 6
    x = torch.randn(b, t, h, p, generator=g, dtype=F64)
    dt = F.softplus(torch.randn(b, t, h, generator=g, dtype=F64))
    A = -torch.rand(h, generator=g, dtype=F64) * 3
    B, C = (torch.randn(b, t, groups, n, generator=g, dtype=F64) for _ in range(2))
    state = torch.randn(b, h, p, n, generator=g, dtype=F64)
    D = torch.randn(h, generator=g, dtype=F64) if d_shape == "per_head" else torch.randn(h, p, generator=g, dtype=F64)
    y, new = ssd_step(x, dt, A, B, C, state, D=D)
    y_ref, new_ref = naive_ssd_steps(x, dt, A, B, C, state, D)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(new, new_ref, rtol=0, atol=1e-12)
    y_chunked, final = ssd(x, dt, A, B, C, chunk_size=2, D=D, initial_states=state, return_final_states=True)
    torch.testing.assert_close(y, y_chunked, rtol=0, atol=1e-12)
    torch.testing.assert_close(new, final, rtol=0, atol=1e-12)


def test_conv_step_continues_the_causal_convolution():
    g = gen(1)
    b, length, c, k = 3, 11, 5, 4
    u = torch.randn(b, length, c, generator=g, dtype=F64)
    weight, bias = torch.randn(c, k, generator=g, dtype=F64), torch.randn(c, generator=g, dtype=F64)
    full = depthwise_conv1d(u, weight, bias, causal=True, silu=True)
    lengths = torch.tensor([6, 2, 0])
    state = causal_conv1d_state(u, k, lengths)
    # the state is each row's last k inputs, zeros before the row's start
    for row, n in enumerate(lengths.tolist()):
        expected = torch.zeros(c, k, dtype=F64)
        for slot in range(k):
            pos = n - k + slot
            if pos >= 0:
                expected[:, slot] = u[row, pos]
        torch.testing.assert_close(state[row], expected, rtol=0, atol=0)
    # steps from each row's own length reproduce the full convolution there
    for t in (1, 3):
        index = (lengths[:, None] + torch.arange(t))[..., None].expand(-1, -1, c)
        y, state = causal_conv1d_step(u.gather(1, index), state, weight, bias, silu=True)
        torch.testing.assert_close(y, full.gather(1, index), rtol=0, atol=1e-13)
        lengths = lengths + t


# -- the cache ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["semiseparable", "attention", "sliding_window_attention", "toeplitz"])
def test_reorder_follows_the_rows(name):
    """Beam search reorders (and shrinks or grows) the batch between steps; each row then continues its own row."""
    mixer = build(name)
    x = torch.randn(3, 14, 32, generator=gen(2), dtype=F64)
    with torch.no_grad():
        cache = mixer.allocate_cache(3, 14)
        mixer.prefill(x[:, :6], cache)
        mixer.step(x[:, 6:8], cache)
        order = torch.tensor([2, 0, 0, 1])
        cache.reorder(order)
        y = mixer.step(x[order, 8:11], cache)
        expected = mixer(x[order, :11])[:, 8:11]
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)
    assert cache.batch == 4 and cache.lengths.tolist() == [11, 11, 11, 11]


@pytest.mark.parametrize("name", ["semiseparable", "low_rank", "sliding_window_attention"])
def test_constant_size_states(name):
    """The linear-time mixers keep a state whose size does not grow with the length they can decode."""
    mixer = build(name)
    assert mixer.allocate_cache(2, 16).nbytes() == mixer.allocate_cache(2, 4096).nbytes()


def test_kv_caches_grow_with_max_len():
    mixer = build("attention")
    assert mixer.allocate_cache(2, 64).nbytes() > 10 * mixer.allocate_cache(2, 4).nbytes()


def test_nonfinite_token_poisons_only_its_row_from_there_on():
    mixer = set_nonfinite_guard(build("semiseparable"))
    x = torch.randn(2, 10, 32, generator=gen(3), dtype=F64)
    with torch.no_grad():
        expected = mixer(x)
        cache = mixer.allocate_cache(2, 10)
        mixer.prefill(x[:, :4], cache)
        bad = x[:, 4:6].clone()
        bad[0, 1] = float("nan")
        y = mixer.step(bad, cache)
        later = mixer.step(x[:, 6:8], cache)
    torch.testing.assert_close(y[0, 0], expected[0, 4], rtol=0, atol=1e-12)
    assert torch.isnan(y[0, 1]).all() and torch.isnan(later[0]).all()
    torch.testing.assert_close(torch.cat([y[1], later[1]]), expected[1, 4:8], rtol=0, atol=1e-12)


def test_prompt_with_a_nonfinite_token_poisons_the_steps():
    mixer = set_nonfinite_guard(build("attention"))
    x = torch.randn(1, 6, 32, generator=gen(4), dtype=F64)
    x[0, 2] = float("inf")
    with torch.no_grad():
        cache = mixer.allocate_cache(1, 8)
        mixer.prefill(x[:, :4], cache)
        assert torch.isnan(mixer.step(x[:, 4:5], cache)).all()


def test_errors_say_what_is_wrong():
    bidirectional = mp.create_mixer("quasiseparable", 32, head_dim=16, d_state=8)
    with pytest.raises(StepNotSupportedError, match="bidirectional"):
        bidirectional.allocate_cache(1, 4)
    with pytest.raises(StepNotSupportedError, match="causal=True"):
        mp.create_mixer("attention", 32, num_heads=4).step(torch.randn(1, 1, 32), None)
    mixer = build("semiseparable")
    with pytest.raises(MixerInputError, match="max_len"):
        mixer.allocate_cache(1, 0)
    cache = mixer.allocate_cache(2, 5)
    with pytest.raises(MixerInputError, match="2 rows"):
        mixer.prefill(torch.randn(3, 2, 32, dtype=F64), cache)
    with pytest.raises(SequenceLengthError, match="max_len=5"):
        mixer.prefill(torch.randn(2, 6, 32, dtype=F64), cache)
    with torch.no_grad():
        mixer.prefill(torch.randn(2, 4, 32, dtype=F64), cache)
    with pytest.raises(MixerInputError, match="empty cache"):
        mixer.prefill(torch.randn(2, 1, 32, dtype=F64), cache)
    with pytest.raises(SequenceLengthError, match="do not fit"):
        mixer.step(torch.randn(2, 2, 32, dtype=F64), cache)
    with pytest.raises(MixerInputError, match="MixerCache"):
        mixer.step(torch.randn(2, 1, 32, dtype=F64), {"ssm": None})
    data_independent = build("dense", max_seq_len=8)
    with pytest.raises(SequenceLengthError, match="max_seq_len=8"):
        data_independent.allocate_cache(1, 9)


@pytest.mark.parametrize("spec", steppable_specs(), ids=lambda s: s.name)
def test_steps_read_no_values(spec):
    """Prefill and step run on the meta device (shapes only): no ``.item()``, ``bool(tensor)`` or data-dependent
    shape anywhere, which is what a CUDA-graph capture of ``step`` needs."""
    options = dict(spec.test_options)
    if "causal" in spec.config.model_fields:
        options["causal"] = True
    with torch.device("meta"):
        mixer = spec.build(spec.make_config(32, **options)).eval()
        x = torch.empty(2, 6, 32)
        mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        cache = mixer.allocate_cache(2, 16)
        mixer.prefill(x, cache, mask=mask)
        mixer.step(x[:, :1], cache)
        y = mixer.step(x[:, :3], cache)
    assert y.shape == (2, 3, 32) and cache.offset == 10


def test_step_updates_the_cache_in_place():
    """Fixed tensor addresses across steps (a captured CUDA graph replays on the same buffers)."""
    mixer = build("semiseparable")
    cache = mixer.allocate_cache(2, 8)
    pointers = {name: t.data_ptr() for name, t in cache.state.items()}
    with torch.no_grad():
        mixer.prefill(torch.randn(2, 3, 32, dtype=F64), cache)
        mixer.step(torch.randn(2, 1, 32, dtype=F64), cache)
    assert {name: t.data_ptr() for name, t in cache.state.items()} == pointers


# -- the kit catches broken steppers --------------------------------------------------------------------------------

class _ForgetsTheConvTail(SemiseparableMixer):
    """prefill leaves the short convolution's state empty."""

    def fill_conv_cache(self, cache, x, lengths):
        pass


class _StaleState(SemiseparableMixer):
    """a step does not update the SSD state."""

    def mix_step(self, ctx, cache):
        saved = cache.state["ssm"].clone()
        y = super().mix_step(ctx, cache)
        cache.state["ssm"].copy_(saved)
        return y


class _IgnoresRowLengths(SemiseparableMixer):
    """prefill keeps the state after the padded width, not after each row's last token."""

    def fill_cache(self, cache, ctx, x, lengths):
        ctx.mask = None
        return super().fill_cache(cache, ctx, x, lengths)


@pytest.mark.parametrize("broken", [_ForgetsTheConvTail, _StaleState, _IgnoresRowLengths])
def test_the_kit_catches_broken_steppers(broken):
    spec = default_registry.get_spec("semiseparable")
    fake = MixerSpec(name="broken", config=spec.config, builder=broken, direction="causal", stepping=True,
                     test_options=spec.test_options)
    with pytest.raises(AssertionError, match="differ"):
        check_step(MixerHarness(spec=fake))


def test_the_kit_catches_a_spec_that_understates_stepping():
    spec = default_registry.get_spec("attention")
    fake = MixerSpec(name="understated", config=spec.config, builder=spec.builder, direction="either",
                     stepping=False, test_options=spec.test_options)
    with pytest.raises(AssertionError, match="set stepping=True"):
        check_step(MixerHarness(spec=fake))


def test_cache_repr_and_positions():
    cache = MixerCache(lengths=torch.tensor([3, 1]), poisoned=torch.zeros(2, dtype=torch.bool), max_len=9,
                       state={"k": torch.zeros(2, 9, 1)})
    assert cache.positions(2).tolist() == [[3, 4], [1, 2]]
    assert "max_len=9" in repr(cache) and "k=(2, 9, 1)" in repr(cache)


def test_the_conv_tail_of_a_short_prompt_starts_from_zeros():
    """With in_proj biases, the convolution's inputs before a row's start are zeros (its padding), not the bias."""
    spec = default_registry.get_spec("semiseparable")
    check_step(MixerHarness(spec=spec, options={"proj_bias": True, "d_conv": 6}))


@pytest.mark.parametrize("name", ["semiseparable", "low_rank"])
def test_one_token_step_is_a_few_ops(name):
    """A one-token step of the SSD-style mixers is the fused decoding op between the projections: at most 40 aten ops
    as the profiler records them (views and nested calls included), no value read on the host."""
    from mixer_plugins.kernels import available_backends

    if "native" not in available_backends("decode", "cpu"):
        pytest.skip("the native kernels are not built here")
    torch.manual_seed(0)
    mixer = mp.create_mixer(name, 256, **({"causal": True} if name == "low_rank" else {})).eval()
    cache = mixer.allocate_cache(1, 64)
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        mixer.prefill(torch.randn(1, 16, 256), cache)
        mixer.step(x, cache)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            mixer.step(x, cache)
    names = [e.name for e in prof.events()]
    ops = [n for n in names if "::" in n]
    assert "mixer_plugins_native::ssd_decode" in ops, ops
    assert "mixer_plugins_native::norm_forward" not in ops, ops   # the block's gated norm runs inside the step op
    assert len(ops) <= 40, f"{len(ops)} ops: {sorted(set(ops))}"
    assert "aten::item" not in ops and "aten::_local_scalar_dense" not in ops


def _ops_of_a_one_token_step(mixer: mp.MatrixMixer, prompt: int = 128) -> list[str]:
    """The aten ops (profiler events with "::", views and nested calls included) of one one-token step of ``mixer``
    (dim 256, batch 1) after a prompt and a first step."""
    cache = mixer.allocate_cache(1, 2 * prompt)
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        mixer.prefill(torch.randn(1, prompt, 256), cache)
        mixer.step(x, cache)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            mixer.step(x, cache)
    return [e.name for e in prof.events() if "::" in e.name]


#: The most aten ops a one-token step of each KV-cache mixer may take: the projections (and QK-LN), the cache written
#: in place, the attention over the cache (one SDPA call per softmax: about 25 ops on the CPU when the query and value
#: widths agree, 55 when not; MLR's levels are written out) and the output projection.
KV_STEP_OPS = {"attention": 80, "sliding_window_attention": 105, "mlr_attention": 215, "global_local_attention": 225}


@pytest.mark.parametrize("name", sorted(KV_STEP_OPS))
def test_a_one_token_kv_cache_step_does_only_the_work_it_needs(name):
    """A one-token step of a KV-cache mixer writes its keys and values in place and attends once: no concatenation,
    no value read on the host, at most a fixed number of ops (a real limit, not a loose one)."""
    torch.manual_seed(0)
    mixer = mp.create_mixer(name, 256, causal=True).eval()
    ops = _ops_of_a_one_token_step(mixer)
    assert len(ops) <= KV_STEP_OPS[name], f"{len(ops)} ops: {sorted(set(ops))}"
    assert "aten::item" not in ops and "aten::_local_scalar_dense" not in ops
    assert "aten::cat" not in ops
    assert ops.count("aten::scaled_dot_product_attention") == (0 if name == "mlr_attention" else
                                                               2 if name == "global_local_attention" else 1)
