"""The timm adapter.

1. timm's own generic model checks (tests/test_models.py: forward + grad checkpointing, backward, default cfgs,
   TorchScript, forward_intermediates, features_only getter, FX forward/backward), re-stated for models with a
   swapped mixer, for every registered mixer (parametrized at collection time, so mixers added later are covered)
   and both construction paths (``timm.create_model('vit_tiny', mixer=...)`` and ``swap_mixer`` on timm's name).
2. Per mixer: the behaviour the adapter promises (NaFlex padding, dynamic image size, prefix tokens, init,
   pretrained loading with its report, export round trip, attn_layer names, other ViT families).
3. The mechanisms themselves (mask mapping, name guard, presets, patch dropout, warnings, TorchScript).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from typing import Any, Optional

import pytest
import timm
import torch
from pydantic import Field
from timm.layers import get_notrace_functions, get_notrace_modules, set_scriptable
from timm.models import FeatureInfo
from torch import Tensor, nn

import mixer_plugins as mp
from mixer_plugins.backbones.timm import (
    HYDRA_PRESETS,
    MODEL_NAMES,
    MixerOnlyBlock,
    MixerSwapWarning,
    PartialWeightsWarning,
    TimmMixerAttention,
    create_model,
    is_order_sensitive,
    load_compatible_state_dict,
    padding_mask_from_attn_mask,
    register_attn_layers,
    register_timm_models,
    resolve_mixer_config,
    swap_mixer,
)
from mixer_plugins.backbones.timm.mixer_vit import _register_entrypoint

# -- small timm models with registered mixers, built both ways, and timm's FX helper re-stated -----------------
#
# Construction paths (every generic check runs on both):
#
# * ``create``: ``timm.create_model('vit_tiny', mixer=name, mixer_options=...)`` — our registered name; class token,
#   ``global_pool='token'``.
# * ``swap``: ``swap_mixer(timm.create_model('vit_little_patch16_reg4_gap_256'), name, ...)`` — timm's own name; four
#   register tokens, no class token, average pooling, layer scale.
#
# Both are shrunk to 32 x 32 images, 8 x 8 patches (16 patches), width 32, 3 blocks (timm's intermediates checks want
# at least 3 feature levels) and 2 heads, so every check runs in a fraction of a second on CPU.

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


MIXERS = mp.list_mixers()
every_mixer = pytest.mark.parametrize("mixer", MIXERS)
both_paths = pytest.mark.parametrize("path", PATHS)


def _image(batch: int = 1, *, seed: int = 0, size: tuple[int, int] = IMG[1:], dtype=torch.float32) -> Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _spatial_ok(output: Tensor, reduction: int) -> bool:
    return all(output.shape[axis] <= math.ceil(IMG[axis - 1] / reduction) + 1 for axis in (2, 3))


# =================================================================================================================
# 1. timm's generic model checks, re-stated, x every registered mixer x both construction paths
# =================================================================================================================

@every_mixer
@both_paths
def test_forward_and_grad_checkpointing(mixer, path):
    model = build(path, mixer).eval()
    assert [type(b.attn) for b in model.blocks] == [TimmMixerAttention] * SMALL["depth"]
    assert {b.attn.mixer_name for b in model.blocks} == {mp.get_spec(mixer).name}
    x = _image()
    out = model(x)
    assert out.shape == (1, model.num_classes)
    assert not torch.isnan(out).any()
    model.set_grad_checkpointing()
    assert torch.allclose(out, model(x), rtol=1e-4, atol=1e-5), "grad checkpointing changed the output"


@every_mixer
@both_paths
def test_backward_reaches_every_parameter(mixer, path):
    model = build(path, mixer, num_classes=42).train()
    num_params = sum(p.numel() for p in model.parameters())
    out = model(_image(2))
    out.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
    assert sum(p.grad.numel() for p in model.parameters()) == num_params
    assert out.shape[-1] == 42
    assert not torch.isnan(out).any()


@every_mixer
@both_paths
def test_default_cfgs_non_std(mixer, path):
    model = build(path, mixer).eval()
    state_dict = model.state_dict()
    cfg = model.pretrained_cfg
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    x = _image()
    features = model.forward_features(x)
    assert features.shape == (1, NUM_PATCHES + PREFIX_TOKENS[path], model.num_features)
    pre_logits = model.forward_head(features, pre_logits=True)
    assert pre_logits.shape[1] == model.head_hidden_size
    model.reset_classifier(0)
    assert model.num_classes == 0
    out = model(x)
    assert out.shape[-1] == model.head_hidden_size == pre_logits.shape[-1]
    headless = build(path, mixer, num_classes=0).eval()
    assert headless(x).shape[-1] == headless.num_features
    assert cfg["classifier"] + ".weight" in state_dict
    assert cfg["first_conv"] + ".weight" in state_dict


@every_mixer
@both_paths
def test_torchscript(mixer, path):
    reason = script_failure(mixer)
    if reason is not None:
        pytest.skip(f"mixer {mixer!r} is not TorchScript-compatible ({reason}); the adapter itself scripts, see "
                    "test_scriptable_mixer_scripts_through_a_whole_vit")
    with set_scriptable(True):
        model = build(path, mixer).eval()
    scripted = torch.jit.script(model)
    x = _image()
    out = scripted(x)
    assert out.shape[0] == 1 and not torch.isnan(out).any()
    assert torch.allclose(out, model(x), atol=1e-6)


@every_mixer
@both_paths
def test_forward_intermediates(mixer, path):
    model = build(path, mixer).eval()
    info = FeatureInfo(model.feature_info, len(model.feature_info))
    channels, reductions = info.channels(), info.reduction()
    assert len(channels) >= 3
    x = _image()
    output, intermediates = model.forward_intermediates(x, output_fmt="NCHW")
    assert len(intermediates) == len(channels)
    for c, r, o in zip(channels, reductions, intermediates):
        assert o.shape[:2] == (1, c) and _spatial_ok(o, r) and not torch.isnan(o).any()
    torch.testing.assert_close(model.forward_features(x), output)
    model.set_grad_checkpointing()
    output2, intermediates2 = model.forward_intermediates(x, output_fmt="NCHW")
    torch.testing.assert_close(output, output2)
    for a, b in zip(intermediates, intermediates2):
        torch.testing.assert_close(a, b)


@every_mixer
@both_paths
def test_features_only_getter(mixer, path):
    torch.manual_seed(3)
    model = build(path, mixer, features_only=True).eval()
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    x = _image(2)
    outputs = model(x)
    assert len(outputs) == len(channels) == 3
    for c, r, o in zip(channels, reductions, outputs):
        assert o.shape[:2] == (2, c) and _spatial_ok(o, r) and not torch.isnan(o).any()
    # the features are the blocks' outputs of the same network built whole
    torch.manual_seed(3)
    whole = build(path, mixer).eval()
    expected = whole.forward_intermediates(x, indices=3, intermediates_only=True)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def fx_pair():
    """``fx_pair(path, mixer)``: a model and its FX feature extractor, built and traced once for the FX forward and
    backward checks. The extractor holds a training graph and an eval graph (``.train()``/``.eval()`` picks one);
    each check sets the mode it needs."""
    pairs: dict[tuple[str, str], tuple[nn.Module, nn.Module]] = {}

    def get(path: str, mixer: str) -> tuple[nn.Module, nn.Module]:
        if (path, mixer) not in pairs:
            model = build(path, mixer, num_classes=42).train()
            pairs[path, mixer] = model, create_fx_model(model, train=True)
        return pairs[path, mixer]

    return get


@every_mixer
@both_paths
def test_fx_forward(mixer, path, fx_pair):
    model, fx_model = fx_pair(path, mixer)
    model.eval()
    fx_model.eval()
    x = _image()
    with torch.no_grad():
        out = model(x)
        fx_out = torch.cat(tuple(fx_model(x).values()))
    assert torch.all(fx_out == out), "FX-traced model differs from the eager one"
    assert not torch.isnan(out).any()


@every_mixer
@both_paths
def test_fx_backward(mixer, path, fx_pair):
    model, fx_model = fx_pair(path, mixer)
    model.train()
    fx_model.train()
    num_params = sum(p.numel() for p in model.parameters())
    out = torch.cat(tuple(fx_model(_image(2)).values()))
    out.mean().backward()
    for name, p in fx_model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
    assert sum(p.grad.numel() for p in fx_model.parameters() if p.grad is not None) == num_params
    assert out.shape[-1] == 42


# =================================================================================================================
# 2. The adapter's promises, per mixer
# =================================================================================================================

def _naflex_inputs(n_real: tuple[int, int], length: int, dtype=torch.float64):
    """Two NaFlex rows of ``length`` patch slots (8 x 8 px), the first ``n_real[b]`` of them real."""
    g = torch.Generator().manual_seed(0)
    patches = torch.randn(2, length, 8 * 8 * 3, generator=g, dtype=dtype)
    coord = torch.stack([torch.arange(length) // 4, torch.arange(length) % 4], -1).expand(2, -1, -1).clone()
    valid = torch.arange(length)[None, :] < torch.tensor(n_real)[:, None]
    patches = torch.where(valid[..., None], patches, 1e3)  # pad contents must not matter
    coord = coord * valid[..., None]  # as NaFlex's loader does: pads at (0, 0), so they do not widen the grid
    return patches, coord, valid


@every_mixer
def test_naflex_padding_mask_reaches_the_mixer(mixer):
    """NaFlexViT pads with an additive finfo.min mask; real tokens must not see padding, in both mask layouts."""
    model = timm.create_model("naflexvit_base_patch16_gap", num_classes=3, **SMALL)
    swap_mixer(model, mixer, **mixer_test_options(mixer))
    model = model.double().eval()
    patches, coord, valid = _naflex_inputs((12, 9), 16)
    with torch.no_grad():
        padded = model(patches, patch_coord=coord, patch_valid=valid)
        for row, n in enumerate((12, 9)):
            alone = model(patches[row:row + 1, :n], patch_coord=coord[row:row + 1, :n],
                          patch_valid=valid[row:row + 1, :n])
            torch.testing.assert_close(padded[row], alone[0], rtol=1e-9, atol=1e-10)
        model.use_key_only_attn_mask = True   # [B, 1, 1, N] instead of [B, 1, N, N]: the same key mask
        assert torch.equal(model(patches, patch_coord=coord, patch_valid=valid), padded)


@every_mixer
def test_dynamic_image_size(mixer):
    model = build("create", mixer, dynamic_img_size=True).eval()
    adapter = model.blocks[0].attn
    assert adapter.seq_len == NUM_PATCHES + 1
    limit = getattr(adapter.mixer, "max_seq_len", None)
    assert limit in (None, NUM_PATCHES + 1), "a data-independent mixer must cover exactly the model's tokens"
    with torch.no_grad():
        for size, tokens in (((32, 32), 17), ((24, 40), 16), ((16, 16), 5)):
            features = model.forward_features(_image(size=size))
            assert features.shape[1] == tokens and torch.isfinite(features).all()
        bigger = _image(size=(40, 40))  # 25 patches + cls = 26 tokens
        if limit is None:
            assert model.forward_features(bigger).shape[1] == 26
        else:
            with pytest.raises(mp.SequenceLengthError, match="max_seq_len"):
                model(bigger)


@every_mixer
def test_prefix_tokens(mixer):
    """cls + register tokens lead the sequence; they see the patches exactly when the mixer is not causal."""
    model = build("create", mixer, reg_tokens=2).double().eval()
    for adapter in attention_modules(model):
        assert (adapter.num_prefix_tokens, adapter.seq_len) == (3, NUM_PATCHES + 3)
    x = _image(dtype=torch.float64)
    other = x + _image(seed=5, dtype=torch.float64)  # every patch changes
    with torch.no_grad():
        prefix, prefix_other = model.forward_features(x)[:, :3], model.forward_features(other)[:, :3]
    unchanged = torch.allclose(prefix, prefix_other, rtol=1e-9, atol=1e-12)
    if model.blocks[0].attn.causal:
        assert unchanged, "a causal mixer let the leading prefix tokens see later patches"
    else:
        assert not unchanged, "the prefix tokens never saw the patches"


@every_mixer
def test_mixer_keeps_its_own_init(mixer):
    spec = mp.get_spec(mixer)
    model = build("create", mixer)
    adapter = model.blocks[0].attn
    # init_weights() re-draws exactly the mixer's own initialisation
    torch.manual_seed(123)
    adapter.init_weights()
    torch.manual_seed(123)
    fresh = spec.build(adapter.mixer_config)
    for key, value in fresh.state_dict().items():
        assert torch.equal(adapter.mixer.state_dict()[key], value), key
    # tensors the mixer initialises deterministically survive each of timm's re-initialisations
    torch.manual_seed(1)
    other = spec.build(adapter.mixer_config).state_dict()
    fixed = {k: v for k, v in fresh.state_dict().items() if torch.equal(v, other[k])}
    for mode in ("", "jax", "moco"):
        model.init_weights(mode)
        for block in model.blocks:
            state = block.attn.mixer.state_dict()
            for key, value in fixed.items():
                assert torch.equal(state[key], value), f"timm's {mode or 'default'} init overwrote {key}"


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory):
    """timm's own small ViT (attention, 10 classes) saved as a local file: the stand-in for hub weights."""
    torch.manual_seed(7)
    source = timm.create_model("vit_tiny_patch16_224", num_classes=10, **SMALL).eval()
    path = tmp_path_factory.mktemp("ckpt") / "vit_tiny_small.pth"
    torch.save(source.state_dict(), path)
    return source, path


