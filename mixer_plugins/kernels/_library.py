"""Helpers for our autograd functions and custom ops: saved tensors by name, never by position; the types of their
hooks' arguments."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["Grads", "Shape", "save_tensors", "saved_tensors"]

#: A tensor's shape, as a FLOP formula (``torch.utils.flop_counter.register_flop_formula``) receives it.
Shape = Sequence[int]
#: What a backward returns: one gradient (or None) per input.
Grads = tuple[torch.Tensor | None, ...]


def save_tensors(ctx: Any, **tensors: torch.Tensor | None) -> None:
    """``ctx.save_for_backward`` by name (``None`` allowed); read them back with :func:`saved_tensors`."""
    ctx.saved_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def saved_tensors(ctx: Any) -> SimpleNamespace:
    """The tensors :func:`save_tensors` stored, as attributes by name."""
    return SimpleNamespace(**dict(zip(ctx.saved_names, ctx.saved_tensors)))
