"""``torch`` backend of :func:`..directional_scan`: the chunked scan of one direction (O(L) memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import run_chunked

if TYPE_CHECKING:
    from . import DirectionalScanArgs


def impl(args: DirectionalScanArgs) -> Tensor:
    y, _ = run_chunked(args.scan_inputs(), want_final=False)
    return y.to(args.x.dtype)


BACKEND = register(Backend(op="directional_scan", name="torch", impl=impl, priority=10))