def _load_pretrained(mixer: str, path, **kwargs):
    options = kwargs.pop("mixer_options", mixer_test_options(mixer))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = timm.create_model("vit_tiny", mixer=mixer, mixer_options=options, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
                                  **{**SMALL, "num_classes": 10, **kwargs})
    return model, [w for w in caught if issubclass(w.category, PartialWeightsWarning)]


@every_mixer
def test_pretrained_loads_every_compatible_tensor_and_reports_the_rest(mixer, timm_checkpoint):
    source, path = timm_checkpoint
    model, warned = _load_pretrained(mixer, path)
    report = model.pretrained_report
    src, dst = source.state_dict(), model.state_dict()
    for key, value in src.items():
        if ".attn." not in key:
            assert torch.equal(dst[key], value), f"{key} was not loaded"
    # expected from names and shapes alone: attn.<name> goes to attn.mixer.<name> when that exists, same shape
    transferable = {k.replace(".attn.", ".attn.mixer."): k for k in src if ".attn." in k}
    loaded = {m for m, s in transferable.items() if m in dst and dst[m].shape == src[s].shape}
    for key in loaded:
        assert torch.equal(dst[key], src[transferable[key]])
    # every mixer weight not loaded is reported (the mixer's record of its name and options is not a weight)
    assert set(report.missing) == {k for k in dst if ".attn.mixer." in k and not k.endswith("_extra_state")} - loaded
    assert set(report.unused) == {s for m, s in transferable.items() if m not in loaded}
    assert report.complete == (not report.missing and not report.unused)
    assert bool(warned) == (not report.complete), "partial loads must warn, complete ones must not"
    if warned:
        assert "not loaded" in str(warned[0].message) or "not used" in str(warned[0].message)


