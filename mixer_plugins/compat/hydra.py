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

:func:`convert_matrix_mixer_state_dict` maps the released ``MatrixMixer`` checkpoints (``matrix_mixer.*`` keys) of every
type to ours (:func:`matrix_mixer_options` gives the mixer and options to load them into). The data-independent
Toeplitz kernel is stored by the released code rotated by one offset (``m_ij = c[(i - j + Lmax) mod (2 Lmax - 1)]``):
ours holds offsets ``-(L-1) .. L-1`` in order, so the converter rolls the taps by one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import MixerInputError
from ..mixers.quasiseparable import QuasiseparableConfig, QuasiseparableMixer

__all__ = ["Hydra", "convert_matrix_mixer_state_dict", "matrix_mixer_options", "HYDRA_KEY_MAP", "NO_SHIFT_RAW"]

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
            ngroups=ngroups, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor, dt_limit=dt_limit,
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
        use_released_keys(self)
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
        assert self.ssm.D is not None, "Hydra's diagonal has D"
        return self.ssm.D

    # the released module's signature (its second argument is seq_idx, not the contract's mask)
    def forward(self, u: Tensor, seq_idx: Optional[Tensor] = None, *,  # type: ignore[override]
                mask: Optional[Tensor] = None) -> Tensor:
        if seq_idx is not None:
            raise MixerInputError(
                "Hydra: seq_idx (packed sequences) is not supported: the released module mixes segments through "
                "its shift and backward scan; pass right-padded rows with mask= instead"
            )
        return super().forward(u, mask=mask)


def use_released_keys(module: torch.nn.Module) -> None:
    """Save and load ``module``'s SSM parameters under the released names (:data:`HYDRA_KEY_MAP`; Hydra and
    Mamba-2 share them)."""
    module._register_state_dict_hook(_to_released_keys)
    module._register_load_state_dict_pre_hook(_from_released_keys, with_module=False)


def _to_released_keys(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: dict[str, Any]) -> dict[str, Any]:
    for ours, theirs in HYDRA_KEY_MAP.items():
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = state_dict.pop(prefix + ours)
    return state_dict


def _from_released_keys(state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
                        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    for ours, theirs in HYDRA_KEY_MAP.items():
        if prefix + theirs in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)


# -- the released matrix mixers ---------------------------------------------------------------------------------------

_BLOCK_KEYS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "norm.weight", "out_proj.weight",
               "out_proj.bias")
#: Per released matrix-mixer type and form (data-dependent or not): the mixer's own keys -> ours (None: dropped).
_MIXER_KEYS: dict[tuple[str, bool], dict[str, str | None]] = {
    ("dense", False): {"M": "weight"},
    ("toeplitz", False): {"conv_params": "taps"},
    ("vandermonde", True): {},
    ("vandermonde", False): {"dft_matrix": None},          # the DFT: a fixed buffer, no parameter of ours
    ("cauchy", True): {"bias": "shift_raw"},
    ("cauchy", False): {"q_matrix": "q_param", "k_matrix": "k_param"},
    ("low_rank", True): {},
    ("low_rank", False): {"q_matrix": "q_param", "k_matrix": "k_param"},
    ("attention", True): {},
    ("attention", False): {"q_matrix": "q_param", "k_matrix": "k_param"},
    ("quasiseparable", True): {"A_log": "ssm.A_log", "dt_bias": "ssm.dt_bias", "D": "ssm.D",
                               "fc_D.weight": "fc_D.weight"},
    ("quasiseparable", False): {"A_log": "ssm.A_log", "dt_bias": "ssm.dt_bias", "D": "ssm.D",
                                "fc_D.weight": "fc_D.weight", "BC": "BC"},
}
#: Our mixer for each released type.
_OUR_MIXER = {"dense": "dense", "toeplitz": "toeplitz", "vandermonde": "vandermonde", "cauchy": "cauchy",
              "low_rank": "low_rank", "attention": "block_attention", "quasiseparable": "quasiseparable"}
