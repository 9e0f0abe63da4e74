"""Reload a model a recipe saved, through fairseq2's own ``load_model``."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fairseq2.assets import AssetCard
from fairseq2.checkpoint import ModelMetadataLoader
from fairseq2.device import CPU, Device
from fairseq2.models import ModelStateDictConverter, load_model
from fairseq2.runtime.dependency import DependencyResolver, get_dependency_resolver
from torch.nn import Module

from ...mixers.base import RECORD_KEY, MixerCheckpointMismatchError, read_mixer_record, record_differences

__all__ = ["load_mixer_checkpoint", "read_model_metadata", "saved_steps", "with_mixer_records"]

#: File name of the model metadata: fairseq2 writes ``checkpoints/model.yaml``; the recipe's steps keep a copy.
MODEL_METADATA = "model.yaml"


def saved_steps(checkpoint_dir: Path) -> list[int]:
    """The steps saved in ``checkpoint_dir`` (``step_N`` folders; a step still being written is ``step_N.tmp``), in
    order. fairseq2 resumes from the last full one and overwrites a step it saves again, so each of them is at stake."""
    return sorted(int(p.name[5:]) for p in Path(checkpoint_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def read_model_metadata(resolver: DependencyResolver, path: Path) -> dict[str, Any] | None:
    """The ``model.yaml`` mapping at ``path``, or None when it is missing, empty, cut or not a model's metadata."""
    from fairseq2.utils.yaml import YamlError, YamlLoader

    if not path.is_file():
        return None
    try:
        docs = resolver.resolve(YamlLoader).load(path)
    except (YamlError, OSError, ValueError):
        return None
    saved = docs[0] if docs else None
    if not isinstance(saved, dict) or not isinstance(saved.get("model_config"), dict) or "model_family" not in saved:
        return None
    return saved


def _missing_fields(resolver: DependencyResolver, saved: dict[str, Any]) -> list[str]:
    """The fields of its family's model config that a ``model.yaml`` mapping lacks: YAML cut between two lines still
    parses, with the last fields missing (empty for a family fairseq2 does not know: it reports that itself)."""
    from fairseq2.models import ModelFamily
    from fairseq2.runtime.dependency import DependencyLookup

    family = DependencyLookup(resolver, ModelFamily).maybe_get(str(saved["model_family"]))
    if family is None or not dataclasses.is_dataclass(family.config_kls):
        return []
    return [f.name for f in dataclasses.fields(family.config_kls) if f.name not in saved["model_config"]]


def _stand_in_problem(resolver: DependencyResolver, cut: dict[str, Any], whole: dict[str, Any] | None) -> str | None:
    """Why the folder's ``model.yaml`` (``whole``) cannot stand in for a step's cut copy (``cut``), or None when it
    can: it is whole, of the same family, and agrees with every field of the cut copy but the last (which the cut
    may have split)."""
    if whole is None or _missing_fields(resolver, whole):
        return "is missing or cut too"
    kept = list(cut["model_config"].items())[:-1]
    if whole["model_family"] != cut["model_family"] or any(whole["model_config"].get(k) != v for k, v in kept):
        return "holds another model config"
    return None


