"""Helpers for tests that need throwaway installed distributions."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_fake_distribution(root: Path, dist_name: str, entry_points: dict[str, str],
                           modules: dict[str, str] | None = None,
                           group: str = "mixer_plugins.mixers") -> Path:
    """Write a throwaway installed distribution (a ``.dist-info`` folder plus modules) under ``root``.

    Put ``root`` on ``sys.path`` and ``importlib.metadata`` sees it exactly like a pip-installed package.
    """
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist_name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1.0\n")
    lines = [f"[{group}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root
