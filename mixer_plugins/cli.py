"""The ``mixer-plugins`` command line.

    mixer-plugins list               a table of every registered mixer (and any broken plugin)
    mixer-plugins info NAME          a mixer's options: type, default and help
    mixer-plugins demo               train small timm ViTs that differ only in the mixer, on scikit-learn's digits
    mixer-plugins bench              time, FLOPs and peak memory of mixers against sequence length (+ a log-log plot)
    mixer-plugins bench-table PATH   the comparison table of pytest-benchmark's saved JSON (benchmarks/ suites)
    mixer-plugins show NAME          heat map of a mixer's matrix for a random or given input
    mixer-plugins flops              analytic FLOPs of every mixer against PyTorch's FlopCounterMode

Bad arguments exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "format_table", "parse_option_assignments", "CliError"]


class CliError(Exception):
    """An error reported as one line on stderr, exit status 2."""


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cells[0]).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r).rstrip() for r in cells[1:]]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    """Multi-line messages (e.g. several invalid options) joined into one line."""
    parts = [line.strip().removeprefix("- ") for line in str(text).splitlines()]
    out = ""
    for part in filter(None, parts):
        out += ("" if not out else " " if out.endswith(":") else "; ") + part
    return out


# -- argument types ------------------------------------------------------------------------------------------

def _number_type(convert: Callable[[str], float], accept: Callable[[float], bool], what: str):
    """An argparse ``type=`` that converts, checks and explains in one line."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number_type(int, lambda v: v > 0, "a positive integer")
_non_negative_int = _number_type(int, lambda v: v >= 0, "a non-negative integer")
_positive_float = _number_type(float, lambda v: v > 0, "a positive number")


def _length_list(text: str) -> list[int]:
    lengths = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lengths.append(_positive_int(part))
    if not lengths:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 256,1024,4096")
    return sorted(set(lengths))


def _name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated mixer names, e.g. attention,quasi (or 'all')")
    return names


def _head(text: str) -> int | str:
    if text == "mean":
        return "mean"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a head index or 'mean', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a head index (>= 0) or 'mean', got {text!r}")
    return value


def resolve_mixers(names: Sequence[str]) -> list[str]:
    """Canonical names of ``names`` (aliases allowed; ``all`` = every registered mixer), without duplicates."""
    import mixer_plugins as mp

    if list(names) == ["all"]:
        return mp.list_mixers()
    resolved = []
    for name in names:
        try:
            canonical = mp.get_spec(name).name
        except mp.MixerError as err:
            raise CliError(str(err)) from None
        if canonical not in resolved:
            resolved.append(canonical)
    return resolved


def _literal(raw: str) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw


