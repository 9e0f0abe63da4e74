"""Small timm models with registered mixers, built both ways, and timm's FX helper re-stated.

Construction paths (every generic check runs on both):

* ``create``: ``timm.create_model('vit_tiny', mixer=name, mixer_options=...)`` — our registered name; class token,
  ``global_pool='token'``.
* ``swap``: ``swap_mixer(timm.create_model('vit_little_patch16_reg4_gap_256'), name, ...)`` — timm's own name; four
  register tokens, no class token, average pooling, layer scale.

Both are shrunk to 32 x 32 images, 8 x 8 patches (16 patches), width 32, 3 blocks (timm's intermediates checks want
at least 3 feature levels) and 2 heads, so every check runs in a fraction of a second on CPU.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torch import nn

import mixer_plugins as mp
from mixer_plugins.backbones.timm import MixerSwapWarning, swap_mixer

SMALL: dict[str, Any] = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2)
IMG = (3, 32, 32)
NUM_PATCHES = 16
PATHS = ("create", "swap")
CREATE_NAME = "vit_tiny"
SWAP_NAME = "vit_little_patch16_reg4_gap_256"
PREFIX_TOKENS = {"create": 1, "swap": 4}


def mixer_test_options(mixer: str) -> dict[str, Any]:
    """The spec's small test options (how every mixer is kept small here; no mixer is special-cased).

    ``max_seq_len`` is left out: inside a ViT the model sets it to its token count, which is what is tested.
    """
    return {k: v for k, v in mp.get_spec(mixer).test_options.items() if k != "max_seq_len"}


def build(path: str, mixer: str, **kwargs: Any) -> nn.Module:
    """A small ViT with ``mixer`` in every block, built along ``path`` (``create`` or ``swap``).

    The causal-mixer-with-class-token warning is silenced here: it is tested on its own, and the generic checks
    hold for causal mixers too.
    """
    args = {**SMALL, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixerSwapWarning)
        if path == "create":
            return timm.create_model(CREATE_NAME, mixer=mixer, mixer_options=mixer_test_options(mixer), **args)
        if path == "swap":
            return swap_mixer(timm.create_model(SWAP_NAME, **args), mixer, **mixer_test_options(mixer))
    raise ValueError(f"unknown construction path {path!r}")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    from mixer_plugins.backbones.timm import TimmMixerAttention

    return [m for m in model.modules() if isinstance(m, TimmMixerAttention)]


@functools.cache
def script_failure(mixer: str) -> Optional[str]:
    """Why the bare mixer cannot be scripted (first line of TorchScript's error), or None when it can."""
    module = mp.create_mixer(mixer, 32, **mp.get_spec(mixer).test_options)
    try:
        torch.jit.script(module)
    except Exception as err:  # noqa: BLE001 - TorchScript raises many error types
        lines = [line for line in str(err).splitlines() if line.strip()]
        return lines[0][:200] if lines else type(err).__name__
    return None


def create_fx_model(model: nn.Module, train: bool = False) -> nn.Module:
    """timm's ``_create_fx_model`` (tests/test_models.py), re-stated: trace with timm's leaf modules/functions."""
    from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor, get_graph_node_names

    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    eval_return_nodes = [eval_nodes[-1]]
    train_return_nodes = [train_nodes[-1]]
    if train:
        tracer = NodePathTracer(**tracer_kwargs)
        graph = tracer.trace(model)
        graph_nodes = list(reversed(graph.nodes))
        output_node_names = [n.name for n in graph_nodes[0]._input_nodes.keys()]
        graph_node_names = [n.name for n in graph_nodes]
        output_node_indices = [-graph_node_names.index(node_name) for node_name in output_node_names]
        train_return_nodes = [train_nodes[ix] for ix in output_node_indices]
    return create_feature_extractor(model, train_return_nodes=train_return_nodes,
                                    eval_return_nodes=eval_return_nodes, tracer_kwargs=tracer_kwargs)