def _save(model: nn.Module, folder) -> dict:
    from timm.models import save_for_hf

    save_for_hf(model, folder)
    return json.loads((folder / "config.json").read_text())


@every_mixer
@both_paths
def test_export_round_trip_rebuilds_the_same_model(mixer, path, tmp_path):
    model = build(path, mixer, num_classes=7).eval()
    config = _save(model, tmp_path)
    spec = mp.get_spec(mixer)
    if path == "create":
        assert config["architecture"] == "vit_tiny"
        assert (config["model_args"]["mixer"], config["model_args"]["mixer_options"]) == (mixer,
                                                                                        mixer_test_options(mixer))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixerSwapWarning)  # causal mixers + class token: tested on its own
            rebuilt = timm.create_model(f"local-dir:{tmp_path}", pretrained=True)
    else:
        assert config["model_args"]["mixer_swaps"] == [
            {"mixer": spec.name, "mixer_options": mixer_test_options(mixer), "mixer_blocks": None}]
        with pytest.raises(TypeError, match="mixer_swaps"):  # timm alone cannot place the mixer: it says so
            timm.create_model(f"local-dir:{tmp_path}")
        rebuilt = create_model(f"local-dir:{tmp_path}", pretrained=True)
    rebuilt.eval()
    assert [type(m) for m in rebuilt.modules()] == [type(m) for m in model.modules()]
    assert rebuilt.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value), key
    x = _image(2)
    assert torch.equal(rebuilt(x), model(x))


