"""``triton`` backend of the scan: our fused chunked scan (:mod:`.triton_kernels`), forward and backward in Triton,
both directions in one pass. Chosen first on CUDA; it refuses float64 (see :func:`.._requirements.triton_unavailable`).
Triton is imported on the first call, never when the kernels package is."""

from __future__ import annotations

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable
from .inputs import Direction, ScanArgs, prepare_dt


def impl(args: ScanArgs) -> Tensor | tuple[Tensor, Tensor]:
    """The ``scan`` op's call on the fused kernels: step sizes prepared in PyTorch (autograd through them), a per-head
    skip as the diagonal, ``x``, ``B`` and ``C`` in their own dtypes (accumulated in float32)."""
    from .triton_kernels import scan_triton

    def generators(d: Direction | None) -> tuple:
        if d is None:
            return (None,) * 4
        return prepare_dt(d.dt, args.dt_bias, args.dt_softplus, args.dt_limit).float(), d.A, d.B, d.C

    out = scan_triton(args.x, *generators(args.forward), *generators(args.backward), args.skip_as_diag(args.diag),
                      args.seq_idx, args.initial_state, shift=args.shift, chunk_size=args.chunk_size,
                      return_final_state=args.return_final_state)
    y, final = out if args.return_final_state else (out, None)
    return args.finish(y, final)


BACKEND = register(Backend(op="scan", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