def load_mixer_checkpoint(checkpoint_dir: Path, *, step: int | None = None, device: Device = CPU,
                          dtype: torch.dtype | None = None) -> Module:
    """Reload a model saved by a recipe, through fairseq2's own ``load_model``.

    ``checkpoint_dir`` is the run's ``checkpoints`` folder (holding ``model.yaml`` and ``step_N/``);
    ``step=None`` takes the last step. The model config is the one the step was trained with: the step's own copy
    (``step_N/model.yaml``, which the recipe writes), else the folder's ``model.yaml`` (read by fairseq2's
    ``ModelMetadataLoader``, the metadata ``register_checkpoint_models`` exposes as ``checkpoint_step_N`` /
    ``last_checkpoint``). So family, config (the mixer included) and weights all come from the checkpoint, and a
    cut or empty ``checkpoints/model.yaml`` (fairseq2 rewrites it at every start) does not lose the run. A cut
    ``step_N/model.yaml`` (its config lacks fields) is replaced by the folder's ``model.yaml`` when that one is whole
    and agrees with it (with a warning), else it is a ``ValueError`` naming both files.
    A relative ``checkpoint_dir`` is taken from the current working directory. Initialises fairseq2 if needed.
    """
    folder = Path(checkpoint_dir).expanduser().resolve()   # fairseq2's asset cards take absolute paths only
    resolver = get_dependency_resolver()
    steps = saved_steps(folder)
    chosen = (steps[-1] if steps else None) if step is None else step
    if chosen is not None and chosen in steps:
        step_file = folder / f"step_{chosen}" / MODEL_METADATA
        saved = read_model_metadata(resolver, step_file)
        missing = [] if saved is None else _missing_fields(resolver, saved)
        if saved is not None and missing:  # cut: the folder's model.yaml stands in if it is whole and agrees
            problem = _stand_in_problem(resolver, saved, read_model_metadata(resolver, folder / MODEL_METADATA))
            if problem is not None:
                raise ValueError(
                    f"{step_file} is cut (its model_config lacks {', '.join(missing)}) and {folder / MODEL_METADATA} "
                    f"{problem}: restore {step_file}, the model.yaml of the run that saved step {chosen}"
                )
            warnings.warn(f"{step_file} is cut (its model_config lacks {', '.join(missing)}); the model config is "
                          f"read from {folder / MODEL_METADATA}, which agrees with the fields it has", stacklevel=2)
            saved = None
        if saved is not None:
            base = {"model_family": saved["model_family"], "model_config": saved["model_config"],
                    "__base_path__": folder}
            weights = _file_uri(folder / f"step_{chosen}" / "model")
            card = AssetCard(f"checkpoint_step_{chosen}", {"checkpoint": weights}, base=AssetCard("checkpoint", base))
            return load_model(card, device=device, dtype=dtype)
    if not (folder / MODEL_METADATA).is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a recipe checkpoint folder (no model.yaml); pass OUT_DIR/checkpoints"
        )
    provider = resolver.resolve(ModelMetadataLoader).load(folder)
    name = "last_checkpoint@" if step is None else f"checkpoint_step_{step}@"
    metadata = provider.maybe_get_metadata(name)
    base_metadata = provider.maybe_get_metadata("checkpoint@")
    if metadata is None or base_metadata is None:
        found = sorted(n for n in provider.asset_names if n.startswith("checkpoint_step_"))
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {'checkpoint' if step is None else f'step {step}'} to load "
            f"(found: {', '.join(found) or 'none'})"
        )
    metadata = {k: v for k, v in metadata.items() if k != "base"}
    metadata["checkpoint"] = _file_uri(Path(str(metadata["checkpoint"])))
    card = AssetCard(name.rstrip("@"), metadata, base=AssetCard("checkpoint", base_metadata))
    return load_model(card, device=device, dtype=dtype)


def _file_uri(path: Path) -> str:
    """``path`` as an asset card's ``checkpoint`` field. fairseq2 turns a plain path into a percent-encoded URI and
    reads the path back without decoding it, so a folder with a space in its name would not be found; a ``file://``
    URI written out as is reads back as the path itself."""
    return "file://" + path.as_posix()


def with_mixer_records(factory: Callable[[Any], Module],
                       converter: Callable[[dict[str, object], Any], dict[str, object]] | None = None
                       ) -> ModelStateDictConverter[Any]:
    """A family's ``state_dict_converter`` that handles the mixers' records (their name and options, the
    ``..._extra_state`` entries of :class:`~mixer_plugins.MatrixMixer`), around ``converter`` (if any).

    fairseq2's ``load_model`` copies a checkpoint's tensors into the model's own state (not through
    ``load_state_dict``), so the mixers' own check does not run there. This converter does it: each record of the
    checkpoint must match the mixer the config builds (:class:`MixerCheckpointMismatchError` otherwise, naming both),
    and a checkpoint without records gets the config's, so it loads without the check. The expected records come
    from the model built on the meta device (no memory, no initialisation).
    """

    def convert(state_dict: dict[str, object], config: Any) -> dict[str, object]:
        if converter is not None:
            state_dict = converter(state_dict, config)
        with torch.device("meta"):
            model = factory(config)
        for key, expected in model.state_dict().items():
            if key.rsplit(".", 1)[-1] != RECORD_KEY:
                continue
            own = read_mixer_record(expected)
            if own is None:
                continue
            if key not in state_dict:
                state_dict[key] = expected
                continue
            saved = read_mixer_record(state_dict[key])
            if saved is None:
                raise MixerCheckpointMismatchError(f"{key!r} in the checkpoint is not a mixer-plugins record")
            module = model.get_submodule(key.rsplit(".", 1)[0])
            problems = record_differences(saved, own, length_free=getattr(module, "max_seq_len", None) is None,
                                          config_class=type(getattr(module, "config", None)))
            if problems:
                raise MixerCheckpointMismatchError(
                    f"{key.rsplit('.', 1)[0]}: the checkpoint holds mixer {saved.get('mixer') or saved.get('class')!r}"
                    f" and the model config builds {own.get('mixer') or own.get('class')!r}, with other settings "
                    f"(checkpoint -> config: {'; '.join(problems)}); load it with the config it was saved with"
                )
        return state_dict

    return convert
