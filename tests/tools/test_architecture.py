"""The package's layers: imports run one way, no module cycles, low layers load no host library.

The layers contract lives in ``pyproject.toml`` (``[tool.importlinter]``) and is checked with import-linter; the cycle
check uses grimp's import graph (import-linter's engine). Each check is also run on a copy of the package with a
planted defect, to show it can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mixer_plugins"

pytest.importorskip("importlinter", reason="needs import-linter (the dev extra)")
pytest.importorskip("grimp", reason="needs grimp (installed with import-linter)")


def _lint_imports(source_root: Path) -> subprocess.CompletedProcess:
    """Run import-linter with our contract on the package found under ``source_root``."""
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=source_root, env=env, capture_output=True, text=True,
                          timeout=300)


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "mixer_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(source_root: Path, relative: str, line: str) -> None:
    path = source_root / "mixer_plugins" / relative
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_layers_contract_holds():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_layers_contract_catches_a_planted_wrong_way_import(tmp_path):
    root = _copy_package(tmp_path)
    _plant(root, "kernels/__init__.py", "import mixer_plugins.backbones.timm  # planted: a kernel importing a host")
    result = _lint_imports(root)
    assert result.returncode != 0
    assert "mixer_plugins.kernels is not allowed to import mixer_plugins.backbones" in result.stdout


_CYCLES_SCRIPT = r"""
import json, sys
import grimp

graph = grimp.build_graph("mixer_plugins", cache_dir=None, exclude_type_checking_imports=True)
# Imports made only for type checkers never run, so they are left out. A package's __init__ importing its own
# submodules is how Python packages work, not a cycle of concepts:
# only edges between modules that are not ancestors of one another count.
edges = {
    m: sorted(t for t in graph.find_modules_directly_imported_by(m)
              if t.startswith("mixer_plugins") and not t.startswith(m + ".") and not m.startswith(t + "."))
    for m in graph.modules if m.startswith("mixer_plugins")
}
index, low, stack, on_stack, components = {}, {}, [], set(), []

def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop()
            on_stack.discard(w)
            component.append(w)
            if w == v:
                break
        if len(component) > 1:
            components.append(sorted(component))

sys.setrecursionlimit(10_000)
for module in sorted(edges):
    if module not in index:
        visit(module)
print(json.dumps(components))
"""


def _module_cycles(source_root: Path) -> list[list[str]]:
    """Strongly connected components (size > 1) of the import graph of the package under ``source_root``."""
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    out = subprocess.run([sys.executable, "-c", _CYCLES_SCRIPT], cwd=source_root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_no_import_cycles_between_modules():
    assert _module_cycles(ROOT) == []


def test_cycle_check_catches_a_planted_cycle(tmp_path):
    root = _copy_package(tmp_path)
    (root / "mixer_plugins" / "_planted_a.py").write_text("from mixer_plugins import _planted_b  # noqa\n")
    (root / "mixer_plugins" / "_planted_b.py").write_text("from mixer_plugins import _planted_a  # noqa\n")
    assert ["mixer_plugins._planted_a", "mixer_plugins._planted_b"] in _module_cycles(root)


def _loaded_after(statement: str) -> set[str]:
    code = textwrap.dedent(f"""
        import sys
        {statement}
        print(" ".join(m for m in ("timm", "fairseq2", "matplotlib") if m in sys.modules))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["mixer_plugins", "mixer_plugins.kernels", "mixer_plugins.registry",
                                    "mixer_plugins.mixers", "mixer_plugins.errors"])
def test_low_layers_load_no_host_library(module):
    assert _loaded_after(f"import {module}") == set()


def test_a_mixer_loads_no_host_library():
    assert _loaded_after("import mixer_plugins as mp; mp.create_mixer('quasiseparable', 32)(__import__('torch')"
                         ".randn(1, 8, 32))") == set()


@pytest.mark.parametrize("order", ["mixer_plugins first", "timm first"])
def test_timm_names_registered_whatever_the_import_order(order):
    first, second = ("mixer_plugins", "timm") if order == "mixer_plugins first" else ("timm", "mixer_plugins")
    code = textwrap.dedent(f"""
        import {first}, {second}
        import timm
        from timm.layers import get_attn
        model = timm.create_model("vit_base", mixer="quasi", depth=1, img_size=32, patch_size=16, embed_dim=32,
                                  num_heads=2)
        print(type(model.blocks[0].attn).__name__)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TimmMixerAttention"


def test_importing_the_package_imports_neither_torch_nor_timm_and_adds_no_finder_of_its_own():
    """``import mixer_plugins`` stays cheap (the command line's --help and argument errors rely on it): the timm
    registration waits, in wrapt's post-import hook, for timm to be imported. No import finder of ours is added."""
    code = textwrap.dedent("""
        import sys
        import mixer_plugins
        ours = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("mixer_plugins")]
        print(" ".join(m for m in ("torch", "timm", "pydantic") if m in sys.modules), "|", " ".join(ours))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["|"], out.stdout


def test_a_failing_timm_adapter_warns_and_never_breaks_import_timm():
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["mixer_plugins.backbones.timm"] = None   # the adapter cannot be imported
        import mixer_plugins
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import timm
        print(timm.is_model("vit_tiny_patch16_224"), timm.is_model("vit_base"))
        print([str(w.message) for w in caught if "could not register its timm models" in str(w.message)])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "True False" and "mixer_plugins.backbones.timm" in second, out.stdout
