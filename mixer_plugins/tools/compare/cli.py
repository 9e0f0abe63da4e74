"""``mixer-plugins compare``: the argparse wiring (``mixer_plugins.tools.cli.compare`` adds it to the command line).

``add_compare_parser(subparsers)`` adds the subcommand to any argparse parser and sets ``func=run_compare``.
Also runnable alone: ``python -m mixer_plugins.tools.compare ...`` (the command line's ``compare``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import MixerError
from ..cli.args import one_line, positive_int, set_threads

if TYPE_CHECKING:  # pragma: no cover
    from .runner import CompareConfig

__all__ = ["add_compare_parser", "config_from_args", "configure_parser", "run_compare"]

EPILOG = """\
examples:
  mixer-plugins compare --preset hydra-classes                 # a paper's comparison (see docs/compare.md)
  mixer-plugins compare --preset structured-attention --quick  # the CI smoke run
  mixer-plugins compare --task mqar --task-option num_kv_pairs=8 \\
      --mixers 'attention,long_conv=toeplitz(data_dependent=False),quasiseparable(d_state=8)'
  mixer-plugins compare --list                                 # tasks, knobs and presets
  mixer-plugins compare --from docs/compare/runs/hydra-classes.json   # a saved run's tables, judged again

--mixers entries: NAME, NAME(key=value,...) or LABEL=NAME(key=value,...), comma-separated; any registered
mixer (plugins included); 'all' = every registered mixer with its default options.
"""


def _seeds(text: str) -> list[int]:
    """``3`` (seeds 0, 1, 2) or ``0,5,7``."""
    if "," not in text and text.strip().isdigit():
        count = int(text)
        if count <= 0:
            raise argparse.ArgumentTypeError("the number of seeds must be positive (seed 0 alone: --seeds 0,)")
        return list(range(count))
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are a count (3) or a list (0,5,7), got {text!r}") from None


def _knob(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (key, raw value); the value is typed later (:func:`config_from_args`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), raw


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    parser = subparsers.add_parser(
        "compare", help="train every mixer on a synthetic task (several seeds) and compare them",
        description="Train one small backbone per mixer and seed on a task (multi-query recall, selective "
        "copying, in-context regression, digits); print mean ± std of the task metric, parameters, FLOPs and "
        "train time; write results.json, results.md and plots. Presets reproduce the papers' comparisons.",
)
    configure_parser(parser)
    return parser


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The arguments, epilog and ``func`` of ``compare`` (for the command line and :func:`add_compare_parser`)."""
    parser.epilog, parser.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--preset", default=None, help="a paper's comparison (see --list); other flags override it")
    parser.add_argument("--task", default=None, help="mqar, copying, regression or digits (default mqar)")
    parser.add_argument("--task-option", action="append", type=_knob, default=[], metavar="KNOB=VALUE",
                        help="a difficulty knob of the task, e.g. num_kv_pairs=8 (repeatable)")
    parser.add_argument("--mixers", default=None, metavar="ENTRIES",
                        help="mixer entries (see below); default: the preset's, else attention,quasiseparable,toeplitz")
    parser.add_argument("--seeds", type=_seeds, default=None, help="number of seeds (3) or a list (0,5,7)")
    parser.add_argument("--steps", type=positive_int, default=None, help="training steps per model")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="training sequences per step (default: the task's or the preset's)")
    parser.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (warmup, then cosine)")
    parser.add_argument("--eval-every", type=positive_int, default=None, help="steps between test evaluations")
    parser.add_argument("--test-size", type=positive_int, default=None, help="test examples per seed")
    parser.add_argument("--width", type=positive_int, default=None, help="backbone width")
    parser.add_argument("--depth", type=positive_int, default=None, help="backbone blocks")
    parser.add_argument("--heads", type=positive_int, default=None, help="heads of every mixer that has heads")
    parser.add_argument("--causal", action="store_true", default=None,
                        help="causal mixers (causal=True where the mixer has the option; bidirectional-only "
                        "mixers are refused)")
    parser.add_argument("--token-shift", action=argparse.BooleanOptionalAction, default=None,
                        help="add the previous token's embedding at every position (the recall presets do)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a few steps and one seed (CI): it checks that everything runs; the "
                        "orderings are not judged")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.json, results.md, curves.png, final.png (default: "
                        "outputs/compare/<preset or task>)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only; write nothing")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads per run (default 1)")
    parser.add_argument("--jobs", type=positive_int, default=None,
                        help="worker processes training (mixer, seed) runs side by side (default 1); the results "
                        "do not depend on it. Cores used: jobs x threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--list", action="store_true", help="list the tasks (with their knobs) and the presets")
    parser.add_argument("--from", dest="from_results", type=Path, default=None, metavar="RESULTS_JSON",
                        help="train nothing: print the tables of a saved results.json (or its folder) as markdown, "
                        "its parameters and FLOPs counted again by this version and its orderings judged by the "
                        "current rule; with --out, also write results.md and the plots there")
    parser.set_defaults(func=run_compare)


