"""A drop-in for the released Mamba-2 module (``mamba_ssm.modules.mamba2.Mamba2``), generation included.

:class:`Mamba2` takes the released constructor's arguments, has its ``state_dict`` keys (``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``) and its inference API: ``allocate_inference_cache(batch_size,
max_seqlen, dtype=None)`` returns ``(conv_state, ssm_state)`` in the released layouts ((batch, conv_dim, d_conv) and
(batch, nheads, headdim, d_state)), ``step(hidden_states, conv_state, ssm_state)`` updates them in place and returns
``(out, conv_state, ssm_state)``, and ``forward(u, inference_params=...)`` prefills the states of
``inference_params.key_value_memory_dict[layer_idx]`` (``seqlen_offset == 0``) or steps them (``> 0``).

It computes the released function because it *is* our
:class:`~mixer_plugins.mixers.semiseparable.SemiseparableMixer` (the same block: ``in_proj`` to ``[z0, x0, z, xBC,
dt]``, causal depthwise conv + SiLU on ``xBC``, the SSD scan with ``dt = softplus(dt + dt_bias)`` clamped to
``dt_limit`` and the ``D`` skip, the gated RMSNorm per group of ``d_ssm / ngroups`` channels or the gate alone, the MLP
branch in front, ``out_proj``), with the SSM parameters' keys renamed on save and load. So it is also a full mixer:
``mask=`` for right-padded rows, ``materialize`` (except with ``D_has_hdim``) and the library's own decoding API
(``allocate_cache``/``prefill``/``step(x, cache)``).

Differences from the released module, all deliberate:

* ``A = -exp(A_log)`` is computed in the parameters' dtype (float32 for half-precision parameters); the released code
  always rounds it to float32, which in a float64 model changes the result at the 1e-8 level.
* ``dt_limit`` applies in ``step`` too (the released pure-PyTorch step ignores it, so its steps and its forward
  differ when a limit is set).
* ``seq_idx`` and ``cu_seqlens`` (packed sequences) are refused: pass right-padded rows with ``mask=``;
  ``process_group`` (tensor parallelism) is refused; ``use_mem_eff_path`` and ``sequence_parallel`` are accepted and
  change nothing (they choose kernels, not results).
* ``step`` takes one or several tokens (the released one asserts a single token).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..errors import MixerInputError
from ..mixers.cache import MixerCache
from ..mixers.semiseparable import SemiseparableConfig, SemiseparableMixer
from .hydra import use_released_keys

__all__ = ["Mamba2"]


class Mamba2(SemiseparableMixer):
    """The released ``Mamba2`` module's constructor, ``state_dict`` and inference API, computed by our semiseparable
    mixer.

    ``forward(u)`` maps (batch, length, d_model) to the same shape (``seqlen=`` for a flattened (batch * seqlen,
    d_model) input, as released); ``mask=`` (bool (batch, length), right-padded) is our addition. Its ``state_dict``
    has exactly the released keys (no mixer record).
    """

    # The released key set: no extra-state record.
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, conv_init: Optional[float] = None,
                 expand: int = 2, headdim: int = 64, d_ssm: Optional[int] = None, ngroups: int = 1,
                 A_init_range: tuple[float, float] = (1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit: tuple[float, float] = (0.0, float("inf")), bias: bool = False,
                 conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = True,
                 layer_idx: Optional[int] = None, process_group: Any = None, sequence_parallel: bool = True,
                 device: Any = None, dtype: Optional[torch.dtype] = None):
        if process_group is not None:
            raise ValueError("Mamba2: process_group (tensor parallelism) is not supported; build it without one")
        if (expand * d_model if d_ssm is None else d_ssm) % headdim:
            raise ValueError(f"Mamba2: the SSM width (d_ssm, or expand * d_model) must be a multiple of headdim "
                             f"({headdim})")
        config = SemiseparableConfig(
            dim=d_model, d_state=d_state, d_conv=d_conv, conv_init=conv_init, expand=expand, head_dim=headdim,
            d_ssm=d_ssm, ngroups=ngroups, A_init_range=(float(A_init_range[0]), float(A_init_range[1])),
            D_has_hdim=D_has_hdim, rmsnorm=rmsnorm, norm_before_gate=norm_before_gate, norm_per_group=True,
            norm_eps=1e-5, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor,
            dt_limit=(float(dt_limit[0]), float(dt_limit[1])), proj_bias=bias, conv_bias=conv_bias,
            chunk_size=chunk_size,
        )
        super().__init__(config)
        # the released attributes
        self.d_model, self.d_conv, self.conv_init = d_model, d_conv, conv_init
        self.expand, self.headdim = expand, headdim
        self.d_inner, self.d_ssm, self.d_mlp = expand * d_model, config.d_inner, config.mlp_width
        self.nheads, self.conv_dim = self.num_heads, config.d_inner + 2 * ngroups * d_state
        self.rmsnorm, self.norm_before_gate = rmsnorm, norm_before_gate
        self.dt_limit = config.dt_limit
        self.activation = "silu"
        self.use_mem_eff_path, self.sequence_parallel, self.layer_idx = use_mem_eff_path, sequence_parallel, layer_idx
        use_released_keys(self)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    @property
    def A_log(self) -> nn.Parameter:
        """The released name of ``ssm.A_log``."""
        return self.ssm.A_log

    @property
    def dt_bias(self) -> nn.Parameter:
        """The released name of ``ssm.dt_bias``."""
        return self.ssm.dt_bias

    @property
    def D(self) -> nn.Parameter:
        """The released name of ``ssm.D``."""
        assert self.ssm.D is not None, "the SSD mixer has a skip"
        return self.ssm.D

    # the released module's signature (its second argument is seqlen, not the contract's mask)
    def forward(self, u: Tensor, seqlen: Optional[int] = None, seq_idx: Optional[Tensor] = None,  # type: ignore[override]
                cu_seqlens: Optional[Tensor] = None, inference_params: Any = None, *,
                mask: Optional[Tensor] = None) -> Tensor:
        """(batch, length, d_model) -> same shape; ``seqlen``: ``u`` is (batch * seqlen, d_model), as released.

        With ``inference_params`` (an object with ``key_value_memory_dict`` and ``seqlen_offset``, as mamba-ssm's
        ``InferenceParams``): ``seqlen_offset == 0`` runs the prompt and fills this layer's
        ``(conv_state, ssm_state)`` (allocated on first use), ``> 0`` steps them.
        """
        if seq_idx is not None or cu_seqlens is not None:
            raise MixerInputError(
                "Mamba2: seq_idx / cu_seqlens (packed sequences) are not supported; pass right-padded rows with "
                "mask= instead"
            )
        flat = seqlen is not None
        if seqlen is not None:
            if u.dim() != 2 or u.shape[0] % seqlen:
                raise MixerInputError(f"Mamba2: with seqlen={seqlen}, u must be (batch * seqlen, d_model), got shape "
                                      f"{tuple(u.shape)}")
            u = u.unflatten(0, (-1, seqlen))
        if inference_params is None:
            out = super().forward(u, mask=mask)
        else:
            out = self._forward_inference(u, inference_params, mask)
        return out.flatten(0, 1) if flat else out

    def _forward_inference(self, u: Tensor, inference_params: Any, mask: Tensor | None) -> Tensor:
        if self.layer_idx is None:
            raise ValueError("Mamba2: inference_params needs the layer's layer_idx (its key in "
                             "key_value_memory_dict); build the module with layer_idx=")
        states = inference_params.key_value_memory_dict
        if self.layer_idx not in states:
            states[self.layer_idx] = self.allocate_inference_cache(u.shape[0], 0)
        conv_state, ssm_state = states[self.layer_idx]
        if inference_params.seqlen_offset > 0:
            return self.step(u, conv_state, ssm_state)[0]
        return self.prefill(u, self._wrap(conv_state, ssm_state, u.shape[1]), mask=mask)

    # -- the released inference API ---------------------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: Optional[torch.dtype] = None,
                                 **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Zero ``(conv_state, ssm_state)``: (batch, conv_dim, d_conv) (a transposed view of a (batch, d_conv,
        conv_dim) buffer, as released) and (batch, nheads, headdim, d_state). ``max_seqlen`` is unused (the states do
        not grow)."""
        device = self.out_proj.weight.device
        assert self.conv1d is not None, "the SSD block has a short convolution"
        conv_state = torch.zeros(batch_size, self.d_conv, self.conv_dim, device=device,
                                 dtype=self.conv1d.weight.dtype if dtype is None else dtype).transpose(1, 2)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=self.in_proj.weight.dtype if dtype is None else dtype)
        return conv_state, ssm_state

    # The released signature, which also takes the contract's (x, cache): wider than the mixer's step.
    def step(  # type: ignore[override]
        self, hidden_states: Tensor, conv_state: Tensor | MixerCache, ssm_state: Optional[Tensor] = None
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """The released ``step(hidden_states, conv_state, ssm_state) -> (out, conv_state, ssm_state)``: new tokens
        (batch, t, d_model) against the states, which are updated in place.

        Called as ``step(x, cache)`` with a :class:`~mixer_plugins.mixers.cache.MixerCache` it is the mixer
        contract's step (see :class:`~mixer_plugins.MatrixMixer`).
        """
        if ssm_state is None and isinstance(conv_state, MixerCache):
            return super().step(hidden_states, conv_state)
        if ssm_state is None or isinstance(conv_state, MixerCache):
            raise TypeError("Mamba2.step takes (hidden_states, conv_state, ssm_state), or (x, cache) with a MixerCache")
        cache = self._wrap(conv_state, ssm_state, hidden_states.shape[1])
        return super().step(hidden_states, cache), conv_state, ssm_state

    def _wrap(self, conv_state: Tensor, ssm_state: Tensor, tokens: int) -> MixerCache:
        """The released states as a cache of this module (the states are shared, not copied)."""
        b = conv_state.shape[0]
        for name, state, shape in (("conv_state", conv_state, (b, self.conv_dim, self.d_conv)),
                                   ("ssm_state", ssm_state, (b, self.nheads, self.headdim, self.d_state))):
            if tuple(state.shape) != shape:
                raise MixerInputError(f"Mamba2: {name} must be {shape}, got {tuple(state.shape)}")
        device = conv_state.device
        return MixerCache(lengths=torch.zeros(b, dtype=torch.long, device=device),
                          poisoned=torch.zeros(b, dtype=torch.bool, device=device), max_len=tokens,
                          state={"conv": conv_state, "ssm": ssm_state}, owner=self._owner_key())

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, expand={self.expand}, "
                f"headdim={self.headdim}, d_ssm={self.d_ssm}, ngroups={self.ngroups}, rmsnorm={self.rmsnorm}")
