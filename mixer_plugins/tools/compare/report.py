"""The plots of ``mixer-plugins compare``: the metric against training steps, and the final metric per mixer.

matplotlib is imported only here and only when a plot is written (it is in the ``demo`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..plotting import figure, save_figure
from .stats import mean_var

if TYPE_CHECKING:
    from .runner import CompareResult

__all__ = ["save_curves", "save_final"]


def _title(result: CompareResult) -> str:
    name = result.config.preset or result.task.name
    knobs = ", ".join(f"{k}={v}" for k, v in result.task.knobs().items())
    return f"{name}\n{result.task.name} ({knobs})"


def _better(result: CompareResult) -> str:
    return "higher is better" if result.task.higher_is_better else "lower is better"


def save_curves(result: CompareResult, path: Path) -> Path:
    """Test metric against training steps: the mean over seeds per mixer, with a band of one std."""
    with figure(figsize=(7.5, 4.5)) as (fig, ax):
        for entry in result.config.entries:
            runs = [r for r in result.runs if r.label == entry.label and r.error is None]
            if not runs:
                continue
            steps = [s for s, _ in runs[0].curve]
            values = [[v for _, v in r.curve] for r in runs]
            mean, var = zip(*(mean_var(col) for col in zip(*values)))
            std = [v ** 0.5 for v in var]
            (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=entry.label)
            if len(runs) > 1:
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=line.get_color(), alpha=0.15)
        for name, value in result.reference.items():
            ax.axhline(value, color="grey", linestyle="--", linewidth=1, label=name)
        ax.set_xlabel("training step")
        ax.set_ylabel(f"test {result.metric_name} ({_better(result)})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        ax.set_title(_title(result), fontsize=9)
        return save_figure(fig, path)


def save_final(result: CompareResult, path: Path) -> Path:
    """Final test metric per mixer: the mean over seeds with an error bar of one std, and each seed as a dot."""
    summaries = [s for s in result.summaries() if s.mean is not None]
    with figure(figsize=(max(6.0, 0.75 * len(summaries) + 2.5), 4.5)) as (fig, ax):
        xs = range(len(summaries))
        ax.bar(xs, [s.mean for s in summaries], yerr=[s.std for s in summaries], capsize=4, color="#8fb3d9",
               edgecolor="#35618f")
        for x, s in zip(xs, summaries):
            seeds = result.seed_metrics(s.label)
            ax.scatter([x] * len(seeds), seeds, color="black", s=10, zorder=3)
        for name, value in result.reference.items():
            ax.axhline(value, color="grey", linestyle="--", linewidth=1, label=name)
            ax.legend(fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([s.label for s in summaries], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(f"final test {result.metric_name} ({_better(result)})")
        ax.grid(axis="y", alpha=0.3)
        n_seeds = max(s.seeds for s in summaries) if summaries else 0
        ax.set_title(_title(result).replace("\n", f", {n_seeds} seeds\n", 1), fontsize=8)
        return save_figure(fig, path)