@every_mixer
def test_attn_layer_name_on_timm_vit(mixer):
    """attn_layer='<mixer name>' on timm's own ViT name: the mixer with its defaults (what the hook allows)."""
    spec = mp.get_spec(mixer)
    kwargs = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=3)
    max_len = spec.config.model_fields.get("max_seq_len")
    if max_len is not None and max_len.is_required():
        with pytest.raises(mp.MixerError, match="max_seq_len"):
            timm.create_model("vit_tiny_patch16_224", attn_layer=spec.name, **kwargs)
        return
    try:
        resolve_mixer_config(spec, 64, None, {"num_heads": 2})
    except mp.InvalidMixerOptions as err:
        pytest.skip(f"the defaults of {mixer!r} do not fit a width-64 ViT: {err}")
    model = timm.create_model("vit_tiny_patch16_224", attn_layer=spec.name, **kwargs)
    assert all(type(b.attn).__name__ == f"TimmMixerAttention_{spec.name}" for b in model.blocks)
    assert model._model_args["attn_layer"] == spec.name  # a string: exportable
    out = model(_image(2))
    out.mean().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters())


def test_attn_layer_on_timm_deit_and_vit_names_and_swap_for_eva():
    """The README's second form: ``attn_layer=`` on timm's own VisionTransformer names (DeiT included); Eva's model
    class takes no ``attn_layer`` (it has ``attn_type``), so EVA-02 goes through ``swap_mixer`` or our
    ``create_model``; and timm's own names take no ``mixer=`` (only our registered names do)."""
    small = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    for name in ("deit_small_patch16_224", "vit_base_patch16_224"):
        model = timm.create_model(name, attn_layer="quasi", **small)
        assert all(type(b.attn).__name__ == "TimmMixerAttention_quasiseparable" for b in model.blocks)
        assert torch.isfinite(model(_image(2))).all()
    with pytest.raises(TypeError, match="attn_layer"):
        timm.create_model("eva02_tiny_patch14_224", attn_layer="quasi", **small)
    with pytest.raises(TypeError, match="mixer"):
        timm.create_model("vit_base_patch16_224", mixer="quasi", **small)
    for model in (swap_mixer(timm.create_model("eva02_tiny_patch14_224", **small), "quasi"),
                  create_model("eva02_tiny_patch14_224", mixer="quasi", **small)):
        assert all(isinstance(b.attn, TimmMixerAttention) and b.attn.mixer_name == "quasiseparable"
                   for b in model.blocks)
        assert torch.isfinite(model(_image(2))).all()


FAMILIES = {
    "deit_distilled": ("deit_tiny_distilled_patch16_224", NUM_PATCHES + 2),  # cls + distillation token
    "respost": ("vit_base_patch16_rpn_224", NUM_PATCHES),                     # ResPostBlock, no prefix
    "eva": ("eva02_tiny_patch14_224", NUM_PATCHES + 1),                       # EvaBlock: attn(x, rope=...)
    "beit": ("beit_base_patch16_224", NUM_PATCHES + 1),                       # attn(x, shared_rel_pos_bias=...)
}


@every_mixer
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swap_into_other_vit_families(mixer, family):
    name, tokens = FAMILIES[family]
    model = timm.create_model(name, num_classes=3, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixerSwapWarning)  # BEiT loses its relative position bias: tested below
        swap_mixer(model, mixer, **mixer_test_options(mixer))
    adapters = attention_modules(model)
    assert len(adapters) == SMALL["depth"] and all(a.seq_len == tokens for a in adapters)
    assert not any(hasattr(a, "qkv") or hasattr(a, "relative_position_bias_table") for a in adapters)
    out = model.train()(_image(2))
    out.mean().backward()
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    with torch.no_grad():
        assert torch.isfinite(model.eval()(_image(2))).all()


# =================================================================================================================
# 3. Mechanisms
# =================================================================================================================

