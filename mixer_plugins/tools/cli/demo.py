"""``mixer-plugins demo``: train small timm ViTs that differ only in the mixer, on scikit-learn's digits."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import DEFAULT_MIXERS
from .args import (
    Command,
    head,
    name_list,
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
    set_threads,
    writing,
)
from .options import parse_option_assignments, resolve_mixers

__all__ = ["COMMAND"]

#: ``--quick``: epochs and training images, unless --epochs / --train-limit say otherwise.
QUICK_EPOCHS, QUICK_TRAIN_LIMIT = 3, 640

#: the defaults of ``mixer_plugins.tools.demo.DemoConfig`` that the arguments show, repeated here so that parsing
#: the arguments imports no torch (a test keeps them equal)
DEFAULTS: dict[str, Any] = {"epochs": 15, "batch_size": 64, "lr": 3e-3, "embed_dim": 64, "depth": 2, "num_heads": 4,
                            "patch_size": 2, "seed": 0, "sample": 0, "out": Path("demo_output")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = argparse.Namespace(**DEFAULTS)
    parser.add_argument("--mixers", type=name_list, default=list(DEFAULT_MIXERS), metavar="A,B,...",
                        help=f"comma-separated mixers to compare, or 'all' (default: {','.join(DEFAULT_MIXERS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_EPOCHS} epochs on {QUICK_TRAIN_LIMIT} training images "
                             "(unless --epochs/--train-limit)")
    parser.add_argument("--epochs", type=positive_int, default=None, help=f"training epochs (default {d.epochs})")
    parser.add_argument("--train-limit", type=positive_int, default=None, metavar="N",
                        help=f"train on the first N training images only (default: all; --quick: {QUICK_TRAIN_LIMIT})")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                        help=f"training batch size (default {d.batch_size})")
    parser.add_argument("--lr", type=positive_float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    parser.add_argument("--width", type=positive_int, default=d.embed_dim,
                        help=f"ViT width, the mixers' dim (default {d.embed_dim})")
    parser.add_argument("--depth", type=positive_int, default=d.depth, help=f"ViT blocks (default {d.depth})")
    parser.add_argument("--heads", type=positive_int, default=d.num_heads,
                        help=f"ViT heads, passed to mixers with a head count (default {d.num_heads})")
    parser.add_argument("--patch-size", type=positive_int, default=d.patch_size, choices=[1, 2, 4, 8],
                        help=f"patch side in pixels of the 8x8 digits; tokens = (8/patch)^2 (default {d.patch_size})")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); without MIXER. it applies "
                             "to every chosen mixer that has KEY. Example: --option quasi.d_state=32")
    parser.add_argument("--seed", type=non_negative_int, default=d.seed,
                        help="seed of the train/test split, the initialisation and the batch order (default 0)")
    parser.add_argument("--head", type=head, default="mean",
                        help="which head the matrix heat maps show: an index or 'mean' (default: mean)")
    parser.add_argument("--sample", type=non_negative_int, default=d.sample,
                        help="index of the test image whose matrices are drawn (default 0)")
    parser.add_argument("--out", type=Path, default=d.out,
                        help=f"output folder for the table and plots (default {d.out}/)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (default 1: the models are so small that more threads only "
                             "add synchronization; measured slower with 2 on 2 cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ..demo import DemoConfig, run_demo

    mixers = resolve_mixers(args.mixers)
    options = parse_option_assignments(args.option, mixers)
    epochs = args.epochs if args.epochs is not None else (QUICK_EPOCHS if args.quick else DEFAULTS["epochs"])
    train_limit = args.train_limit if args.train_limit is not None else (QUICK_TRAIN_LIMIT if args.quick else None)
    config = DemoConfig(  # a MixerError (bad settings) is one line, exit status 2, like a CliError
        mixers=tuple(mixers), epochs=epochs, train_limit=train_limit, batch_size=args.batch_size, lr=args.lr,
        embed_dim=args.width, depth=args.depth, num_heads=args.heads, patch_size=args.patch_size,
        options=options, seed=args.seed, head=args.head, sample=args.sample, out=args.out,
        progress=not args.no_progress,
    )
    output_folder(config.out, "--out")  # an unwritable folder fails now, in one line, not after training
    set_threads(args.threads)
    with writing(config.out, "--out"):
        results = run_demo(config)
    failed = [r.mixer for r in results if r.error is not None]
    if failed:
        print(f"mixer-plugins: {len(failed)} of {len(results)} mixer(s) failed: {', '.join(failed)} "
              f"(tracebacks in {config.out / 'errors.log'})", file=sys.stderr)
        return 1
    return 0


COMMAND = Command("train small timm ViTs that differ only in the mixer on scikit-learn's digits; "
                  "print a table and write learning curves and matrix heat maps", run, add_arguments)
