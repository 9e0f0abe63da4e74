"""Padding and attention masks, shared by every mixer (and by the hosts' adapters).

Conventions: a padding ``mask`` is bool ``(batch, length)``, True on real tokens, right-padded; an "allowed" mask is
bool ``(batch|1, 1, L, L)`` over (query, key) pairs, True where the key may be attended, or ``None`` when every pair is.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import MixerInputError

__all__ = [
    "attention_bias_mask",
    "check_mixer_input",
    "dense_allowed",
    "masked_softmax",
    "causal_nonfinite_guard",
    "causal_nonfinite_guard_many",
    "padding_mask_to_bool",
    "poison_after",
    "set_nonfinite_guard",
    "zero_pads",
]


def padding_mask_to_bool(mask: Tensor, batch: int, length: int) -> Tensor:
    """Validate a padding mask and return it as bool (batch, length), True on real tokens.

    The value checks (0/1 entries, right padding) read the mask's contents, so they run eagerly on real data only:
    under ``torch.compile`` they are skipped rather than breaking the graph, and on the ``meta`` device (shapes only,
    no contents) there is nothing to read.
    """
    if not isinstance(mask, Tensor):
        raise MixerInputError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise MixerInputError(
            f"mask must be bool (True on real tokens), got dtype {mask.dtype}; "
            "additive float masks are not accepted because their meaning is ambiguous"
        )
    if mask.shape != (batch, length):
        raise MixerInputError(f"mask must have shape (batch, length) = {(batch, length)}, got {tuple(mask.shape)}")
    eager = not torch.compiler.is_compiling() and mask.device.type != "meta"
    if mask.dtype != torch.bool:
        if eager and ((mask != 0) & (mask != 1)).any():
            raise MixerInputError("an integer mask must hold only 0 and 1")
        mask = mask != 0
    if eager and length > 1 and (mask[:, 1:] & ~mask[:, :-1]).any():
        raise MixerInputError(
            "mask must be right-padded: each row is True on its real tokens, then False on the pads"
        )
    return mask


def zero_pads(out: Tensor, mask: Tensor | None) -> Tensor:
    """``out`` (batch, length, ...) with the pad positions set to zero (unchanged when ``mask`` is None).

    Zeroing is by selection (``masked_fill``), never by multiplying with the mask: a NaN or Inf at a pad becomes an
    exact zero (``NaN * 0`` would stay NaN), so whatever a pad holds never reaches any other position.
    """
    if mask is None:
        return out
    return out.masked_fill(~mask.reshape(*mask.shape, *([1] * (out.dim() - 2))), 0.0)


def causal_nonfinite_guard(x: Tensor) -> tuple[Tensor, Tensor]:
    """Isolate non-finite tokens of the input of a causal mixer: ``(x_clean, poisoned)``.

    ``x`` is (batch, length, ...). A token holding a NaN or an Inf is replaced (by selection) with zeros, so no
    ``0 * NaN`` inside the mixer (a masked score times a future value, a zero decay times a future state) can carry
    it into earlier positions. ``poisoned`` is bool (batch, length): True from the first non-finite token of each row
    on. A causal mixer's output at ``i`` depends only on tokens ``j <= i``, so outputs before the first non-finite
    token are exactly those of the clean computation; :func:`poison_after` then marks the later ones NaN, which is
    what the non-finite input makes them.
    """
    bad = ~torch.isfinite(x).flatten(2).all(dim=-1)
    poisoned = bad.cumsum(dim=1) > 0  # a count, not ``cummax``: ONNX has no cumulative maximum
    return x.masked_fill(bad.reshape(*bad.shape, *([1] * (x.dim() - 2))), 0.0), poisoned


def causal_nonfinite_guard_many(*tensors: Tensor) -> tuple[list[Tensor], Tensor]:
    """:func:`causal_nonfinite_guard` over several per-token tensors ``(batch|1, length, ...)`` of one causal op.

    Each tensor's non-finite tokens become zeros (by selection); ``poisoned`` (batch, length) is True from the first
    token that is non-finite in any of them on. Used where a finite but huge input becomes non-finite inside a mixer
    (a LayerNorm of 1e30), so the base class's input guard cannot see it.
    """
    cleaned, poisoned = [], None
    for t in tensors:
        clean, p = causal_nonfinite_guard(t)
        cleaned.append(clean)
        poisoned = p if poisoned is None else poisoned | p
    assert poisoned is not None, "at least one tensor"
    return cleaned, poisoned


def poison_after(out: Tensor, poisoned: Tensor | None) -> Tensor:
    """``out`` (batch, length, ...) set to NaN where ``poisoned`` (bool (batch, length)) is True."""
    if poisoned is None:
        return out
    return out.masked_fill(poisoned.reshape(*poisoned.shape, *([1] * (out.dim() - 2))), float("nan"))


def attention_bias_mask(mask: Tensor | None, length: int, causal: bool, device: torch.device) -> Tensor | None:
    """Bool (batch|1, 1, L, L) mask of allowed (query, key) pairs, or None when everything is allowed.

    Pad keys are excluded. Rows with no real token at all keep every key allowed so softmax stays finite;
    their outputs are zeroed afterwards like every pad output.
    """
    allowed = None
    if causal:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if mask is not None:
        keys = mask | ~mask.any(dim=1, keepdim=True)  # empty rows: allow all (outputs are zeroed later)
        keys = keys[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def dense_allowed(mask: Tensor | None, length: int, causal: bool, device: torch.device,
                  window: int | None = None) -> Tensor | None:
    """:func:`attention_bias_mask`, optionally restricted to a band: ``window`` keeps ``|i - j| <= window``.

    So causal + window keeps ``i - window <= j <= i``; pad keys are excluded; fully padded rows keep every key.
    """
    allowed = attention_bias_mask(mask, length, causal, device)
    if window is not None:
        pos = torch.arange(length, device=device)
        band = ((pos[:, None] - pos[None, :]).abs() <= window)[None, None]
        allowed = band if allowed is None else allowed & band
    return allowed


def masked_softmax(scores: Tensor, allowed: Tensor | None) -> Tensor:
    """Softmax over the last axis, restricted to ``allowed`` keys.

    Disallowed scores are set to the dtype's most negative finite value, not ``-inf``: a row with no allowed key (a
    pad query) then gives a finite uniform row instead of NaN, and NaN never reaches the gradients. Any row with at
    least one allowed key is exact: its disallowed entries underflow to zero.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1)