class TestPaddingMaskFromAttnMask:
    B, N = 2, 6
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)

    def symmetric(self) -> Tensor:
        return (self.valid[:, None, :, None] & self.valid[:, None, None, :])

    def test_bool_layouts(self):
        for mask in (self.symmetric(), self.valid[:, None, None, :], self.valid[:, None, None, :].expand(-1, 1, 6, -1)):
            assert torch.equal(padding_mask_from_attn_mask(mask, self.B, self.N), self.valid)

    def test_additive_layouts(self):
        for fill in (torch.finfo(torch.float32).min, float("-inf"), -1e4):
            additive = torch.zeros(self.B, 1, self.N, self.N).masked_fill(~self.symmetric(), fill)
            assert torch.equal(padding_mask_from_attn_mask(additive, self.B, self.N), self.valid)
        half = torch.zeros(self.B, 1, 1, self.N, dtype=torch.float16).masked_fill(
            ~self.valid[:, None, None, :], torch.finfo(torch.float16).min)
        assert torch.equal(padding_mask_from_attn_mask(half, self.B, self.N), self.valid)

    def test_all_real_gives_none(self):
        assert padding_mask_from_attn_mask(None, self.B, self.N) is None
        assert padding_mask_from_attn_mask(torch.ones(self.N, self.N, dtype=torch.bool), self.B, self.N) is None
        assert padding_mask_from_attn_mask(torch.zeros(1, 1, 1, self.N), self.B, self.N) is None

    @pytest.mark.parametrize("what, mask, message", [
        ("causal", torch.ones(6, 6, dtype=torch.bool).tril(), "not a key-padding mask"),
        ("per-head", torch.stack([torch.ones(6, 6), torch.ones(6, 6).triu()])[None].bool(), "not a key-padding"),
        ("additive bias", torch.full((2, 1, 6, 6), -0.5), "additive biases"),
        ("wrong length", torch.ones(2, 1, 1, 7, dtype=torch.bool), "does not fit"),
        ("3-D", torch.ones(2, 6, 6, dtype=torch.bool), "must have shape"),
        ("integer", torch.ones(2, 1, 1, 6, dtype=torch.long), "bool"),
    ])
    def test_refusals(self, what, mask, message):
        with pytest.raises(mp.MixerInputError, match=message):
            padding_mask_from_attn_mask(mask, self.B, self.N)

    def test_forward_checks_values_only_when_asked(self):
        """The adapter's forward reads the key mask from shapes and dtype alone (no host sync): value checks are
        opt-in (``check_attn_mask``)."""
        for mask in (self.symmetric(), self.valid[:, None, None, :]):
            assert torch.equal(padding_mask_from_attn_mask(mask, self.B, self.N, check_values=False), self.valid)
        all_real = torch.ones(self.N, self.N, dtype=torch.bool)
        assert padding_mask_from_attn_mask(all_real, self.B, self.N, check_values=False).all()
        model = build("create", "attention").eval()
        causal = torch.ones(NUM_PATCHES + 1, NUM_PATCHES + 1, dtype=torch.bool).tril()
        assert not any(a.check_attn_mask for a in attention_modules(model))
        model(_image(), attn_mask=causal)  # not checked: every key is attended by some query
        for adapter in attention_modules(model):
            adapter.check_attn_mask = True
        with pytest.raises(mp.MixerInputError, match="not a key-padding mask"):
            model(_image(), attn_mask=causal)

    def test_left_padding_is_refused_by_the_mixer(self):
        model = build("create", "attention")
        mask = torch.ones(1, 1, 1, NUM_PATCHES + 1, dtype=torch.bool)
        mask[..., 0] = False
        with pytest.raises(mp.MixerInputError, match="right-padded"):
            model(_image(), attn_mask=mask)


def test_is_causal_is_refused_by_bidirectional_mixers_and_passed_to_causal_ones():
    bidirectional = timm.create_model("vit_tiny", mixer="attention", **SMALL).eval()
    with pytest.raises(mp.MixerInputError, match="bidirectional"):
        bidirectional(_image(), is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixerSwapWarning)
        causal = timm.create_model("vit_tiny", mixer="attention", mixer_options={"causal": True},
                                   class_token=False, global_pool="avg", **SMALL).eval()
    x = _image()
    assert torch.equal(causal(x, is_causal=True), causal(x))


def test_our_names_are_registered_with_timm():
    assert all(timm.is_model(name) for name in MODEL_NAMES)
    assert sorted(timm.list_models(module="mixer_vit")) == sorted(MODEL_NAMES)
    assert register_timm_models() == list(MODEL_NAMES)  # idempotent
    cfg = timm.models.get_pretrained_cfg("vit_base")
    assert cfg.hf_hub_id == "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k" and cfg.input_size == (3, 224, 224)
    assert timm.models.is_model_pretrained("vit_small") and not timm.models.is_model_pretrained("hydra_vit_base")


def test_vit_base_with_quasi_is_a_vit_b16():
    """``timm.create_model('vit_base', mixer='quasi')`` is a ViT-B/16, on the meta device (no memory, no init cost)."""
    model = timm.create_model("vit_base", mixer="quasi", device="meta")
    attn = model.blocks[0].attn
    assert type(attn) is TimmMixerAttention and attn.mixer_name == "quasiseparable"
    assert (len(model.blocks), model.embed_dim, attn.seq_len, model.patch_embed.patch_size) == (12, 768, 197, (16, 16))
    assert model._model_args == {"mixer": "quasi"}


@pytest.mark.slow  # a fresh interpreter imports torch and timm: ~10 s on a loaded CI core
def test_a_fresh_interpreter_gets_the_names_from_import_mixer_plugins():
    import subprocess
    import sys

    code = ("import mixer_plugins, timm; m = timm.create_model('vit_base', mixer='quasi', device='meta'); "
            "print(type(m.blocks[0].attn).__name__, m.blocks[0].attn.mixer_name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TimmMixerAttention", "quasiseparable"]


def test_existing_timm_names_are_never_overwritten():
    name = "vit_small_patch16_224"
    before = (timm.models.model_entrypoint(name), timm.list_pretrained(f"{name}.*"),
              name in timm.list_models(module="vision_transformer"))

    def vit_small_patch16_224(pretrained: bool = False, **kwargs):  # same name as timm's
        raise AssertionError("must never be called")

    with pytest.warns(UserWarning, match="does not overwrite"):
        assert _register_entrypoint(vit_small_patch16_224) is False
    after = (timm.models.model_entrypoint(name), timm.list_pretrained(f"{name}.*"),
             name in timm.list_models(module="vision_transformer"))
    assert after == before and before[1]


@pytest.mark.parametrize("preset, width", [("hydra_vit_tiny", 192), ("hydra_vit_small", 384),
                                           ("hydra_vit_base", 768)])
def test_hydra_presets_follow_the_paper(preset, width):
    model = timm.create_model(preset, device="meta")
    assert len(model.blocks) == 24 and model.embed_dim == width
    assert all(type(b) is MixerOnlyBlock and not hasattr(b, "mlp") for b in model.blocks)
    assert model.pos_embed is None and model.cls_token is None and model.num_prefix_tokens == 0
    assert model.global_pool == "avg" and isinstance(model.fc_norm, nn.LayerNorm)
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.5)
    attn = model.blocks[0].attn
    assert attn.mixer_name == "quasiseparable" and attn.seq_len == 196 and not attn.inherit_num_heads
    assert HYDRA_PRESETS[preset]["depth"] == 24
    if preset == "hydra_vit_base":
        # Table 5 of the paper reports 91M; the Hydra layer count of hydra.md (3.83M x 24 + stem + head) is 93M.
        params = sum(p.numel() for p in model.parameters())
        assert 0.95 * 91e6 < params < 1.05 * 91e6, params