def typed_option_value(spec, key: str, raw: str) -> Any:
    """``raw`` (command-line text) as a value of option ``key`` of ``spec``, typed and checked by its config field.

    Numbers, booleans, ``none`` and lists/tuples (``[8,4,2]``, ``1,16``) are parsed, then validated by pydantic
    against the field's type and constraints; a bad value raises :class:`CliError` naming the option.
    """
    from pydantic import TypeAdapter, ValidationError

    fields = spec.config.model_fields
    if key not in fields:
        import difflib

        close = difflib.get_close_matches(key, list(fields), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise CliError(f"mixer {spec.name!r} has no option {key!r}{hint} (options: {', '.join(fields)})")
    field = fields[key]
    annotation = field.annotation
    if field.metadata:
        annotation = typing.Annotated[(annotation, *field.metadata)]
    adapter = TypeAdapter(annotation)
    candidates = [_literal(raw)]
    if "," in raw and not raw.strip().startswith(("[", "(")):
        candidates.append([_literal(part.strip()) for part in raw.split(",")])
    candidates.append(raw)  # a string option whose value happens to look like a number
    first_error = None
    for candidate in candidates:
        try:
            return adapter.validate_python(candidate)
        except ValidationError as err:
            first_error = first_error or err
    message = first_error.errors()[0]["msg"] if first_error is not None else "invalid value"
    raise CliError(f"invalid value {raw!r} for option {key!r} of mixer {spec.name!r}: {message}")


def parse_option_assignments(assignments: Sequence[str], mixers: Sequence[str], *,
                             allow_unprefixed: bool = True) -> dict[str, dict[str, Any]]:
    """``["quasi.d_state=32", "expand=1"]`` -> options per canonical mixer name, typed by each mixer's config.

    ``MIXER.KEY=VALUE`` applies to that mixer (which must be among ``mixers``); a bare ``KEY=VALUE`` applies to
    every mixer in ``mixers`` that has the option (and is an error if none has it).
    """
    import mixer_plugins as mp

    out: dict[str, dict[str, Any]] = {name: {} for name in mixers}
    for text in assignments:
        target, sep, raw = text.partition("=")
        if not sep or not target.strip():
            raise CliError(f"--option expects KEY=VALUE or MIXER.KEY=VALUE, got {text!r}")
        target = target.strip()
        if "." in target:
            prefix, key = target.split(".", 1)
            try:
                name = mp.get_spec(prefix).name
            except mp.MixerError as err:
                raise CliError(f"--option {text!r}: {err}") from None
            if name not in out:
                raise CliError(f"--option {text!r} names mixer {name!r}, which is not among {', '.join(mixers)}")
            out[name][key] = typed_option_value(mp.get_spec(name), key, raw)
        else:
            if not allow_unprefixed and len(mixers) > 1:
                raise CliError(f"--option {text!r}: say which mixer, as MIXER.{target}={raw}")
            having = [name for name in mixers if target in mp.get_spec(name).config.model_fields]
            if not having:
                if len(mixers) == 1:
                    typed_option_value(mp.get_spec(mixers[0]), target, raw)  # raises with "did you mean"
                raise CliError(f"--option {text!r}: none of {', '.join(mixers)} has an option {target!r}")
            for name in having:
                out[name][target] = typed_option_value(mp.get_spec(name), target, raw)
    return out


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# -- list / info -----------------------------------------------------------------------------------------------

def _cmd_list(args: argparse.Namespace) -> int:
    import warnings

    import mixer_plugins as mp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mp.MixerPluginWarning)  # reported below instead
        specs = mp.list_specs()
        problems = mp.plugin_problems()
    rows = [
        (
            s.name,
            ", ".join(s.aliases) or "-",
            s.matrix_class or "-",
            s.direction,
            s.complexity or "-",
            s.data_dependent,
            s.distribution or "-",
        )
        for s in specs
    ]
    headers = ("name", "aliases", "matrix class", "direction", "complexity", "data-dependent", "distribution")
    print(format_table(headers, rows))
    if problems:
        print(f"\n{len(problems)} plugin problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  [{problem.kind}] {problem.message}", file=sys.stderr)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import mixer_plugins as mp

    try:
        spec = mp.get_spec(args.name)
    except mp.MixerError as err:
        raise CliError(str(err)) from None
    print(f"{spec.name}: {spec.summary}")
    if spec.aliases:
        print(f"aliases: {', '.join(spec.aliases)}")
    print(
        f"matrix class: {spec.matrix_class or '-'} | direction: {spec.direction} | "
        f"complexity: {spec.complexity or '-'} | data-dependent: {spec.data_dependent} | "
        f"distribution: {spec.distribution or '-'}"
    )
    print()
    print(format_table(("option", "type", "default", "help"), spec.options_table()))
    return 0


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="mixer name or alias")


# -- demo ------------------------------------------------------------------------------------------------------

