"""The scan machinery that :mod:`..ssd`, :mod:`..quasiseparable` and :mod:`..directional_scan` share.

* :mod:`.inputs` — :class:`ScanInputs` (one scan's tensors and options, by name), argument checks,
  :func:`prepare_dt`;
* :mod:`.reference` — the materialized matrices (:func:`scan_matrix`), the oracle;
* :mod:`.chunked` — the chunked O(L)-memory algorithm (:func:`scan_chunked`), the general path;
* :mod:`.factored` — the same algorithm with factored decays (matmuls over a group's heads), where it applies;
* :mod:`.custom_op` — the chunked scan as a ``torch.library`` custom op (for ``torch.compile``) with its FLOP
  formula (:func:`chunked_scan_flops`), and :func:`run_chunked`, which picks eager autograd or the op.
"""

from .chunked import scan_chunked
from .custom_op import chunked_scan, chunked_scan_flops, run_chunked
from .inputs import Direction, ScanInputs, check_generators, check_seq_idx, normalize_seq_idx, prepare_dt, upcast
from .reference import reference_scan, scan_matrix, scan_reference

__all__ = [
    "Direction",
    "ScanInputs",
    "check_generators",
    "check_seq_idx",
    "chunked_scan",
    "chunked_scan_flops",
    "normalize_seq_idx",
    "prepare_dt",
    "reference_scan",
    "run_chunked",
    "scan_chunked",
    "scan_matrix",
    "scan_reference",
    "upcast",
]
