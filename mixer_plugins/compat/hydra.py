"""A drop-in for the released Hydra module, and a converter for the released matrix-mixer checkpoints.

:class:`Hydra` takes the released ``Hydra.__init__`` arguments (``hydra/modules/hydra.py``), has its ``state_dict``
keys (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``fc_D``, ``norm``, ``out_proj``, ``init_states``) and
computes the same function: it *is* our :class:`~mixer_plugins.mixers.quasiseparable.QuasiseparableMixer` (Hydra's
generators, one O(L) pass for both directions), with the keys renamed on save and load. The in_proj channel order
is the same as the released one (``z, x, B_f, C_f, B_b, C_b, dt_f, dt_b``), so no weight is permuted.

Differences from the released module, all deliberate:

* ``seq_idx`` (packed sequences) is refused: the released module forwards a (B, L) ``seq_idx`` to a kernel that
  needs (2B, L), and its roll-based shift crosses segment boundaries (see the design note); pass ``mask=`` for
  right-padded batches instead (the released code has no masking).
* ``use_mem_eff_path`` is accepted and ignored: it changes memory use, not the result.
* ``A_log`` starts at 0 (``A = -1``) as in the released code, which has no ``A_init_range`` argument.

:func:`convert_matrix_mixer_state_dict` maps the released ``MatrixMixer`` checkpoints (``matrix_mixer.*`` keys) to
ours; the one layout that changes is the data-independent Toeplitz kernel, stored by the released code rotated by
one offset (``m_ij = c[(i - j + Lmax) mod (2 Lmax - 1)]``): ours holds offsets ``-(L-1) .. L-1`` in order, so the
converter rolls the taps by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import MixerInputError
from ..mixers.quasiseparable import QuasiseparableConfig, QuasiseparableMixer

__all__ = ["Hydra", "convert_matrix_mixer_state_dict", "HYDRA_KEY_MAP"]

#: Our parameter names -> the released Hydra module's (the others are the same in both).
HYDRA_KEY_MAP: dict[str, str] = {"ssm.A_log": "A_log", "ssm.dt_bias": "dt_bias", "ssm.D": "D"}


class Hydra(QuasiseparableMixer):
    """The released ``Hydra`` module's constructor and ``state_dict``, computed by our quasiseparable mixer.

    Arguments are the released ones (``headdim``, ``bias`` etc. keep its names); ``activation`` must be ``"silu"``
    or ``"swish"`` (the released code asserts the same). ``forward(u)`` maps (batch, length, d_model) to the same
    shape; ``mask=`` (bool (batch, length), right-padded) is our addition. Its ``state_dict`` has exactly the released
    keys: unlike our mixers it records no name and options (so it does not check them on load either).
    """

    # The released key set: no extra-state record.
    get_extra_state = torch.nn.Module.get_extra_state
    set_extra_state = torch.nn.Module.set_extra_state

    def __init__(self, d_model: int, d_state: int = 64, d_conv: int = 7, conv_init: Optional[float] = None,
                 expand: int = 2, headdim: int = 64, ngroups: int = 1, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit: tuple[float, float] = (0.0, float("inf")),
                 learnable_init_states: bool = False, activation: str = "swish", bias: bool = False,
                 conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = False,
                 layer_idx: Optional[int] = None, device: Any = None, dtype: Optional[torch.dtype] = None):
        if activation not in ("silu", "swish"):
            raise ValueError(f"Hydra supports activation 'silu' or 'swish' (as the released code), got {activation!r}")
        config = QuasiseparableConfig(
            dim=d_model, d_state=d_state, d_conv=d_conv, conv_init=conv_init, expand=expand, head_dim=headdim,
            ngroups=ngroups, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor, dt_limit=tuple(dt_limit),
            learnable_init_states=learnable_init_states, proj_bias=bias, conv_bias=conv_bias, chunk_size=chunk_size,
            A_init_range=(1.0, 1.0), norm_eps=1e-5, norm_before_gate=True,
        )
        super().__init__(config)
        self.d_model, self.d_state, self.d_conv, self.conv_init = d_model, d_state, d_conv, conv_init
        self.expand, self.headdim, self.ngroups = expand, headdim, ngroups
        self.nheads = self.scan_heads
        self.dt_limit = tuple(dt_limit)
        self.learnable_init_states = learnable_init_states
        self.activation = activation
        self.use_mem_eff_path = use_mem_eff_path
        self.layer_idx = layer_idx
        self._register_state_dict_hook(_to_released_keys)
        self._register_load_state_dict_pre_hook(_from_released_keys, with_module=False)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    @property
    def A_log(self) -> torch.nn.Parameter:
        """The released name of ``ssm.A_log``."""
        return self.ssm.A_log

    @property
    def dt_bias(self) -> torch.nn.Parameter:
        """The released name of ``ssm.dt_bias``."""
        return self.ssm.dt_bias

    @property
    def D(self) -> torch.nn.Parameter:
        """The released name of ``ssm.D``."""
        return self.ssm.D

    def forward(self, u: Tensor, seq_idx: Optional[Tensor] = None, *, mask: Optional[Tensor] = None) -> Tensor:
        if seq_idx is not None:
            raise MixerInputError(
                "Hydra: seq_idx (packed sequences) is not supported: the released module mixes segments through "
                "its shift and backward scan; pass right-padded rows with mask= instead"
            )
        return super().forward(u, mask=mask)


def _to_released_keys(module, state_dict, prefix, local_metadata):
    for ours, theirs in HYDRA_KEY_MAP.items():
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = state_dict.pop(prefix + ours)
    return state_dict


def _from_released_keys(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for ours, theirs in HYDRA_KEY_MAP.items():
        if prefix + theirs in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)


# -- the released matrix mixers ---------------------------------------------------------------------------------------

_BLOCK_KEYS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "norm.weight", "out_proj.weight",
               "out_proj.bias")
_MIXER_KEYS: dict[str, dict[str, str]] = {
    "toeplitz": {"conv_params": "taps"},
    "quasiseparable": {"A_log": "ssm.A_log", "dt_bias": "ssm.dt_bias", "D": "ssm.D", "fc_D.weight": "fc_D.weight",
                       "BC": "BC"},
}


def roll_released_toeplitz_taps(conv_params: Tensor) -> Tensor:
    """The released data-independent Toeplitz kernel (heads, 2 Lmax - 1), read as ``m_ij = c[(i - j + Lmax) mod K]``,
    in our layout (offsets ``-(Lmax-1) .. Lmax-1`` in order): ``roll(c, -1)``."""
    return torch.roll(conv_params, shifts=-1, dims=-1)


def convert_matrix_mixer_state_dict(state_dict: Mapping[str, Tensor], matrix_mixer_type: str, *,
                                    is_data_dependent: bool = True) -> dict[str, Tensor]:
    """A released ``MatrixMixer`` ``state_dict`` (``hydra/modules/matrix_mixer.py``) in our mixer's layout.

    Supported: ``"quasiseparable"`` (load into ``quasiseparable`` with ``shared_bc=True``, ``d_state = heads *
    qk_dim``, ``ngroups=1``; ``data_dependent=False`` for the DI form) and the data-independent ``"toeplitz"``
    (load into ``toeplitz`` with ``data_dependent=False``; its taps are rolled by one, see
    :func:`roll_released_toeplitz_taps`). The data-dependent Toeplitz checkpoint has no exact image: the released
    code builds its kernel rotated by one offset from per-token projections, which no weight permutation undoes;
    it raises. Unknown keys raise rather than load silently.
    """
    if matrix_mixer_type not in _MIXER_KEYS:
        raise ValueError(f"no converter for the released {matrix_mixer_type!r} matrix mixer; supported: "
                         f"{sorted(_MIXER_KEYS)}")
    if matrix_mixer_type == "toeplitz" and is_data_dependent:
        raise ValueError(
            "the released data-dependent Toeplitz mixer reads its kernel rotated by one offset from the per-token "
            "taps (tap delta from token delta+1); our paper-exact layout cannot reproduce it by permuting weights"
        )
    names = _MIXER_KEYS[matrix_mixer_type]
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key in _BLOCK_KEYS:
            out[key] = value
        elif key.startswith("matrix_mixer.") and key[len("matrix_mixer."):] in names:
            local = key[len("matrix_mixer."):]
            if matrix_mixer_type == "toeplitz" and local == "conv_params":
                value = roll_released_toeplitz_taps(value)
            out[names[local]] = value
        else:
            raise KeyError(f"unexpected key {key!r} in a released {matrix_mixer_type} matrix-mixer state_dict")
    return out
