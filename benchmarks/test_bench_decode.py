"""Decoding: time per generated token against the number of tokens already in the cache, for the linear-time
mixers that step (semiseparable, low_rank, sliding-window attention) and attention with its KV cache; dim 256,
batch 1, on CPU. Targets:

* semiseparable per-token time at 8,192 tokens of context within 1.2x of its time at 128 (constant work per token);
* attention's per-token time grows with the context (its KV cache);
* semiseparable at least 3x faster per token than attention at 8,192 tokens of context, and no slower at 128;
* ``compat.Mamba2.step`` at least as fast as the released module's PyTorch step path (its op sequence, written out
  below on the same weights; the released norm is its plain-op reference) and equal to it in float64;
* generation throughput (tokens per second) of a tiny fairseq2 ``mixer_decoder``, semiseparable against attention,
  after 1,024 and 8,192 tokens of prompt (reported; needs the fairseq2 extra).

The targets are measured only when benchmarking is enabled (``make bench``), with the mixers interleaved token by
token in one process (``mixer-plugins bench --decode`` runs the same measurement); in CI each case runs once.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from mixer_plugins.tools.benchmarking import build_mixer, time_calls, time_decoding
from mixer_plugins.tools.cli.bench import decode_table

MIXERS = ["semiseparable", "low_rank", "sliding_window_attention", "attention"]
CONTEXTS = [128, 1024, 8192]
DIM = 256
ROUNDS, WARMUP = 20, 3


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("mixer", MIXERS)
def test_decode_step(benchmark, benchmarking_enabled, mixer, context):
    """One generated token (a step of one token) after ``context`` tokens of prefill."""
    torch.manual_seed(0)
    capacity = context + ROUNDS + WARMUP + 1
    model = build_mixer(mixer, DIM, capacity, causal=True).eval()
    cache = model.allocate_cache(1, capacity)
    x = torch.randn(1, 1, DIM)
    with torch.no_grad():
        model.prefill(torch.randn(1, context, DIM), cache)
    benchmark.group = f"decode D={DIM} B=1 L={context}"
    benchmark.extra_info.update(mixer=mixer, context=context, dim=DIM, batch=1)

    def step():
        with torch.no_grad():
            return model.step(x, cache)

    if benchmarking_enabled:
        y = benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP)
    else:
        y = benchmark(step)
    assert y.shape == (1, 1, DIM) and torch.isfinite(y).all()


def test_decode_targets(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    timings, problems = time_decoding(MIXERS, [128, 8192], dim=DIM, batch=1, steps=64, warmup=8)
    assert not problems, problems
    median = {(t.mixer, t.context): t.median for t in timings}
    print("\n" + decode_table(timings, baseline="attention", markdown=True))
    flat = median["semiseparable", 8192] / median["semiseparable", 128]
    growth = median["attention", 8192] / median["attention", 128]
    speedup = median["attention", 8192] / median["semiseparable", 8192]
    benchmark.extra_info.update(semiseparable_growth=flat, attention_growth=growth, speedup_at_8192=speedup)
    benchmark.pedantic(lambda: None, rounds=1)
    assert flat <= 1.2, f"semiseparable per-token time grew {flat:.2f}x from 128 to 8192 tokens (target <= 1.2x)"
    assert growth > 2.0, f"attention's per-token time grew only {growth:.2f}x from 128 to 8192 tokens"
    assert speedup >= 3.0, f"semiseparable is only {speedup:.2f}x faster than attention at 8192 (target 3x)"
    short = median["semiseparable", 128] / median["attention", 128]
    benchmark.extra_info.update(semiseparable_over_attention_at_128=short)
    assert short <= 1.0, f"semiseparable takes {short:.2f}x attention's time per token at 128 (target <= 1x)"


# -- compat.Mamba2 against the released module's PyTorch step path ---------------------------------------------------

def released_pytorch_step(module, hidden, conv_state, ssm_state):
    """The released ``Mamba2.step`` without its fused CUDA kernels (``causal_conv1d_update`` and
    ``selective_state_update`` absent, so ``ngroups == 1``), op for op on ``module``'s weights, with its gated norm
    (``norm_before_gate=False``) as plain ops: roll the conv state, convolve, SiLU, softplus(dt + dt_bias),
    ``exp(dt A)``, the state update and read-out as einsums, the skip, the norm, ``out_proj``."""
    dtype = hidden.dtype
    zxbcdt = F.linear(hidden.squeeze(1), module.in_proj.weight, module.in_proj.bias)
    d_mlp = module.d_mlp
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, module.d_ssm, module.conv_dim, module.nheads], dim=-1)
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = xBC
    xBC = torch.sum(conv_state * module.conv1d.weight[:, 0, :], dim=-1)
    if module.conv1d.bias is not None:
        xBC = xBC + module.conv1d.bias
    xBC = F.silu(xBC).to(dtype=dtype)
    x, B, C = torch.split(xBC, [module.d_ssm, module.d_state, module.d_state], dim=-1)
    A = -torch.exp(module.A_log.to(torch.promote_types(module.A_log.dtype, torch.float32)))  # .float(); float64 kept
    dt = F.softplus(dt + module.dt_bias.to(dtype=dt.dtype))
    dA = torch.exp(dt * A)
    x = x.reshape(x.shape[0], module.nheads, module.headdim)
    dBx = torch.einsum("bh,bn,bhp->bhpn", dt, B, x)
    ssm_state.copy_(ssm_state * dA[:, :, None, None] + dBx)
    y = torch.einsum("bhpn,bn->bhp", ssm_state.to(dtype), C)
    y = y + module.D.to(dtype)[:, None] * x
    y = y.reshape(y.shape[0], -1)
    gated = (y * F.silu(z)).to(torch.promote_types(dtype, torch.float32))   # .float(); float64 kept
    y = (gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + module.norm.eps)).to(dtype)
    y = y * module.norm.weight
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return F.linear(y, module.out_proj.weight, module.out_proj.bias).unsqueeze(1), conv_state, ssm_state


def _mamba2(dtype):
    from mixer_plugins.compat import Mamba2

    torch.manual_seed(0)
    module = Mamba2(DIM, d_state=64, headdim=64).to(dtype).eval()
    with torch.no_grad():
        module.A_log.uniform_(-2, 2)
        module.dt_bias.uniform_(-3, 0)
        module.D.uniform_(0.5, 1.5)
        module.norm.weight.uniform_(0.5, 1.5)
    return module


def test_compat_mamba2_step_equals_the_released_path():
    """The comparison is of equal computations: over a few steps from the same states, float64."""
    module = _mamba2(torch.float64)
    ours = module.allocate_inference_cache(2, 0)
    theirs = tuple(t.clone() for t in ours)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 1, DIM, generator=gen, dtype=torch.float64)
            y_ours = module.step(x, *ours)[0]
            y_theirs = released_pytorch_step(module, x, *theirs)[0]
            torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-12)


def test_compat_mamba2_step_target(benchmark, benchmarking_enabled):
    """``compat.Mamba2.step`` against the released PyTorch step path, float32, batch 1, interleaved call by call."""
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    module = _mamba2(torch.float32)
    states = {"ours": module.allocate_inference_cache(1, 0), "released": module.allocate_inference_cache(1, 0)}
    steps = {"ours": module.step, "released": lambda x, c, s: released_pytorch_step(module, x, c, s)}
    x = torch.randn(1, 1, DIM)
    with torch.no_grad():   # interleaved call by call, in a new order every turn
        times = time_calls({name: lambda name=name: steps[name](x, *states[name]) for name in steps}, rounds=200,
                           warmup=8, shuffle=0)
    median = {name: times.median(name) for name in steps}
    ratio = median["ours"] / median["released"]
    benchmark.extra_info.update(ours_ms=median["ours"] * 1e3, released_ms=median["released"] * 1e3, ratio=ratio)
    print(f"\ncompat.Mamba2.step {median['ours'] * 1e3:.3f} ms, released PyTorch path "
          f"{median['released'] * 1e3:.3f} ms: {ratio:.2f}x")
    benchmark.pedantic(lambda: None, rounds=1)
    assert ratio <= 1.0, f"compat.Mamba2.step takes {ratio:.2f}x the released PyTorch step path's time (target <= 1x)"


# -- generation throughput of a fairseq2 decoder ------------------------------------------------------------------

GEN_CONTEXTS = [1024, 8192]
GEN_TOKENS = 32


def _decoder_and_prompt(mixer: str, context: int):
    pytest.importorskip("fairseq2")
    from dataclasses import replace

    from fairseq2.runtime.dependency import get_dependency_resolver

    get_dependency_resolver()   # fairseq2 set up once per process, through the entry points
    import mixer_plugins.backbones.fairseq2 as fs2

    hub = fs2.get_mixer_decoder_hub()
    torch.manual_seed(0)
    config = replace(hub.get_arch_config("tiny"), mixer=mixer, max_seq_len=context + GEN_TOKENS + 8)
    model = hub.create_new_model(config, device=torch.device("cpu")).eval()
    prompt = torch.randint(4, 200, (1, context), generator=torch.Generator().manual_seed(1))
    return model, prompt


def _generate(model, prompt) -> float:
    """Seconds to generate GEN_TOKENS tokens greedily after the prompt's prefill (the prefill not counted)."""
    from fairseq2.nn import BatchLayout, IncrementalStateBag

    with torch.no_grad():
        bag = IncrementalStateBag(max_num_steps=prompt.shape[1] + GEN_TOKENS + 1)
        logits = model(prompt, BatchLayout.of(prompt), state_bag=bag)
        bag.increment_step_nr(prompt.shape[1])
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(GEN_TOKENS):
            logits = model(token, BatchLayout.of(token), state_bag=bag)
            bag.increment_step_nr(1)
            token = logits[:, -1:].argmax(-1)
        return time.perf_counter() - start


