"""timm's Attention contract around any registered mixer.

timm's ViT-family blocks build their token mixer as ``attn_layer(dim, num_heads=..., qkv_bias=..., ...)`` and call
it as ``attn(x, attn_mask=None, is_causal=False)`` (Eva adds ``rope=``, BEiT ``shared_rel_pos_bias=``).
:class:`TimmMixerAttention` accepts exactly that, builds the mixer through the registry and calls
``mixer(x, mask=...)``: ``attn_mask`` becomes a right-padded key mask (see :func:`padding_mask_from_attn_mask`),
``is_causal=True`` is refused by bidirectional mixers, and ``rope`` / ``shared_rel_pos_bias`` are ignored (position
comes from the mixer or the model's position embedding; :func:`~mixer_plugins.backbones.timm.swap_mixer` warns when
none is left).

The adapter is an FX leaf and its forward is TorchScript-compatible. Its ``init_weights()``, which timm calls after
re-initialising every ``nn.Linear``, re-draws the mixer's own initialisation under every ``weight_init`` mode.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Optional

import torch
from timm.layers import DropPath, LayerNorm, LayerScale, register_notrace_module
from torch import Tensor, nn

from ...registry import MixerConfig, MixerError, MixerInputError, MixerPluginWarning, MixerSpec, default_registry
from ..options import HostModel, resolve_config
from ..reinit import reinitialize_mixer

__all__ = ["TimmMixerAttention", "MixerOnlyBlock", "padding_mask_from_attn_mask", "resolve_mixer_config",
           "attn_layer_class", "register_attn_layers", "MASKED_LOGIT_THRESHOLD"]

#: Additive-mask entries at or below this value mean "masked". timm fills masked entries with
#: ``torch.finfo(dtype).min`` (NaFlexViT) or ``-inf``; ``torch.finfo`` itself is not TorchScript-compatible.
MASKED_LOGIT_THRESHOLD = -1.0e4


def padding_mask_from_attn_mask(attn_mask: Optional[Tensor], batch: int, length: int,
                                check_values: bool = True) -> Optional[Tensor]:
    """timm's attention mask as our bool ``(batch, length)`` key mask (True on real tokens): key j is real when some
    query may attend to it, which both NaFlexViT layouts (``[B, 1, N, N]`` and ``[B, 1, 1, N]``) give.

    Accepts a bool mask (True = may attend) or an additive float mask (0 = may attend, ``<= -1e4`` or ``-inf`` =
    masked) of shape ``(batch | 1, heads | 1, queries | 1, length)`` or ``(queries, length)``; dtype and shape are
    always checked. With ``check_values`` (host syncs), a mask that is not key padding (additive biases, causal or
    per-head patterns, which a mixer cannot honour) raises :class:`MixerInputError`, and an all-real mask gives
    None. :class:`TimmMixerAttention` checks values only when its ``check_attn_mask`` is set.
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        allowed = attn_mask
    elif attn_mask.is_floating_point():
        allowed = attn_mask == 0
        # -1e4 is MASKED_LOGIT_THRESHOLD (TorchScript cannot read float globals)
        if check_values and not bool((allowed | (attn_mask <= -1.0e4)).all()):
            raise MixerInputError(
                "attn_mask holds additive biases (entries that are neither 0 nor <= -1e4): a matrix mixer "
                "only accepts padding masks (0 = attend, large negative or -inf = masked)"
            )
    else:
        raise MixerInputError("attn_mask must be bool (True = attend) or an additive float mask, got " +
                              str(attn_mask.dtype))
    if allowed.dim() == 2:
        allowed = allowed.unsqueeze(0).unsqueeze(0)
    if allowed.dim() != 4:
        raise MixerInputError("attn_mask must have shape (batch, heads, queries, keys) or (queries, keys), got " +
                              str(list(attn_mask.shape)))
    rows, heads, queries, keys = allowed.shape
    if keys != length or rows not in (1, batch) or queries not in (1, length):
        raise MixerInputError("attn_mask of shape " + str(list(attn_mask.shape)) + " does not fit a sequence of "
                              + str(batch) + " x " + str(length) + " tokens")
    allowed = allowed.expand(batch, heads, queries, keys)
    key_valid = allowed.any(dim=2).any(dim=1)                         # key j is attended by some query
    if not check_values:
        return key_valid
    query_live = allowed.any(dim=3, keepdim=True)                     # query i attends to something
    if not torch.equal(allowed, key_valid[:, None, None, :] & query_live):
        raise MixerInputError(
            "attn_mask is not a key-padding mask (it differs between queries or heads, e.g. a causal pattern): "
            "mixers accept padding masks only; use is_causal=True with a causal mixer for causal masking"
        )
    return None if bool(key_valid.all()) else key_valid


