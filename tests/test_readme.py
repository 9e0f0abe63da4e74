"""The README's code must run: the plugin example passes the conformance kit, the quick start works."""

from __future__ import annotations

import re
from pathlib import Path

import mixer_plugins as mp
from mixer_plugins.testing import check_mixer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _snippet(first_line: str) -> str:
    match = re.search(r"```python\n" + re.escape(first_line) + r"\n(.*?)```", README, re.S)
    assert match, f"README has no python block starting with {first_line!r}"
    return first_line + "\n" + match.group(1)


def test_readme_plugin_example_passes_the_kit():
    namespace: dict = {}
    exec(_snippet("# my_mixers/__init__.py"), namespace)
    spec = namespace["SPEC"]
    mp.register_mixer(spec)
    try:
        assert all(r.passed for r in check_mixer("causal_mean"))
    finally:
        mp.unregister_mixer("causal_mean")


def test_readme_quick_start_runs():
    namespace: dict = {}
    exec(_snippet("import torch\nimport mixer_plugins as mp"), namespace)
    assert namespace["y"].shape == (2, 128, 64)
    assert (namespace["y"][1, 100:] == 0).all()
