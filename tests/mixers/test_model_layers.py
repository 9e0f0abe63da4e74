"""The model-code layers keep their dependency direction (read from the source, so no import order can hide a cycle):

* ``mixer_plugins.layers`` imports only the kernels and the leaf modules (never the registry or the mixers);
* ``mixer_plugins.registry`` imports only the leaf modules;
* no concrete mixer module imports another concrete mixer module (shared code lives in ``base``, ``block``,
  ``records``, ``qk_block``, ``_ssm`` and ``_softmax_common``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixer_plugins

PACKAGE = Path(mixer_plugins.__file__).parent
SHARED_MIXER_MODULES = {"__init__", "base", "block", "cache", "records", "qk_block", "_ssm", "_softmax_common"}


def _imports(path: Path) -> set[str]:
    """Absolute ``mixer_plugins.*`` module names imported by ``path`` (relative imports resolved)."""
    package = ["mixer_plugins", *path.parent.relative_to(PACKAGE).parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mixer_plugins"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("mixer_plugins"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


LEAF = ("mixer_plugins.errors", "mixer_plugins._text")


@pytest.mark.parametrize("path", _modules("layers"), ids=lambda p: p.name)
def test_layers_import_only_kernels_and_leaves(path):
    bad = [m for m in _imports(path)
           if not _allowed(m, ("mixer_plugins.layers", "mixer_plugins.kernels", *LEAF)) and m != "mixer_plugins"]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", _modules("registry"), ids=lambda p: p.name)
def test_registry_imports_only_leaves(path):
    bad = [m for m in _imports(path) if not _allowed(m, ("mixer_plugins.registry", *LEAF)) and m != "mixer_plugins"]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", _modules("mixers"), ids=lambda p: p.name)
def test_no_mixer_imports_another_mixer(path):
    concrete = {p.stem for p in _modules("mixers")} - SHARED_MIXER_MODULES
    others = {f"mixer_plugins.mixers.{name}" for name in concrete - {path.stem}}
    bad = sorted(m for m in _imports(path) if any(_allowed(m, (o,)) for o in others))
    assert not bad, f"{path.name} imports concrete mixer modules {bad}"
    upward = [m for m in _imports(path)
              if _allowed(m, ("mixer_plugins.testing", "mixer_plugins.backbones", "mixer_plugins.tools",
                              "mixer_plugins.cli", "mixer_plugins.mup", "mixer_plugins.mlbtc"))]
    assert not upward, f"{path.name} imports a higher layer: {upward}"


def test_relative_imports_are_resolved():
    """The AST reading above sees relative imports, so the tests can fail."""
    masks = PACKAGE / "layers" / "masks.py"
    assert "mixer_plugins.errors" in _imports(masks) and "mixer_plugins.kernels" not in _imports(masks)
    assert "mixer_plugins.mixers._ssm" in _imports(PACKAGE / "mixers" / "quasiseparable.py")
