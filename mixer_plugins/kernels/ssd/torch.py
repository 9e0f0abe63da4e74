"""``torch`` backend of :func:`..ssd`: the chunked scan in pure PyTorch (O(L) memory; any device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import run_chunked

if TYPE_CHECKING:
    from . import SSDArgs


def impl(args: SSDArgs) -> Tensor | tuple[Tensor, Tensor]:
    inputs = args.scan_inputs(skip_in_scan=True)
    y, final = run_chunked(inputs, want_final=args.return_final_states)
    return args.finish(inputs, y, final)


BACKEND = register(Backend(op="ssd", name="torch", impl=impl, priority=10))
