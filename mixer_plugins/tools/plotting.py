"""Plots of the command line: mixer matrices as heat maps, learning curves, and log-log scaling plots.

matplotlib (the ``demo`` extra) is imported only when a plot is drawn, with the file-only ``Agg`` backend. Heat maps
take their colour scale from the off-diagonal entries, so a diagonal orders of magnitude larger saturates instead of
hiding the structure (``docs/cli.md``, ``show``); ``scale="log"`` shows ``log10 |M|``.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import MissingExtraError, MixerError
from . import SCALES

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "SCALES",
    "figure",
    "heatmap_limits",
    "matrix_to_image",
    "require_matplotlib",
    "save_learning_curves",
    "save_matrix_grid",
    "save_matrix_heatmap",
    "save_figure",
    "save_scaling_plot",
]


def require_matplotlib() -> ModuleType:
    """``matplotlib.pyplot`` with the Agg backend, or :class:`MissingExtraError` naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(
            "plots need matplotlib, which is not installed; install the demo extra: pip install 'mixer-plugins[demo]'"
        ) from None
    # Agg renders to files only; selecting it before pyplot is imported never opens a window (CI has no display).
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(*args: Any, **kwargs: Any) -> Iterator[tuple[Figure, Any]]:
    """``with figure(...) as (fig, axes)``: ``plt.subplots(*args, **kwargs)``, the figure closed after the block."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
    finally:
        plt.close(fig)


def matrix_to_image(matrix: Tensor, head: int | str = "mean") -> Tensor:
    """One (L, L) float64 picture from a materialized matrix.

    ``matrix`` is ``(heads, L, L)``, ``(batch, heads, L, L)`` (the first batch row is used) or ``(L, L)``; ``head``
    is a head index or ``"mean"`` (the average over heads).
    """
    m = matrix.detach().to("cpu", torch.float64)
    if m.dim() == 4:
        m = m[0]
    if m.dim() == 2:
        m = m[None]
    if m.dim() != 3 or m.shape[-1] != m.shape[-2]:
        raise MixerError(f"expected a (batch, heads, L, L) matrix, got shape {tuple(matrix.shape)}")
    if head == "mean":
        return m.mean(0)
    if not isinstance(head, int) or not (-m.shape[0] <= head < m.shape[0]):
        raise MixerError(f"head must be 'mean' or an index in [0, {m.shape[0]}), got {head!r}")
    return m[head]


def heatmap_limits(image: Tensor) -> tuple[float, float, bool]:
    """(vmin, vmax, diverging) of the colour scale: set by the off-diagonal entries (see the module docstring).

    Diverging (symmetric around zero) when the picture has negative entries, else from zero up.
    """
    n = image.shape[-1]
    off = image[~torch.eye(n, dtype=torch.bool)] if n > 1 else image.flatten()
    reference = off if off.abs().max() > 0 else image.flatten()
    top = float(reference.abs().max()) or 1.0
    diverging = bool((image < 0).any())
    return (-top if diverging else 0.0), top, diverging


def _draw_matrix(ax: Axes, image: Tensor, title: str, scale: str) -> None:
    if scale not in SCALES:
        raise MixerError(f"scale must be one of {SCALES}, got {scale!r}")
    if scale == "log":
        data = image.abs().clamp_min(1e-12).log10().numpy()
        finite = data[data > -12]
        low = float(finite.min()) if finite.size else -12.0
        im = ax.imshow(data, cmap="magma", vmin=max(low, float(data.max()) - 8), interpolation="nearest")
        label = "log10 |M|"
        extend = "neither"
    else:
        vmin, vmax, diverging = heatmap_limits(image)
        im = ax.imshow(image.numpy(), cmap="RdBu_r" if diverging else "viridis", vmin=vmin, vmax=vmax,
                       interpolation="nearest")
        saturated = bool((image.abs() > vmax * (1 + 1e-9)).any())
        label = "M" + (" (diagonal saturated)" if saturated else "")
        extend = ("both" if diverging else "max") if saturated else "neither"
    ax.set_title(textwrap.fill(title, 48), fontsize=9)
    ax.set_xlabel("j (input token)", fontsize=8)
    ax.set_ylabel("i (output token)", fontsize=8)
    ax.tick_params(labelsize=7)
    bar = ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, extend=extend)
    bar.set_label(label, fontsize=7)
    bar.ax.tick_params(labelsize=7)


def save_matrix_heatmap(matrix: Tensor, path: str | Path, *, title: str = "", head: int | str = "mean",
                        scale: str = "linear") -> Path:
    """Write a heat map of one mixer matrix (see :func:`matrix_to_image`) to ``path`` (PNG)."""
    with figure(figsize=(5.2, 4.4)) as (fig, ax):
        _draw_matrix(ax, matrix_to_image(matrix, head), title, scale)
        return save_figure(fig, path)


def save_matrix_grid(matrices: Mapping[str, Tensor | str], path: str | Path, *, input_image: Tensor | None = None,
                     input_title: str = "input", head: int | str = "mean", scale: str = "linear",
                     suptitle: str = "") -> Path:
    """One heat map per entry of ``matrices`` (a matrix, or a string saying why there is none), in a grid.

    ``input_image`` (a 2-D tensor, e.g. the digit the matrices were computed on) is drawn first, in grey.
    """
    panels: list[tuple[str, Any]] = []
    if input_image is not None:
        panels.append((input_title, input_image))
    panels += list(matrices.items())
    cols = min(3, len(panels)) or 1
    rows = (len(panels) + cols - 1) // cols
    with figure(rows, cols, figsize=(4.6 * cols, 4.0 * rows), squeeze=False) as (fig, axes):
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax, (title, item) in zip(axes.flat, panels):
            if input_image is not None and item is input_image:
                ax.imshow(item.detach().cpu().numpy(), cmap="gray_r", interpolation="nearest")
                ax.set_title(title, fontsize=9)
                ax.axis("off")
            elif isinstance(item, str):
                ax.axis("off")
                ax.set_title(title, fontsize=9)
                ax.text(0.5, 0.5, item, ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes)
            else:
                _draw_matrix(ax, matrix_to_image(item, head), title, scale)
        return save_figure(fig, path, suptitle)


def save_learning_curves(histories: Mapping[str, Sequence[Mapping[str, float]]], path: str | Path, *,
                         title: str = "") -> Path:
    """Training loss and test accuracy per epoch, one line per model.

    ``histories[name]`` is a list of per-epoch records with ``epoch``, ``train_loss`` and ``test_accuracy``.
    """
    with figure(1, 2, figsize=(10, 4)) as (fig, (loss_ax, acc_ax)):
        for name, history in histories.items():
            if not history:
                continue
            epochs = [h["epoch"] for h in history]
            loss_ax.plot(epochs, [h["train_loss"] for h in history], marker="o", markersize=3, label=name)
            acc_ax.plot(epochs, [h["test_accuracy"] for h in history], marker="o", markersize=3, label=name)
        loss_ax.set_xlabel("epoch")
        loss_ax.set_ylabel("training loss (mean over the epoch)")
        loss_ax.set_yscale("log")
        acc_ax.set_xlabel("epoch")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.set_ylim(0, 1)
        acc_ax.axhline(0.1, color="grey", linestyle=":", linewidth=1, label="chance")
        for ax in (loss_ax, acc_ax):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        return save_figure(fig, path, title)


def save_scaling_plot(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Log-log plots of time and peak memory against sequence length, one line per mixer.

    ``rows`` are measurement records (``mixer``, ``length``, ``seconds``, ``peak_memory_bytes``), e.g.
    :meth:`mixer_plugins.tools.benchmarking.Measurement.as_dict`. Memory panels skip points without a measurement.
    """
    by_mixer: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_mixer.setdefault(row["mixer"], []).append(row)
    with figure(1, 2, figsize=(10, 4)) as (fig, (time_ax, mem_ax)):
        for name, points in by_mixer.items():
            points = sorted(points, key=lambda r: r["length"])
            time_ax.plot([p["length"] for p in points], [p["seconds"] for p in points], marker="o", label=name)
            mem = [p for p in points if p.get("peak_memory_bytes")]
            if mem:
                mem_ax.plot([p["length"] for p in mem], [p["peak_memory_bytes"] / 2**20 for p in mem], marker="o",
                            label=name)
        time_ax.set_ylabel("time per call (s)")
        mem_ax.set_ylabel("peak memory (MiB)")
        for ax in (time_ax, mem_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        return save_figure(fig, path, title)


def save_figure(fig: Figure, path: str | Path, suptitle: str = "") -> Path:
    """Give the figure its overall title (if any), lay it out and write it as a PNG."""
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
