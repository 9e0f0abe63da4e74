"""A drop-in for the released Mamba-2 module (``mamba_ssm.modules.mamba2.Mamba2``), generation included.

:class:`Mamba2` takes the released constructor's arguments, has its ``state_dict`` keys (``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``) and its inference API: ``allocate_inference_cache(batch_size,
max_seqlen, dtype=None)`` returns ``(conv_state, ssm_state)`` in the released layouts ((batch, conv_dim, d_conv) and
(batch, nheads, headdim, d_state)), ``step(hidden_states, conv_state, ssm_state)`` updates them in place and returns
``(out, conv_state, ssm_state)``, and ``forward(u, inference_params=...)`` prefills the states of
``inference_params.key_value_memory_dict[layer_idx]`` (``seqlen_offset == 0``) or steps them (``> 0``).

It computes the released function: ``in_proj`` to ``[z0, x0, z, xBC, dt]`` (the first two only when ``d_ssm <
d_inner``: a SiLU-gated MLP beside the SSM), causal depthwise conv + SiLU on ``xBC``, the SSD scan
(:func:`~mixer_plugins.kernels.ssd`, any backend) with ``dt = softplus(dt + dt_bias)`` clamped to ``dt_limit`` and the
``D`` skip (per head, or per channel with ``D_has_hdim``), then the gated RMSNorm (per group of ``d_ssm / ngroups``
channels, ``norm_before_gate`` as given) or, with ``rmsnorm=False``, the gate ``y * silu(z)``, the MLP branch in
front, and ``out_proj``. It is also a full :class:`~mixer_plugins.MatrixMixer`: ``mask=`` for right-padded rows,
``materialize`` (except with ``D_has_hdim``, whose skip differs per channel), and the library's own decoding API
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

import dataclasses
import math
from typing import Annotated, Any, Optional

import torch
import torch.nn.functional as F
from pydantic import AllowInfNan, Field, model_validator
from torch import Tensor, nn

from ..errors import MixerInputError, NotMaterializableError
from ..kernels import chunked_scan_flops, depthwise_conv1d, gated_rmsnorm, scan_matrix, ssd
from ..kernels.conv.step import causal_conv1d_state, causal_conv1d_step
from ..kernels.decode import ssd_decode_step
from ..kernels.scan.step import ssd_step
from ..layers.conv import ShortConv
from ..mixers._ssm import StepOptions, compute_dtype, init_dt_bias, step_sizes
from ..mixers.base import MatrixMixer, MixerContext
from ..mixers.block import rows_linear
from ..mixers.cache import MixerCache
from ..registry import MixerConfig

__all__ = ["Mamba2", "Mamba2Config"]


class Mamba2Config(MixerConfig):
    """The released ``Mamba2`` arguments that shape the module (``dim`` is ``d_model``)."""

    d_state: int = Field(128, gt=0)
    d_conv: int = Field(4, gt=0)
    conv_init: Optional[float] = Field(None, gt=0)
    expand: int = Field(2, gt=0)
    headdim: int = Field(64, gt=0)
    d_ssm: Optional[int] = Field(None, gt=0)
    ngroups: int = Field(1, gt=0)
    A_init_range: tuple[float, float] = (1.0, 16.0)
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    dt_min: float = Field(1e-3, gt=0)
    dt_max: float = Field(1e-1, gt=0)
    dt_init_floor: float = Field(1e-4, gt=0)
    dt_limit: tuple[float, Annotated[float, AllowInfNan(True)]] = (0.0, math.inf)
    bias: bool = False
    conv_bias: bool = True
    chunk_size: int = Field(256, gt=0)

    @property
    def d_inner(self) -> int:
        return self.expand * self.dim

    @property
    def ssm_width(self) -> int:
        return self.d_inner if self.d_ssm is None else self.d_ssm

    @model_validator(mode="after")
    def _check(self) -> Mamba2Config:
        if self.ssm_width > self.d_inner:
            raise ValueError(f"d_ssm ({self.d_ssm}) must not exceed expand * d_model = {self.d_inner}")
        if self.ssm_width % self.headdim:
            raise ValueError(f"the SSM width ({self.ssm_width}) must be a multiple of headdim ({self.headdim})")
        heads = self.ssm_width // self.headdim
        if heads % self.ngroups:
            raise ValueError(f"nheads ({heads}) must be a multiple of ngroups ({self.ngroups})")
        lo, hi = self.A_init_range
        if not 0 < lo <= hi:
            raise ValueError(f"A_init_range must satisfy 0 < lo <= hi, got {self.A_init_range}")
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must not exceed dt_max ({self.dt_max})")
        lo, hi = self.dt_limit
        if not 0 <= lo <= hi:
            raise ValueError(f"dt_limit must satisfy 0 <= lo <= hi, got {self.dt_limit}")
        return self


@dataclasses.dataclass(eq=False, kw_only=True)
class Mamba2Context(MixerContext):
    """The SSD generators (``dt`` (b, L, h) as the scan op takes it, with ``steps``, how the op turns it into step
    sizes (:meth:`step_sizes`); ``A`` (h,), ``B``/``C`` (b, L, g, n)), the gate ``z`` (b, L, d_ssm) and the MLP branch
    ``z0``, ``x0`` (b, L, d_mlp)."""

    dt: Tensor
    steps: StepOptions | None
    A: Tensor
    B: Tensor
    C: Tensor
    z: Tensor
    z0: Tensor
    x0: Tensor

    def step_sizes(self) -> Tensor:
        """The step sizes ``clamp(softplus(dt + dt_bias), *dt_limit)`` (float32 or wider), as the scan op forms them."""
        return step_sizes(self.dt, self.steps)


class Mamba2(MatrixMixer[Mamba2Context]):
    """The released ``Mamba2`` module's constructor, ``state_dict`` and inference API, on our kernels.

    ``forward(u)`` maps (batch, length, d_model) to the same shape (``seqlen=`` for a flattened (batch * seqlen,
    d_model) input, as released); ``mask=`` (bool (batch, length), right-padded) is our addition. Its ``state_dict``
    has exactly the released keys (no mixer record).
    """

    causal = True
    steppable = True
    config: Mamba2Config
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
        config = Mamba2Config(
            dim=d_model, d_state=d_state, d_conv=d_conv, conv_init=conv_init, expand=expand, headdim=headdim,
            d_ssm=d_ssm, ngroups=ngroups, A_init_range=(float(A_init_range[0]), float(A_init_range[1])),
            D_has_hdim=D_has_hdim, rmsnorm=rmsnorm, norm_before_gate=norm_before_gate, dt_min=dt_min, dt_max=dt_max,
            dt_init_floor=dt_init_floor, dt_limit=(float(dt_limit[0]), float(dt_limit[1])), bias=bias,
            conv_bias=conv_bias, chunk_size=chunk_size,
        )
        super().__init__(config)
        self.d_model, self.d_state, self.d_conv, self.conv_init = d_model, d_state, d_conv, conv_init
        self.expand, self.headdim, self.ngroups = expand, headdim, ngroups
        self.d_inner = config.d_inner
        self.d_ssm = config.ssm_width
        self.nheads = self.d_ssm // headdim
        self.num_heads, self.head_dim = self.nheads, headdim
        self.d_mlp = self.d_inner - self.d_ssm
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit = config.dt_limit
        self.activation = "silu"
        self.chunk_size = chunk_size
        self.use_mem_eff_path = use_mem_eff_path
        self.layer_idx = layer_idx
        self.sequence_parallel = sequence_parallel
        self.materializable = not D_has_hdim
        self.conv_dim = self.d_ssm + 2 * ngroups * d_state
        # Order: [z0, x0, z, xBC, dt]; z0 and x0 are d_mlp wide each (0 unless d_ssm < d_inner).
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=bias)
        self.conv1d = ShortConv(self.conv_dim, d_conv, bias=conv_bias, causal=True)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.d_ssm if D_has_hdim else self.nheads))
        self.norm = _GroupedGatedRMSNorm(self.d_ssm, ngroups, norm_before_gate) if rmsnorm else None
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self._draw_ssm_parameters()
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    # -- initialisation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _draw_ssm_parameters(self) -> None:
        if self.conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
        self.dt_bias.copy_(init_dt_bias(self.nheads, self.config.dt_min, self.config.dt_max,
                                        self.config.dt_init_floor))
        self.A_log.copy_(torch.log(torch.empty(self.nheads).uniform_(*self.config.A_init_range)))
        self.D.fill_(1.0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every parameter as the constructor does (in_proj, conv1d, dt_bias, A_log, D = 1, norm = 1,
        out_proj)."""
        self.in_proj.reset_parameters()
        self.conv1d.reset_parameters()
        self._draw_ssm_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        self.out_proj.reset_parameters()

    # -- the generators ---------------------------------------------------------------------------------
    def _A(self, dtype: torch.dtype) -> Tensor:
        return -torch.exp(self.A_log.to(compute_dtype(dtype)))

    def _skip(self) -> Tensor:
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def _split(self, zxbcdt: Tensor) -> list[Tensor]:
        return list(zxbcdt.split([self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1))

    def _context(self, z0: Tensor, x0: Tensor, z: Tensor, xBC: Tensor, dt: Tensor, mask: Tensor | None
                 ) -> Mamba2Context:
        xs, B, C = xBC.split([self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        gn = (self.ngroups, self.d_state)
        return Mamba2Context(values=xs.unflatten(-1, (self.nheads, self.headdim)), mask=mask, dt=dt,
                             steps=StepOptions(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit),
                             A=self._A(xs.dtype), B=B.unflatten(-1, gn), C=C.unflatten(-1, gn), z=z, z0=z0, x0=x0)

    def prepare(self, x: Tensor, mask: Tensor | None) -> Mamba2Context:
        z0, x0, z, xBC, dt = self._split(self.in_proj(x))
        keep = mask[..., None].to(x.dtype) if mask is not None else None
        if keep is not None:
            xBC = xBC * keep      # pads are neutral inputs of the convolution, like its zero padding
        xBC = depthwise_conv1d(xBC, self.conv1d.weight[:, 0, :], self.conv1d.bias, causal=True, silu=True)
        if keep is not None:
            xBC = xBC * keep      # the conv bias made them non-zero again
        return self._context(z0, x0, z, xBC, dt, mask)

    def matrix(self, ctx: Mamba2Context) -> Tensor:
        if self.D_has_hdim:
            raise NotMaterializableError(
                "Mamba2 with D_has_hdim=True adds a different skip D to each channel of a head: the heads' "
                "channels do not share one L x L matrix"
            )
        dt = ctx.step_sizes()
        diag = self.D.to(ctx.values.dtype).expand_as(dt)
        return scan_matrix(dt, ctx.A, ctx.B, ctx.C, diag=diag).to(ctx.values.dtype)

    def mix(self, ctx: Mamba2Context) -> Tensor:
        # the raw step sizes go to the op, which forms them in float32 (inside the kernels on the GPU), as released
        return ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self._skip(),
                   **(ctx.steps or {}))

    def finish(self, ctx: Mamba2Context, y: Tensor) -> Tensor:
        y = y.flatten(2)
        y = self.norm(y, ctx.z) if self.norm is not None else y * F.silu(ctx.z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(ctx.z0) * ctx.x0, y], dim=-1)
        return self.out_proj(y)

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        tokens = batch * length
        return {
            "in_proj": 2 * tokens * self.d_model * self.in_proj.out_features,
            "conv": 2 * tokens * self.conv_dim * self.d_conv,
            "scan": chunked_scan_flops(batch, length, self.nheads, self.headdim, self.ngroups, self.d_state, 1,
                                       self.chunk_size),
            "out_proj": 2 * tokens * self.d_inner * self.d_model,
        }

    # -- forward with the released arguments ------------------------------------------------------------
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
        cache = self._wrap(conv_state, ssm_state, u.shape[1])
        return self.prefill(u, cache, mask=mask)

    # -- the released inference API ---------------------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: Optional[torch.dtype] = None,
                                 **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Zero ``(conv_state, ssm_state)``: (batch, conv_dim, d_conv) (a transposed view of a (batch, d_conv,
        conv_dim) buffer, as released) and (batch, nheads, headdim, d_state). ``max_seqlen`` is unused (the states do
        not grow)."""
        device = self.out_proj.weight.device
        conv_state = torch.zeros(batch_size, self.d_conv, self.conv_dim, device=device,
                                 dtype=self.conv1d.weight.dtype if dtype is None else dtype).transpose(1, 2)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=self.in_proj.weight.dtype if dtype is None else dtype)
        return conv_state, ssm_state

    # The released signature, which also takes the contract's (x, cache): wider than MatrixMixer.step's.
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

    # -- the decoding hooks (shared by both APIs) -------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        cache.state["conv"] = torch.zeros(batch, self.conv_dim, self.d_conv, dtype=dtype, device=device)
        cache.state["ssm"] = torch.zeros(batch, self.nheads, self.headdim, self.d_state, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: Mamba2Context, x: Tensor, lengths: Tensor) -> Tensor:
        # the convolution's inputs at each row's last d_conv real tokens (zeros before the row's start)
        tail = causal_conv1d_state(x, self.d_conv, lengths).transpose(1, 2)            # (b, d_conv, d_model)
        rows = slice(2 * self.d_mlp + self.d_ssm, 2 * self.d_mlp + self.d_ssm + self.conv_dim)
        bias = None if self.in_proj.bias is None else self.in_proj.bias[rows]
        xBC = F.linear(tail, self.in_proj.weight[rows], bias)
        started = (lengths[:, None] - self.d_conv + torch.arange(self.d_conv, device=x.device)) >= 0
        xBC = torch.where(started[..., None], xBC, xBC.new_zeros(()))
        cache.state["conv"].copy_(xBC.transpose(1, 2).detach())
        dt = ctx.step_sizes()
        dt = dt if ctx.mask is None else torch.where(ctx.mask[..., None], dt, dt.new_zeros(()))
        y, state = ssd(ctx.values, dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self._skip(),
                       return_final_states=True)
        cache.state["ssm"].copy_(state.detach())
        return y

    def prepare_step(self, x: Tensor, cache: MixerCache) -> Mamba2Context:
        z0, x0, z, xBC, dt = self._split(self.in_proj(x))
        xBC, conv = causal_conv1d_step(xBC, cache.state["conv"], self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                       silu=True)
        cache.state["conv"].copy_(conv.detach())
        return self._context(z0, x0, z, xBC, dt, None)

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        conv, ssm = cache.state["conv"], cache.state["ssm"]
        if x.shape[1] != 1 or (ssm.dtype != x.dtype and ssm.dtype.itemsize <= x.dtype.itemsize):
            return super().step_tokens(x, cache)
        # one token, in the states' dtype (at least as wide as the input's): the fused step
        b = x.shape[0]
        z0, x0, z, xBC, dt = rows_linear(x.view(b, -1), self.in_proj.weight, self.in_proj.bias).split_with_sizes(
            [self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1)
        weight = self.conv1d.weight
        y = ssd_decode_step(xBC, conv, weight.view(weight.shape[0], -1), self.conv1d.bias, ssm, dt,
                            self.A_log, self._skip(), dt_bias=self.dt_bias,
                            dt_softplus=True, dt_limit=self.dt_limit)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return rows_linear(y, self.out_proj.weight, self.out_proj.bias).view(b, 1, -1)

    def mix_step(self, ctx: Mamba2Context, cache: MixerCache) -> Tensor:
        state = cache.state["ssm"]
        if ctx.values.shape[1] == 1:
            y, new = ssd_step(ctx.values, ctx.step_sizes(), ctx.A, ctx.B, ctx.C, state, D=self._skip())
        else:
            y, new = ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self._skip(),
                         initial_states=state, return_final_states=True, **(ctx.steps or {}))
        state.copy_(new.detach())
        return y

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, expand={self.expand}, "
                f"headdim={self.headdim}, d_ssm={self.d_ssm}, ngroups={self.ngroups}, rmsnorm={self.rmsnorm}")


class _GroupedGatedRMSNorm(nn.Module):
    """The released ``RMSNormGated(d_ssm, eps=1e-5, norm_before_gate, group_size=d_ssm // ngroups)``: statistics
    per group of channels, one gain ``weight`` over the whole width (its only state_dict key)."""

    def __init__(self, width: int, groups: int, norm_before_gate: bool, eps: float = 1e-5):
        super().__init__()
        self.groups, self.norm_before_gate, self.eps = groups, norm_before_gate, eps
        self.weight = nn.Parameter(torch.ones(width))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        if self.groups == 1:
            return gated_rmsnorm(y, z, self.weight, self.eps, self.norm_before_gate)
        g = self.groups
        ones = torch.ones(y.shape[-1] // g, dtype=self.weight.dtype, device=y.device)
        normed = gated_rmsnorm(y.unflatten(-1, (g, -1)), z.unflatten(-1, (g, -1)), ones, self.eps,
                               self.norm_before_gate).flatten(-2)
        return normed * self.weight.to(normed.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, groups={self.groups}, norm_before_gate={self.norm_before_gate}"
