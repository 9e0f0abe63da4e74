"""``reference`` backend of :func:`..directional_scan`: the materialized triangular matrix (the oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import reference_scan

if TYPE_CHECKING:
    from . import DirectionalScanArgs


def impl(args: DirectionalScanArgs) -> Tensor:
    return reference_scan(args.scan_inputs()).to(args.x.dtype)


BACKEND = register(Backend(op="directional_scan", name="reference", impl=impl))