def resolve_mixer_config(spec: MixerSpec, dim: int, options: Mapping[str, Any] | None = None,
                         host: Mapping[str, Any] | None = None) -> MixerConfig:
    """The mixer's validated config: ``dim``, then what timm's block asks for, then the user's ``options``.

    ``host`` holds timm's attention arguments (``num_heads``, ``qkv_bias``, ``proj_bias``, ``attn_drop``,
    ``qk_norm``, ``scale_norm``) plus ``seq_len`` (the model's token count, for ``max_seq_len``) and
    ``num_prefix_tokens``, forwarded by the rules of :mod:`mixer_plugins.backbones.options` (``proj_bias`` goes to
    ``out_bias``, not to the in/out projections of Hydra-style mixers).
    """
    options = dict(options or {})
    host = dict(host or {})
    facts = HostModel(
        dim=dim, num_heads=host.get("num_heads"), max_seq_len=host.get("seq_len"), qkv_bias=host.get("qkv_bias"),
        out_bias=host.get("proj_bias"), attn_drop=host.get("attn_drop"), qk_norm=host.get("qk_norm"),
        scale_norm=host.get("scale_norm"), num_prefix_tokens=host.get("num_prefix_tokens"),
        source="the timm model", override_hint="pass them in mixer_options to override",
    )
    max_len = spec.config.model_fields.get("max_seq_len")
    if max_len is not None and max_len.is_required() and "max_seq_len" not in options and facts.max_seq_len is None:
        raise MixerError(
            f"mixer {spec.name!r} is data-independent and needs the token count (max_seq_len), which timm's "
            "attn_layer hook does not pass. Build it with mixer_plugins.swap_mixer(model, "
            f"{spec.name!r}) or timm.create_model('vit_base', mixer={spec.name!r}) (which read the token count "
            "from the model), or pass max_seq_len explicitly"
        )
    config, _ = resolve_config(spec, facts, options)
    return config