def _listing() -> str:
    import dataclasses

    from .presets import PRESETS
    from .tasks import TASKS

    lines = ["tasks:"]
    for name, cls in TASKS.items():
        knobs = ", ".join(f"{f.name.rstrip('_')}={f.default}" for f in dataclasses.fields(cls))
        lines.append(f"  {name:<11} {cls.summary} [{cls.metric_name}]; knobs: {knobs}")
    lines.append("presets:")
    for name, preset in PRESETS.items():
        lines.append(f"  {name:<21} {preset.paper}")
        lines.append(f"  {'':<21} task {preset.task}, mixers: {', '.join(preset.mixers)}")
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    """The :class:`CompareConfig` the arguments describe."""
    from .presets import preset_config
    from .runner import CompareConfig

    flags = ("steps", "batch_size", "lr", "eval_every", "test_size", "width", "depth", "heads", "causal", "token_shift",
             "seeds", "mixers", "task", "jobs")
    overrides: dict[str, Any] = {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}
    if args.task_option:
        from ..cli.options import literal_value

        overrides["task_options"] = {key: literal_value(raw.strip()) for key, raw in args.task_option}
    overrides["progress"] = not args.no_progress
    if args.preset is not None:
        if "task" in overrides and "task_options" not in overrides:
            overrides["task_options"] = {}
        config = preset_config(args.preset, quick=args.quick, **overrides)
    else:
        if args.quick:
            from .presets import QUICK

            overrides = {**QUICK, "quick": True, **overrides}
        config = CompareConfig(**overrides)
    if not args.no_plots:
        config.out = Path(args.out) if args.out is not None else Path("outputs/compare") / (args.preset or config.task)
    return config


def run_compare(args: argparse.Namespace) -> int:
    """Run ``compare`` from parsed arguments; returns the exit status (0, or 2 after printing a usage error)."""
    if args.list:
        print(_listing())
        return 0
    if args.from_results is not None:
        return _report_saved(args)
    set_threads(args.threads)
    try:
        config = config_from_args(args)
        from .runner import compare

        result = compare(config)
    except MixerError as err:  # bad entries, options, knobs or settings: found before any training
        print(f"mixer-plugins compare: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    return 0 if any(r.error is None for r in result.runs) else 1


def _report_saved(args: argparse.Namespace) -> int:
    """``--from``: the markdown report of a saved result, recounted and judged again (and written with ``--out``)."""
    from .runner import CompareResult

    try:
        result = CompareResult.load(args.from_results).recount()
    except (OSError, ValueError, KeyError, TypeError, MixerError) as err:  # JSON errors are ValueErrors
        detail = str(err) if isinstance(err, MixerError) else f"{type(err).__name__}: {err}"
        print(f"mixer-plugins compare: error: cannot read {args.from_results}: {one_line(detail)}", file=sys.stderr)
        return 2
    print(result.report())
    if args.out is not None and not args.no_plots:
        for path in result.write(args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0
