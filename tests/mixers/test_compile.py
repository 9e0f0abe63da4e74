"""Every registered mixer compiles as one graph: ``torch.compile(mixer, fullgraph=True)`` traces its whole forward
(typed contexts, masks, kernels as custom ops) and matches eager, outputs and input gradients.

The backend is ``aot_eager``: dynamo and AOTAutograd trace forward and backward exactly as under inductor, without
inductor's C++ code generation (minutes per mixer on a CPU runner). ``fullgraph=True`` makes any graph break an
error, so a mixer that stops being traceable fails here.

Inductor itself (the default backend users get) is tested in ``tests/backbones/test_compile_models.py``: a ViT
whose blocks use ``quasi`` and ``attention``, training step and eval against eager, ``torch.export`` of a mixer ViT,
and with ``MIXER_PLUGINS_INDUCTOR_ALL=1`` every registered mixer; the fairseq2 encoder in
``tests/backbones/test_fairseq2.py``; the custom ops under ``torch.library.opcheck`` in
``tests/ops/test_custom_ops.py``.
"""

from __future__ import annotations

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.testing import MixerHarness

LENGTH = 11

# Kernel bugs found by this test, for the kernels' owners (the mixers themselves trace):
#: mixer name -> why its compiled graph is known to fail (a strict xfail: it flags the fix). None at present.
KNOWN_KERNEL_BUGS: dict[str, str] = {}


def _params():
    for name in mp.list_mixers():
        marks = [pytest.mark.xfail(reason=KNOWN_KERNEL_BUGS[name], strict=True)] if name in KNOWN_KERNEL_BUGS else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_params()))
def test_whole_mixer_compiles_with_fullgraph(name):
    harness = MixerHarness(spec=mp.get_spec(name))
    mixer = harness.build(dtype=torch.float32).train()
    length = min(LENGTH, mixer.max_seq_len or LENGTH)
    mask = torch.arange(length)[None, :] < torch.tensor([length, length - 4])[:, None]
    x = harness.inputs(length, dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend="aot_eager")

    x_eager = x.clone().requires_grad_(True)
    x_compiled = x.clone().requires_grad_(True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    y_eager = mixer(x_eager, mask=mask)
    y_compiled = compiled(x_compiled, mask=mask)
    torch.testing.assert_close(y_compiled, y_eager, rtol=1e-4, atol=1e-5)
    (y_eager * probe).sum().backward()
    (y_compiled * probe).sum().backward()
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # inference takes other paths in some mixers (no custom backward to set up)
        torch.testing.assert_close(compiled(x, mask=mask), mixer(x, mask=mask), rtol=1e-4, atol=1e-5)


def test_fullgraph_fails_on_a_graph_break():
    """The test above can fail: one graph break anywhere in a mixer's forward is an error under fullgraph."""
    from mixer_plugins.mixers.attention import AttentionConfig, SoftmaxAttention

    class BreakingAttention(SoftmaxAttention):
        def prepare(self, x, mask):
            torch._dynamo.graph_break()
            return super().prepare(x, mask)

    mixer = BreakingAttention(AttentionConfig(dim=16, num_heads=2))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(mixer, fullgraph=True, backend="aot_eager")(torch.randn(1, 5, 16))


def _stepping():
    return [name for name in mp.list_mixers() if mp.get_spec(name).stepping]


@pytest.mark.parametrize("name", _stepping())
def test_step_compiles_with_fullgraph(name):
    """``torch.compile(mixer.step, fullgraph=True)`` traces a decoding step (cache bookkeeping, in-place state
    updates) and its steps equal eager ones, the cache included."""
    import copy

    spec = mp.get_spec(name)
    options = dict(spec.test_options)
    if "causal" in spec.config.model_fields:
        options["causal"] = True
    torch.manual_seed(0)
    mixer = spec.build(spec.make_config(32, **options)).eval()
    cache = mixer.allocate_cache(2, 12)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mixer.prefill(torch.randn(2, 5, 32, generator=gen), cache)
        twin = copy.deepcopy(cache)
        torch._dynamo.reset()
        compiled = torch.compile(mixer.step, fullgraph=True, backend="eager")
        for _ in range(3):
            x = torch.randn(2, 1, 32, generator=gen)
            torch.testing.assert_close(compiled(x, twin), mixer.step(x, cache), rtol=1e-5, atol=1e-6)
    for key, tensor in cache.state.items():
        torch.testing.assert_close(twin.state[key], tensor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(twin.lengths, cache.lengths)


def test_compat_mamba2_step_compiles_with_fullgraph():
    """The released API's step (``step(hidden_states, conv_state, ssm_state)``) traces as one graph too."""
    from mixer_plugins.compat import Mamba2

    torch.manual_seed(0)
    mixer = Mamba2(32, d_state=8, headdim=8, ngroups=2).eval()
    conv_state, ssm_state = mixer.allocate_inference_cache(2, 0)
    twin = conv_state.clone(), ssm_state.clone()
    compiled = torch.compile(mixer.step, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 1, 32)
            out, *_ = mixer.step(x, conv_state, ssm_state)
            out_c, *_ = compiled(x, *twin)
            torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(twin[1], ssm_state, rtol=1e-5, atol=1e-6)
