"""Any registered mixer behind fairseq2's ``MultiheadAttention`` contract (self-attention only).

* **Padding**: fairseq2's :class:`~fairseq2.nn.BatchLayout` is always right-padded, so our mask (True on real tokens)
  is ``position_indices >= 0``; unpadded batches pass ``mask=None``. **Packed** batches are gathered into a padded
  batch, mixed with a mask and scattered back (tokens after the last sequence get zero).
* **Incremental decoding** (``state_bag``, eval mode, as fairseq2's own attention): a causal mixer keeps a
  :class:`MixerDecodingState` (its :class:`~mixer_plugins.mixers.cache.MixerCache` of ``state_bag.max_num_steps``
  tokens: ``prefill``, then ``step``; beam search reorders it), or, without a step, a :class:`RecomputeState` that
  reruns the whole prefix per call. Bidirectional mixers and cross-attention raise ``NotSupportedError``.
* **Attention-weight hooks** receive the mixer's materialized matrix ``(N, H, S, S)``.
* **Meta device**: a mixer whose constructor cannot run on meta is built on CPU and moved there; its
  non-persistent buffers are recomputed in ``reset_non_persistent_buffers``.
"""

from __future__ import annotations

import torch
from fairseq2.error import NotSupportedError
from fairseq2.models.transformer import AttentionBiasCache, MultiheadAttention
from fairseq2.nn import BatchLayout, IncrementalState, IncrementalStateBag
from torch import Tensor, nn

from mixer_plugins.mixers.base import MatrixMixer
from mixer_plugins.mixers.cache import MixerCache
from mixer_plugins.registry import MixerConfig, MixerError, MixerSpec

from ..reinit import reinitialize_mixer
from .options import ResolvedMixer, resolve_mixer

__all__ = ["MixerAttention", "MixerDecodingState", "RecomputeState", "unpack_layout", "padding_mask"]


def padding_mask(seqs_layout: BatchLayout) -> Tensor | None:
    """Our bool mask (True on real tokens) for a padded layout, or ``None`` when nothing is padded."""
    if seqs_layout.packed:
        raise NotSupportedError("padding_mask() takes a padded (2-D) layout; use unpack_layout() for packed ones")
    if not seqs_layout.padded:
        return None
    return seqs_layout.position_indices >= 0


def unpack_layout(seqs_layout: BatchLayout, device: torch.device) -> tuple[Tensor, Tensor]:
    """For a packed layout: ``index`` (N, W) into the packed tokens and ``mask`` (N, W), W = longest sequence.

    ``packed[index]`` is the right-padded batch (pad slots point at a valid token and must be masked).
    """
    if not seqs_layout.packed:
        raise NotSupportedError("unpack_layout() takes a packed layout; use padding_mask() for padded ones")
    lens = seqs_layout.seq_lens_pt.to(device=device, dtype=torch.long)
    begins = seqs_layout.seq_begin_indices_pt[:-1].to(device=device, dtype=torch.long)
    width = max(seqs_layout.seq_lens)
    steps = torch.arange(width, device=device)
    mask = steps[None, :] < lens[:, None]
    index = torch.where(mask, begins[:, None] + steps[None, :], begins[:, None])
    return index, mask


def _build_on_any_device(spec: MixerSpec, config: MixerConfig) -> nn.Module:
    """``spec.build(config)``; on the meta device, fall back to building on CPU and moving to meta."""
    try:
        return spec.build(config)
    except MixerError:
        raise
    except Exception:
        if torch.get_default_device().type != "meta":
            raise
    # Some constructors compute values (e.g. .item(), numpy) that the meta device cannot give. fairseq2 only
    # needs shapes here: the real values come from the checkpoint that is loaded next.
    with torch.device("cpu"):
        module = spec.build(config)
    return module.to("meta")


class MixerDecodingState(IncrementalState):
    """fairseq2's incremental state of a mixer that steps: its :class:`~mixer_plugins.mixers.cache.MixerCache`."""

    def __init__(self, cache: MixerCache) -> None:
        self.cache = cache

    def step(self, mixer: nn.Module, seqs: Tensor) -> Tensor:
        assert isinstance(mixer, MatrixMixer), "a decoding state is made for a mixer that steps"
        return mixer.step(seqs, self.cache)

    def reorder(self, new_order: Tensor) -> None:
        self.cache.reorder(new_order)

    def size_bytes(self) -> int:
        return self.cache.nbytes()

    def capacity_bytes(self) -> int:
        return self.cache.nbytes()


