"""mkdocs hook: the site's home page is README.md, so the README is written once and links to docs/ work in both.

Listed under ``hooks:`` in mkdocs.yml and left out of the site by ``exclude_docs``.
"""

from __future__ import annotations

import re
from pathlib import Path


def on_page_markdown(markdown: str, *, page, config, files) -> str:
    """Replace ``docs/index.md``'s text by README.md's, with README's ``docs/...`` links made relative to docs/."""
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config["config_file_path"]).parent / "README.md"
    return re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
