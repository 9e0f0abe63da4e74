"""Loading attention checkpoints into models whose mixers changed: every compatible tensor, and a report.

A tensor is *compatible* when the model has a tensor of the same name and shape. Attention checkpoints name the
attention's tensors ``blocks.{i}.attn.<name>``; our adapter keeps the mixer under ``blocks.{i}.attn.mixer``, so
``attn.<name>`` is also tried as ``attn.mixer.<name>``. The ``attention`` mixer lays out ``qkv`` and ``proj``
exactly like timm's ``Attention``, so a ViT checkpoint loads into it completely; other mixers keep only what
matches (often ``proj``) and initialise the rest. Nothing is dropped silently: :class:`WeightLoadReport` lists
what was not loaded and :class:`PartialWeightsWarning` says so.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["WeightLoadReport", "PartialWeightsWarning", "load_compatible_state_dict", "pretrained_filter"]


class PartialWeightsWarning(UserWarning):
    """Some tensors of a model were not loaded from a checkpoint (they keep their initialisation)."""


def _group(keys: Iterable[str]) -> list[str]:
    """Collapse block indices (``blocks.3.attn.x`` -> ``blocks.*.attn.x``) so warnings stay readable."""
    seen: dict[str, None] = {}
    for key in keys:
        seen.setdefault(re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", key), None)
    return list(seen)


@dataclasses.dataclass
class WeightLoadReport:
    """What a (partial) checkpoint load did.

    Attributes:
        source: where the weights came from (a file, ``"pretrained"``, ``"swapped attention"``).
        loaded: model tensors filled from the checkpoint.
        missing: model tensors not in the checkpoint (or of another shape); they keep their initialisation.
        unused: checkpoint tensors the model did not take (no such name, or another shape).
        mismatched: ``(name, checkpoint shape, model shape)`` for same-named tensors of different shapes.
        classifier_reset: classifier tensors deliberately not loaded because ``num_classes`` changed.
    """

    source: str
    loaded: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=list)
    classifier_reset: list[str] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every model tensor was loaded (a reset classifier aside) and every checkpoint tensor used."""
        return not (set(self.missing) - set(self.classifier_reset)) and not self.unused

    def summary(self) -> str:
        lines = [f"loaded {len(self.loaded)} of {len(self.loaded) + len(self.missing)} tensors from {self.source}"]
        not_loaded = [k for k in self.missing if k not in self.classifier_reset]
        if not_loaded:
            lines.append(f"not loaded, kept at initialisation ({len(not_loaded)}): {', '.join(_group(not_loaded))}")
        if self.mismatched:
            shapes = {f"{_group([n])[0]} {tuple(a)} vs model {tuple(b)}": None for n, a, b in self.mismatched}
            lines.append(f"shape mismatches ({len(self.mismatched)}): {', '.join(shapes)}")
        if self.unused:
            lines.append(f"checkpoint tensors not used ({len(self.unused)}): {', '.join(_group(self.unused))}")
        if self.classifier_reset:
            lines.append(f"classifier re-initialised for the new num_classes: {', '.join(self.classifier_reset)}")
        return "\n  ".join(lines)

    def warn_if_partial(self, stacklevel: int = 3) -> None:
        if not self.complete:
            warnings.warn("partial weight load: " + self.summary(), PartialWeightsWarning, stacklevel=stacklevel)


def _prepare(state_dict: Mapping[str, Tensor], model_state: Mapping[str, Tensor]
             ) -> tuple[dict[str, Tensor], dict[str, str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Rename ``...attn.<name>`` to ``...attn.mixer.<name>`` where only the latter exists in the model, and drop
    same-named tensors of another shape (they would make ``load_state_dict`` fail). Returns the tensors to load,
    new name -> checkpoint name (reports speak of the checkpoint's names) and the shape mismatches."""
    kept: dict[str, Tensor] = {}
    original: dict[str, str] = {}
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, value in state_dict.items():
        name, parts = key, key.split(".")
        if key not in model_state and "attn" in parts:
            at = parts.index("attn") + 1
            candidate = ".".join(parts[:at] + ["mixer"] + parts[at:])
            name = candidate if candidate in model_state else key
        original[name] = key
        target = model_state.get(name)
        if target is not None and isinstance(value, Tensor) and tuple(value.shape) != tuple(target.shape):
            mismatched.append((key, tuple(value.shape), tuple(target.shape)))
        else:
            kept[name] = value
    return kept, original, mismatched


def _report(source: str, model_keys: Iterable[str], missing: list[str], unexpected: Iterable[str],
            original: Mapping[str, str], mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
            classifier_reset: list[str] | None = None) -> WeightLoadReport:
    """A report from what ``load_state_dict`` said (``missing``, ``unexpected``) and what :func:`_prepare` did."""
    reset = [k for k in classifier_reset or [] if k in missing]
    # timm drops the old classifier on purpose when num_classes changes; our filter may have seen it first as a
    # shape mismatch, which is then expected rather than worth reporting.
    mismatched = [m for m in mismatched if m[0] not in reset]
    return WeightLoadReport(
        source=source,
        loaded=[k for k in model_keys if k not in set(missing)],
        missing=missing,
        unused=[original.get(k, k) for k in unexpected] + [m[0] for m in mismatched],
        mismatched=mismatched,
        classifier_reset=reset,
    )


def load_compatible_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], *, source: str = "state_dict",
                               warn: bool = True) -> WeightLoadReport:
    """Load every tensor of ``state_dict`` whose name and shape match ``model``; report the rest.

    Use it after :func:`~mixer_plugins.backbones.timm.swap_mixer` to bring back weights of the original model,
    or to load an attention checkpoint into a model with another mixer. Warns
    (:class:`PartialWeightsWarning`) unless everything matched.
    """
    model_state = model.state_dict()
    kept, original, mismatched = _prepare(state_dict, model_state)
    result = model.load_state_dict(kept, strict=False)
    report = _report(source, model_state, list(result.missing_keys), result.unexpected_keys, original, mismatched)
    if warn:
        report.warn_if_partial(stacklevel=3)
    return report


def pretrained_filter(base_filter: Callable[..., dict[str, Tensor]] | None, box: dict[str, Any]
                      ) -> Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]]:
    """A timm ``pretrained_filter_fn`` that remaps attention keys, drops shape mismatches and records the load.

    ``box`` receives what :func:`_prepare` did and, through a ``load_state_dict`` post-hook registered on the
    model, ``missing`` / ``unexpected`` of the load timm then performs (after its own classifier adaptation), so
    :func:`report_from_box` can state exactly what was loaded.
    """

    def filter_fn(state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        if base_filter is not None:
            state_dict = base_filter(state_dict, model)
        model_state = model.state_dict()
        state_dict, box["original"], box["mismatched"] = _prepare(state_dict, model_state)
        box["model_keys"] = list(model_state)

        def capture(module: nn.Module, incompatible: Any) -> None:
            box["missing"], box["unexpected"] = list(incompatible.missing_keys), list(incompatible.unexpected_keys)

        box["handle"] = model.register_load_state_dict_post_hook(capture)
        return state_dict

    return filter_fn


def report_from_box(box: dict[str, Any], source: str, classifier_reset: list[str]) -> WeightLoadReport | None:
    """Turn what :func:`pretrained_filter` recorded into a report; None if timm never loaded a state dict."""
    handle = box.pop("handle", None)
    if handle is not None:
        handle.remove()
    if "missing" not in box:
        return None
    return _report(source, box["model_keys"], box["missing"], box["unexpected"], box["original"], box["mismatched"],
                   classifier_reset)