class RecomputeState(IncrementalState):
    """fairseq2's incremental state of a causal mixer without a step: the inputs so far (batch, capacity, dim);
    each call writes the new tokens after each row's own and reruns the mixer over the whole prefix."""

    def __init__(self, seqs: Tensor, mask: Tensor | None, capacity: int) -> None:
        b, length, dim = seqs.shape
        self.inputs = seqs.new_zeros(b, capacity, dim)
        self.inputs[:, :length] = seqs.detach()
        self.lengths = (mask.sum(dim=1) if mask is not None
                        else torch.full((b,), length, dtype=torch.long, device=seqs.device))
        self.offset = length

    def step(self, mixer: nn.Module, seqs: Tensor) -> Tensor:
        b, t, dim = seqs.shape
        if self.offset + t > self.inputs.shape[1]:
            raise NotSupportedError(f"the incremental state holds {self.inputs.shape[1]} tokens; {self.offset} were "
                                    f"given and {t} more do not fit")
        positions = self.lengths[:, None] + torch.arange(t, device=seqs.device)
        index = positions[..., None].expand(b, t, dim)
        self.inputs.scatter_(1, index, seqs.detach().to(self.inputs.dtype))
        self.lengths = self.lengths + t
        self.offset += t
        width = self.offset
        mask = torch.arange(width, device=seqs.device)[None, :] < self.lengths[:, None]
        return mixer(self.inputs[:, :width], mask=mask).gather(1, index)

    def reorder(self, new_order: Tensor) -> None:
        self.inputs = self.inputs.index_select(0, new_order)
        self.lengths = self.lengths.index_select(0, new_order)

    def size_bytes(self) -> int:
        return self.offset * self.inputs.shape[0] * self.inputs.shape[2] * self.inputs.element_size()

    def capacity_bytes(self) -> int:
        return self.inputs.numel() * self.inputs.element_size()