def test_hydra_preset_trains_on_a_small_input():
    model = timm.create_model("hydra_vit_tiny", img_size=32, patch_size=8, embed_dim=32, num_classes=4,
                              mixer_options=mixer_test_options("quasi"))
    assert not any("mlp" in n for n, _ in model.named_parameters())
    out = model(_image(2))
    out.mean().backward()
    assert out.shape == (2, 4) and all(p.grad is not None for p in model.parameters())
    with pytest.raises(mp.MixerError, match="fix_init"):
        timm.create_model("hydra_vit_tiny", fix_init=True, device="meta")
    with pytest.raises(RuntimeError, match="No pretrained weights"):
        timm.create_model("hydra_vit_tiny", pretrained=True, device="meta")


def test_hybrid_models_and_their_export(tmp_path):
    model = timm.create_model("vit_tiny", mixer="attention", mixer_blocks=[1], **SMALL)
    assert [type(b.attn).__name__ for b in model.blocks] == ["Attention", "TimmMixerAttention", "Attention"]
    swap_mixer(model, "attention", mixer_blocks=[-1], num_heads=4)
    assert [type(b.attn).__name__ for b in model.blocks] == ["Attention", "TimmMixerAttention", "TimmMixerAttention"]
    assert model.blocks[2].attn.mixer.num_heads == 4 and model.blocks[1].attn.mixer.num_heads == 2
    _save(model.eval(), tmp_path)
    rebuilt = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert [type(b.attn) for b in rebuilt.blocks] == [type(b.attn) for b in model.blocks]
    assert torch.equal(rebuilt(_image()), model(_image()))
    with pytest.raises(mp.MixerError, match="not a block index"):
        timm.create_model("vit_tiny", mixer="attention", mixer_blocks=[3], **SMALL)


def test_patch_dropout_order():
    plain = timm.create_model("vit_tiny_patch16_224", patch_drop_rate=0.5, class_token=False, global_pool="avg",
                              **SMALL)
    assert not plain.patch_drop.ordered
    swap_mixer(plain, "attention")  # permutation-equivariant: shuffled patches are fine
    with pytest.raises(mp.MixerError, match="patch_drop.ordered = True"):
        swap_mixer(plain, "attention", causal=True)
    assert not plain.blocks[0].attn.causal, "a refused swap must leave the model unchanged"
    plain.patch_drop.ordered = True
    swap_mixer(plain, "attention", causal=True)
    ours = timm.create_model("vit_tiny", mixer="attention", patch_drop_rate=0.5, **SMALL)
    assert ours.patch_drop.ordered, "our names keep kept patches in raster order"


def test_order_sensitivity_probe():
    attention = mp.create_mixer("attention", 16, num_heads=2)
    assert not is_order_sensitive(attention)
    assert is_order_sensitive(mp.create_mixer("attention", 16, num_heads=2, causal=True))
    assert is_order_sensitive(attention, spec_data_dependent="no")


def test_warnings_for_models_that_would_ignore_the_image_or_position():
    with pytest.warns(MixerSwapWarning, match="class token"):
        timm.create_model("vit_tiny", mixer="attention", mixer_options={"causal": True}, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixerSwapWarning)
        timm.create_model("vit_tiny", mixer="attention", mixer_options={"causal": True}, class_token=False,
                          global_pool="avg", **SMALL)
    beit = timm.create_model("beit_base_patch16_224", **SMALL)
    with pytest.warns(MixerSwapWarning, match="relative position bias"):
        swap_mixer(beit, "attention")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixerSwapWarning)
        swap_mixer(timm.create_model("beit_base_patch16_224", **SMALL), "attention", causal=True)


def test_errors_are_clear():
    with pytest.raises(mp.UnknownMixerError, match="did you mean 'attention'"):
        timm.create_model("vit_tiny", mixer="attentoin", **SMALL)
    with pytest.raises(mp.InvalidMixerOptions, match="did you mean 'num_heads'"):
        timm.create_model("vit_tiny", mixer="attention", mixer_options={"num_head": 2}, **SMALL)
    with pytest.raises(mp.InvalidMixerOptions, match="dim is set by the timm model"):
        timm.create_model("vit_tiny", mixer="attention", mixer_options={"dim": 8}, **SMALL)
    with pytest.raises(TypeError, match="attn_layer"):
        timm.create_model("vit_tiny", attn_layer="attention", **SMALL)
    with pytest.raises(mp.MixerError, match="model.blocks"):
        swap_mixer(timm.create_model("resnet10t"), "attention")
    with pytest.raises(mp.MixerError, match="no separate attention"):
        swap_mixer(timm.create_model("vit_pwee_patch16_reg1_gap_256", device="meta"), "attention")
    with pytest.raises(mp.MixerError, match="needs a mixer"):
        TimmMixerAttention(32)
    with pytest.raises(TypeError, match="need mixer="):
        create_model("vit_tiny_patch16_224", mixer_options={"num_heads": 2})


