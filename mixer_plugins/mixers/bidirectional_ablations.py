"""The bidirectional heuristics and the quasiseparable ablations of the Hydra paper (Table 3, App. F).

Each is the quasiseparable mixer (Hydra's block and generators: separate forward/backward B, C, dt; one A) built
with other ``shift``/``diag``/``combine`` arguments, so they differ only in how the forward scan ``S_f = SS_f(x)``
and the backward scan ``S_b = flip(SS_b(flip x))`` are combined:

=================================  =============================================  ========================
mixer                              combination                                    matrix
=================================  =============================================  ========================
``bidirectional_add`` (``add``)    ``S_f + S_b``                                  quasiseparable, diagonal
                                                                                  tied to the generators
``bidirectional_mult`` (``mult``)  ``S_f * S_b`` (elementwise)                    none: not linear
``bidirectional_concat``           ``[S_f, S_b]`` on channels (out_proj of        2 blocks of heads
(``concat``)                       width 2 d_inner)
``quasiseparable_no_shift``        ``S_f + S_b + diag * x`` (Add+Diag)            quasiseparable
``quasiseparable_no_diag``         ``shift(S_f) + shift(S_b)`` (Add+Shift)        quasiseparable, zero
                                                                                  diagonal
=================================  =============================================  ========================

The paper gives only the names and citations of these variants; the formulas are the design notes'
reconstruction. Add and Add+Shift keep no separate D skip (unspecified in the paper).
"""

from __future__ import annotations

from ..registry.spec import MixerSpec
from ._ssm import BidirectionalConfig, QuasiseparableMixer

__all__ = [
    "AddMixer", "MultMixer", "ConcatMixer", "NoShiftMixer", "NoDiagMixer",
    "ADD_SPEC", "MULT_SPEC", "CONCAT_SPEC", "NO_SHIFT_SPEC", "NO_DIAG_SPEC",
]

_TEST = {"head_dim": 16, "d_state": 8, "chunk_size": 8}


class AddMixer(QuasiseparableMixer):
    """``S_f + S_b``: no shift, no diagonal."""

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config, shift=False, diag=False, combine="sum")


class MultMixer(QuasiseparableMixer):
    """``S_f * S_b`` (elementwise; not linear in the values)."""

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config, shift=False, diag=False, combine="product")


class ConcatMixer(QuasiseparableMixer):
    """``[S_f, S_b]`` on channels."""

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config, shift=False, diag=False, combine="concat")


class NoShiftMixer(QuasiseparableMixer):
    """``S_f + S_b + diag * x`` (Add+Diag)."""

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config, shift=False, diag=True, combine="sum")


class NoDiagMixer(QuasiseparableMixer):
    """``shift(S_f) + shift(S_b)`` (Add+Shift)."""

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config, shift=True, diag=False, combine="sum")


def _spec(name: str, alias: str, builder: type[QuasiseparableMixer], summary: str, matrix_class: str) -> MixerSpec:
    return MixerSpec(name=name, aliases=(alias,), config=BidirectionalConfig, builder=builder, summary=summary,
                     matrix_class=matrix_class, direction="bidirectional", complexity="O(L)", data_dependent="yes",
                     test_options=_TEST)


ADD_SPEC = _spec("bidirectional_add", "add", AddMixer, "bidirectional SSM heuristic: S_f + S_b (no shift, no diag)",
                 "quasiseparable (tied diagonal)")
MULT_SPEC = _spec("bidirectional_mult", "mult", MultMixer, "bidirectional SSM heuristic: S_f * S_b (not linear)",
                  "none (nonlinear)")
CONCAT_SPEC = _spec("bidirectional_concat", "concat", ConcatMixer,
                    "bidirectional SSM heuristic: [S_f, S_b] on channels", "2 x semiseparable")
NO_SHIFT_SPEC = _spec("quasiseparable_no_shift", "no_shift", NoShiftMixer,
                      "QS ablation without the shift: S_f + S_b + diag x", "quasiseparable")
NO_DIAG_SPEC = _spec("quasiseparable_no_diag", "no_diag", NoDiagMixer,
                     "QS ablation without the diagonal: shift(S_f) + shift(S_b)", "quasiseparable (zero diagonal)")
