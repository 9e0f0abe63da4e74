"""``swap_mixer``: put a registered mixer into a timm model that is already built.

Works on every model whose transformer blocks live in ``model.blocks`` and hold their token mixer as ``.attn``
(ViT, DeiT, hybrid ViTs, NaFlexViT, Eva / EVA-02 / RoPE-ViT, BEiT, ResPostBlock and ParallelThingsBlock ViTs),
including ``features_only`` wrappers. The swap is recorded in the model's ``_model_args`` (what timm's
``save_for_hf`` / ``push_to_hf_hub`` export), so :func:`mixer_plugins.backbones.timm.create_model` rebuilds the
same model from the exported folder.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from timm.layers import PatchDropout, PatchDropoutWithIndices
from torch import nn

from ...registry import MixerError, default_registry
from .adapter import TimmMixerAttention
from .weights import WeightLoadReport

__all__ = ["swap_mixer", "replay_swaps", "block_indices", "is_order_sensitive", "nominal_token_count", "unwrap_model",
           "MixerSwapWarning"]


class MixerSwapWarning(UserWarning):
    """A swapped-in mixer leaves the model in a legal but probably unintended state (e.g. no positional signal)."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The network inside timm's ``features_only`` wrapper (``FeatureGetterNet`` keeps it as ``.model``)."""
    inner = getattr(model, "model", None)
    return inner if getattr(model, "blocks", None) is None and isinstance(inner, nn.Module) else model