def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import DEFAULT_MIXERS, DemoConfig

    d = DemoConfig()
    parser.add_argument("--mixers", type=_name_list, default=list(DEFAULT_MIXERS), metavar="A,B,...",
                        help=f"comma-separated mixers to compare, or 'all' (default: {','.join(DEFAULT_MIXERS)})")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run in seconds: 3 epochs on 640 training images (unless --epochs/--train-limit)")
    parser.add_argument("--epochs", type=_positive_int, default=None, help=f"training epochs (default {d.epochs})")
    parser.add_argument("--train-limit", type=_positive_int, default=None, metavar="N",
                        help="train on the first N training images only (default: all; --quick: 640)")
    parser.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                        help=f"training batch size (default {d.batch_size})")
    parser.add_argument("--lr", type=_positive_float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    parser.add_argument("--width", type=_positive_int, default=d.embed_dim,
                        help=f"ViT width, the mixers' dim (default {d.embed_dim})")
    parser.add_argument("--depth", type=_positive_int, default=d.depth, help=f"ViT blocks (default {d.depth})")
    parser.add_argument("--heads", type=_positive_int, default=d.num_heads,
                        help=f"ViT heads, passed to mixers with a head count (default {d.num_heads})")
    parser.add_argument("--patch-size", type=_positive_int, default=d.patch_size, choices=[1, 2, 4, 8],
                        help=f"patch side in pixels of the 8x8 digits; tokens = (8/patch)^2 (default {d.patch_size})")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); without MIXER. it applies "
                             "to every chosen mixer that has KEY. Example: --option quasi.d_state=32")
    parser.add_argument("--seed", type=_non_negative_int, default=d.seed,
                        help="seed of the train/test split, the initialisation and the batch order (default 0)")
    parser.add_argument("--head", type=_head, default="mean",
                        help="which head the matrix heat maps show: an index or 'mean' (default: mean)")
    parser.add_argument("--sample", type=_non_negative_int, default=d.sample,
                        help="index of the test image whose matrices are drawn (default 0)")
    parser.add_argument("--out", type=Path, default=d.out,
                        help=f"output folder for the table and plots (default {d.out}/)")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch intra-op threads (default 1: the models are so small that more threads only "
                             "add synchronization; measured slower with 2 on 2 cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo
    from .registry import MixerError

    mixers = resolve_mixers(args.mixers)
    options = parse_option_assignments(args.option, mixers)
    epochs = args.epochs if args.epochs is not None else (3 if args.quick else DemoConfig.epochs)
    train_limit = args.train_limit if args.train_limit is not None else (640 if args.quick else None)
    try:
        config = DemoConfig(
            mixers=tuple(mixers), epochs=epochs, train_limit=train_limit, batch_size=args.batch_size, lr=args.lr,
            embed_dim=args.width, depth=args.depth, num_heads=args.heads, patch_size=args.patch_size,
            options=options, seed=args.seed, head=args.head, sample=args.sample, out=args.out,
            progress=not args.no_progress,
        )
    except MixerError as err:
        raise CliError(str(err)) from None
    _set_threads(args.threads)
    results = run_demo(config)
    failed = [r.mixer for r in results if r.error is not None]
    if failed:
        print(f"mixer-plugins: {len(failed)} of {len(results)} mixer(s) failed: {', '.join(failed)} "
              f"(tracebacks in {config.out / 'errors.log'})", file=sys.stderr)
        return 1
    return 0


# -- bench -----------------------------------------------------------------------------------------------------

BENCH_DEFAULT_MIXERS = ("attention", "quasiseparable", "mlr_attention", "toeplitz")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .benchmarking import DIRECTIONS, MODES

    parser.add_argument("--mixers", type=_name_list, default=list(BENCH_DEFAULT_MIXERS), metavar="A,B,...",
                        help=f"comma-separated mixers, or 'all' (default: {','.join(BENCH_DEFAULT_MIXERS)})")
    parser.add_argument("--lengths", type=_length_list, default=[256, 1024, 4096], metavar="L1,L2,...",
                        help="comma-separated sequence lengths (default: 256,1024,4096)")
    parser.add_argument("--dim", type=_positive_int, default=256, help="model width (default 256)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--direction", choices=DIRECTIONS, default="default",
                        help="causal or bidirectional; mixers that cannot run that way are reported and skipped "
                             "(default: each mixer's own default)")
    parser.add_argument("--mode", choices=MODES, default="forward",
                        help="time a forward (no grad) or a forward+backward (default: forward)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--repeats", type=_positive_int, default=3, help="timed calls; the median is kept (default 3)")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--baseline", default="attention",
                        help="mixer the time and memory ratios refer to; measured even when not in --mixers "
                             "(default: attention; 'none' for no ratios)")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); without MIXER. it applies "
                             "to every chosen mixer that has KEY")
    parser.add_argument("--plot", type=Path, default=Path("outputs/bench.png"),
                        help="PNG of time and peak memory against length, log-log (default: outputs/bench.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements as JSON to this file")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement (one run less)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch intra-op threads (default: torch's choice, all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_device(device: str) -> str:
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench_table import results_table
    from .benchmarking import sweep

    device = _check_device(args.device)
    mixers = resolve_mixers(args.mixers)
    baseline = None if args.baseline.lower() == "none" else resolve_mixers([args.baseline])[0]
    run_list = ([baseline] if baseline and baseline not in mixers else []) + mixers
    options = parse_option_assignments(args.option, run_list)
    if not args.no_plot:
        from .plotting import require_matplotlib

        require_matplotlib()  # fail now, not after the measurements
    _set_threads(args.threads)

    bar = None
    if not args.no_progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(run_list) * len(args.lengths), unit="run", dynamic_ncols=True, file=sys.stderr)
        except ImportError:  # progress is optional
            bar = None

    def on_start(name: str, length: int) -> None:
        if bar is not None:
            bar.set_description(f"{name} L={length}")

    def on_done(name: str, length: int) -> None:
        if bar is not None:
            bar.update(1)

    try:
        results, problems = sweep(run_list, args.lengths, dim=args.dim, batch=args.batch, mode=args.mode,
                                  direction=args.direction, options=options, device=device, warmup=args.warmup,
                                  repeats=args.repeats, memory=not args.no_memory, on_start=on_start, on_done=on_done)
    finally:
        if bar is not None:
            bar.close()
    rows = [m.as_dict() for m in results]
    if rows:
        print(results_table(rows, baseline=baseline, markdown=args.markdown))
    for p in problems:
        print(f"{p.kind}: {p.mixer} at L={p.length}: {p.reason}", file=sys.stderr)
    written = []
    if rows and not args.no_plot:
        from .plotting import save_scaling_plot

        title = f"{args.mode}, dim {args.dim}, batch {args.batch}, {device}"
        written.append(save_scaling_plot(rows, args.plot, title=title))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "settings": {"dim": args.dim, "batch": args.batch, "mode": args.mode, "direction": args.direction,
                         "device": device, "repeats": args.repeats, "warmup": args.warmup, "options": options},
            "measurements": rows,
            "problems": [dataclasses.asdict(p) for p in problems],
        }, indent=2))
        written.append(args.json)
    if written:
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0 if rows else 1


