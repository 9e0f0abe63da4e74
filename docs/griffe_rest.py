"""Griffe extension for the API reference: our docstrings' reST markup, rewritten as Markdown before rendering.

The docstrings are prose with a few reST constructs; mkdocstrings renders Markdown. Once the package is loaded
(so every name can be looked up), each docstring is rewritten:

* a role, ``:class:`~mixer_plugins.MixerError```, ``:func:`..gated_rmsnorm```, ``:mod:`.native```, ...: a code span
  linked to the object's entry in the reference (an optional autorefs link: plain code when the object has no page).
  Targets resolve as Python imports do (``.x``: beside this module, ``..x``: one package up), then in the enclosing
  class and module, then as the unique object of the package with that dotted suffix; ``~`` shows the last name only.
* a literal block (a paragraph ending ``::`` followed by an indented block): a fenced code block (``python`` when it
  parses as Python), the paragraph ending ``:`` (reST's rule: ``text::`` -> ``text:``, a lone ``::`` disappears).
* a bullet list right after a paragraph line: a blank line is put before it (Markdown starts no list without one);
* the first paragraph is joined into one line, as the summary tables show a docstring's first line only.

An attribute documented by ``#:`` comments above it (the Sphinx convention some of our modules use) gets them as its
docstring.

Listed under the Python handler's ``extensions`` in mkdocs.yml and left out of the site by ``exclude_docs``.
"""

from __future__ import annotations

import ast
import html
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
LIST_ITEM = re.compile(r"^(\s*)(?:[*+-]|\d+\.)\s+\S")
CALLABLE_ROLES = {"func", "meth"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class RestToMarkdown(griffe.Extension):
    """Rewrites the reST roles, literal blocks and list openings of every docstring of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        paths = self._paths(pkg)
        for obj in self._objects(pkg):
            if obj.docstring is None and obj.is_attribute:
                _comment_docstring(obj)
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, lambda target, o=obj: _resolve(pkg, o, target,
                                                                                                paths))

    @staticmethod
    def _objects(root: griffe.Object) -> list[griffe.Object]:
        """Every object defined in the package (aliases are skipped: their target is visited where it lives)."""
        found, stack = [], [root]
        while stack:
            obj = stack.pop()
            found.append(obj)
            stack.extend(member for member in obj.members.values() if not member.is_alias)
        return found

    @classmethod
    def _paths(cls, pkg: griffe.Module) -> list[str]:
        return [obj.path for obj in cls._objects(pkg)]


def _comment_docstring(obj: griffe.Object) -> None:
    """An attribute documented by ``#:`` comment lines right above it (Sphinx's convention) gets them as docstring."""
    try:
        lines = obj.module.lines
    except Exception:  # noqa: BLE001 - no source
        return
    comment: list[str] = []
    number = (obj.lineno or 0) - 1   # the attribute's line, 1-based -> the line above it, 0-based index
    while number > 0 and lines[number - 1].strip().startswith("#:"):
        comment.insert(0, lines[number - 1].strip()[2:].strip())
        number -= 1
    if comment:
        obj.docstring = griffe.Docstring("\n".join(comment), parent=obj)


def rewrite(text: str, resolve) -> str:
    """The docstring ``text`` in Markdown; ``resolve(target)`` gives the full path of a role's target, or None."""
    return _first_paragraph_on_one_line(_list_openings(_literal_blocks(ROLE.sub(lambda m: _role(m, resolve), text))))


def _role(match: re.Match, resolve) -> str:
    kind, short, target = match.group(1), match.group(2) == "~", match.group(3).strip()
    name = target.lstrip(".")
    shown = name.rsplit(".", 1)[-1] if short else name
    if kind in CALLABLE_ROLES and not shown.endswith(")"):
        shown += "()"
    path = resolve(target)
    code = f"<code>{html.escape(shown)}</code>"
    if path is None:
        return f"`{shown}`"
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def _lookup(pkg: griffe.Module, path: str) -> str | None:
    """The canonical path of ``path`` if the package defines it (following re-exports), else None."""
    parts = path.split(".")
    if parts[0] != pkg.name:
        return None
    try:
        obj = pkg[".".join(parts[1:])] if len(parts) > 1 else pkg
        if obj.is_alias:
            obj = obj.final_target
    except Exception:  # noqa: BLE001 - not ours, or a re-export of another package's object
        return None
    return obj.path if obj.path.split(".")[0] == pkg.name else None


def _resolve(pkg: griffe.Module, obj: griffe.Object, target: str, paths: list[str]) -> str | None:
    dots = len(target) - len(target.lstrip("."))
    name = target[dots:]
    module = obj if obj.is_module else obj.module
    if dots:  # as a relative import: from the module's package, one level up per extra dot
        base = module if module.is_package else module.parent
        for _ in range(dots - 1):
            base = base.parent if base is not None and base.parent is not None else base
        if base is not None and (found := _lookup(pkg, f"{base.path}.{name}")):
            return found
    else:
        if found := _lookup(pkg, name):
            return found
        scope = obj
        while scope is not None:  # the enclosing class, module and packages
            if found := _lookup(pkg, f"{scope.path}.{name}"):
                return found
            scope = scope.parent
    suffix = [p for p in paths if p.endswith(f".{name}")]
    return suffix[0] if len(suffix) == 1 else None


def _literal_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        head = line[:-2] if line.endswith("::") and not line.endswith(":::") else None
        indent = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if head is None or j == len(lines) or _indent(lines[j]) <= indent:
            out.append(lines[i])
            i += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        block = lines[j:end]
        while block and not block[-1].strip():
            block.pop()
        code = textwrap.dedent("\n".join(block))
        if head.strip():
            out.append(head.rstrip() + ("" if head.endswith(" ") else ":"))
            out.append("")
        pad = " " * indent
        out.append(f"{pad}```{'python' if _is_python(code) else 'text'}")
        out.extend(pad + code_line if code_line else "" for code_line in code.split("\n"))
        out.append(f"{pad}```")
        out.append("")
        i = j + len(block)
    return "\n".join(out)


def _is_python(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def _list_openings(text: str) -> str:
    out: list[str] = []
    in_fence = in_list = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        item = not in_fence and LIST_ITEM.match(line)
        if not line.strip():
            in_list = False
        elif item and not in_list:
            if out and out[-1].strip():
                out.append("")
            in_list = True
        out.append(line)
    return "\n".join(out)


def _first_paragraph_on_one_line(text: str) -> str:
    """The first paragraph joined into one line (the same Markdown): the reference's summary tables show a
    docstring's first line, which would otherwise stop mid-sentence. Left alone when it holds a list or a block."""
    lines = text.split("\n")
    end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    head = lines[:end]
    if len(head) < 2 or any(LIST_ITEM.match(line) or line.startswith((" ", "|", "#", "```")) for line in head[1:]):
        return text
    return "\n".join([" ".join(line.strip() for line in head), *lines[end:]])
