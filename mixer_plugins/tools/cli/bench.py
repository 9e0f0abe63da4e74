"""``mixer-plugins bench``: time, FLOPs and peak memory of mixers against sequence length (+ a log-log plot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

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

__all__ = ["COMMAND", "DEFAULT_MIXERS"]

DEFAULT_MIXERS = ("attention", "quasiseparable", "mlr_attention", "toeplitz")
#: ``mixer_plugins.tools.benchmarking``'s ``DIRECTIONS`` and ``MODES``, repeated here so that parsing the arguments
#: imports no torch (a test keeps them equal)
DIRECTIONS = ("default", "causal", "bidirectional")
MODES = ("forward", "forward_backward")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", type=name_list, default=list(DEFAULT_MIXERS), metavar="A,B,...",
                        help=f"comma-separated mixers, or 'all' (default: {','.join(DEFAULT_MIXERS)})")
    parser.add_argument("--lengths", type=length_list, default=[256, 1024, 4096], metavar="L1,L2,...",
                        help="comma-separated sequence lengths (default: 256,1024,4096)")
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


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is optional
        return None
    return tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from ..benchmarking import sweep
    from ..tables import results_table

    device = check_device(args.device)
    mixers = resolve_mixers(args.mixers)
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
    settings = {"dim": args.dim, "batch": args.batch, "mode": args.mode, "direction": args.direction,
                "device": device, "repeats": args.repeats, "warmup": args.warmup, "options": options}

    def write_json(results, problems, complete: bool) -> None:
        if json_path is None:
            return
        with writing(json_path, "--json"):
            json_path.write_text(json.dumps({
                "settings": settings,
                "complete": complete,
                "measurements": [m.as_dict() for m in results],
                "problems": [dataclasses.asdict(p) for p in problems],
            }, indent=2))

    write_json([], [], complete=False)

    bar = _progress(len(run_list) * len(args.lengths), not args.no_progress)

    def on_start(name: str, length: int) -> None:
        if bar is not None:
            bar.set_description(f"{name} L={length}")

    def on_done(name: str, length: int) -> None:
        if bar is not None:
            bar.update(1)

    try:
        results, problems = sweep(run_list, args.lengths, dim=args.dim, batch=args.batch, mode=args.mode,
                                  direction=args.direction, options=options, device=device, warmup=args.warmup,
                                  repeats=args.repeats, memory=not args.no_memory, on_start=on_start, on_done=on_done,
                                  on_record=lambda results, problems: write_json(results, problems, complete=False))
    finally:
        if bar is not None:
            bar.close()
    rows = [m.as_dict() for m in results]
    if rows:
        print(results_table(rows, baseline=baseline, markdown=args.markdown))
    for p in problems:
        print(f"{p.kind}: {p.mixer} at L={p.length}: {p.reason}", file=sys.stderr)
    written = []
    if json_path is not None:  # first: the numbers are never lost to a plotting problem
        write_json(results, problems, complete=True)
        written.append(json_path)
    if rows and plot_path is not None:
        from ..plotting import save_scaling_plot

        title = f"{args.mode}, dim {args.dim}, batch {args.batch}, {device}"
        with writing(plot_path, "--plot"):
            written.append(save_scaling_plot(rows, plot_path, title=title))
    if written:
        print("\nwrote " + ", ".join(str(p) for p in written))
    failed = [p for p in problems if p.kind == "failed"]
    if failed:
        print(f"mixer-plugins: {len(failed)} run(s) failed", file=sys.stderr)
    # Like flops: non-zero when anything that was attempted failed (skipped directions are not failures).
    return 1 if failed or not rows else 0


COMMAND = Command("time, FLOPs and peak memory of mixers against sequence length; table and log-log plot", run,
                  add_arguments)
