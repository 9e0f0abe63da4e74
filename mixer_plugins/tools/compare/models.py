"""The small backbone every mixer is trained in (``docs/compare.md``, "The backbone"), and how ``--mixers`` entries
are parsed and their options fitted to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import mixer_plugins

from ...errors import MixerError
from ..cli.options import literal_value
from ..demo import small_model_options
from .tasks import Task

__all__ = ["MixerEntry", "SequenceModel", "adapted_options", "check_entry", "parse_mixers", "model_flops"]


@dataclasses.dataclass(frozen=True)
class MixerEntry:
    """One model of a comparison: a registered mixer, its options, and the label shown in tables and plots."""

    name: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        spec = mixer_plugins.get_spec(self.name)  # unknown names fail here, with "did you mean"
        object.__setattr__(self, "name", spec.name)
        object.__setattr__(self, "options", dict(self.options))
        if not self.label:
            opts = ",".join(f"{k}={v}" for k, v in self.options.items())
            object.__setattr__(self, "label", f"{spec.name}({opts})" if opts else spec.name)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "name": self.name, "options": dict(self.options)}


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses and brackets."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
            if depth < 0:
                raise MixerError(f"unbalanced parentheses in {text!r}")
        if char == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise MixerError(f"unbalanced parentheses in {text!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_mixer(text: str) -> MixerEntry:
    """``NAME``, ``NAME(key=value,...)`` or ``LABEL=NAME(key=value,...)`` -> :class:`MixerEntry`.

    Values are Python literals (``8``, ``False``, ``[4,4]``, ``None``); anything else is a string.
    """
    text = text.strip()
    label = ""
    head = text.split("(", 1)[0]
    if "=" in head:
        label, text = (part.strip() for part in text.split("=", 1))
    options: dict[str, Any] = {}
    if "(" in text:
        if not text.endswith(")"):
            raise MixerError(f"mixer entry {text!r}: options go in parentheses at the end, NAME(key=value,...)")
        name, inner = text[:-1].split("(", 1)
        for item in _split_top_level(inner):
            if "=" not in item:
                raise MixerError(f"mixer entry {text!r}: option {item!r} is not key=value")
            key, raw = item.split("=", 1)
            options[key.strip()] = literal_value(raw.strip())
    else:
        name = text
    if not name.strip():
        raise MixerError(f"mixer entry {text!r} has no mixer name")
    return MixerEntry(name.strip(), options, label)


def parse_mixers(text: str | Sequence[str | MixerEntry]) -> list[MixerEntry]:
    """A comma-separated list (commas inside parentheses belong to the options), or a sequence of entries.

    ``all`` expands to every registered mixer (plugins included) with its default options.
    """
    items = _split_top_level(text) if isinstance(text, str) else list(text)
    entries: list[MixerEntry] = []
    for item in items:
        if isinstance(item, MixerEntry):
            entries.append(item)
        elif item == "all":
            entries.extend(MixerEntry(name) for name in mixer_plugins.list_mixers())
        else:
            entries.append(parse_mixer(item))
    if not entries:
        raise MixerError("at least one mixer is needed")
    labels = [e.label for e in entries]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise MixerError(f"mixer labels must be unique; repeated: {', '.join(duplicates)} "
                         "(give them labels: LABEL=NAME(options))")
    return entries


def adapted_options(entry: MixerEntry, *, width: int, heads: int, seq_len: int, causal: bool) -> dict[str, Any]:
    """The entry's options filled in for the backbone where the mixer has the option and the user did not set it
    (``docs/compare.md``, "The backbone"); a bidirectional-only mixer in a causal comparison is refused."""
    spec = mixer_plugins.get_spec(entry.name)
    fields = spec.config.model_fields
    user = dict(entry.options)
    filled: dict[str, Any] = {}
    if "num_heads" in fields:
        filled["num_heads"] = heads
    if "head_dim" in fields and "expand" in fields:
        expand = user.get("expand", fields["expand"].get_default())
        if (expand * width) % heads == 0:
            filled["head_dim"] = expand * width // heads
    filled.update(small_model_options(fields, seq_len))
    if "max_seq_len" in fields:
        filled["max_seq_len"] = seq_len
    if causal:
        if "causal" in fields:
            filled["causal"] = True
        elif spec.direction != "causal":
            raise MixerError(f"{entry.label}: mixer {spec.name!r} is {spec.direction} only; it cannot run in a "
                             "causal comparison")
    return {**filled, **user}


def check_entry(entry: MixerEntry, *, width: int, heads: int, seq_len: int, causal: bool) -> None:
    """Raise :class:`MixerError` naming ``entry`` when its options, as :func:`adapted_options` fills them in, are
    not valid for the mixer's config (misspelt or mistyped options, bad values, a direction it cannot run):
    what :class:`SequenceModel` would refuse, found before any training."""
    spec = mixer_plugins.get_spec(entry.name)
    try:
        spec.make_config(width, **adapted_options(entry, width=width, heads=heads, seq_len=seq_len, causal=causal))
    except MixerError as err:
        raise MixerError(f"--mixers entry {entry.label!r}: {err}") from None


class _Block(nn.Module):
    def __init__(self, mixer: nn.Module, width: int, mlp_ratio: float):
        super().__init__()
        self.hidden = hidden = int(round(mlp_ratio * width))
        self.norm1 = nn.LayerNorm(width)
        self.mixer = mixer
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SequenceModel(nn.Module):
    """Embedding + positions, ``depth`` pre-LN blocks with the same mixer kind, final LN and readout.

    ``token_shift`` adds an embedding of the *previous* input to every position, as RWKV's token shift
    (``docs/compare.md``)."""

    def __init__(self, task: Task, entry: MixerEntry, *, width: int = 64, depth: int = 2, heads: int = 4,
                 mlp_ratio: float = 2.0, positions: bool = True, token_shift: bool = False, causal: bool = False):
        super().__init__()
        self.task = task
        self.readout = task.readout
        self.options = adapted_options(entry, width=width, heads=heads, seq_len=task.seq_len, causal=causal)
        if task.input_kind == "tokens":
            self.embed: nn.Module = nn.Embedding(task.input_size, width)
        else:
            self.embed = nn.Linear(task.input_size, width)
        self.shift_embed = type(self.embed)(task.input_size, width) if token_shift else None
        self.positions = nn.Parameter(torch.randn(1, task.seq_len, width) * 0.02) if positions else None
        self.blocks = nn.ModuleList(
            _Block(mixer_plugins.create_mixer(entry.name, width, **self.options), width, mlp_ratio)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, task.output_size)
        self.width = width

    def forward(self, inputs: Tensor) -> Tensor:
        x = self.embed(inputs)
        if self.shift_embed is not None:
            previous = self.shift_embed(inputs)
            x = x + torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
        if self.positions is not None:
            x = x + self.positions[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.readout == "mean":
            x = x.mean(dim=1)
        return self.head(x)


def model_flops(model: SequenceModel) -> int | None:
    """Analytic forward FLOPs (2 per multiply-add) for one example: each mixer's ``flops(1, L)`` plus the
    backbone's dense layers (embedding lookups and norms not counted). None when a mixer cannot count its FLOPs."""
    length, width = model.task.seq_len, model.width
    total = 0
    for block in model.blocks:
        assert isinstance(block, _Block)
        mixer_flops = getattr(block.mixer, "flops", None)
        if mixer_flops is None:
            return None
        try:
            total += int(mixer_flops(1, length))
        except (NotImplementedError, AttributeError):
            return None
        total += 2 * 2 * length * width * block.hidden
    if isinstance(model.embed, nn.Linear):
        total += 2 * length * model.embed.in_features * width * (2 if model.shift_embed is not None else 1)
    readout_tokens = 1 if model.readout == "mean" else length
    total += 2 * readout_tokens * width * model.head.out_features
    return total


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
