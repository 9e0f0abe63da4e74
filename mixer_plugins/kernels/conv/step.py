"""The causal depthwise convolution for one or a few tokens, with a rolling state: the decoding step of a short
causal convolution.

The state holds the last ``kernel`` inputs of each channel, oldest first, as (batch, channels, kernel): mamba-ssm's
``conv_state`` layout (``causal_conv1d_update``). A step over ``t`` new inputs appends them, emits for each the
cross-correlation of the ``kernel`` most recent inputs with the weight (``nn.Conv1d``'s product, bias added,
optionally SiLU), and keeps the last ``kernel`` inputs. A fresh state of zeros is the causal convolution's own zero
padding, so a prefill followed by steps equals :func:`~mixer_plugins.kernels.depthwise_conv1d` (``causal=True``) over
the whole sequence. Plain PyTorch, no value-dependent control flow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check

__all__ = ["causal_conv1d_state", "causal_conv1d_step"]


def causal_conv1d_step(x: Tensor, state: Tensor, weight: Tensor, bias: Tensor | None, *,
                       silu: bool = False) -> tuple[Tensor, Tensor]:
    """Convolve ``t`` new inputs ``x`` (batch, t, channels) against the rolling ``state`` (batch, channels, kernel).

    Returns ``(y, new_state)``: ``y`` (batch, t, channels), ``y_i = bias + sum_k weight[:, k] * u[i + 1 + k]`` over
    the window ``u = [state, x]``, then SiLU when ``silu``; ``new_state`` the last ``kernel`` inputs of ``u``.
    ``weight`` is (channels, kernel). ``state`` itself is not modified (copy the result into it to update in place).
    """
    check(x.dim() == 3, f"causal_conv1d_step: x must be (batch, tokens, channels), got shape {tuple(x.shape)}")
    b, t, c = x.shape
    check(weight.dim() == 2 and weight.shape[0] == c,
          f"causal_conv1d_step: weight must be (channels, kernel) = ({c}, k), got {tuple(weight.shape)}")
    k = weight.shape[1]
    check(tuple(state.shape) == (b, c, k),
          f"causal_conv1d_step: state must be (batch, channels, kernel) = {(b, c, k)}, got {tuple(state.shape)}")
    window = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)          # (b, c, k + t)
    frames = window[..., 1:].unfold(-1, k, 1)                                        # (b, c, t, k)
    y = (frames * weight.to(window.dtype)[:, None, :]).sum(-1)                      # (b, c, t)
    if bias is not None:
        y = y + bias.to(y.dtype)[:, None]
    if silu:
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), window[..., t:]


def causal_conv1d_state(x: Tensor, kernel: int, lengths: Tensor | None = None) -> Tensor:
    """The rolling state after a prompt: each row's last ``kernel`` inputs, (batch, channels, kernel), zeros before
    the row's start.

    ``x`` is (batch, length, channels); ``lengths`` (batch,) the number of real (leading) tokens of each row
    (default: all of them), so right-padded rows of different lengths each keep their own last inputs.
    """
    check(x.dim() == 3, f"causal_conv1d_state: x must be (batch, length, channels), got shape {tuple(x.shape)}")
    b, length, c = x.shape
    if lengths is None:
        lengths = torch.full((b,), length, dtype=torch.long, device=x.device)
    positions = lengths.to(torch.long)[:, None] - kernel + torch.arange(kernel, device=x.device)   # (b, kernel)
    padded = F.pad(x, (0, 0, kernel, 0))                                             # kernel zeros in front
    index = (positions + kernel).clamp(min=0)[..., None].expand(b, kernel, c)
    return padded.gather(1, index).transpose(1, 2)