def nominal_token_count(model: nn.Module) -> Optional[int]:
    """Tokens the blocks see at the model's nominal image size: patches plus prefix (cls, register, dist) tokens.

    NaFlexViT's sequence lengths are set by its data loader: its nominal grid is the default image size over the
    patch size, else the grid of its learned position embedding.
    """
    def pair(value: Any) -> tuple[int, int]:
        return (value, value) if isinstance(value, int) else tuple(value)

    patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    embeds = getattr(model, "embeds", None)
    size, patch = getattr(embeds, "default_img_size", None), getattr(embeds, "patch_size", None)
    grid = getattr(embeds, "pos_embed_grid_size", None)
    if not patches and size is not None and patch is not None:
        patches = (pair(size)[0] // pair(patch)[0]) * (pair(size)[1] // pair(patch)[1])
    elif not patches and grid is not None:
        patches = pair(grid)[0] * pair(grid)[1]
    return int(patches) + int(getattr(model, "num_prefix_tokens", 0) or 0) if patches else None


def is_order_sensitive(mixer: nn.Module, *, spec_data_dependent: str | None = None, length: int = 8) -> bool:
    """Whether a mixer's output depends on token order (it is not permutation-equivariant).

    Data-independent and causal mixers are order-sensitive by construction. Otherwise a float64 copy of the
    mixer is run on a random sequence and on its reversal; meta-device mixers are assumed order-sensitive.
    """
    if spec_data_dependent == "no" or getattr(mixer, "causal", False):
        return True
    reference = next(iter(mixer.parameters()), None)
    if reference is not None and reference.device.type == "meta":
        return True
    max_len = getattr(mixer, "max_seq_len", None)
    length = max(2, min(length, max_len or length))
    dim = int(getattr(mixer, "dim", 0) or getattr(getattr(mixer, "config", None), "dim", 0))
    probe = copy.deepcopy(mixer).eval()
    generator = torch.Generator().manual_seed(0)
    for dtype, rtol in ((torch.float64, 1e-7), (torch.float32, 1e-4)):
        try:
            probe = probe.to(device="cpu", dtype=dtype)
            x = torch.randn(1, length, dim, generator=generator, dtype=dtype)
            reverse = torch.arange(length - 1, -1, -1)
            with torch.no_grad():
                y, y_rev = probe(x), probe(x[:, reverse])
        except (RuntimeError, TypeError, MixerError):
            continue  # some kernels have no float64 path; try float32
        scale = float(y.abs().max()) + 1e-12
        return not torch.allclose(y[:, reverse], y_rev, rtol=rtol, atol=rtol * scale)
    return True


def block_indices(selection: Optional[Iterable[int]], depth: int, what: str = "mixer_blocks") -> list[int]:
    """``selection`` (block indices, negative ones counted from the end; None: every block) as indices 0..depth-1."""
    if selection is None:
        return list(range(depth))
    for index in selection:
        if not isinstance(index, int) or isinstance(index, bool) or not -depth <= index < depth:
            raise MixerError(f"{what} entry {index!r} is not a block index of this model (0..{depth - 1})")
    return [index % depth for index in selection]


def replay_swaps(model: nn.Module, swaps: Optional[Sequence[Mapping[str, Any]]]) -> None:
    """Apply swaps as :func:`swap_mixer` records them in ``model._model_args['mixer_swaps']``, in order."""
    for swap in swaps or ():
        if not isinstance(swap, Mapping) or "mixer" not in swap or set(swap) - {"mixer", "mixer_options",
                                                                                 "mixer_blocks"}:
            raise MixerError(f"each mixer_swaps entry is a dict with 'mixer', 'mixer_options', 'mixer_blocks'; "
                             f"got {swap!r}")
        swap_mixer(model, swap["mixer"], mixer_blocks=swap.get("mixer_blocks"), **dict(swap.get("mixer_options") or {}))


def _attention_slots(root: nn.Module, mixer_blocks: Optional[Iterable[int]]
                     ) -> list[tuple[nn.Module, str, nn.Module, int]]:
    """(parent, attribute, old module, block index) for every token mixer to replace."""
    blocks = getattr(root, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise MixerError(
            f"swap_mixer needs a model whose transformer blocks are in `model.blocks` (ViT, DeiT, NaFlexViT, Eva, "
            f"BEiT, ...); {type(root).__name__} has none"
        )
    selected = sorted(set(block_indices(mixer_blocks, len(blocks))))
    slots: list[tuple[nn.Module, str, nn.Module, int]] = []
    for index in selected:
        block = blocks[index]
        found = [(name, module) for name, module in block.named_modules()
                 if name.split(".")[-1] == "attn" and name]
        # keep outermost `attn` modules only (a module named attn inside another is part of it)
        found = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
        if not found:
            raise MixerError(
                f"block {index} ({type(block).__name__}) has no separate attention module `attn` "
                "(ParallelScalingBlock fuses attention with the MLP), so no mixer can be swapped in"
            )
        for name, module in found:
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            slots.append((parent, name.split(".")[-1], module, index))
    return slots


def _host_arguments(parent: nn.Module, old: nn.Module, root: nn.Module) -> dict[str, Any]:
    """What timm built the old attention with: width, heads, biases, dropouts, device and dtype."""
    reference = next(itertools.chain(old.parameters(), parent.parameters()), None)
    placement = {
        "device": reference.device if reference is not None else None,
        "dtype": reference.dtype if reference is not None and reference.is_floating_point() else None,
    }
    if isinstance(old, TimmMixerAttention):
        return {"dim": old.mixer_config.dim, **old.host_arguments, **placement}
    norm = getattr(parent, "norm1", None)
    shape = getattr(norm, "normalized_shape", None)
    qkv = getattr(old, "qkv", None)
    if shape:
        dim = int(shape[0])
    elif isinstance(qkv, nn.Linear):
        dim = qkv.in_features
    else:
        dim = int(getattr(root, "embed_dim", 0) or getattr(root, "num_features", 0))
    if not dim:
        raise MixerError(f"cannot tell the width of {type(old).__name__}; swap_mixer needs blocks with norm1 or qkv")
    qkv_bias = None
    if isinstance(qkv, nn.Linear):
        qkv_bias = qkv.bias is not None or getattr(old, "q_bias", None) is not None
    proj, drop, attn_drop = (getattr(old, name, None) for name in ("proj", "proj_drop", "attn_drop"))
    return {
        "dim": dim,
        "num_heads": getattr(old, "num_heads", None),
        "qkv_bias": qkv_bias,
        "proj_bias": (proj.bias is not None) if isinstance(proj, nn.Linear) else None,
        "proj_drop": drop.p if isinstance(drop, nn.Dropout) else 0.0,
        "attn_drop": attn_drop.p if isinstance(attn_drop, nn.Dropout) else None,
        **placement,
    }


def warn_causal_token_pool(root: nn.Module, adapter: TimmMixerAttention) -> None:
    """A causal mixer never lets front prefix tokens see the patches; pooling such a token ignores the image."""
    if adapter.causal and getattr(root, "global_pool", None) == "token" and getattr(root, "num_prefix_tokens", 0):
        warnings.warn(
            f"mixer {adapter.mixer_name!r} is causal and the model pools its class token (global_pool='token'), "
            "which comes first and so never sees a patch: the classifier ignores the image. Use "
            "global_pool='avg' (or a bidirectional mixer)", MixerSwapWarning, stacklevel=3,
        )


def _check_token_order(root: nn.Module, replaced: Sequence[nn.Module], adapter: TimmMixerAttention) -> None:
    """Refuse unordered patch dropout (kept patches in random order) for an order-sensitive mixer; warn when an
    order-insensitive one replaces the only positional signal (RoPE or relative position bias in the attention)."""
    drop = getattr(root, "patch_drop", None)
    shuffles = isinstance(drop, (PatchDropout, PatchDropoutWithIndices)) and drop.prob > 0 and not drop.ordered
    rope = getattr(root, "rope", None) is not None
    relpos = getattr(root, "rel_pos_bias", None) is not None or any(
        getattr(m, "relative_position_bias_table", None) is not None for m in replaced)
    loses_position = getattr(root, "pos_embed", None) is None and (rope or relpos)
    if not (shuffles or loses_position):
        return
    spec = default_registry.get_spec(adapter.mixer_name)
    sensitive = is_order_sensitive(adapter.mixer, spec_data_dependent=spec.data_dependent)
    if shuffles and sensitive:
        raise MixerError(
            f"the model uses patch dropout (rate {getattr(drop, 'prob', None)}) that keeps patches in random "
            f"order, but mixer {adapter.mixer_name!r} depends on token order. Set model.patch_drop.ordered = True "
            "(kept patches stay in raster order) or build the model with patch_drop_rate=0"
        )
    if loses_position and not sensitive:
        warnings.warn(
            f"{type(root).__name__} has no absolute position embedding: its attention carried position "
            f"({'RoPE' if rope else 'relative position bias'}), which mixer {adapter.mixer_name!r} ignores and "
            "does not replace (it is order-insensitive). The swapped model sees the image as a set of patches",
            MixerSwapWarning, stacklevel=3,
        )


def _transfer(old: nn.Module, new: TimmMixerAttention, prefix: str, report: WeightLoadReport) -> None:
    """Copy old-attention tensors whose name and shape match into the new mixer."""
    new_state = new.state_dict()
    old_state = old.state_dict()
    taken = {}
    for key, value in old_state.items():
        target = "mixer." + key
        if target in new_state and tuple(new_state[target].shape) == tuple(value.shape):
            taken[target] = value
        else:
            report.unused.append(prefix + key)
            if target in new_state:
                report.mismatched.append((prefix + key, tuple(value.shape), tuple(new_state[target].shape)))
    new.load_state_dict(taken, strict=False)
    report.loaded.extend(prefix + k for k in taken)
    # the mixer's record of its name and options (its extra state) is not a weight: never "missing"
    report.missing.extend(prefix + k for k in new_state if k not in taken and not k.endswith("_extra_state"))


def swap_mixer(model: nn.Module, mixer: str, /, *, mixer_blocks: Optional[Iterable[int]] = None,
               transfer_weights: bool = False, **options: Any) -> nn.Module:
    """Replace the token mixer of a built timm model's blocks with registered mixer ``mixer``.

    Args:
        model: a timm model (or ``features_only`` wrapper) whose blocks are ``model.blocks[i]`` with ``.attn``.
        mixer: a registered mixer name or alias.
        mixer_blocks: indices of the blocks to swap (default: all), e.g. ``[0, 6]`` for a hybrid.
        transfer_weights: copy the old attention's tensors whose name and shape match into the new mixer (the
            ``attention`` mixer takes ``qkv`` and ``proj`` exactly) and warn about the rest; the report is kept
            as ``model.mixer_weight_report``. By default the new mixers keep their own initialisation.
        **options: the mixer's options. Width, head count (where the mixer has ``num_heads``), biases and, for
            data-independent mixers, ``max_seq_len`` (the model's token count) come from the model.

    Returns the model (modified in place). Raises :class:`~mixer_plugins.MixerError` for models without
    swappable blocks and for order-sensitive mixers under unordered patch dropout; warns
    (:class:`MixerSwapWarning`) when a causal mixer feeds a pooled class token or when no positional signal
    would be left. The swap is appended to ``model._model_args['mixer_swaps']`` for export.
    """
    if not isinstance(mixer, str):
        raise TypeError(f"mixer must be a registered mixer name (str), got {type(mixer).__name__}")
    spec = default_registry.get_spec(mixer)
    root = unwrap_model(model)
    slots = _attention_slots(root, mixer_blocks)
    seq_len = nominal_token_count(root)
    prefix = int(getattr(root, "num_prefix_tokens", 0) or 0)
    built = []
    for parent, _attr, old, _index in slots:
        # A mixer that did not take timm's head count (Hydra presets) hands that choice on to its successor.
        host = {k: v for k, v in _host_arguments(parent, old, root).items() if v is not None}
        adapter = TimmMixerAttention(host.pop("dim"), mixer=spec.name, mixer_options=dict(options), seq_len=seq_len,
                                     num_prefix_tokens=prefix, **host,
                                     inherit_num_heads=getattr(old, "inherit_num_heads", True))
        adapter.train(old.training)
        built.append(adapter)
    # Checks run before anything is replaced, so a refused swap leaves the model untouched.
    _check_token_order(root, [old for _, _, old, _ in slots], built[0])
    warn_causal_token_pool(root, built[0])
    report = WeightLoadReport(source="the swapped-out attention") if transfer_weights else None
    names = {id(m): n for n, m in model.named_modules()}
    for (parent, attr, old, _), adapter in zip(slots, built):
        if report is not None:
            _transfer(old, adapter, names.get(id(old), attr) + ".", report)
        setattr(parent, attr, adapter)
    if report is not None:
        # a plain attribute: torch types a module's attributes as tensors and modules only
        model.mixer_weight_report = report  # type: ignore[assignment]
        report.warn_if_partial(stacklevel=2)
    record = {"mixer": spec.name, "mixer_options": dict(options),
              "mixer_blocks": None if mixer_blocks is None else sorted({s[3] for s in slots})}
    model_args = dict(getattr(model, "_model_args", {}))
    model_args["mixer_swaps"] = list(model_args.get("mixer_swaps", [])) + [record]
    # a plain attribute: torch types a module's attributes as tensors and modules only
    model._model_args = model_args  # type: ignore[assignment]
    return model
