"""FLOP accounting: each mixer's analytic ``flops(batch, length)`` against PyTorch's ``FlopCounterMode``.

``FlopCounterMode`` counts matmul-like aten ops (``mm``, ``bmm``, ``addmm``, convolutions, SDPA) and the custom
ops that register a FLOP formula (our chunked scan, Toeplitz FFT and depthwise convolution); it counts no
elementwise op. So the comparison is between the counter and the *matmul-like* part of the analytic count: every
part of :meth:`MatrixMixer.flops_breakdown` except those whose key ends with ``_elementwise`` (the Vandermonde and
Cauchy matrix construction: cos, exp, reciprocals), which are real work the counter cannot see. Those parts are
reported separately, so the table explains every difference between the two totals.

The forward+backward column is informational: it is what the benchmark suites record as counted FLOPs of a
training step. Ops whose count does not grow in the backward pass are listed (their backward runs elementwise
ops or FFTs the counter does not count).

``mixer-plugins flops --markdown`` prints the table of ``docs/flops.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .._text import markdown_table as _markdown_table
from ..registry import default_registry
from .benchmarking import build_mixer, error_summary, format_flops, mixer_step

__all__ = [
    "TABLE_HEADERS",
    "TOLERANCE",
    "UNCOUNTED_SUFFIX",
    "FlopComparison",
    "compare_flops",
    "flop_report",
    "markdown_table",
    "table_rows",
]

#: Parts of ``flops_breakdown`` with keys ending in this are elementwise work ``FlopCounterMode`` does not count.
UNCOUNTED_SUFFIX = "_elementwise"
#: Largest accepted relative difference between the analytic matmul part and the counted FLOPs.
TOLERANCE = 0.10


@dataclasses.dataclass
class FlopComparison:
    """Analytic and counted FLOPs of one mixer at one size (forward; forward+backward when measured)."""

    mixer: str
    batch: int
    length: int
    dim: int
    analytic_total: int
    uncounted_parts: dict[str, int]
    counted_forward: int
    counted_by_op: dict[str, int]
    counted_forward_backward: int | None = None
    #: ops whose count is the same with and without the backward pass: their backward is not counted.
    backward_uncounted_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def analytic_counted_part(self) -> int:
        """The analytic FLOPs of the matmul-like parts: what ``FlopCounterMode`` should count."""
        return self.analytic_total - sum(self.uncounted_parts.values())

    @property
    def ratio(self) -> float:
        """Counted / analytic matmul part (1.0 when they agree)."""
        part = self.analytic_counted_part
        return self.counted_forward / part if part else float("inf") if self.counted_forward else 1.0

    @property
    def agrees(self) -> bool:
        """Whether the counted forward is within :data:`TOLERANCE` of the analytic matmul part."""
        return abs(self.ratio - 1.0) <= TOLERANCE

    @property
    def backward_ratio(self) -> float | None:
        """Counted forward+backward / counted forward (about 3 for matmul-only work)."""
        if self.counted_forward_backward is None or not self.counted_forward:
            return None
        return self.counted_forward_backward / self.counted_forward

    def explanation(self) -> str:
        """Why the totals differ (empty when they agree and nothing is uncounted)."""
        notes = []
        if self.uncounted_parts:
            share = sum(self.uncounted_parts.values()) / self.analytic_total
            parts = ", ".join(self.uncounted_parts)
            notes.append(f"{parts} ({share:.0%} of the analytic total) is elementwise work FlopCounterMode does "
                         "not count")
        if not self.agrees:
            notes.append(f"UNEXPLAINED: counted/analytic matmul part = {self.ratio:.3f}")
        elif abs(self.ratio - 1.0) > 1e-3:
            by_op = ", ".join(f"{op} {format_flops(n)}" for op, n in self.counted_by_op.items())
            notes.append(f"counted {self.ratio - 1:+.1%} vs the analytic matmul part, within the "
                         f"{TOLERANCE:.0%} tolerance (counted by op: {by_op})")
        if self.backward_uncounted_ops:
            notes.append("backward of " + ", ".join(self.backward_uncounted_ops) + " not counted")
        return "; ".join(notes)


_CUSTOM_OP_NAMES: set[str] = set()


def _short_op_name(op: Any) -> str:
    full = str(op)
    short = full.removeprefix("aten.").removeprefix("mixer_plugins.")
    if full.startswith("mixer_plugins."):
        _CUSTOM_OP_NAMES.add(short)
    return short


def compare_flops(name: str, *, dim: int = 256, length: int = 1024, batch: int = 1,
                  options: Mapping[str, Any] | None = None, backward: bool = True, seed: int = 0) -> FlopComparison:
    """Count one forward (and, with ``backward``, one forward+backward) of mixer ``name`` with
    ``FlopCounterMode`` and set it against the mixer's analytic :meth:`flops_breakdown`."""
    torch.manual_seed(seed)
    mixer = build_mixer(name, dim, length, options=dict(options or {}))
    x = torch.randn(batch, length, dim)
    mixer.eval()
    with FlopCounterMode(display=False) as counter:
        mixer_step(mixer, x, "forward")()
    forward_by_op = {_short_op_name(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    breakdown = {k: int(v) for k, v in mixer.flops_breakdown(batch, length).items()}
    result = FlopComparison(
        mixer=default_registry.get_spec(name).name, batch=batch, length=length, dim=dim,
        analytic_total=sum(breakdown.values()),
        uncounted_parts={k: v for k, v in breakdown.items() if k.endswith(UNCOUNTED_SUFFIX)},
        counted_forward=int(counter.get_total_flops()), counted_by_op=forward_by_op,
    )
    if backward:
        mixer.train()
        x.requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            mixer_step(mixer, x, "forward_backward")()
        result.counted_forward_backward = int(counter.get_total_flops())
        both_by_op = {_short_op_name(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
        # Only our custom ops can hide their backward: an aten op's backward is other aten ops (addmm's is mm),
        # which are counted under their own names; ours count theirs as a "<op>_backward" custom op.
        result.backward_uncounted_ops = [
            op for op, n in forward_by_op.items()
            if op in _CUSTOM_OP_NAMES and n and both_by_op.get(op, 0) <= n and not both_by_op.get(op + "_backward")
        ]
    return result


def flop_report(mixers: Sequence[str] | None = None, *, dim: int = 256, length: int = 1024, batch: int = 1,
                options: Mapping[str, Mapping[str, Any]] | None = None, backward: bool = True,
                ) -> tuple[list[FlopComparison], list[tuple[str, str]]]:
    """:func:`compare_flops` for every mixer (default: every registered one); mixers that fail to build or run
    are returned as ``(name, error)`` instead of stopping the report."""
    names = list(mixers) if mixers is not None else default_registry.names()
    options = options or {}
    rows: list[FlopComparison] = []
    failures: list[tuple[str, str]] = []
    for name in names:
        try:
            rows.append(compare_flops(name, dim=dim, length=length, batch=batch, options=options.get(name),
                                      backward=backward))
        except Exception as err:  # noqa: BLE001 - one broken mixer must not hide the others' numbers
            failures.append((name, error_summary(err)))
    return rows, failures


def table_rows(rows: Sequence[FlopComparison]) -> list[tuple[str, ...]]:
    """Cells of the FLOP table (see :data:`TABLE_HEADERS`)."""
    out: list[tuple[str, ...]] = []
    for r in rows:
        uncounted = sum(r.uncounted_parts.values())
        out.append((
            r.mixer, format_flops(r.analytic_total), format_flops(uncounted) if uncounted else "0",
            format_flops(r.counted_forward), f"{r.ratio:.3f}",
            format_flops(r.counted_forward_backward), f"{r.backward_ratio:.2f}" if r.backward_ratio else "-",
            r.explanation() or "exact",
        ))
    return out


TABLE_HEADERS = ("mixer", "analytic", "analytic elementwise", "counted fwd", "counted / analytic matmul",
                 "counted fwd+bwd", "fwd+bwd / fwd", "difference explained")


def markdown_table(rows: Sequence[FlopComparison]) -> str:
    """The FLOP table as a markdown pipe table."""
    return _markdown_table(TABLE_HEADERS, table_rows(rows))
