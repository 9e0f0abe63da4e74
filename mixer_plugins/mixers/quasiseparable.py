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

The bidirectional heuristics and the QS ablations (:mod:`.bidirectional_ablations`) are this mixer with other
constructor arguments: ``shift`` (move each direction one step off the diagonal), ``diag`` (add ``D + W_D x``) and
``combine`` (``"sum"``, ``"product"`` or ``"concat"`` of the two directions).

Most of a Hydra block's time is the two-direction scan, then ``in_proj``; the glue here is kept to a few small ops
per forward: the scan op receives the raw step-size projections (two strided views of in_proj's output) with
``dt_bias`` and ``dt_limit`` and forms the step sizes itself, and ``A`` from ``A_log``; the diagonal ``W_D x + D`` is
one fused multiply-add (``D`` rides as the bias of the product).
"""

from __future__ import annotations

from pydantic import Field

from ..registry.spec import MixerSpec
from ._ssm import BidirectionalConfig, QuasiseparableMixer, ScanContext
from .block import DataIndependentOptions

__all__ = ["QuasiseparableConfig", "QuasiseparableMixer", "ScanContext", "SPEC"]


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
