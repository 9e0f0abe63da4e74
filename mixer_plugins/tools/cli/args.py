"""What every subcommand shares: the one-line error, the command record, and the argument types."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

NumberT = TypeVar("NumberT", int, float)

__all__ = [
    "CliError",
    "allocation_guard",
    "Command",
    "head",
    "length_list",
    "name_list",
    "non_negative_int",
    "number_type",
    "image_suffixes",
    "one_line",
    "output_file",
    "output_folder",
    "writing",
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


def _os_reason(err: OSError) -> str:
    return err.strerror or str(err)


def output_folder(path: Path, option: str) -> Path:
    """Create ``path`` (a folder the command writes into) now, or fail with one line naming ``option``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CliError(f"{option} {str(path)!r}: exists and is not a folder") from None
    except OSError as err:
        raise CliError(f"{option} {str(path)!r}: cannot create the folder ({_os_reason(err)})") from None
    return path


def output_file(path: Path, option: str, *, default_suffix: str | None = None,
                suffixes: Callable[[], set[str]] | None = None) -> Path:
    """Check, before any work, that ``path`` can be written; returns the name that will really be written.

    A name without an extension gets ``default_suffix`` (what matplotlib would silently add); ``suffixes()``
    lists the accepted extensions (without the dot). The file itself is not left behind by the check.
    """
    if path.is_dir():
        raise CliError(f"{option} {str(path)!r} is a folder; give a file name")
    if default_suffix and not path.suffix:
        path = path.with_name(path.name + default_suffix)
    if suffixes is not None:
        accepted = suffixes()
        if path.suffix.lstrip(".").lower() not in accepted:
            raise CliError(f"{option} {str(path)!r}: unsupported file type {path.suffix!r} "
                           f"(use one of: {', '.join(sorted(accepted))})")
    if path.is_dir():
        raise CliError(f"{option} {str(path)!r} is a folder; give a file name")
    output_folder(path.parent, option)
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise CliError(f"{option} {str(path)!r}: cannot write there ({_os_reason(err)})") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def writing(path: Path, option: str) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``path`` into one line naming ``option``."""
    try:
        yield
    except OSError as err:
        raise CliError(f"{option} {str(path)!r}: cannot write there ({_os_reason(err)})") from None


def image_suffixes() -> set[str]:
    """The file extensions matplotlib can write (``png``, ``pdf``, ``svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


_ALLOCATION_FAILURES = ("can't allocate", "cannot allocate", "out of memory", "not enough memory", "overflow")


@contextlib.contextmanager
def allocation_guard(what: str, hint: str) -> Iterator[None]:
    """Turn torch's "cannot allocate" errors inside the block into one line: ``what`` cannot be allocated,
    ``hint`` says which option to lower."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if isinstance(err, RuntimeError) and not any(m in str(err).lower() for m in _ALLOCATION_FAILURES):
            raise
        raise CliError(f"{what} cannot be allocated; {hint} ({one_line(str(err))[:160]})") from None


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count for this process (the commands' ``--threads`` option; compare's workers
    get the parent's count through it); None leaves it as it is."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# -- argument types ------------------------------------------------------------------------------------------

def number_type(convert: Callable[[str], NumberT], accept: Callable[[NumberT], bool],
                 what: str) -> Callable[[str], NumberT]:
    """An argparse ``type=`` that converts, checks and explains in one line."""

    def parse(text: str) -> NumberT:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = number_type(int, lambda v: v > 0, "a positive integer")
non_negative_int = number_type(int, lambda v: v >= 0, "a non-negative integer")
positive_float = number_type(float, lambda v: v > 0, "a positive number")


def length_list(text: str) -> list[int]:
    """``256,1024`` -> sorted distinct positive lengths."""
    lengths = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not lengths:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 256,1024,4096")
    return sorted(set(lengths))


def name_list(text: str) -> list[str]:
    """``attention,quasi`` -> the names (``all`` is resolved later)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated mixer names, e.g. attention,quasi (or 'all')")
    return names


_head_index = number_type(int, lambda v: v >= 0, "a head index (>= 0) or 'mean'")


def head(text: str) -> int | str:
    """A head index or ``mean``."""
    return "mean" if text == "mean" else _head_index(text)

