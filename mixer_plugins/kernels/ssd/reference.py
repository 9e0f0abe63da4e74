"""``reference`` backend of :func:`..ssd`: the materialized lower-triangular matrix (float64-capable oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._scan import reference_scan

if TYPE_CHECKING:
    from . import SSDArgs


def impl(args: SSDArgs) -> Tensor | tuple[Tensor, Tensor]:
    inputs = args.scan_inputs()
    y, final = reference_scan(inputs, return_final_state=True)
    return args.finish(inputs, y, final)


BACKEND = register(Backend(op="ssd", name="reference", impl=impl))
