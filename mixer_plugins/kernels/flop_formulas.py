"""FLOP formulas that make ``torch.utils.flop_counter.FlopCounterMode`` see attention on the CPU.

PyTorch registers formulas for its CUDA SDPA kernels only; on the CPU, ``scaled_dot_product_attention``
runs ``_scaled_dot_product_flash_attention_for_cpu``, which the counter would count as zero. We register
PyTorch's own SDPA formulas for the CPU kernel and its backward, once, and only where PyTorch has none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

from ._library import Shape

__all__ = ["register_cpu_sdpa_flop_formulas"]


def register_cpu_sdpa_flop_formulas() -> None:
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    registry = flop_counter.flop_registry
    if forward is not None and forward not in registry:
        @flop_counter.register_flop_formula(forward)
        def _cpu_sdpa(query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    if backward is not None and backward not in registry:
        @flop_counter.register_flop_formula(backward)
        def _cpu_sdpa_backward(grad_out_shape: Shape, query_shape: Shape, key_shape: Shape, value_shape: Shape,
                               *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


register_cpu_sdpa_flop_formulas()
