"""``quasiseparable`` (aliases ``quasi``, ``hydra``): Hydra, the quasiseparable matrix mixer.

Per head the matrix is quasiseparable (Hydra, Eq. 3 / Prop. 3.7):

* below the diagonal ``m_ij = C_{f,i-1}.B_{f,j} exp(A sum_{k=j+1..i-1} dt^f_k) dt^f_j`` (shifted forward SSD),
* above it ``m_ij = C_{b,i+1}.B_{b,j} exp(A sum_{k=i+1..j-1} dt^b_k) dt^b_j`` (shifted backward SSD),
* on it the free, data-dependent ``diag_i = D + W_D x_i``,

computed in O(L) by :func:`mixer_plugins.kernels.quasiseparable` (one pass for both directions, no
flipped copies). Two forms of the generators:

* ``shared_bc=False`` (default): the Hydra module, separate B_f, C_f, B_b, C_b and dt_f, dt_b per token;
* ``shared_bc=True``: the paper's QS matrix mixer, one B, C for both directions (separate dt).

``data_dependent=False`` gives the data-independent QS mixer: B, C are a free (max_seq_len, 2 g N)
parameter, dt is the constant ``softplus(dt_bias)`` (a time-invariant decay), and, as in the released code,
the diagonal stays data-dependent.

The bidirectional heuristics and the QS ablations (:mod:`.bidirectional_ablations`) share this block
(:class:`._ssm.BidirectionalSSMBlock`) and differ only in how the two directions are combined.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from ..registry.spec import MixerSpec
from ._ssm import BidirectionalConfig, BidirectionalSSMBlock, ScanContext
from .block import DataIndependentOptions

__all__ = ["QuasiseparableConfig", "QuasiseparableMixer", "SPEC"]


class QuasiseparableConfig(BidirectionalConfig, DataIndependentOptions):
    """Options of Hydra (the Hydra block, SSM generators, and the data-independent form)."""

    shared_bc: bool = Field(
        False, description="one B, C for both directions (the paper's QS mixer) instead of Hydra's separate ones"
    )
    learnable_init_states: bool = Field(
        False, description="a learnable initial SSM state (heads, head_dim, d_state), zero at init, that both scan "
        "directions start from (Hydra's learnable_init_states); it adds an input-independent term to the mixed "
        "values (not part of the matrix)"
    )


class QuasiseparableMixer(BidirectionalSSMBlock):
    """Hydra: shifted forward and backward scans plus a free data-dependent diagonal."""

    shift = True
    use_diag = True
    combine = "sum"

    def __init__(self, config: QuasiseparableConfig):
        super().__init__(config)
        self.init_states: nn.Parameter | None = None
        if config.learnable_init_states:
            self.init_states = nn.Parameter(torch.zeros(self.scan_heads, self.head_dim, self.d_state))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.init_states is not None:
            self.init_states.zero_()

    def initial_state_term(self, ctx: ScanContext) -> Tensor:
        """What the initial state ``S0`` adds to the mixed values, (batch, length, heads, head_dim).

        Each direction's scan starts from ``S0`` (Hydra repeats it for both), so after the shift position ``i`` gets
        ``exp(A sum_{k<=i-1} dt^f_k) C_{f,i-1} . S0`` from the forward scan (``i >= 1``) and
        ``exp(A sum_{k>=i+1} dt^b_k) C_{b,i+1} . S0`` from the backward one (``i <= L-2``); the backward sum runs over
        real tokens only (pads have zero step), so a padded row equals the unpadded one.
        """
        if self.init_states is None:
            raise RuntimeError(f"{type(self).__name__} was built without learnable_init_states: no initial state")
        s0 = self.init_states.to(ctx.x.dtype)                        # (h, p, n)
        rep = self.scan_heads // self.ngroups
        dt_f, dt_b = ctx.step_sizes()
        if ctx.mask is not None:
            keep = ctx.mask[..., None].to(dt_b.dtype)
            dt_f, dt_b = dt_f * keep, dt_b * keep
        A = ctx.A.to(dt_f.dtype)                                     # the decays in the step sizes' dtype
        decay_f = torch.exp(A * torch.cumsum(dt_f, dim=1))                         # sum_{k<=t}
        decay_b = torch.exp(A * torch.flip(torch.cumsum(torch.flip(dt_b, (1,)), dim=1), (1,)))  # sum_{k>=t}
        read_f = torch.einsum("blhn,hpn->blhp", ctx.C_f.repeat_interleave(rep, dim=2), s0) * decay_f[..., None]
        read_b = torch.einsum("blhn,hpn->blhp", ctx.C_b.repeat_interleave(rep, dim=2), s0) * decay_b[..., None]
        zero = torch.zeros_like(read_f[:, :1])
        return torch.cat([zero, read_f[:, :-1]], dim=1) + torch.cat([read_b[:, 1:], zero], dim=1)

    def finish(self, ctx: ScanContext, y: Tensor) -> Tensor:
        if self.init_states is not None:
            y = y + self.initial_state_term(ctx).to(y.dtype)
        return super().finish(ctx, y)


SPEC = MixerSpec(
    name="quasiseparable",
    aliases=("quasi", "hydra"),
    config=QuasiseparableConfig,
    builder=QuasiseparableMixer,
    summary="Hydra: quasiseparable matrix mixer (bidirectional SSD + shift + data-dependent diagonal)",
    matrix_class="quasiseparable",
    direction="bidirectional",
    complexity="O(L)",
    data_dependent="option",
    test_options={"head_dim": 16, "d_state": 8, "chunk_size": 8},
)