# -- bench-table -----------------------------------------------------------------------------------------------

def _bench_table_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="pytest-benchmark JSON files, or folders (e.g. .benchmarks): their newest JSON")
    parser.add_argument("--all-runs", action="store_true", help="for folders, every saved run, not just the newest")
    parser.add_argument("--baseline", default="attention", help="mixer the ratios refer to (default: attention)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")


def _cmd_bench_table(args: argparse.Namespace) -> int:
    from .bench_table import find_benchmark_files, load_benchmark_rows, results_table

    files = find_benchmark_files(args.paths, every_run=args.all_runs)
    rows, left_out = load_benchmark_rows(files)
    if not rows:
        raise CliError(f"no mixer benchmarks with timings in {', '.join(map(str, files))} (was timing disabled? "
                       "save runs with: pytest benchmarks --benchmark-only --benchmark-autosave)")
    print(results_table(rows, baseline=args.baseline, markdown=args.markdown))
    if left_out:
        print(f"\n{len(left_out)} benchmark(s) without mixer/length information left out: "
              + ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else ""), file=sys.stderr)
    return 0


# -- show ------------------------------------------------------------------------------------------------------

def _show_arguments(parser: argparse.ArgumentParser) -> None:
    from .benchmarking import DIRECTIONS
    from .plotting import SCALES

    parser.add_argument("name", help="mixer name or alias")
    parser.add_argument("--length", type=_positive_int, default=None,
                        help="sequence length L of the random input (default 64; taken from --input if given)")
    parser.add_argument("--dim", type=_positive_int, default=None,
                        help="model width of the random input (default 32; taken from --input if given)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); on top of the spec's small "
                             "test options")
    parser.add_argument("--direction", choices=DIRECTIONS, default="default",
                        help="causal or bidirectional, where the mixer allows it (default: the mixer's default)")
    parser.add_argument("--head", type=_head, default="mean", help="head index to show, or 'mean' (default: mean)")
    parser.add_argument("--input", type=Path, default=None,
                        help="a .pt file holding one input tensor of shape (L, dim) or (1, L, dim)")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seed of the mixer's parameters and the random input (default 0)")
    parser.add_argument("--scale", choices=SCALES, default="linear",
                        help="colour scale: linear (set by the off-diagonal entries) or log (log10 |M|)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: outputs/show_NAME.png)")
    parser.add_argument("--save-matrix", type=Path, default=None, metavar="PATH",
                        help="also save the materialized (heads, L, L) float64 matrix with torch.save")