@pytest.mark.parametrize("context", GEN_CONTEXTS)
def test_generation_throughput(benchmark, benchmarking_enabled, context):
    """Tokens per second of the tiny ``mixer_decoder`` with semiseparable and with attention after ``context`` tokens
    of prompt (greedy, batch 1; each model's prefill untimed), the two interleaved run by run."""
    models = {name: _decoder_and_prompt(name, context) for name in ("semiseparable", "attention")}
    if not benchmarking_enabled:
        for model, prompt in models.values():
            assert _generate(model, prompt[:, :16]) > 0
        benchmark.pedantic(lambda: None, rounds=1)
        return
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(3):
        for name, (model, prompt) in models.items():
            seconds[name].append(_generate(model, prompt))
    rate = {name: GEN_TOKENS / sorted(times)[len(times) // 2] for name, times in seconds.items()}
    benchmark.extra_info.update(context=context, tokens_per_second=rate,
                                speedup=rate["semiseparable"] / rate["attention"])
    print(f"\ncontext {context}: semiseparable {rate['semiseparable']:.0f} tokens/s, attention "
          f"{rate['attention']:.0f} tokens/s ({rate['semiseparable'] / rate['attention']:.2f}x)")
    benchmark.pedantic(lambda: None, rounds=1)
    assert all(math.isfinite(r) and r > 0 for r in rate.values())
