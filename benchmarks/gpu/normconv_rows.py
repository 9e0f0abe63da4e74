"""The block's gated RMSNorm and short convolution on CUDA: every backend timed, to choose the default.

Candidates, all called through the public ops with ``backend=`` (so each includes its own glue):

* ``gated_rmsnorm``: ``triton`` (our fused kernels), ``torch`` (PyTorch tile by tile with a hand-written backward),
  ``reference`` (the plain formula, eager); with ``--inductor`` also the formula under ``torch.compile`` (what a
  compiled model runs on the ``torch`` path);
* ``depthwise_conv1d`` (SiLU fused, as the block calls it): ``triton`` (our fused kernels), ``cudnn (reference)``
  (PyTorch's grouped ``conv1d``, which is cuDNN on CUDA, then the SiLU), ``torch`` (shifted multiply-adds).

Shapes (bfloat16 for every tensor, parameters included, so each candidate gets the same inputs): ViT-B/16's Hydra
block at batch 64 (197 tokens, inner width 1536, 1536 + 2 x 64 convolved channels, kernel 7 centred) and 65,536
tokens as 4 x 16,384 (the same widths; the conv also causal with kernel 4, Mamba-2's). Forward, and forward plus
backward (``torch.autograd.grad`` with a fixed output gradient, so nothing accumulates between iterations); the
median of the timed iterations after warm-up, in milliseconds.

Usage::

    python benchmarks/gpu/normconv_rows.py [--json OUT.json] [--inductor]   # on a CUDA machine
    python benchmarks/gpu/normconv_rows.py --dry                            # CPU, the Triton interpreter, tiny shapes

Prints a markdown table; a candidate that cannot run says why in its row. ``--dry`` checks the script itself (CI
runs it); its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path


@dataclass
class Row:
    op: str
    candidate: str
    shape: str
    mode: str
    ms: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: str
    norm_shapes: tuple[tuple[int, int, int], ...]             # (batch, length, width)
    conv_shapes: tuple[tuple[int, int, int, int, bool], ...]  # (batch, length, channels, kernel, causal)
    warmup: int
    iters: int


GPU = Setup(device="cuda", dtype="bfloat16",
            norm_shapes=((64, 197, 1536), (4, 16384, 1536)),
            conv_shapes=((64, 197, 1664, 7, False), (4, 16384, 1664, 7, False), (4, 16384, 1664, 4, True)),
            warmup=3, iters=20)
DRY = Setup(device="cpu", dtype="float32", norm_shapes=((2, 5, 24),), conv_shapes=((2, 9, 12, 3, False),),
            warmup=0, iters=1)


def timed(fn: Callable[[], object], setup: Setup) -> float:
    """Median milliseconds of ``fn`` (synchronized on CUDA)."""
    from mixer_plugins.tools.benchmarking import time_calls

    return time_calls(fn, rounds=setup.iters, warmup=setup.warmup, device=setup.device).median(None) * 1e3


def _step(forward: Callable[[], object], inputs: list, backward: bool) -> Callable[[], object]:
    """The forward, or the forward and the gradients of all ``inputs`` for a fixed output gradient."""
    import torch

    if not backward:
        def run():
            with torch.no_grad():
                return forward()
        return run
    cot: list = []

    def run_with_grad():
        out = forward()
        if not cot:
            cot.append(torch.randn_like(out))
        return torch.autograd.grad(out, inputs, cot[0])
    return run_with_grad


def _measure(rows: list[Row], op: str, candidate: str, shape: str, forward: Callable[[], object], inputs: list,
             setup: Setup) -> None:
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        row = Row(op, candidate, shape, mode)
        try:
            row.ms = round(timed(_step(forward, inputs, backward), setup), 4)
        except Exception as err:  # a candidate that cannot run says why; the others still run
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
        print(f"{op:5s} {candidate:20s} {shape:28s} {mode:8s} {row.ms if row.ms is not None else '-':>10} {row.note}",
              flush=True)


def norm_rows(setup: Setup, inductor: bool = False) -> list[Row]:
    import torch

    from mixer_plugins import kernels
    from mixer_plugins.kernels.norm import gated_rmsnorm_reference

    dtype = getattr(torch, setup.dtype)
    rows: list[Row] = []
    for batch, length, width in setup.norm_shapes:
        g = torch.Generator().manual_seed(0)
        y, z = (torch.randn(batch, length, width, generator=g).to(setup.device, dtype).requires_grad_()
                for _ in range(2))
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(setup.device, dtype).requires_grad_()
        shape = f"{batch}x{length}x{width}"
        candidates: dict[str, Callable[[], object]] = {
            name: partial(kernels.gated_rmsnorm, y, z, w, 1e-5, True, backend=name)
            for name in ("triton", "torch", "reference")}
        if inductor:
            candidates["reference (inductor)"] = partial(torch.compile(gated_rmsnorm_reference), y, z, w, 1e-5, True)
        for name, forward in candidates.items():
            _measure(rows, "norm", name, shape, forward, [y, z, w], setup)
    return rows


def conv_rows(setup: Setup) -> list[Row]:
    import torch

    from mixer_plugins import kernels

    dtype = getattr(torch, setup.dtype)
    rows: list[Row] = []
    for batch, length, channels, k, causal in setup.conv_shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, length, channels, generator=g).to(setup.device, dtype).requires_grad_()
        w = (0.3 * torch.randn(channels, k, generator=g)).to(setup.device, dtype).requires_grad_()
        b = (0.1 * torch.randn(channels, generator=g)).to(setup.device, dtype).requires_grad_()
        shape = f"{batch}x{length}x{channels} k={k}{' causal' if causal else ''}"
        for label, name in (("triton", "triton"), ("cudnn (reference)", "reference"), ("torch", "torch")):
            forward = partial(kernels.depthwise_conv1d, x, w, b, causal=causal, silu=True, backend=name)
            _measure(rows, "conv", label, shape, forward, [x, w, b], setup)
    return rows


def markdown(rows: list[Row]) -> str:
    """The table, with each candidate's time relative to ``triton`` on the same shape and mode."""
    base = {(r.op, r.shape, r.mode): r.ms for r in rows if r.candidate == "triton" and r.ms}
    lines = ["| op | candidate | shape | mode | ms | / triton | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = base.get((r.op, r.shape, r.mode))
        ratio = f"{r.ms / ref:.2f}" if r.ms is not None and ref else ""
        ms = f"{r.ms:.4f}" if r.ms is not None else "-"
        lines.append(f"| {r.op} | {r.candidate} | {r.shape} | {r.mode} | {ms} | {ratio} | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, under the Triton interpreter")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--inductor", action="store_true", help="also time the norm's formula under torch.compile")
    args = parser.parse_args(argv)
    if args.dry:
        # read by triton.jit when our kernels are defined (on their first use, after this)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry to check the script on the CPU")
    setup = DRY if args.dry else GPU
    rows = norm_rows(setup, inductor=args.inductor) + conv_rows(setup)
    text = markdown(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