class TimmMixerAttention(nn.Module):
    """A registered mixer behind timm's Attention interface (constructor, forward, ``proj``, ``init_weights``).

    Build it like timm's ``Attention`` plus ``mixer=`` (a registered name or alias) and ``mixer_options=``;
    subclasses made by :func:`attn_layer_class` carry the mixer name, which is how ``attn_layer='<name>'``
    works on timm's own ViT names. ``seq_len`` (the model's token count) sets ``max_seq_len`` for
    data-independent mixers; ``inherit_num_heads=False`` leaves the head count to the mixer's own default.

    The mixer is the submodule ``mixer``, so its parameters are ``blocks.{i}.attn.mixer.*``.
    """

    #: Mixer built when the constructor gets no ``mixer=``; set by :func:`attn_layer_class`.
    default_mixer: ClassVar[Optional[str]] = None
    # ``proj`` is a Python-side alias for timm's fix_init; TorchScript must not compile it.
    __jit_unused_properties__ = ["proj"]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.0,
            proj_drop: float = 0.0,
            norm_layer: Optional[type] = None,
            *,
            mixer: Optional[str] = None,
            mixer_options: Optional[Mapping[str, Any]] = None,
            seq_len: Optional[int] = None,
            num_prefix_tokens: int = 0,
            inherit_num_heads: bool = True,
            device: Any = None,
            dtype: Optional[torch.dtype] = None,
            **kwargs: Any,
    ) -> None:
        super().__init__()
        name = mixer or self.default_mixer
        if name is None:
            raise MixerError(
                "TimmMixerAttention needs a mixer: pass mixer='<name>', or use attn_layer='<name>' "
                "(a registered mixer name) instead of the bare class"
            )
        if not isinstance(name, str):
            raise TypeError(f"mixer must be a registered mixer name (str), got {type(name).__name__}")
        # Later timm versions may pass more constructor arguments; `depth` is DiffAttention's and harmless.
        ignored = {k: v for k, v in kwargs.items() if k != "depth" and v not in (None, False, 0, 0.0)}
        if ignored:
            warnings.warn(f"TimmMixerAttention ignores timm attention arguments it does not know: {ignored}",
                          UserWarning, stacklevel=2)
        spec = default_registry.get_spec(name)
        # What timm asked for, kept so a later swap_mixer builds the next mixer from the same arguments.
        self.host_arguments = {"num_heads": num_heads, "qkv_bias": qkv_bias, "qk_norm": qk_norm,
                               "scale_norm": scale_norm, "proj_bias": proj_bias, "attn_drop": attn_drop,
                               "proj_drop": proj_drop}
        host = dict(self.host_arguments, num_heads=num_heads if inherit_num_heads else None, seq_len=seq_len,
                    num_prefix_tokens=num_prefix_tokens)
        self.mixer_config = resolve_mixer_config(spec, dim, mixer_options, host)
        self.mixer_name: str = spec.name
        self.mixer_options = dict(mixer_options or {})
        self.num_heads: int = num_heads  # timm's head count (what a swap back to Attention would use)
        self.inherit_num_heads: bool = inherit_num_heads
        self.num_prefix_tokens: int = num_prefix_tokens
        self.seq_len: Optional[int] = seq_len
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.mixer = spec.build(self.mixer_config).to(dtype=dtype)
        self.causal: bool = bool(getattr(self.mixer, "causal", False))
        #: Check attn_mask's values in every forward (host syncs; off by default: shapes and dtype only).
        self.check_attn_mask: bool = False
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
            self,
            x: Tensor,
            attn_mask: Optional[Tensor] = None,
            is_causal: bool = False,
            rope: Optional[Tensor] = None,
            shared_rel_pos_bias: Optional[Tensor] = None,
    ) -> Tensor:
        if is_causal and not self.causal:
            raise MixerInputError(
                "mixer '" + self.mixer_name + "' is bidirectional and cannot run with is_causal=True; "
                "build a causal mixer (e.g. mixer_options={'causal': True} where the mixer has that option)"
            )
        mask = padding_mask_from_attn_mask(attn_mask, x.shape[0], x.shape[1], self.check_attn_mask)
        return self.proj_drop(self.mixer(x, mask=mask))

    @torch.jit.ignore
    def init_weights(self) -> None:
        """Re-draw the mixer's own initialisation (timm calls this after re-initialising every ``nn.Linear``):
        the mixer's ``reset_parameters()`` where it has one, else the state of a fresh mixer of the same config."""
        spec = default_registry.get_spec(self.mixer_name)
        reinitialize_mixer(self.mixer, lambda: spec.build(self.mixer_config))

    @property
    def proj(self) -> nn.Module:
        """The mixer's output projection (``proj`` or ``out_proj``); timm's ``fix_init`` rescales its weight."""
        for name in ("proj", "out_proj"):
            module = getattr(self.mixer, name, None)
            if isinstance(module, nn.Module):
                return module
        raise AttributeError(
            f"mixer {self.mixer_name!r} has no output projection named 'proj' or 'out_proj', which timm's "
            "fix_init=True rescales; build the model with fix_init=False"
        )

    @torch.jit.ignore
    def flops(self, batch: int, length: int) -> int:
        """Analytic FLOPs of the mixer at this batch size and token count (see ``MatrixMixer.flops``)."""
        mixer_flops = getattr(self.mixer, "flops", None)
        if not callable(mixer_flops):
            raise AttributeError(f"mixer {self.mixer_name!r} has no flops(batch, length) method")
        return int(mixer_flops(batch, length))

    def extra_repr(self) -> str:
        return f"mixer={self.mixer_name!r}, seq_len={self.seq_len}, num_prefix_tokens={self.num_prefix_tokens}"


register_notrace_module(TimmMixerAttention)  # FX: subclasses are leaves too (timm checks with isinstance)


