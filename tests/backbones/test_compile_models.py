"""``torch.compile`` with the inductor backend (the compiler users get by default) on whole timm ViTs with a mixer,
and on mixers; ``torch.export`` of a mixer ViT. Everything is compared with eager: outputs, losses and every
parameter's gradient, in training (a step) and in eval (dropout off).

Inductor generates and compiles C++ for every graph: on a small CPU runner that is ~10-60 s per graph, so CI runs a
representative set: one ViT whose blocks use ``quasi`` (the Hydra block's custom ops: chunked scan and its backward,
short conv, gated norm) and softmax ``attention`` with dropout; the FFT Toeplitz op runs in the fairseq2 encoder
(``tests/backbones/test_fairseq2.py``, which has the fairseq2 set-up). ``MIXER_PLUGINS_INDUCTOR_ALL=1`` compiles every
registered mixer as well (``test_every_mixer_compiles_with_inductor``).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TOL, assert_train_and_eval_match, inductor_settings
from torch import nn

import mixer_plugins as mp
from mixer_plugins.testing import MixerHarness

timm = pytest.importorskip("timm")

pytestmark = pytest.mark.slow

ALL = os.environ.get("MIXER_PLUGINS_INDUCTOR_ALL") == "1"


# -- whole timm ViTs --------------------------------------------------------------------------------------------

def _vit(mixer: str, depth: int = 1, **options) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny", mixer=mixer, mixer_options=options, img_size=32, patch_size=8,
                             embed_dim=32, depth=depth, num_heads=2, num_classes=5, drop_rate=0.1, proj_drop_rate=0.1)


QUASI = {"d_state": 8, "head_dim": 16, "chunk_size": 32}


def test_timm_vit_compiles_with_inductor():
    """One ViT, two mixers (one set of graphs to compile): block 0 is ``quasi`` -- the Hydra block and its custom
    ops (chunked scan and its backward, short conv, gated norm) --, block 1 is softmax ``attention`` with dropout on
    its weights (and timm's dropouts), which eval must turn off. (The FFT Toeplitz op: the fairseq2 encoder test.)"""
    model = _vit("quasi", depth=2, **QUASI)
    model.blocks[1].attn = _vit("attention", depth=2, dropout=0.1).blocks[1].attn
    assert [type(b.attn.mixer).__name__ for b in model.blocks] == ["QuasiseparableMixer", "SoftmaxAttention"]
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([1, 3])
    with inductor_settings():
        assert_train_and_eval_match(model, (images,), lambda logits: nn.functional.cross_entropy(logits, labels))


def test_torch_export_of_a_mixer_vit():
    model = _vit("quasi", **QUASI).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    exported = torch.export.export(model, (images,))
    names = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    # exported graphs hold standard ops only (the ops trace their plain formulas while exporting; see docs/onnx.md)
    assert not [n for n in names if "mixer_plugins" in n], names
    other = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for x in (images, other):
            torch.testing.assert_close(exported.module()(x), model(x), **TOL)


# -- every registered mixer (opt-in: ~20 graphs of 10-60 s each) -----------------------------------------------

def _mixer_params():
    for name in mp.list_mixers():
        yield pytest.param(name, id=name, marks=[] if ALL else [pytest.mark.skip(
            reason="set MIXER_PLUGINS_INDUCTOR_ALL=1 to compile every mixer with inductor (minutes)")])


class _Loss(nn.Module):
    """A mixer with a mask, as one module to compile."""

    def __init__(self, mixer: nn.Module, mask: torch.Tensor):
        super().__init__()
        self.mixer = mixer
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(x, mask=self.mask)


@pytest.mark.parametrize("name", list(_mixer_params()))
def test_every_mixer_compiles_with_inductor(name):
    spec = mp.get_spec(name)
    options = {"dropout": 0.1} if "dropout" in spec.config.model_fields else {}
    harness = MixerHarness(spec=spec, dim=32)
    mixer = harness.build(dtype=torch.float32, **options)
    length = min(10, mixer.max_seq_len or 10)
    mask = torch.arange(length)[None, :] < torch.tensor([length, length - 3])[:, None]
    x = harness.inputs(length, dtype=torch.float32)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    with inductor_settings():
        assert_train_and_eval_match(_Loss(mixer, mask), (x,), lambda y: (y * probe).sum())
