"""``triton`` backend of the scan: our fused kernels, forward and backward in Triton, both directions in one pass.
Chosen first on CUDA; it refuses float64 (see :func:`.._requirements.triton_unavailable`). Triton is imported on the
first call, never when the kernels package is.

Two kernel families, chosen by shape (never by values):

* :mod:`.triton_one_chunk` — a sequence that is one chunk (:func:`.inputs.chunk_length` gives its whole length, at
  most :data:`ONE_CHUNK_MAX` tokens, e.g. a ViT's 197) and carries no initial or final state: flash-style tiles over
  the keys with both directions' decays, the shift and the diagonal, and no states at all;
* :mod:`.triton_kernels` — the chunked scan with its state passes, for everything else.

Both take the raw step sizes and prepare them inside the kernels (``dt_bias``, softplus, ``dt_limit``), and ``A_log``
where the op was given it (``A = -exp(A_log)`` formed inside the kernels), read every input through its strides, and
return gradients in the inputs' dtypes.
"""

from __future__ import annotations

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable
from .inputs import Direction, ScanArgs, chunk_length

__all__ = ["ONE_CHUNK_MAX", "impl", "uses_one_chunk"]

#: the longest sequence the one-chunk kernels take (its tiles of keys and queries cover it in a few steps)
ONE_CHUNK_MAX = 256


def uses_one_chunk(args: ScanArgs) -> bool:
    """Whether the scan runs on the one-chunk kernels: one chunk long (:func:`.inputs.chunk_length`), at most
    :data:`ONE_CHUNK_MAX` tokens, and no initial or final state (decided from shapes and options only)."""
    b, length, heads, head_dim = args.x.shape
    state = args.directions[0].B.shape[-1]
    if length > ONE_CHUNK_MAX or args.initial_state is not None or args.return_final_state:
        return False
    return chunk_length(length, args.chunk_size, heads, head_dim, state) >= length


def impl(args: ScanArgs) -> Tensor | tuple[Tensor, Tensor]:
    """The ``scan`` op's call on the fused kernels: raw step sizes (prepared in the kernels), a per-head skip as the
    diagonal (a broadcast view), every tensor in its own dtype and strides (accumulated in float32)."""

    def generators(d: Direction | None) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        return (None, None, None, None) if d is None else (d.dt, d.A, d.B, d.C)

    (dt_f, A_f, B_f, C_f), (dt_b, A_b, B_b, C_b) = generators(args.forward), generators(args.backward)
    diag = args.skip_as_diag(args.diag)
    if uses_one_chunk(args):
        from .triton_one_chunk import scan_one_chunk

        y = scan_one_chunk(args.x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, args.seq_idx, shift=args.shift,
                           dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit,
                           a_log=args.A_is_log)
        return args.finish(y, None)
    from .triton_kernels import scan_triton

    out = scan_triton(args.x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, args.seq_idx, args.initial_state,
                      shift=args.shift, chunk_size=args.chunk_size, return_final_state=args.return_final_state,
                      dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit, a_log=args.A_is_log)
    if isinstance(out, tuple):
        return args.finish(*out)
    return args.finish(out, None)


BACKEND = register(Backend(op="scan", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
