"""``mixer-plugins bench``: time, FLOPs and peak memory of mixers against sequence length (+ a log-log plot).

``mixer-plugins bench --decode`` times decoding instead: the time per generated token (one ``step`` of the mixer's
cache) after ``L`` tokens of context, for causal mixers that step, the mixers interleaved token by token in one
process (so a busy machine slows them alike); medians with the interquartile range, a table and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..._text import markdown_table
from .. import DEFAULT_MIXERS, DIRECTIONS, MODES
from ..progress import progress_bar
from .args import (
    CliError,
    Command,
    image_suffixes,
    length_list,
    name_list,
    non_negative_int,
    output_file,
    positive_int,
    set_threads,
    writing,
)
from .options import parse_option_assignments, resolve_mixers

if TYPE_CHECKING:  # pragma: no cover
    from ..benchmarking import DecodeTiming, Measurement, SweepProblem

__all__ = ["COMMAND", "DECODE_CONTEXTS", "DECODE_MIXERS", "DEFAULT_MIXERS", "decode_table"]

#: ``--decode``'s defaults: the linear-time mixers that step, and attention with its KV cache.
DECODE_MIXERS = ("semiseparable", "low_rank", "sliding_window_attention", "attention")
DECODE_CONTEXTS = (128, 1024, 8192)
# The parser's defaults, kept as objects so that --decode can tell "not given" from "given the same values".
_MIXERS_DEFAULT = list(DEFAULT_MIXERS)
_LENGTHS_DEFAULT = [256, 1024, 4096]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", type=name_list, default=_MIXERS_DEFAULT, metavar="A,B,...",
                        help=f"comma-separated mixers, or 'all' (default: {','.join(DEFAULT_MIXERS)}; with --decode: "
                             f"{','.join(DECODE_MIXERS)})")
    parser.add_argument("--lengths", type=length_list, default=_LENGTHS_DEFAULT, metavar="L1,L2,...",
                        help="comma-separated sequence lengths (default: 256,1024,4096); with --decode, the tokens "
                             f"of context before the timed steps (default: {','.join(map(str, DECODE_CONTEXTS))})")
    parser.add_argument("--decode", action="store_true",
                        help="time decoding: per generated token after each length of context (a prefill, then "
                             "steps of one token), for causal mixers that step; --mode, --no-memory do not apply")
    parser.add_argument("--decode-steps", type=positive_int, default=32,
                        help="tokens timed per mixer and context with --decode (default 32, after 4 untimed)")
    parser.add_argument("--dim", type=positive_int, default=256, help="model width (default 256)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--direction", choices=DIRECTIONS, default="default",
                        help="causal or bidirectional; mixers that cannot run that way are reported and skipped "
                             "(default: each mixer's own default)")
    parser.add_argument("--mode", choices=MODES, default="forward",
                        help="time a forward (no grad) or a forward+backward (default: forward)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls; the median is kept (default 3)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--baseline", default="attention",
                        help="mixer the time and memory ratios refer to; measured even when not in --mixers "
                             "(default: attention; 'none' for no ratios)")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); without MIXER. it applies "
                             "to every chosen mixer that has KEY")
    parser.add_argument("--plot", type=Path, default=Path("outputs/bench.png"),
                        help="PNG of time and peak memory against length, log-log (default: outputs/bench.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the measurements as JSON to this file (rewritten after every run, so an "
                             "interrupted sweep keeps what it measured)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement (one run less)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: torch's choice, all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_device(device: str) -> str:
    """``--device`` as torch's canonical string; refused when it is not cpu/cuda or CUDA is missing."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CliError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError("--device cuda: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    return str(dev)


# -- decoding --------------------------------------------------------------------------------------------

def decode_table(timings: Sequence[DecodeTiming], *, baseline: str | None, markdown: bool = False) -> str:
    """Median ms per token (interquartile range) per mixer and context, the growth of the median from the shortest
    context to the longest, and the baseline's median over each mixer's at the longest context."""
    contexts = sorted({t.context for t in timings})
    by = {(t.mixer, t.context): t for t in timings}
    head = ["mixer"] + [f"L={c}: ms/token (p25-p75)" for c in contexts] + [f"L={contexts[-1]}/L={contexts[0]}"]
    if baseline is not None:
        head.append(f"{baseline} / mixer at L={contexts[-1]}")
    rows = []
    for name in dict.fromkeys(t.mixer for t in timings):
        row = [name]
        for c in contexts:
            t = by.get((name, c))
            row.append("-" if t is None else
                       f"{t.median * 1e3:.3f} ({t.quantile(0.25) * 1e3:.3f}-{t.quantile(0.75) * 1e3:.3f})")
        first, last = by.get((name, contexts[0])), by.get((name, contexts[-1]))
        row.append(f"{last.median / first.median:.2f}x" if first and last else "-")
        if baseline is not None:
            base = by.get((baseline, contexts[-1]))
            row.append(f"{base.median / last.median:.2f}x" if base and last else "-")
        rows.append(row)
    if markdown:
        return markdown_table(head, rows)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows])