def _load_input(path: Path, length: int | None, dim: int | None):
    import torch

    if not path.is_file():
        raise CliError(f"--input: no such file {str(path)!r}")
    try:
        x = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a bad argument
        raise CliError(f"--input {str(path)!r} is not a tensor saved with torch.save: {_one_line(str(err))}") from None
    if not isinstance(x, torch.Tensor):
        raise CliError(f"--input {str(path)!r} holds a {type(x).__name__}, not a tensor")
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2 or 0 in x.shape:
        raise CliError(f"--input must hold one sequence of shape (L, dim) or (1, L, dim), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise CliError(f"--input must be a floating-point tensor, got dtype {x.dtype}")
    if length is not None and length != x.shape[0]:
        raise CliError(f"--length {length} disagrees with the input's length {x.shape[0]}")
    if dim is not None and dim != x.shape[1]:
        raise CliError(f"--dim {dim} disagrees with the input's width {x.shape[1]}")
    return x[None].double()


def _cmd_show(args: argparse.Namespace) -> int:
    import torch

    import mixer_plugins as mp

    from .benchmarking import build_mixer, direction_problem
    from .plotting import matrix_to_image, require_matplotlib, save_matrix_heatmap

    name = resolve_mixers([args.name])[0]
    spec = mp.get_spec(name)
    user = parse_option_assignments(args.option, [name])[name]
    # The spec's test options are small and fast; their max_seq_len (if any) would cap --length, so the length
    # of this run decides it unless the user sets it.
    options = {k: v for k, v in spec.test_options.items() if k != "max_seq_len"}
    options.update(user)
    require_matplotlib()
    if args.input is not None:
        x = _load_input(args.input, args.length, args.dim)
    else:
        gen = torch.Generator().manual_seed(args.seed + 1)
        x = torch.randn(1, args.length or 64, args.dim or 32, generator=gen, dtype=torch.float64)
    length, dim = x.shape[1], x.shape[2]
    causal = None if args.direction == "default" else args.direction == "causal"
    problem = direction_problem(name, causal)
    if problem:
        raise CliError(problem)
    torch.manual_seed(args.seed)
    mixer = build_mixer(name, dim, length, causal=causal, options=options, dtype=torch.float64).eval()
    with torch.no_grad():
        matrix = mixer.materialize(x)[0]  # NotMaterializableError: one line, exit 2 (main)
    if args.head != "mean" and args.head >= matrix.shape[0]:
        raise CliError(f"--head {args.head}: mixer {name!r} has {matrix.shape[0]} head(s) here")
    image = matrix_to_image(matrix, args.head)
    shown = "mean over heads" if args.head == "mean" else f"head {args.head}"
    direction = "causal" if getattr(mixer, "causal", False) else "bidirectional"
    title = f"{name} ({spec.matrix_class or 'matrix'}, {direction}), L={length}, {shown}"
    out = args.out or Path("outputs") / f"show_{name}.png"
    save_matrix_heatmap(matrix, out, title=title, head=args.head, scale=args.scale)
    if args.save_matrix is not None:
        args.save_matrix.parent.mkdir(parents=True, exist_ok=True)
        torch.save(matrix.detach().cpu(), args.save_matrix)
    below = float(image.tril(-1).abs().max()) if length > 1 else 0.0
    above = float(image.triu(1).abs().max()) if length > 1 else 0.0
    diagonal = float(image.diagonal().abs().max())
    print(f"{name}: {spec.matrix_class or 'matrix'}, {direction}, {matrix.shape[0]} head(s) of {length} x {length} "
          f"({shown}); max |M| below the diagonal {below:.3g}, on it {diagonal:.3g}, above it {above:.3g}")
    print(f"wrote {out}" + (f", {args.save_matrix}" if args.save_matrix is not None else ""))
    return 0


# -- flops -----------------------------------------------------------------------------------------------------

def _flops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", type=_name_list, default=["all"], metavar="A,B,...",
                        help="comma-separated mixers (default: all)")
    parser.add_argument("--dim", type=_positive_int, default=256, help="model width (default 256)")
    parser.add_argument("--length", type=_positive_int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--option", action="append", default=[], metavar="[MIXER.]KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable)")
    parser.add_argument("--no-backward", action="store_true", help="skip the forward+backward count")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (as in docs/flops.md)")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch intra-op threads")