class MixerAttention(MultiheadAttention):
    """A registered mixer as the self-attention of a fairseq2 Transformer layer.

    Build it from a :class:`~mixer_plugins.backbones.fairseq2.options.ResolvedMixer` (what
    :func:`~mixer_plugins.backbones.fairseq2.options.resolve_mixer` returns); each instance owns its own mixer,
    available as ``.mixer``.
    """

    def __init__(self, resolved: ResolvedMixer) -> None:
        super().__init__()
        self._spec = resolved.spec
        self._config = resolved.config
        self.mixer_name = resolved.spec.name
        self.mixer = _build_on_any_device(resolved.spec, resolved.config)
        self.model_dim = resolved.config.dim

    @classmethod
    def create(cls, mixer: str, model_dim: int, **options: object) -> MixerAttention:
        """Build from a mixer name and its options, e.g. to replace ``layer.self_attn`` of a model by hand::

            layer.self_attn = MixerAttention.create("quasi", 512, d_state=32)

        Options are validated by the registry (``UnknownMixerError``, ``InvalidMixerOptions``). Mixers that
        can run either way get ``causal=False`` (encoder self-attention) unless ``causal`` is given.
        """
        return cls(resolve_mixer(mixer, {mixer: options}, dim=model_dim))

    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        keys: Tensor,
        keys_layout: BatchLayout,
        values: Tensor,
        bias_cache: AttentionBiasCache,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        """Mix ``seqs`` (N, S, M) — or (T, M) for a packed layout — and return the same shape.

        With ``state_bag`` (eval mode): the next tokens of an incremental decoding (see the module docstring).
        """
        if state_bag is not None and not self.mixer.causal:
            raise NotSupportedError(
                f"mixer {self.mixer_name!r} is bidirectional: incremental decoding (state_bag) needs a causal mixer"
            )
        if keys is not seqs or values is not seqs or keys_layout is not seqs_layout:
            raise NotSupportedError(
                f"mixer {self.mixer_name!r} replaces self-attention only: keys and values must be the queries "
                "themselves (cross-attention is not supported)"
            )
        if state_bag is not None and not self.training:
            return self._forward_incremental(seqs, seqs_layout, state_bag)
        if seqs_layout.packed:
            return self._forward_packed(seqs, seqs_layout)
        mask = padding_mask(seqs_layout)
        out = self.mixer(seqs, mask=mask)
        if self._attn_weight_hooks:
            self._run_hooks(out, seqs, mask)
        return out

    def _forward_incremental(self, seqs: Tensor, seqs_layout: BatchLayout, state_bag: IncrementalStateBag) -> Tensor:
        if seqs_layout.packed:
            raise NotSupportedError("incremental decoding takes a padded (2-D) batch, not a packed one")
        state = state_bag.maybe_get_state(self, IncrementalState)
        if state is None:
            mask = padding_mask(seqs_layout)
            capacity = max(state_bag.max_num_steps, seqs.shape[1])
            if isinstance(self.mixer, MatrixMixer) and self.mixer.can_step:
                cache = self.mixer.allocate_cache(seqs.shape[0], capacity)
                out = self.mixer.prefill(seqs, cache, mask=mask)
                state_bag.set_state(self, MixerDecodingState(cache))
            else:
                out = self.mixer(seqs, mask=mask)
                state_bag.set_state(self, RecomputeState(seqs, mask, capacity))
            return out
        if seqs_layout.padded:
            raise NotSupportedError("incremental decoding: only the first call (the prompt) may be padded; later "
                                    "calls give the same number of new tokens for every row")
        if not isinstance(state, (MixerDecodingState, RecomputeState)):
            raise NotSupportedError(f"the state bag holds a {type(state).__name__} for this module, not a mixer's")
        return state.step(self.mixer, seqs)

    def _forward_packed(self, seqs: Tensor, seqs_layout: BatchLayout) -> Tensor:
        if seqs.dim() != 2:
            raise NotSupportedError(
                f"a packed layout needs (tokens, model_dim) inputs, got shape {tuple(seqs.shape)}"
            )
        index, mask = unpack_layout(seqs_layout, seqs.device)
        padded = seqs[index].masked_fill(~mask[..., None], 0.0)
        mixed = self.mixer(padded, mask=mask)
        if self._attn_weight_hooks:
            self._run_hooks(mixed, padded, mask)
        # Scatter the real positions back; tokens after the last sequence stay zero.
        return torch.zeros_like(seqs).index_put((index[mask],), mixed[mask])

    def _run_hooks(self, out: Tensor, seqs: Tensor, mask: Tensor | None) -> None:
        materialize = getattr(self.mixer, "materialize", None)
        if materialize is None:
            raise NotSupportedError(f"mixer {self.mixer_name!r} has no materialize(): it cannot report attention "
                                    "weights to the hooks")
        weights = materialize(seqs, mask=mask)  # NotMaterializableError for non-linear mixers
        for hook in self._attn_weight_hooks.values():
            hook(self, out, weights)

    def reset_parameters(self) -> None:
        """Re-draw the mixer's own initialisation (fairseq2 calls this when it materialises a meta-device model
        without a checkpoint): the mixer's ``reset_parameters()`` where it has one, else the state of a fresh
        mixer of the same config."""
        reinitialize_mixer(self.mixer, lambda: self._spec.build(self._config))

    def reset_non_persistent_buffers(self) -> None:
        """Recompute the mixer's non-persistent buffers (called by fairseq2 after a meta-device load).

        They are not in checkpoints, so they must be a function of the mixer's config: a fresh CPU instance of
        the same config has the right values.
        """
        modules = dict(self.mixer.named_modules())
        # the buffers that hold values (not those still on the meta device: shapes only, nothing to fill)
        targets = [(name, buf) for name, sub in modules.items() for buf in sub._non_persistent_buffers_set
                   if sub._buffers.get(buf) is not None and sub._buffers[buf].device.type != "meta"]
        if not targets:
            return
        with torch.device("cpu"):
            fresh = dict(self._spec.build(self._config).named_modules())
        with torch.no_grad():
            for name, buf in targets:
                current = modules[name]._buffers[buf]
                current.copy_(fresh[name]._buffers[buf].to(current.device, current.dtype))

    def extra_repr(self) -> str:
        return f"mixer={self.mixer_name!r}, model_dim={self.model_dim}"
