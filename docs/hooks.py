"""mkdocs hooks: the home page is README.md, and the API reference's mixer page is written from the registry.

* ``docs/index.md``'s text is replaced by README.md's, so the README is written once and links to docs/ work in both.
* A page titled with a module's name is that module's cross-reference target (docstrings link to it).
* On ``docs/api/mixers.md`` the line :data:`MIXERS_MARKER` is replaced by one section per built-in mixer, in
  alphabetical order: its summary and facts, its options (the config's fields: type, default, meaning, as
  ``mixer-plugins info`` prints them) and its class and config from the docstrings, so the page never lags the code.

Listed under ``hooks:`` in mkdocs.yml and left out of the site by ``exclude_docs``.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

MIXERS_MARKER = "<!-- the mixers: written by docs/hooks.py -->"
DISTRIBUTION = "mixer-plugins"


def on_page_markdown(markdown: str, *, page, config, files) -> str:
    """README.md for ``index.md``; the mixer sections for ``api/mixers.md``."""
    if page.file.src_uri == "index.md":
        readme = Path(config["config_file_path"]).parent / "README.md"
        return re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
    if page.file.src_uri == "api/mixers.md":
        if MIXERS_MARKER not in markdown:
            raise ValueError(f"docs/api/mixers.md lost its marker line {MIXERS_MARKER!r}")
        markdown = markdown.replace(MIXERS_MARKER, mixer_sections())
    return _module_anchor(markdown)


def _module_anchor(markdown: str) -> str:
    """A page titled with a module (``# `mixer_plugins.x` ``) becomes that module's cross-reference target (the
    title's id is the module's name): its docstrings' links to the module land on the page."""
    title = re.match(r"# `(mixer_plugins(?:\.\w+)*)`(?=\n)", markdown)
    if title is None:
        return markdown
    return markdown[:title.end()] + f" {{#{title.group(1)}}}" + markdown[title.end():]


def built_in_mixers() -> list[str]:
    """Our own mixers' names (not those of other installed plugins), sorted."""
    import mixer_plugins as mp

    names = [name for name in mp.list_mixers() if mp.get_spec(name).distribution == DISTRIBUTION]
    if not names:
        raise RuntimeError(f"no mixer of {DISTRIBUTION!r} is registered: is it installed (pip install -e .)?")
    return names


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """A code span that may hold ``|`` inside a table cell (an HTML entity: a table splits cells at every pipe)."""
    return "<code>" + html.escape(str(text)).replace("|", "&#124;") + "</code>"


def _directive(path: str) -> str:
    return f"::: {path}\n    options:\n      show_root_heading: true\n      heading_level: 3\n      members: false\n"


def mixer_sections() -> str:
    """The markdown of every built-in mixer: an index table, then one section each."""
    import mixer_plugins as mp
    from mixer_plugins._text import markdown_table
    from mixer_plugins.tools.cli.info import option_rows

    specs = [mp.get_spec(name) for name in built_in_mixers()]
    index = markdown_table(("mixer", "aliases", "what it is"),
                           [(f"[`{s.name}`](#{s.name})", ", ".join(f"`{a}`" for a in s.aliases), _cell(s.summary))
                            for s in specs])
    parts = [index, ""]
    config_home: dict[type, str] = {}
    for spec in specs:
        builder, config = spec.builder, spec.config
        facts = [f"matrix class: {spec.matrix_class or '-'}", f"direction: {spec.direction}",
                 f"complexity: {spec.complexity or '-'}", f"data-dependent: {spec.data_dependent}"]
        if spec.aliases:
            facts.insert(0, "aliases: " + ", ".join(f"`{a}`" for a in spec.aliases))
        rows = [(_code(name), _code(kind), _code(default), _cell(help_text))
                for name, kind, default, help_text in option_rows(spec)]
        parts += [f"## {spec.name}", "", _cell(spec.summary).rstrip(".") + ".", "", " · ".join(facts), "",
                  f"`mixer_plugins.create_mixer(\"{spec.name}\", dim, **options)` with the options of "
                  f"`{config.__qualname__}`:", "", '<div class="options" markdown>', "",
                  markdown_table(("option", "type", "default", "meaning"), rows), "", "</div>", "",
                  _directive(f"{builder.__module__}.{builder.__qualname__}")]
        config_path = f"{config.__module__}.{config.__qualname__}"
        if config in config_home:
            parts += [f"Its config, [`{config.__qualname__}`](#{config_path}), is shown under "
                      f"[`{config_home[config]}`](#{config_home[config]}).", ""]
        else:
            config_home[config] = spec.name
            parts += [_directive(config_path)]
    return "\n".join(parts)