def check_mixer_input(module: nn.Module, x: Tensor, mask: Tensor | None, dim: int) -> tuple[Tensor, Tensor | None]:
    """Clear errors for every way an input can be wrong (rank, width, dtype, device, mask)."""
    if not isinstance(x, Tensor):
        raise MixerInputError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise MixerInputError(
            f"input must have shape (batch, length, dim={dim}); got a {x.dim()}-D tensor of shape {tuple(x.shape)}"
        )
    if x.shape[-1] != dim:
        raise MixerInputError(f"input width {x.shape[-1]} does not match the mixer's dim={dim}")
    if x.shape[1] == 0:
        raise MixerInputError("input length must be at least 1")
    if not x.dtype.is_floating_point:
        raise MixerInputError(f"input must be a floating-point tensor, got dtype {x.dtype}")
    param = next(iter(module.parameters()), None)
    if param is not None:
        if param.device != x.device and param.device.type != "meta":
            raise MixerInputError(f"input is on {x.device} but the mixer's parameters are on {param.device}")
        if (
            param.dtype != x.dtype
            and param.dtype.is_floating_point
            and not torch.is_autocast_enabled(x.device.type)
        ):
            raise MixerInputError(
                f"input dtype {x.dtype} does not match the mixer's parameters ({param.dtype}); "
                f"convert one of them (e.g. mixer.to({x.dtype})) or run under torch.autocast"
            )
    if mask is not None:
        mask = padding_mask_to_bool(mask.to(x.device), x.shape[0], x.shape[1])
    return x, mask


def set_nonfinite_guard(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn the non-finite guard of every mixer in ``module`` (itself included) on or off; returns ``module``.

    With it on, a causal mixer's outputs before a non-finite input token are those of the clean input, and NaN from
    that token on (``forward``, ``materialize``, ``prefill`` and ``step``). It costs a pass over the input (and q, k,
    v in the softmax mixers) per call, so mixers are built with it off."""
    for m in module.modules():
        if hasattr(m, "guard_nonfinite"):
            setattr(m, "guard_nonfinite", enabled)  # noqa: B010 (any module with the attribute, a plugin too)
    return module
