"""Re-draw a mixer's own initialisation in place, for the adapters whose host re-initialises modules.

timm re-initialises a model after building it (and on ``model.init_weights()``), fairseq2 when it materialises a
meta-device model; both must end with the mixer's *own* initialisation, not their generic one. A mixer that has
``reset_parameters()`` does that itself; for one that has not, a fresh instance of the same config is built and
its state copied in (``load_state_dict`` converts dtypes, so a bf16 or mixed-precision mixer keeps its dtypes).

This module imports neither timm nor fairseq2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["reinitialize_mixer"]


def reinitialize_mixer(mixer: nn.Module, rebuild: Callable[[], nn.Module]) -> None:
    """Re-draw ``mixer``'s own initialisation: ``mixer.reset_parameters()`` where it has one, else copy the state
    of ``rebuild()`` (a fresh instance of the same config, built on the mixer's device).

    Mixers on the meta device have no values to re-draw and are left alone.
    """
    reference: Tensor | None = next(iter(mixer.parameters()), None)
    if reference is None:
        reference = next(iter(mixer.buffers()), None)
    if reference is not None and reference.device.type == "meta":
        return
    reset = getattr(mixer, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    if reference is None:
        return  # nothing to re-draw
    with torch.device(reference.device):
        fresh = rebuild()
    mixer.load_state_dict(fresh.state_dict())