#: The released data-independent Cauchy has no shift (``1/(e^q + e^k + tol)``); ours is ``softplus(shift_raw) > 0``.
#: This raw value gives ``softplus = 4.2e-18``, below the resolution of any denominator (each exceeds ``tol = 1e-8``).
NO_SHIFT_RAW = -40.0


def matrix_mixer_options(matrix_mixer_type: str, is_data_dependent: bool, d_model: int, qk_dim: int, *,
                         max_seq_len: Optional[int] = None, d_conv: int = 7, expand: int = 2, headdim: int = 128,
                         bias: bool = False, conv_bias: bool = True,
                         chunk_size: int = 256) -> tuple[str, dict[str, Any]]:
    """Our mixer and its options for the released ``MatrixMixer(matrix_mixer_type, is_data_dependent, d_model,
    qk_dim, max_seq_len, d_conv, expand=..., headdim=..., bias=..., conv_bias=..., chunk_size=...)``: build it with
    ``mixer_plugins.create_mixer(name, d_model, **options)`` and load :func:`convert_matrix_mixer_state_dict` of the
    released checkpoint into it."""
    if matrix_mixer_type not in _OUR_MIXER:
        raise ValueError(f"unknown released matrix mixer {matrix_mixer_type!r}; released types: {sorted(_OUR_MIXER)}")
    dd = is_data_dependent and matrix_mixer_type != "dense"
    options: dict[str, Any] = {"head_dim": headdim, "expand": expand, "d_conv": d_conv, "proj_bias": bias,
                     "conv_bias": conv_bias}
    if matrix_mixer_type == "dense":
        return "dense", {**options, "max_seq_len": max_seq_len}
    options["data_dependent"] = dd
    if not dd or matrix_mixer_type in ("vandermonde", "cauchy", "low_rank"):
        options["max_seq_len"] = max_seq_len
    if matrix_mixer_type == "quasiseparable":
        return "quasiseparable", {**options, "d_state": qk_dim * expand * d_model // headdim, "shared_bc": True,
                                  "ngroups": 1, "chunk_size": chunk_size, "A_init_range": (1.0, 1.0)}
    if matrix_mixer_type == "toeplitz":
        return "toeplitz", options
    options["qk_dim"] = qk_dim
    if dd and matrix_mixer_type in ("vandermonde", "cauchy", "low_rank"):
        # the released output scale 1/sqrt(Lmax ...) uses max_seq_len; ours is the fixed scale_length
        options["scale_length"] = max_seq_len
        del options["max_seq_len"]
    return _OUR_MIXER[matrix_mixer_type], options