def test_pretrained_report_details(timm_checkpoint):
    source, path = timm_checkpoint
    # the attention mixer with the ViT's head count takes every tensor: it is the network timm built
    model, warned = _load_pretrained("attention", path, mixer_options={})
    assert model.pretrained_report.complete and not warned
    x = _image(2)
    torch.testing.assert_close(model.eval()(x), source(x), rtol=1e-5, atol=1e-6)
    # another shape for the same names: reported as mismatched, never loaded, never an exception
    model, warned = _load_pretrained("attention", path, mixer_options={"num_heads": 2, "head_dim": 8})
    report = model.pretrained_report
    assert {m[0] for m in report.mismatched} == {k for k in source.state_dict() if ".attn.qkv." in k or
                                                  ".attn.proj.weight" in k}
    assert warned and "shape mismatches" in str(warned[0].message)
    # a new head for a new num_classes is expected: reported, not warned about
    model, warned = _load_pretrained("attention", path, num_classes=5)
    assert model.pretrained_report.classifier_reset == ["head.weight", "head.bias"] and not warned


def test_create_model_on_timm_names_and_weight_transfer(timm_checkpoint):
    source, path = timm_checkpoint
    kwargs = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10), num_classes=10,
                  **SMALL)
    # attention -> our attention mixer, weights transferred: the same function as timm's own ViT
    model = create_model("vit_tiny_patch16_224", mixer="attention", **kwargs).eval()
    assert model.mixer_weight_report.complete
    x = _image(2)
    torch.testing.assert_close(model(x), source(x), rtol=1e-5, atol=1e-6)
    # swap, then load the original weights back with load_compatible_state_dict
    swapped = swap_mixer(timm.create_model("vit_tiny_patch16_224", num_classes=10, **SMALL), "attention").eval()
    report = load_compatible_state_dict(swapped, source.state_dict())
    assert report.complete and torch.allclose(swapped(x), source(x), atol=1e-6)
    # a mixer that matches nothing: everything of the old attention is reported, with a warning
    with pytest.warns(PartialWeightsWarning, match="not loaded"):
        create_model("vit_tiny_patch16_224", mixer="quasi", mixer_options=mixer_test_options("quasi"), **kwargs)


# -- init and TorchScript through in-process test mixers ----------------------------------------------------------

class _ConstConfig(mp.MixerConfig):
    scale: float = Field(3.0, description="value of the constant parameter")


class _ConstInitMixer(nn.Module):
    """Distinctive init timm would destroy: a Linear of 0.5s and a parameter of 3s."""

    causal = False

    def __init__(self, config: _ConstConfig):
        super().__init__()
        self.dim = config.dim
        self.value = nn.Linear(config.dim, config.dim)
        self.gain = nn.Parameter(torch.full((config.dim,), config.scale))
        with torch.no_grad():
            self.value.weight.fill_(0.5)
            self.value.bias.fill_(0.25)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        y = self.value(x) * self.gain
        return y if mask is None else y * mask.unsqueeze(-1).to(y.dtype)


class _MeanConfig(mp.MixerConfig):
    num_heads: int = Field(2, gt=0, description="unused; makes the ViT's head count flow in")


class _ScriptableMeanMixer(nn.Module):
    """y_i = W(v_i + mean_j v_j) over real tokens: TorchScript-compatible, padding-aware."""

    causal: bool = False

    def __init__(self, config: _MeanConfig):
        super().__init__()
        self.value = nn.Linear(config.dim, config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        v = self.value(x)
        if mask is None:
            weight = torch.ones(x.shape[0], x.shape[1], 1, dtype=x.dtype, device=x.device)
        else:
            weight = mask.unsqueeze(-1).to(x.dtype)
        mean = (v * weight).sum(1, keepdim=True) / weight.sum(1, keepdim=True).clamp(min=1.0)
        return self.proj(v + mean) * weight


@pytest.fixture
def in_process_mixers():
    specs = [mp.MixerSpec(name="timm_test_const", config=_ConstConfig, builder=_ConstInitMixer),
             mp.MixerSpec(name="timm_test_mean", config=_MeanConfig, builder=_ScriptableMeanMixer)]
    for spec in specs:
        mp.register_mixer(spec)
    register_attn_layers([s.name for s in specs])
    yield
    for spec in specs:
        mp.unregister_mixer(spec.name)


@pytest.mark.parametrize("weight_init", ["", "jax", "moco"])
def test_timm_init_passes_keep_the_mixer_init(in_process_mixers, weight_init):
    model = timm.create_model("vit_tiny_patch16_224", attn_layer="timm_test_const", weight_init=weight_init,
                              **SMALL)
    for _ in range(2):  # at construction, and when the user re-initialises
        for block in model.blocks:
            mixer = block.attn.mixer
            assert (mixer.value.weight == 0.5).all() and (mixer.value.bias == 0.25).all()
            assert (mixer.gain == 3.0).all()
        assert not (model.blocks[0].mlp.fc1.weight == 0.5).all()  # the rest does get timm's init
        model.init_weights(weight_init)


def test_fix_init_scales_the_mixer_output_projection():
    torch.manual_seed(0)
    plain = timm.create_model("vit_tiny", mixer="attention", **SMALL)
    torch.manual_seed(0)
    fixed = timm.create_model("vit_tiny", mixer="attention", fix_init=True, **SMALL)
    for i, (a, b) in enumerate(zip(plain.blocks, fixed.blocks)):
        torch.testing.assert_close(b.attn.proj.weight, a.attn.proj.weight / math.sqrt(2.0 * (i + 1)))
        torch.testing.assert_close(b.mlp.fc2.weight, a.mlp.fc2.weight / math.sqrt(2.0 * (i + 1)))


def test_scriptable_mixer_scripts_through_a_whole_vit(in_process_mixers):
    with set_scriptable(True):
        model = timm.create_model("vit_tiny", mixer="timm_test_mean", **SMALL).eval()
    scripted = torch.jit.script(model)
    x = _image(2)
    torch.testing.assert_close(scripted(x), model(x))
    mask = torch.ones(2, 1, 1, NUM_PATCHES + 1, dtype=torch.bool)
    mask[1, ..., 10:] = False
    torch.testing.assert_close(scripted(x, attn_mask=mask), model(x, attn_mask=mask))
    assert not torch.allclose(model(x, attn_mask=mask)[1], model(x)[1])
    with pytest.raises(Exception, match="bidirectional"):
        scripted(x, is_causal=True)


def test_models_with_named_attn_layers_pickle_whole():
    import io

    model = timm.create_model("vit_tiny_patch16_224", attn_layer="attention", **SMALL).eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False).eval()
    assert type(restored.blocks[0].attn) is type(model.blocks[0].attn)
    assert torch.equal(restored(_image()), model(_image()))


