"""Text fitted to the terminal: tables whose long cells wrap, and option types as a user writes them."""

from __future__ import annotations

import shutil
import textwrap
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = ["fit_table", "terminal_width", "user_type", "wrap"]

_GAP = "  "


def terminal_width(fallback: int = 100, *, at_most: int | None = None, at_least: int = 60) -> int:
    """The terminal's width (``$COLUMNS`` first; ``fallback`` when the output is not a terminal), kept within
    [``at_least``, ``at_most``]."""
    width = shutil.get_terminal_size((fallback, 24)).columns
    if at_most is not None:
        width = min(width, at_most)
    return max(width, at_least)


def wrap(text: str, width: int, indent: str = "") -> str:
    """``text`` wrapped to ``width`` columns, continuation lines indented by ``indent``."""
    return textwrap.fill(text, width=width, subsequent_indent=indent, break_on_hyphens=False) or text


def fit_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, *,
              wrapping: Collection[int] = (), minimum: int | Mapping[int, int] = 10) -> str | None:
    """Columns aligned as :func:`mixer_plugins._text.format_table` aligns them, within ``width`` columns: the
    cells of the columns in ``wrapping`` (indexes) wrap onto more lines, the widest such column narrowed first,
    none below its ``minimum`` (one for all, or per column index; never below its header). None when the table
    cannot fit so."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    least = minimum if isinstance(minimum, Mapping) else dict.fromkeys(wrapping, minimum)
    floor = {i: max(least.get(i, 1), len(headers[i])) for i in wrapping}

    def total() -> int:
        return sum(widths) + len(_GAP) * (len(widths) - 1)

    while total() > width:
        narrowable = [i for i in wrapping if widths[i] > floor[i]]
        if not narrowable:
            return None
        widest = max(narrowable, key=lambda i: widths[i])
        widths[widest] -= 1
    lines = [_GAP.join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             _GAP.join("-" * w for w in widths)]
    for row in cells:
        parts = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""] if i in wrapping else [cell]
                 for i, (cell, w) in enumerate(zip(row, widths))]
        for k in range(max(len(p) for p in parts)):
            lines.append(_GAP.join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip())
    return "\n".join(lines)


def user_type(annotation: Any) -> str:
    """An option's type as a user writes it: ``float``, ``int | None``, ``(float, float)``, ``list[int]``,
    ``'a' | 'b'``; constraints (``Annotated`` metadata) are left out (``info`` states them in words)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return user_type(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(user_type(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"({user_type(args[0])}, ...)"
        return "(" + ", ".join(user_type(a) for a in args) + ("," if len(args) == 1 else "") + ")"
    if origin is not None:
        inner = ", ".join(user_type(a) for a in args)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if inner else name
    if annotation is type(None) or annotation is None:
        return "None"
    return getattr(annotation, "__name__", str(annotation))
