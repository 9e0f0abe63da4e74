"""Text helpers shared by every layer: "did you mean" suggestions and tables.

A leaf module (it imports nothing of ours), so the registry, the kernels, the backbones and the tools can all use
the same wording.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["closest", "did_you_mean", "format_table", "markdown_table"]


def closest(word: str, candidates: Iterable[str], *, n: int = 2, cutoff: float = 0.6) -> list[str]:
    """The candidates closest to ``word`` (best first), at most ``n``, as :func:`difflib.get_close_matches`."""
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=cutoff)


def did_you_mean(word: str, candidates: Iterable[str] | Mapping[str, str], *, n: int = 2, cutoff: float = 0.6) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the candidates close to ``word``, or ``""`` when none is.

    ``candidates`` may map the spelling that is compared (e.g. a normalised name) to the one that is shown.
    """
    shown = candidates if isinstance(candidates, Mapping) else {c: c for c in candidates}
    close = closest(word, shown, n=n, cutoff=cutoff)
    if not close:
        return ""
    return f"; did you mean {' or '.join(repr(shown[c]) for c in close)}?"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with aligned columns and a dashed rule under the headers."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cells[0]).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r).rstrip() for r in cells[1:]]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown pipe table."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
