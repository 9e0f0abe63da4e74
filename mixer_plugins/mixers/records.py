"""Checkpoint records: what a mixer's ``state_dict`` says about the mixer that wrote it.

A mixer's ``state_dict`` holds one extra entry, ``<prefix>_extra_state`` (PyTorch's extra-state mechanism): a uint8
tensor of UTF-8 JSON naming the mixer (its registry name, or its class when built without the registry) and its
options. A tensor, so every checkpoint path that expects tensors only (fairseq2's, ``torch.load(weights_only=True)``,
``torch.distributed.checkpoint``) carries it unchanged. ``load_state_dict`` compares it with the mixer being loaded and
raises :class:`MixerCheckpointMismatchError`, naming both, when the checkpoint holds another mixer or other options
(except :data:`CHECKPOINT_FREE_OPTIONS`, and ``max_seq_len`` for a mixer that runs at any length).

A checkpoint without the entry loads without the check; to load weights into another mixer on purpose, drop the
records first: ``model.load_state_dict(strip_mixer_records(state_dict))``. A subclass that keeps another code's key
set (the :mod:`mixer_plugins.compat` drop-ins) turns the record off with ``get_extra_state =
nn.Module.get_extra_state`` (and ``set_extra_state`` likewise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import MixerCheckpointMismatchError
from ..registry.spec import MixerConfig

__all__ = ["CHECKPOINT_FREE_OPTIONS", "RECORD_KEY", "check_record_on_load", "encode_record", "mixer_record",
           "read_mixer_record", "record_differences", "strip_mixer_records"]

#: The state_dict key (after the module's prefix) of a mixer's record: PyTorch's extra-state entry.
RECORD_KEY = "_extra_state"
_RECORD_FORMAT = "mixer-plugins/1"
#: Options that never change what trained weights compute, so checkpoints may differ in them: how the result is
#: computed (``chunk_size``), training-time noise (dropout rates) and initialisation only (the loaded weights replace
#: what they drew).
CHECKPOINT_FREE_OPTIONS = frozenset({"chunk_size", "dropout", "attn_dropout", "dt_min", "dt_max", "dt_init_floor",
                                     "A_init_range", "conv_init"})


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists, inf stays inf); unknown objects by their repr."""
    return json.loads(json.dumps(value, default=repr))


def mixer_record(mixer: nn.Module) -> dict[str, Any]:
    """What a mixer's ``state_dict`` records: ``{"format", "mixer", "class", "options"}``.

    ``mixer`` is the registry name (None for a mixer built without the registry), ``class`` the module's class name,
    ``options`` its validated config (``dim`` included).
    """
    config = getattr(mixer, "config", None)
    options = config.model_dump() if isinstance(config, MixerConfig) else {}
    return {"format": _RECORD_FORMAT, "mixer": getattr(mixer, "mixer_name", None),
            "class": type(mixer).__qualname__, "options": _plain(options)}


def encode_record(record: Mapping[str, Any]) -> Tensor:
    data = json.dumps(record, sort_keys=True).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.uint8)


def read_mixer_record(value: object) -> dict[str, Any] | None:
    """The record held by a state_dict entry, or None when it holds none (empty, on the meta device, or not ours).

    Accepts the uint8 tensor a mixer saves, and the same bytes in any numeric dtype (a checkpoint converted wholesale
    to float16 or bfloat16 keeps them exactly).
    """
    if not isinstance(value, Tensor) or value.dim() != 1 or value.numel() == 0 or value.device.type == "meta":
        return None
    codes = value.detach().to("cpu", torch.float64)
    if not bool(((codes >= 0) & (codes <= 255) & (codes == codes.round())).all()):
        return None
    try:
        record = json.loads(bytes(codes.to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT:
        return None
    return record


def strip_mixer_records(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without the mixers' records: loading it skips the mixer/option check (as for a
    checkpoint without records). Use it to load weights into another mixer on purpose."""
    return {k: v for k, v in state_dict.items()
            if not (k.rsplit(".", 1)[-1] == RECORD_KEY and read_mixer_record(v) is not None)}


def _describe(record: Mapping[str, Any]) -> str:
    return repr(record.get("mixer") or record.get("class"))


def record_differences(saved: Mapping[str, Any], own: Mapping[str, Any], *, length_free: bool,
                       config_class: type | None = None) -> list[str]:
    """What differs between a saved record and a mixer's own (empty: compatible).

    ``length_free``: the mixer runs at any length, so ``max_seq_len`` does not matter. ``config_class`` (the mixer's
    config model) lets records of other library versions compare: an option the checkpoint does not know matches
    when the mixer has its default (the behaviour of a version without the option); an option the checkpoint has
    and the mixer does not is not compared.
    """
    if saved.get("mixer") and own.get("mixer"):
        if saved["mixer"] != own["mixer"]:
            return [f"mixer {saved['mixer']!r} -> {own['mixer']!r}"]
    elif saved.get("class") != own.get("class"):
        return [f"class {saved.get('class')!r} -> {own.get('class')!r}"]
    fields = getattr(config_class, "model_fields", {})
    old = saved.get("options", {})
    new = own.get("options", {})
    free = CHECKPOINT_FREE_OPTIONS | ({"max_seq_len"} if length_free else set())
    problems = []
    for key in sorted(new):
        if key in free:
            continue
        if key in old:
            if old[key] != new[key]:
                problems.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        elif key in fields and not fields[key].is_required():
            default = _plain(fields[key].get_default(call_default_factory=True))
            if new[key] != default:
                problems.append(f"{key}: (not in the checkpoint: its default {default!r}) -> {new[key]!r}")
    return problems


def check_record_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                          strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                          error_msgs: list[str]) -> None:
    """``load_state_dict`` pre-hook of every mixer: compare the checkpoint's record with the mixer's own."""
    if type(module).get_extra_state is nn.Module.get_extra_state:
        return  # a subclass that keeps another code's key set (compat.Hydra) records nothing
    key = prefix + RECORD_KEY
    if key not in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)  # no record: load without the check
        return
    value = state_dict[key]
    if isinstance(value, Tensor) and (value.numel() == 0 or value.device.type == "meta"):
        return
    saved = read_mixer_record(value)
    if saved is None:
        raise MixerCheckpointMismatchError(
            f"{key!r} is not a mixer-plugins record ({type(value).__name__} "
            f"{tuple(value.shape) if isinstance(value, Tensor) else ''}); it belongs to another module, or the "
            "checkpoint was altered. Drop it to load the weights without the check"
        )
    own = mixer_record(module)
    problems = record_differences(saved, own, length_free=getattr(module, "max_seq_len", None) is None,
                                  config_class=type(getattr(module, "config", None)))
    if problems:
        where = prefix[:-1] or "the mixer"
        raise MixerCheckpointMismatchError(
            f"{where}: the checkpoint holds mixer {_describe(saved)} and this is mixer {_describe(own)}, with other "
            f"settings (checkpoint -> this mixer: {'; '.join(problems)}). Build the model with the checkpoint's "
            "mixer and options, or, to load these weights anyway, drop the records: "
            "load_state_dict(strip_mixer_records(state_dict)) (mixer_plugins.mixers.base)"
        )
