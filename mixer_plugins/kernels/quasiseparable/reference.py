"""``reference`` backend of :func:`..quasiseparable`: the materialized matrix (float64-capable oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import reference_scan

if TYPE_CHECKING:
    from . import QuasiseparableArgs


def impl(args: QuasiseparableArgs) -> Tensor:
    return reference_scan(args.scan_inputs()).to(args.x.dtype)


BACKEND = register(Backend(op="quasiseparable", name="reference", impl=impl))
