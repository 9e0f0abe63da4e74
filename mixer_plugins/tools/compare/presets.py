"""Presets: the papers' comparisons at small scale, each with what the paper reports and the orderings it implies.

A preset is a :class:`CompareConfig` recipe plus documentation. ``preset_config(name, quick=False, **overrides)``
builds the config; ``--quick`` shrinks the training (for CI: it checks that everything runs, not the orderings).
``docs/compare.md`` has the tables of the recorded run of each preset and the verdicts the current rule gives them
(``mixer-plugins compare --from docs/compare/runs/<preset>.json`` prints them again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...errors import MixerError
from .runner import CompareConfig, Ordering

__all__ = ["PRESETS", "Preset", "preset_config", "QUICK"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A reproduction recipe: the task, the mixer entries, the training, and the paper's claims."""

    name: str
    paper: str
    reports: str
    task: str
    task_options: Mapping[str, Any]
    mixers: tuple[str, ...]
    orderings: tuple[Ordering, ...]
    training: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def config(self, *, quick: bool = False, **overrides: Any) -> CompareConfig:
        """The preset's :class:`CompareConfig`; ``quick`` applies :data:`QUICK`; ``overrides`` win over both."""
        settings: dict[str, Any] = {"task": self.task, "task_options": dict(self.task_options),
                                    "mixers": list(self.mixers), "orderings": self.orderings, "preset": self.name,
                                    **self.training}
        if quick:
            settings.update(QUICK, quick=True)
        if "mixers" in overrides and "orderings" not in overrides:
            # keep the paper's orderings between the entries that are still compared (matched by label)
            from .models import parse_mixers

            labels = {e.label for e in parse_mixers(overrides["mixers"])}
            settings["orderings"] = tuple(o for o in self.orderings if o.better in labels and o.worse in labels)
        settings.update(overrides)
        return CompareConfig(**settings)


#: What ``--quick`` changes: a few steps, one seed, a small test set (a smoke run; orderings are not meaningful).
QUICK: dict[str, Any] = {"steps": 6, "eval_every": 3, "seeds": (0,), "test_size": 32, "batch_size": 16}

_RECALL = {"seq_len": 32, "num_kv_pairs": 4, "vocab_size": 32}
#: the recall presets' training: three seeds, the fewest with which an ordering can be called held (see
#: :mod:`.stats`)
_RECALL_TRAINING = {"steps": 600, "eval_every": 50, "seeds": (0, 1, 2), "batch_size": 32, "lr": 3e-3, "width": 64,
                    "token_shift": True}

PRESETS: dict[str, Preset] = {preset.name: preset for preset in (Preset(
    name="hydra-classes",
    paper="Hydra (Hwang, Lahoti, Dao, Gu 2024), matrix-mixer classes (data-dependent vs data-independent)",
    reports=("Hydra trains the same block with each matrix class, with the sequence-aligned (data-dependent) "
             "form and with free L x L parameters (data-independent), and reports that the data-dependent "
             "form of every class beats its data-independent form, and that the quasiseparable mixer is the "
             "best class. On associative recall, Zoology (Arora et al. 2023) reports that attention solves "
             "multi-query recall at small width where data-independent long convolutions do not."),
    task="mqar",
    task_options=_RECALL,
    mixers=(
        "attention",
        "quasiseparable",
        "toeplitz",
        "long_conv=toeplitz(data_dependent=False)",
        "low_rank",
        "low_rank_free=low_rank(data_dependent=False)",
        "dense",
    ),
    orderings=(
        Ordering("attention", "long_conv", "attention solves MQAR where a data-independent long convolution does "
                 "not (Zoology)"),
        Ordering("toeplitz", "long_conv", "data-dependent Toeplitz beats data-independent Toeplitz (Hydra)"),
        Ordering("low_rank", "low_rank_free", "data-dependent low-rank beats data-independent low-rank (Hydra)"),
        Ordering("quasiseparable", "dense", "quasiseparable beats the free dense matrix (Hydra)"),
        Ordering("quasiseparable", "toeplitz", "quasiseparable is the best class (Hydra)"),
        Ordering("quasiseparable", "low_rank", "quasiseparable is the best class (Hydra)"),
    ),
    training=_RECALL_TRAINING,
), Preset(
    name="hydra-bidirectional",
    paper="Hydra (Hwang et al. 2024), bidirectional ablations",
    reports=("Hydra compares ways of making an SSM bidirectional -- adding (add), multiplying (mult) or "
             "concatenating (concat) a forward and a backward SSM -- with the quasiseparable mixer, and "
             "ablates the quasiseparable mixer's shift and diagonal; the full quasiseparable mixer is best, "
             "and removing the shift or the diagonal costs accuracy."),
    task="mqar",
    task_options=_RECALL,
    mixers=(
        "quasiseparable",
        "bidirectional_add",
        "bidirectional_mult",
        "bidirectional_concat",
        "quasiseparable_no_shift",
        "quasiseparable_no_diag",
    ),
    orderings=tuple(
        Ordering("quasiseparable", other, "quasiseparable beats " + other + " (Hydra)")
        for other in ("bidirectional_add", "bidirectional_mult", "bidirectional_concat", "quasiseparable_no_shift",
                      "quasiseparable_no_diag")
    ),
    training=_RECALL_TRAINING,
), Preset(
    name="structured-attention",
    paper="Structured attention (Kuang et al. 2025), in-context regression at matched compute",
    reports=("With inputs of higher dimension than the head size, standard attention's per-head bilinear form "
             "W_Q W_K^T has rank at most head_dim; the paper's high-rank structured scores (Bilinear-BTT and "
             "Bilinear-MLR) reach lower in-context-regression error than standard attention at every fixed "
             "compute budget. (Its sequence-axis MLR attention is a language-modelling result about locality; "
             "it is included here for comparison, not because the paper claims it wins at regression.)"),
    task="regression",
    task_options={"dim": 16, "num_examples": 32, "num_queries": 8},
    mixers=(
        "attention",
        "btt_attention(num_heads=2)",
        "bilinear_mlr_attention",
        "mlr_attention",
    ),
    orderings=(
        Ordering("btt_attention(num_heads=2)", "attention",
                 "Bilinear-BTT beats standard attention at matched compute (paper)"),
        Ordering("bilinear_mlr_attention", "attention",
                 "Bilinear-MLR beats standard attention at matched compute (paper)"),
        Ordering("mlr_attention", "attention",
                 "not a claim of the paper, which reports MLR attention's win for language modelling, not here"),
    ),
    training={"steps": 200, "eval_every": 25, "seeds": (0, 1, 2), "batch_size": 32, "lr": 2e-3, "width": 64,
              "heads": 8},
))}


def preset_config(name: str, *, quick: bool = False, **overrides: Any) -> CompareConfig:
    """The :class:`CompareConfig` of preset ``name`` (``--quick`` settings with ``quick``), with ``overrides``."""
    from ..._text import did_you_mean

    if name not in PRESETS:
        raise MixerError(f"unknown preset {name!r}{did_you_mean(name, list(PRESETS))} (presets: {', '.join(PRESETS)})")
    return PRESETS[name].config(quick=quick, **overrides)
