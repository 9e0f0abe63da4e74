"""``torch`` backend of the scan: the chunked algorithm of :mod:`.chunked` in plain PyTorch (O(L) memory, any
device and floating dtype, differentiable by autograd, traceable by ``torch.compile`` and ``torch.export``)."""

from __future__ import annotations

from torch import Tensor

from .._dispatch import Backend, register
from .chunked import scan_chunked
from .inputs import ScanArgs


def impl(args: ScanArgs) -> Tensor | tuple[Tensor, Tensor]:
    return args.run_prepared(scan_chunked)


BACKEND = register(Backend(op="scan", name="torch", impl=impl, priority=10))