def test_example_script(capsys, monkeypatch):
    import importlib.util
    import pathlib
    import re

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "timm_vit.py"
    module_spec = importlib.util.spec_from_file_location("timm_vit_example", path)
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)
    args = ["--model", "hydra_vit_tiny", "--mixer", "attention", "--img-size", "16", "--steps", "2",
            "--batch-size", "2"]
    monkeypatch.setattr("sys.argv", ["timm_vit.py", *args])
    example.main()
    out = capsys.readouterr().out
    reference = timm.create_model("hydra_vit_tiny", mixer="attention", img_size=16, patch_size=8, num_classes=10,
                                  device="meta")
    expected = sum(p.numel() for p in reference.parameters()) / 1e6
    assert f"parameters: {expected:.2f}M" in out
    assert re.search(r"FLOPs per image: [0-9.]+ GFLOP", out) and "step 2: loss" in out


# -- attn_layer='<alias>' and mixers registered at run time, with no hidden call ---------------------------------------

_ALIASES = [(alias, spec.name) for spec in mp.list_specs() for alias in spec.aliases]
_TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, num_classes=3)


@pytest.mark.parametrize("alias, name", _ALIASES, ids=[a for a, _ in _ALIASES])
def test_attn_layer_accepts_every_alias(alias, name):
    """Each alias is a key of timm's ATTN_LAYERS bound to the canonical mixer (timm used to fail with
    "Unknown attn_layer: None")."""
    from timm.models.vision_transformer import ATTN_LAYERS

    assert ATTN_LAYERS.get(alias) is ATTN_LAYERS[name]
    spec = mp.get_spec(name)
    max_len = spec.config.model_fields.get("max_seq_len")
    if max_len is not None and max_len.is_required():  # our clear error, not timm's assertion
        with pytest.raises(mp.MixerError, match="max_seq_len"):
            timm.create_model("vit_tiny_patch16_224", attn_layer=alias, **_TINY_VIT)
        return
    try:
        resolve_mixer_config(spec, 64, None, {"num_heads": 2})
    except mp.InvalidMixerOptions as err:
        pytest.skip(f"the defaults of {name!r} do not fit a width-64 ViT: {err}")
    model = timm.create_model("vit_tiny_patch16_224", attn_layer=alias, **_TINY_VIT)
    attn = model.blocks[0].attn
    assert type(attn).__name__ == f"TimmMixerAttention_{name}" and attn.mixer_name == name
    assert torch.isfinite(model(_image(2))).all()


def test_attn_layer_follows_mixers_registered_and_unregistered_at_run_time():
    from timm.models.vision_transformer import ATTN_LAYERS

    from mixer_plugins.mixers.attention import AttentionConfig, SoftmaxAttention

    class LateConfig(AttentionConfig):
        pass

    @mp.register_mixer("late_timm_attention", config=LateConfig, summary="registered after import",
                       aliases=("late_attn",))
    class LateAttention(SoftmaxAttention):
        pass

    try:
        for key in ("late_timm_attention", "late_attn"):  # no register_attn_layers() call
            model = timm.create_model("vit_tiny_patch16_224", attn_layer=key, **_TINY_VIT)
            assert isinstance(model.blocks[0].attn.mixer, LateAttention)
            assert model.blocks[0].attn.mixer_name == "late_timm_attention"
            assert torch.isfinite(model(_image(1))).all()
    finally:
        mp.unregister_mixer("late_timm_attention")
    assert "late_timm_attention" not in ATTN_LAYERS and "late_attn" not in ATTN_LAYERS
    with pytest.raises(AssertionError, match="Unknown attn_layer"):
        timm.create_model("vit_tiny_patch16_224", attn_layer="late_attn", **_TINY_VIT)


def test_registry_listener_failure_never_breaks_registration():
    registry = mp.MixerRegistry()
    seen = []

    def broken(event, spec):
        raise RuntimeError("boom")

    registry.add_listener(broken)
    registry.add_listener(lambda event, spec: seen.append((event, spec.name)))
    spec = mp.get_spec("attention")
    with pytest.warns(RuntimeWarning, match="boom"):
        registry.register(mp.MixerSpec(name="listened", config=spec.config, builder=spec.builder))
    assert "listened" in registry.names() and seen == [("register", "listened")]
    registry.remove_listener(broken)
    registry.unregister("listened")
    assert seen[-1] == ("unregister", "listened")


@pytest.mark.slow  # a fresh interpreter imports torch and timm
def test_probing_for_timm_does_not_disarm_the_registration():
    """``importlib.util.find_spec('timm')`` (how libraries probe for optional packages) finds without importing;
    the later ``import timm`` must still register our names (wrapt's post-import hook waits for the import)."""
    import subprocess
    import sys

    code = ("import importlib.util, sys, mixer_plugins; importlib.util.find_spec('timm'); "
            "assert 'timm' not in sys.modules; import timm; "
            "print(timm.is_model('vit_base'), 'quasi' in timm.models.vision_transformer.ATTN_LAYERS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