def convert_matrix_mixer_state_dict(state_dict: Mapping[str, Tensor], matrix_mixer_type: str, *,
                                    is_data_dependent: bool = True) -> dict[str, Tensor]:
    """A released ``MatrixMixer`` ``state_dict`` (``hydra/modules/matrix_mixer.py``) in our mixer's layout.

    Every checkpoint kind the released ``MatrixMixer`` can produce converts, except one; :func:`matrix_mixer_options`
    gives the mixer and options to load it into:

    ======================  ============================================================================================
    released type (form)    ours
    ======================  ============================================================================================
    dense (DI only)         ``dense``: ``matrix_mixer.M`` -> ``weight``
    toeplitz (DI)           ``toeplitz``: taps rolled by one (``m_ij = c[(i - j + Lmax) mod K]`` in order)
    vandermonde (DD)        ``vandermonde``: the block's weights only (the mixer has none)
    vandermonde (DI)        ``vandermonde`` DFT: the ``dft_matrix`` buffer is checked and dropped
    cauchy (DD)             ``cauchy``: the shift ``2 beta`` -> ``shift_raw = log(expm1(2 beta))`` (must be > 0)
    cauchy (DI)             ``cauchy``: Q, K -> ``q_param``, ``k_param``; no shift (``shift_raw = NO_SHIFT_RAW``)
    low_rank (DD, DI)       ``low_rank`` (DI: Q, K -> ``q_param``, ``k_param``)
    attention (DD, DI)      ``block_attention`` (DI: Q, K -> ``q_param``, ``k_param``; the intended softmax(Q K^T),
                            which the released DI forward, mislabelling the length axis as heads, could not compute)
    quasiseparable (DD, DI) ``quasiseparable`` with ``shared_bc=True`` (DI: ``BC`` -> ``BC``)
    ======================  ============================================================================================

    The data-dependent Toeplitz checkpoint has no exact image: the released code builds its kernel rotated by one
    offset from per-token projections, which no weight permutation undoes; it raises, and so do a DI Cauchy shift
    that is not positive and unknown keys (rather than loading silently). The released learned (non-DFT) DI
    Vandermonde is unreachable through ``MatrixMixer`` (which never passes ``is_dft``), so no checkpoint of it exists.
    """
    dd = is_data_dependent and matrix_mixer_type != "dense"
    if matrix_mixer_type == "toeplitz" and dd:
        raise ValueError(
            "the released data-dependent Toeplitz mixer reads its kernel rotated by one offset from the per-token "
            "taps (tap delta from token delta+1); our paper-exact layout cannot reproduce it by permuting weights"
        )
    if (matrix_mixer_type, dd) not in _MIXER_KEYS:
        raise ValueError(f"no converter for the released {matrix_mixer_type!r} matrix mixer; supported: "
                         f"{sorted(_OUR_MIXER)}")
    names = _MIXER_KEYS[(matrix_mixer_type, dd)]
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        local = key[len("matrix_mixer."):] if key.startswith("matrix_mixer.") else None
        if key in _BLOCK_KEYS:
            out[key] = value
        elif local in ("q_bias", "k_bias") and matrix_mixer_type == "vandermonde":
            raise ValueError("a learned data-independent Vandermonde (q_bias, k_bias) is not a checkpoint the released "
                             "MatrixMixer can produce (it never passes is_dft), and its einsum computes a diagonal "
                             "scaling: there is no Vandermonde mixer to convert it to")
        elif local is not None and local in names:
            target = names[local]
            if target is None:
                _check_dft(value)
                continue
            if matrix_mixer_type == "toeplitz" and local == "conv_params":
                value = torch.roll(value, shifts=-1, dims=-1)  # offsets -(Lmax-1) .. Lmax-1 in order
            if matrix_mixer_type == "cauchy" and local == "bias":
                value = _cauchy_shift_raw(value)
            out[target] = value
        else:
            hint = ""
            if local is not None and local in _MIXER_KEYS.get((matrix_mixer_type, not dd), {}):
                form = "data-dependent" if not dd else "data-independent"
                hint = (f"; it is a key of the {form} {matrix_mixer_type} mixer: convert with "
                        f"is_data_dependent={not dd}")
            raise KeyError(f"unexpected key {key!r} in a released {'data-dependent' if dd else 'data-independent'} "
                           f"{matrix_mixer_type} matrix-mixer state_dict{hint}")
    if matrix_mixer_type == "cauchy" and not dd:
        out["shift_raw"] = torch.tensor(NO_SHIFT_RAW, dtype=out["q_param"].dtype if "q_param" in out else None)
    return out


def _check_dft(dft: Tensor) -> None:
    length = dft.shape[-1]
    t = torch.arange(length, dtype=torch.float64)
    expected = torch.cos(2 * math.pi * torch.outer(t, t) / length)
    if dft.shape != (length, length) or not torch.allclose(dft.double().cpu(), expected, atol=1e-5):
        raise ValueError("matrix_mixer.dft_matrix is not the real DFT cos(2 pi i j / Lmax) the released code builds")


def _cauchy_shift_raw(beta: Tensor) -> Tensor:
    shift = 2.0 * beta.double()
    if not bool(shift > 0):
        raise ValueError(f"the released Cauchy shift 2 * beta = {float(shift):.4g} is not positive: our shift is "
                         "softplus(shift_raw) > 0, so this checkpoint has no exact image")
    return torch.log(torch.expm1(shift)).to(beta.dtype)