def save_decode_plot(timings: Sequence[DecodeTiming], path: Path, *, title: str = "") -> Path:
    """Time per generated token against the context length (log-log), one line per mixer (the median) with its
    interquartile band."""
    from ..plotting import figure, save_figure

    with figure(figsize=(6, 4)) as (fig, ax):
        for name in dict.fromkeys(t.mixer for t in timings):
            points = sorted((t for t in timings if t.mixer == name), key=lambda t: t.context)
            xs = [t.context for t in points]
            ax.plot(xs, [t.median * 1e3 for t in points], marker="o", label=name)
            ax.fill_between(xs, [t.quantile(0.25) * 1e3 for t in points],
                            [t.quantile(0.75) * 1e3 for t in points], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens of context")
        ax.set_ylabel("ms per generated token")
        ax.set_title(title or "decoding")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    decode = args.decode
    device = check_device(args.device)
    mixers = resolve_mixers(list(DECODE_MIXERS) if decode and args.mixers is _MIXERS_DEFAULT else args.mixers)
    lengths = list(DECODE_CONTEXTS) if decode and args.lengths is _LENGTHS_DEFAULT else args.lengths
    baseline = None if args.baseline.lower() == "none" else resolve_mixers([args.baseline])[0]
    run_list = ([baseline] if baseline and baseline not in mixers else []) + mixers
    options = parse_option_assignments(args.option, run_list)
    # Fail now, not after the measurements: matplotlib present, every output path writable.
    plot_path = None
    if not args.no_plot:
        from ..plotting import require_matplotlib

        require_matplotlib()
        plot_path = output_file(args.plot, "--plot", default_suffix=".png", suffixes=image_suffixes)
    json_path = output_file(args.json, "--json") if args.json is not None else None
    set_threads(args.threads)
    if decode:
        settings = {"decode": True, "dim": args.dim, "batch": args.batch, "device": device,
                    "steps": args.decode_steps, "contexts": lengths, "options": options}
    else:
        settings = {"dim": args.dim, "batch": args.batch, "mode": args.mode, "direction": args.direction,
                    "device": device, "repeats": args.repeats, "warmup": args.warmup, "options": options}

    def write_json(results: Sequence[Measurement | DecodeTiming], problems: Sequence[SweepProblem],
                   complete: bool = False) -> None:
        """The JSON so far: rewritten after every run, so an interrupted sweep keeps what it measured."""
        if json_path is None:
            return
        with writing(json_path, "--json"):
            json_path.write_text(json.dumps({
                "settings": settings, "complete": complete,
                "timings" if decode else "measurements": [r.as_dict() for r in results],
                "problems": [dataclasses.asdict(p) for p in problems]}, indent=2))

    write_json([], [])
    plot: Callable[[Path], Path]
    results: Sequence[Measurement | DecodeTiming]
    if decode:
        from ..benchmarking import time_decoding

        timings, problems = time_decoding(run_list, lengths, dim=args.dim, batch=args.batch, steps=args.decode_steps,
                                          options=options, device=device)
        results = timings
        if timings:
            print(decode_table(timings, baseline=baseline if any(t.mixer == baseline for t in timings) else None,
                               markdown=args.markdown))
        title = f"decoding, dim {args.dim}, batch {args.batch}, {device}"
        plot = lambda path: save_decode_plot(timings, path, title=title)  # noqa: E731
    else:
        from ..benchmarking import sweep
        from ..plotting import save_scaling_plot
        from ..tables import results_table

        with progress_bar(len(run_list) * len(lengths), enabled=not args.no_progress, unit="run",
                          file=sys.stderr) as bar:
            results, problems = sweep(
                run_list, lengths, dim=args.dim, batch=args.batch, mode=args.mode, direction=args.direction,
                options=options, device=device, warmup=args.warmup, repeats=args.repeats, memory=not args.no_memory,
                on_start=None if bar is None else lambda name, length: bar.set_description(f"{name} L={length}"),
                on_done=None if bar is None else lambda name, length: bar.update(1), on_record=write_json)
        rows = [m.as_dict() for m in results]
        if rows:
            print(results_table(rows, baseline=baseline, markdown=args.markdown))
        title = f"{args.mode}, dim {args.dim}, batch {args.batch}, {device}"
        plot = lambda path: save_scaling_plot(rows, path, title=title)  # noqa: E731
    # The problems on stderr, the JSON (first: the numbers are never lost to a plotting problem), then the plot; the
    # exit status is non-zero when anything attempted failed (skipped directions are not failures) or nothing ran.
    for p in problems:
        print(f"{p.kind}: {p.mixer} at L={p.length}: {p.reason}", file=sys.stderr)
    written = []
    if json_path is not None:
        write_json(results, problems, complete=True)
        written.append(json_path)
    if results and plot_path is not None:
        with writing(plot_path, "--plot"):
            written.append(plot(plot_path))
    if written:
        print("\nwrote " + ", ".join(str(p) for p in written))
    failed = [p for p in problems if p.kind == "failed"]
    if failed:
        print(f"mixer-plugins: {len(failed)} run(s) failed", file=sys.stderr)
    return 1 if failed or not results else 0


COMMAND = Command("time, FLOPs and peak memory of mixers against sequence length; table and log-log plot", run,
                  add_arguments)