class MixerOnlyBlock(nn.Module):
    """A pre-norm residual block with a token mixer and no MLP: ``x + drop_path(ls(attn(norm1(x))))``.

    Hydra's ImageNet ViT uses such blocks (twice as many, since the gated, expanded mixer also mixes channels).
    Takes timm's block arguments (``mlp_ratio``, ``mlp_layer``, ``act_layer`` are accepted and unused) and builds
    its mixer from ``attn_layer`` (a class, or a key of timm's ``ATTN_LAYERS`` such as a mixer name).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.0,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_attn_norm: bool = False,
            scale_mlp_norm: bool = False,
            proj_bias: bool = True,
            proj_drop: float = 0.0,
            attn_drop: float = 0.0,
            init_values: Optional[float] = None,
            drop_path: float = 0.0,
            act_layer: Optional[type] = None,
            norm_layer: type = LayerNorm,
            mlp_layer: Optional[type] = None,
            attn_layer: Any = TimmMixerAttention,
            depth: int = 0,
            device: Any = None,
            dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if isinstance(attn_layer, str):
            from timm.models.vision_transformer import ATTN_LAYERS

            if attn_layer not in ATTN_LAYERS:
                raise MixerError(f"unknown attn_layer {attn_layer!r}; known: {sorted(ATTN_LAYERS)}")
            attn_layer = ATTN_LAYERS[attn_layer]
        self.norm1 = norm_layer(dim, **dd)
        self.attn = attn_layer(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, scale_norm=scale_attn_norm,
            proj_bias=proj_bias, attn_drop=attn_drop, proj_drop=proj_drop, norm_layer=norm_layer, **dd,
        )
        self.ls1 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        return x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))


# -- attn_layer='<mixer name>' on timm's own names ---------------------------------------------------------------

def attn_layer_class(name: str) -> type[TimmMixerAttention]:
    """A :class:`TimmMixerAttention` subclass bound to mixer ``name`` (usable as timm's ``attn_layer=``).

    Classes are cached in this module under ``TimmMixerAttention_<name>``, so models holding them pickle and
    unpickle like any other module (after ``import mixer_plugins``).
    """
    cls_name = f"TimmMixerAttention_{name}"
    if cls_name not in globals():
        globals()[cls_name] = type(cls_name, (TimmMixerAttention,), {
            "default_mixer": name, "__module__": __name__, "__qualname__": cls_name,
            "__doc__": f"TimmMixerAttention building mixer {name!r} (timm attn_layer={name!r}).",
        })
    return globals()[cls_name]


def _add_keys(spec: MixerSpec | str) -> list[str]:
    """Bind ``spec``'s name and aliases (or a bare name) to its class in timm's ``ATTN_LAYERS``, unless timm (or
    another library) owns the key; returns the keys added."""
    from timm.models.vision_transformer import ATTN_LAYERS

    name, aliases = (spec, ()) if isinstance(spec, str) else (spec.name, spec.aliases)
    cls, added = attn_layer_class(name), []
    for key in (name, *aliases):
        current = ATTN_LAYERS.get(key)
        if current is not None and not (isinstance(current, type) and issubclass(current, TimmMixerAttention)):
            warnings.warn(f"timm already has an attn_layer named {key!r}; mixer {name!r} is not registered under "
                          "it (use swap_mixer or mixer-plugins' vit_* names instead)", UserWarning, stacklevel=3)
        elif current is not cls:
            ATTN_LAYERS[key] = cls
            added.append(key)
    return added


def _on_registry_event(event: str, spec: MixerSpec) -> None:
    """Registry listener: keep ``ATTN_LAYERS`` in step with in-process ``register_mixer``/``unregister_mixer``."""
    from timm.models.vision_transformer import ATTN_LAYERS

    if event == "register":
        _add_keys(spec)
    elif event == "unregister":
        for key in (spec.name, *spec.aliases):
            if ATTN_LAYERS.get(key) is globals().get(f"TimmMixerAttention_{spec.name}"):
                del ATTN_LAYERS[key]


def register_attn_layers(names: list[str] | None = None) -> list[str]:
    """Make ``attn_layer='<mixer name or alias>'`` work in timm (keys of ``vision_transformer.ATTN_LAYERS``).

    Each mixer (default: every registered one) gets its name and aliases, all bound to the name's class; a plugin
    that fails to load keeps its name (building it raises the load error). timm's own keys are never overwritten.
    Subscribes to the registry, so mixers registered (or unregistered) later get (or lose) their keys at once.
    Returns the keys added.
    """
    added: list[str] = []
    for name in names if names is not None else default_registry.names():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MixerPluginWarning)  # reported when the mixer is used
                added += _add_keys(default_registry.get_spec(name))
        except MixerError:
            added += _add_keys(name)
    default_registry.add_listener(_on_registry_event)
    return added
