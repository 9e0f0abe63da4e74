"""What every subcommand shares: the one-line error, the command record, and the argument types."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

__all__ = [
    "CliError",
    "Command",
    "head",
    "length_list",
    "name_list",
    "non_negative_int",
    "one_line",
    "positive_float",
    "positive_int",
    "set_threads",
]


class CliError(Exception):
    """An error reported as one line on stderr, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its help line, what it runs (returning the exit status) and its arguments."""

    help: str
    run: Callable[[argparse.Namespace], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None


def one_line(text: str) -> str:
    """Multi-line messages (e.g. several invalid options) joined into one line."""
    parts = [line.strip().removeprefix("- ") for line in str(text).splitlines()]
    out = ""
    for part in filter(None, parts):
        out += ("" if not out else " " if out.endswith(":") else "; ") + part
    return out


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` unless ``threads`` is None."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


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


positive_int = _number_type(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number_type(int, lambda v: v >= 0, "a non-negative integer")
positive_float = _number_type(float, lambda v: v > 0, "a positive number")


def length_list(text: str) -> list[int]:
    """``256,1024`` -> sorted distinct positive lengths."""
    lengths = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lengths.append(positive_int(part))
    if not lengths:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 256,1024,4096")
    return sorted(set(lengths))


def name_list(text: str) -> list[str]:
    """``attention,quasi`` -> the names (``all`` is resolved later)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated mixer names, e.g. attention,quasi (or 'all')")
    return names


def head(text: str) -> int | str:
    """A head index or ``mean``."""
    if text == "mean":
        return "mean"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a head index or 'mean', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a head index (>= 0) or 'mean', got {text!r}")
    return value

