"""``mixer-plugins show NAME``: heat map of a mixer's matrix for a random or given input."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .. import DIRECTIONS, SCALES
from .args import (
    CliError,
    Command,
    allocation_guard,
    head,
    image_suffixes,
    non_negative_int,
    one_line,
    output_file,
    positive_int,
    writing,
)
from .options import parse_option_assignments, resolve_mixers

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["COMMAND"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="mixer name or alias")
    parser.add_argument("--length", type=positive_int, default=None,
                        help="sequence length L of the random input (default 64; taken from --input if given)")
    parser.add_argument("--dim", type=positive_int, default=None,
                        help="model width of the random input (default 32; taken from --input if given)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a mixer option, typed by the mixer's config (repeatable); on top of the spec's small "
                             "test options")
    parser.add_argument("--direction", choices=DIRECTIONS, default="default",
                        help="causal or bidirectional, where the mixer allows it (default: the mixer's default)")
    parser.add_argument("--head", type=head, default="mean", help="head index to show, or 'mean' (default: mean)")
    parser.add_argument("--input", type=Path, default=None,
                        help="a .pt file holding one input tensor of shape (L, dim) or (1, L, dim)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the mixer's parameters and the random input (default 0)")
    parser.add_argument("--scale", choices=SCALES, default="linear",
                        help="colour scale: linear (set by the off-diagonal entries) or log (log10 |M|)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: outputs/show_NAME.png)")
    parser.add_argument("--save-matrix", type=Path, default=None, metavar="PATH",
                        help="also save the materialized (heads, L, L) float64 matrix with torch.save")


def load_input(path: Path, length: int | None, dim: int | None) -> torch.Tensor:
    """The ``--input`` tensor as a ``(1, L, dim)`` float64 batch, checked against ``--length`` and ``--dim``."""
    import torch

    if not path.is_file():
        raise CliError(f"--input: no such file {str(path)!r}")
    try:
        x = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a bad argument
        raise CliError(f"--input {str(path)!r} is not a tensor saved with torch.save: {one_line(str(err))}") from None
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


def run(args: argparse.Namespace) -> int:
    import torch

    from ...backbones.options import direction_problem
    from ...registry import default_registry
    from ..benchmarking import build_mixer
    from ..plotting import matrix_to_image, require_matplotlib, save_matrix_heatmap

    name = resolve_mixers([args.name])[0]
    spec = default_registry.get_spec(name)
    user = parse_option_assignments(args.option, [name])[name]
    # The spec's test options are small and fast; their max_seq_len (if any) would cap --length, so the length
    # of this run decides it unless the user sets it.
    options = {**{k: v for k, v in spec.test_options.items() if k != "max_seq_len"}, **user}
    require_matplotlib()
    # Output paths are checked before any work; the heat map is written under the name reported.
    out = output_file(args.out or Path("outputs") / f"show_{name}.png", "--out", default_suffix=".png",
                      suffixes=image_suffixes)
    if args.save_matrix is not None:
        output_file(args.save_matrix, "--save-matrix")
    if args.input is not None:
        x = load_input(args.input, args.length, args.dim)
    else:
        gen = torch.Generator().manual_seed(args.seed + 1)
        with allocation_guard(f"the random input of length {args.length or 64} and width {args.dim or 32}",
                              "lower --length or --dim"):
            x = torch.randn(1, args.length or 64, args.dim or 32, generator=gen, dtype=torch.float64)
    length, dim = x.shape[1], x.shape[2]
    causal = None if args.direction == "default" else args.direction == "causal"
    problem = direction_problem(spec, causal)
    if problem:
        raise CliError(problem)
    torch.manual_seed(args.seed)
    with allocation_guard(f"mixer {name!r} at L={length}, dim={dim}: its {length} x {length} matrix",
                          "lower --length or --dim"):
        mixer = build_mixer(name, dim, length, causal=causal, options=options, dtype=torch.float64).eval()
        with torch.no_grad():
            matrix = mixer.materialize(x)[0]  # NotMaterializableError: one line, exit 2 (main)
    if args.head != "mean" and args.head >= matrix.shape[0]:
        raise CliError(f"--head {args.head}: mixer {name!r} has {matrix.shape[0]} head(s) here")
    image = matrix_to_image(matrix, args.head)
    shown = "mean over heads" if args.head == "mean" else f"head {args.head}"
    direction = "causal" if getattr(mixer, "causal", False) else "bidirectional"
    title = f"{name} ({spec.matrix_class or 'matrix'}, {direction}), L={length}, {shown}"
    with writing(out, "--out"):
        out = save_matrix_heatmap(matrix, out, title=title, head=args.head, scale=args.scale)
    if args.save_matrix is not None:
        with writing(args.save_matrix, "--save-matrix"):
            torch.save(matrix.detach().cpu(), args.save_matrix)
    below = float(image.tril(-1).abs().max()) if length > 1 else 0.0
    above = float(image.triu(1).abs().max()) if length > 1 else 0.0
    diagonal = float(image.diagonal().abs().max())
    print(f"{name}: {spec.matrix_class or 'matrix'}, {direction}, {matrix.shape[0]} head(s) of {length} x {length} "
          f"({shown}); max |M| below the diagonal {below:.3g}, on it {diagonal:.3g}, above it {above:.3g}")
    print(f"wrote {out}" + (f", {args.save_matrix}" if args.save_matrix is not None else ""))
    return 0


COMMAND = Command("heat map of a mixer's matrix for a random or given input", run, add_arguments)
