"""``native`` form of :func:`..ssd_decode_step`: our C++ kernel (``kernels/_native/decode.cpp``), the CPU default.

One pass per batch row (rows in parallel): the convolution's rolling update over every channel, then each head's
state rows. CPU tensors all in the state's dtype (float32 or float64), eagerly; otherwise the ``torch`` backend runs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def decode_native(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, state: Tensor,
                  dt: Tensor | None, A_log: Tensor | None, D: Tensor | float | None, c_first: bool,
                  dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float], scale: float,
                  silu: bool, norm: tuple[Tensor, Tensor, float, bool] | None) -> Tensor:
    """The step on the native kernel (arguments as :func:`.reference.decode_reference`, ``conv_weight`` also as
    (channels, 1, kernel); ``c_first``: ``bc_order`` is ``"CB"``; ``norm``: ``(z, weight, eps, norm_before_gate)``,
    the gated RMSNorm applied to each row in the kernel)."""
    skip, d_scalar = (D, 0.0) if isinstance(D, Tensor) else (None, 0.0 if D is None else float(D))
    z, weight, eps, before = norm if norm is not None else (None, None, 0.0, True)
    return torch.ops.mixer_plugins_native.ssd_decode(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, skip,
                                                     d_scalar, dt_bias, dt_softplus, dt_limit[0], dt_limit[1], scale,
                                                     silu, c_first, z, weight, eps, before)
