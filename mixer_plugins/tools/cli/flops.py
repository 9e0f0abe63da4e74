"""``mixer-plugins flops``: analytic FLOPs of every mixer against PyTorch's FlopCounterMode."""

from __future__ import annotations

import argparse
import json
import sys

from ..._text import format_table
from .args import Command, name_list, positive_int, set_threads
from .options import parse_option_assignments, resolve_mixers

__all__ = ["COMMAND"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", type=name_list, default=["all"], metavar="A,B,...",
                        help="comma-separated mixers (default: all)")
    parser.add_argument("--dim", type=positive_int, default=256, help="model width (default 256)")
    parser.add_argument("--length", type=positive_int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable)")
    parser.add_argument("--no-backward", action="store_true", help="skip the forward+backward count")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (as in docs/flops.md)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")


def run(args: argparse.Namespace) -> int:
    from ..flop_report import TABLE_HEADERS, TOLERANCE, flop_report, markdown_table, table_rows

    mixers = resolve_mixers(args.mixers)
    options = parse_option_assignments(args.option, mixers)
    set_threads(args.threads)
    rows, failures = flop_report(mixers, dim=args.dim, length=args.length, batch=args.batch, options=options,
                                 backward=not args.no_backward)
    print(f"batch {args.batch}, dim {args.dim}, L {args.length}; default options"
          + (f" except {json.dumps({k: v for k, v in options.items() if v})}" if any(options.values()) else ""))
    print()
    print(markdown_table(rows) if args.markdown else format_table(TABLE_HEADERS, table_rows(rows)))
    for name, error in failures:
        print(f"failed: {name}: {error}", file=sys.stderr)
    disagree = [r.mixer for r in rows if not r.agrees]
    if disagree:
        print(f"counted and analytic matmul FLOPs differ by more than {TOLERANCE:.0%} for: {', '.join(disagree)}",
              file=sys.stderr)
    return 1 if disagree or failures else 0


COMMAND = Command("analytic FLOPs of every mixer against PyTorch's FlopCounterMode", run, add_arguments)
