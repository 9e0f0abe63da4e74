"""``linear``: ``F.linear`` whose CPU forward and backward run with the threads :mod:`._threads` picks.

The mixers' projections are their largest matrix products. On a quiet machine they run on all of
``torch.get_num_threads()``, as ``F.linear`` does; while other processes keep cores busy they use only the free ones,
like the scan, conv and norm sections, so that a descheduled thread cannot stall them (measured on 2 cores with one
busy process, quasiseparable at L = 4096: forward+backward 2.10x its time alone with the projections on both
threads, 1.63x with everything on one). The math is ``F.linear``'s own, forward and backward: the same products in
the same order, so results are identical. Off CPU, under ``torch.compile``, under CPU autocast and for tensor
subclasses (DTensor, ...) it is ``F.linear`` itself, and so it is for a product smaller than :data:`MIN_ELEMENTS`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._threads import threads_for

__all__ = ["MIN_ELEMENTS", "linear"]

#: Products smaller than this (their largest tensor, in elements) are plain ``F.linear`` on the caller's threads.
#: Measured on 2 cores with one busy process: at L = 4096 (the projections write 2-3 M elements) following the load
#: helped in seven runs of seven; at L = 1024 (0.3-0.8 M elements) three runs came out worse and the runs were too
#: noisy to tell (SDPA's own slowdown ranged from 1.9x to 3.9x between them), so products that small stay as they
#: were.
MIN_ELEMENTS = 1 << 21


def _elements(x: Tensor, weight: Tensor) -> int:
    """The largest tensor the product or its gradients write: the output, the input gradient or the weight's."""
    rows = x.numel() // max(1, x.shape[-1])
    return max(rows * weight.shape[0], x.numel(), weight.numel())


def _plain(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``; on CPU its forward and backward run with the threads the machine's load
    leaves free (see the module docstring). Differentiable twice, like ``F.linear``."""
    if (x.device.type != "cpu" or torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu")
            or not _plain(x, weight, bias) or _elements(x, weight) < MIN_ELEMENTS):
        return F.linear(x, weight, bias)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        with threads_for(_elements(x, weight), x.device):
            return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with threads_for(_elements(x, weight), x.device):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        with threads_for(_elements(x, weight), grad.device):
            if ctx.needs_input_grad[0]:
                grad_x = grad.matmul(weight)
            if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
                rows = grad.reshape(-1, grad.shape[-1])
                if ctx.needs_input_grad[1]:
                    grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]))
                if ctx.has_bias and ctx.needs_input_grad[2]:
                    grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b
