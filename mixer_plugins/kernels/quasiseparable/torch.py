"""``torch`` backend of :func:`..quasiseparable`: both directions in one chunked pass (O(L) memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import run_chunked

if TYPE_CHECKING:
    from . import QuasiseparableArgs


def impl(args: QuasiseparableArgs) -> Tensor:
    y, _ = run_chunked(args.scan_inputs(), want_final=False)
    return y.to(args.x.dtype)


BACKEND = register(Backend(op="quasiseparable", name="torch", impl=impl, priority=10))