def _cmd_flops(args: argparse.Namespace) -> int:
    from .flop_report import TABLE_HEADERS, TOLERANCE, flop_report, markdown_table, table_rows

    mixers = resolve_mixers(args.mixers)
    options = parse_option_assignments(args.option, mixers)
    _set_threads(args.threads)
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


# -- the parser ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[argparse.Namespace], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None


COMMANDS: dict[str, Command] = {
    "list": Command("list every registered mixer", _cmd_list),
    "info": Command("show a mixer's options", _cmd_info, _info_arguments),
    "demo": Command("train small timm ViTs that differ only in the mixer on scikit-learn's digits; "
                    "print a table and write learning curves and matrix heat maps", _cmd_demo, _demo_arguments),
    "bench": Command("time, FLOPs and peak memory of mixers against sequence length; table and log-log plot",
                     _cmd_bench, _bench_arguments),
    "bench-table": Command("comparison table of pytest-benchmark's saved JSON (the benchmarks/ suites)",
                           _cmd_bench_table, _bench_table_arguments),
    "show": Command("heat map of a mixer's matrix for a random or given input", _cmd_show, _show_arguments),
    "flops": Command("analytic FLOPs of every mixer against PyTorch's FlopCounterMode", _cmd_flops,
                     _flops_arguments),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixer-plugins", description="Matrix mixers as pluggable PyTorch modules.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .registry import MixerError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            import mixer_plugins

            print(mixer_plugins.__version__)
            return 0
        if args.command is None:
            parser.print_help()
            return 2
        return COMMANDS[args.command].run(args)
    except (CliError, MixerError) as err:
        # MixerError: bad names, options, lengths, inputs or a missing extra, all the user's to fix.
        print(f"mixer-plugins: error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
