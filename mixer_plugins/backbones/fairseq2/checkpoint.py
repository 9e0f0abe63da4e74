"""Reload a model a recipe saved, through fairseq2's own ``load_model``."""

from __future__ import annotations

from pathlib import Path

import torch
from fairseq2.assets import AssetCard
from fairseq2.checkpoint import ModelMetadataLoader
from fairseq2.device import CPU, Device
from fairseq2.models import load_model
from fairseq2.runtime.dependency import get_dependency_resolver
from torch.nn import Module

__all__ = ["load_mixer_checkpoint"]


def load_mixer_checkpoint(checkpoint_dir: Path, *, step: int | None = None, device: Device = CPU,
                          dtype: torch.dtype | None = None) -> Module:
    """Reload a model saved by a recipe, through fairseq2's own ``load_model``.

    ``checkpoint_dir`` is the run's ``checkpoints`` folder (holding ``model.yaml`` and ``step_N/``);
    ``step=None`` takes the last step. The card is built by fairseq2's ``ModelMetadataLoader`` (the same
    metadata ``register_checkpoint_models`` exposes as ``checkpoint_step_N`` / ``last_checkpoint``), so family,
    config (the mixer included) and weights all come from the checkpoint. Initialises fairseq2 if needed.
    """
    if not (Path(checkpoint_dir) / "model.yaml").is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a recipe checkpoint folder (no model.yaml); pass OUT_DIR/checkpoints"
        )
    provider = get_dependency_resolver().resolve(ModelMetadataLoader).load(Path(checkpoint_dir))
    name = "last_checkpoint@" if step is None else f"checkpoint_step_{step}@"
    metadata = provider.maybe_get_metadata(name)
    base = provider.maybe_get_metadata("checkpoint@")
    if metadata is None or base is None:
        steps = sorted(n for n in provider.asset_names if n.startswith("checkpoint_step_"))
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {'checkpoint' if step is None else f'step {step}'} to load "
            f"(found: {', '.join(steps) or 'none'})"
        )
    metadata = {k: v for k, v in metadata.items() if k != "base"}
    card = AssetCard(name.rstrip("@"), metadata, base=AssetCard("checkpoint", base))
    return load_model(card, device=device, dtype=dtype)
