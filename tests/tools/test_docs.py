"""The documentation is tested like code.

* Every ```python block in README.md and docs/**/*.md runs, in a fresh namespace (a block whose first line is
  ``# continued`` runs after the block before it on the same page, in its namespace). A block that cannot run here
  starts with ``# not run: <reason>``; such blocks are few, and each gives its reason.
* Every ```pycon block is a transcript: each ``>>>`` statement runs and what it prints, or the exception it raises
  (``TypeName: message``), must match the lines below it (``...`` matches anything).
* The README's quick start and the plugin example do what the text says; facts the text states about them hold.
  The plugin guide's package, taken file by file from the page, installs and passes the conformance kit.
* Links between pages resolve, no paragraph or heading is written twice, and ``mkdocs build --strict`` passes.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.testing import check_mixer

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

NOT_RUN = "# not run:"
CONTINUED = "# continued"
MAX_NOT_RUN = 3  # skipped blocks must stay rare; raise this only with a reason in the block itself


@dataclass(frozen=True)
class Block:
    """One fenced code block: the page, the line of its first code line (1-based), its language and its text."""

    path: Path
    line: int
    lang: str
    source: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.source.split("\n", 1)[0]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, top level only (fences at the start of a line)."""
    found, lang, start, body = [], None, 0, []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if lang is None:
            opening = re.match(r"^```\s*([\w+-]*)\s*$", text)
            if opening:
                lang, start, body = opening.group(1), number + 1, []
        elif re.match(r"^```\s*$", text):
            found.append(Block(path, start, lang, "\n".join(body) + "\n"))
            lang = None
        else:
            body.append(text)
    assert lang is None, f"{path.relative_to(REPO)}: code block opened at line {start - 1} is never closed"
    return found


def python_examples() -> list[list[Block]]:
    """The python blocks of every page, each with the ``# continued`` blocks that follow it."""
    examples: list[list[Block]] = []
    for path in PAGES:
        page: list[list[Block]] = []
        for block in blocks(path):
            if block.lang != "python":
                continue
            if block.first_line.startswith(CONTINUED):
                assert page, f"{block.where}: '{CONTINUED}' but no python block before it on the page"
                page[-1].append(block)
            else:
                page.append([block])
        examples += page
    return examples


def transcripts() -> list[Block]:
    return [b for path in PAGES for b in blocks(path) if b.lang == "pycon"]


EXAMPLES = python_examples()
TRANSCRIPTS = transcripts()


def _compiled(block: Block, mode: str = "exec", source: str | None = None, line: int | None = None):
    """Compile with the page as file name and the page's line numbers, so a traceback points into the doc."""
    padding = "\n" * ((block.line if line is None else line) - 1)
    return compile(padding + (block.source if source is None else source), str(block.path), mode)


@pytest.fixture
def doc_env(tmp_path, monkeypatch):
    """Run examples in a scratch folder, seeded, and unregister any mixer an example registers."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    before = set(mp.list_mixers())
    yield
    for name in set(mp.list_mixers()) - before:
        mp.unregister_mixer(name)


def run_example(example: list[Block]) -> dict:
    """Exec the blocks of one example in one fresh namespace; skip when an optional extra is not installed."""
    namespace: dict = {"__name__": "__doc_example__"}
    for block in example:
        try:
            exec(_compiled(block), namespace)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] in {"fairseq2", "matplotlib", "sklearn", "tqdm", "mamba_ssm",
                                                       "onnx", "onnxscript", "onnxruntime"}:
                pytest.skip(f"{block.where} needs {err.name}, which is not installed")
            raise
    return namespace


def _example_id(example: list[Block]) -> str:
    return example[0].where


@pytest.mark.parametrize("example", EXAMPLES, ids=_example_id)
def test_python_block_runs(example, doc_env, monkeypatch):
    head = example[0]
    if head.first_line.startswith(NOT_RUN):
        reason = head.first_line[len(NOT_RUN):].strip()
        assert reason, f"{head.where}: '{NOT_RUN}' needs a reason"
        pytest.skip(f"{head.where}: {reason}")
    if "init_fairseq2()" in head.source:
        _reuse_initialised_fairseq2(monkeypatch)
    distributed = "init_process_group" in head.source
    if distributed:
        _single_process_torchrun(monkeypatch)
    try:
        run_example(example)
    finally:
        if distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _single_process_torchrun(monkeypatch) -> None:
    """Start a distributed example as torchrun would start a world of one process (gloo, on 127.0.0.1)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)


def _reuse_initialised_fairseq2(monkeypatch) -> None:
    """fairseq2 can be set up only once per process (other test modules may have done it): set it up here, and
    let the example's own ``init_fairseq2()`` return that setup."""
    fairseq2 = pytest.importorskip("fairseq2")
    from fairseq2.runtime.dependency import get_dependency_resolver

    resolver = get_dependency_resolver()  # initialises fairseq2 unless this process already did
    monkeypatch.setattr(fairseq2, "init_fairseq2", lambda **kwargs: resolver)


def test_examples_are_found_and_rarely_skipped():
    pages = {example[0].path for example in EXAMPLES}
    assert README in pages and DOCS / "plugins.md" in pages and DOCS / "kernels.md" in pages
    assert len(EXAMPLES) >= 12, [_example_id(e) for e in EXAMPLES]
    skipped = [e[0].where for e in EXAMPLES if e[0].first_line.startswith(NOT_RUN)]
    assert len(skipped) <= MAX_NOT_RUN, f"too many '{NOT_RUN}' blocks: {skipped}"
    assert TRANSCRIPTS, "the README's error transcript is gone"


# -- transcripts ---------------------------------------------------------------------------------------------

def _statements(block: Block) -> list[tuple[int, str, str]]:
    """(line, source, expected output) for each ``>>>`` statement of a transcript."""
    statements: list[tuple[int, list[str], list[str]]] = []
    for offset, text in enumerate(block.source.rstrip("\n").split("\n")):
        if text.startswith(">>> "):
            statements.append((block.line + offset, [text[4:]], []))
        elif text.startswith("... ") and statements and not statements[-1][2]:
            statements[-1][1].append(text[4:])
        else:
            assert statements, f"{block.where}: a transcript starts with '>>> '"
            statements[-1][2].append(text)
    return [(line, "\n".join(src) + "\n", "\n".join(out).strip()) for line, src, out in statements]


def matches(expected: str, got: str) -> bool:
    """``got`` equals ``expected`` where each ``...`` in ``expected`` stands for any text (doctest's ELLIPSIS)."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, got.strip(), re.S) is not None


def run_transcript(block: Block) -> list[tuple[str, str, str]]:
    """(statement, expected, got) for every statement whose output does not match."""
    namespace: dict = {"__name__": "__doc_example__"}
    failures = []
    for line, source, expected in _statements(block):
        shown = io.StringIO()
        hook, sys.displayhook = sys.displayhook, lambda value: value is not None and print(repr(value))
        try:
            with contextlib.redirect_stdout(shown):
                exec(_compiled(block, "single", source, line), namespace)
            got = shown.getvalue()
        except Exception as err:  # noqa: BLE001 - the exception is the statement's documented output
            got = shown.getvalue() + f"{type(err).__name__}: {err}"
        finally:
            sys.displayhook = hook
        if not matches(expected, got):
            failures.append((source.strip(), expected, got.strip()))
    return failures


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=lambda b: b.where)
def test_transcript_shows_what_the_code_gives(block, doc_env):
    failures = run_transcript(block)
    assert not failures, "\n\n".join(f">>> {s}\nexpected: {e}\ngot:      {g}" for s, e, g in failures)


def test_transcript_checker_can_fail():
    assert matches("unknown mixer 'x'; did you mean 'y' ...", "unknown mixer 'x'; did you mean 'y' or 'z'?")
    assert not matches("did you mean 'attention' ...", "did you mean 'mlr_attention' or 'attention'?")
    block = Block(README, 1, "pycon", ">>> 1 + 1\n3\n>>> int('x')\nValueError: ...\n")
    assert [f[0] for f in run_transcript(block)] == ["1 + 1"]


# -- what the text says about its examples -------------------------------------------------------------------

def _example(path: Path, first_line: str, containing: str = "") -> list[Block]:
    for example in EXAMPLES:
        head = example[0]
        if head.path == path and head.first_line == first_line and containing in head.source:
            return example
    pytest.fail(f"{path.relative_to(REPO)} has no python block starting with {first_line!r} containing {containing!r}")


def test_readme_quick_start_runs(doc_env):
    example = _example(README, "import torch")
    assert "import mixer_plugins as mp" in example[0].source
    namespace = run_example(example)
    assert namespace["y"].shape == (2, 128, 64)
    assert (namespace["y"][1, 100:] == 0).all()
    assert namespace["M"].shape[-2:] == (128, 128)


def test_plugin_example_passes_the_kit(doc_env):
    namespace = run_example(_example(DOCS / "plugins.md", "# my_mixers/__init__.py")[:1])
    spec = namespace["SPEC"]
    mp.register_mixer(spec)
    try:
        assert all(r.passed for r in check_mixer("causal_mean"))
    finally:
        mp.unregister_mixer("causal_mean")


def plugin_package_files() -> dict[str, str]:
    """The plugin guide's package: every code block of docs/plugins.md whose first line is ``# <file path>``."""
    files = {}
    for block in blocks(DOCS / "plugins.md"):
        named = re.fullmatch(r"# ([\w.-]+(?:/[\w.-]+)*\.(?:py|toml))", block.first_line.strip())
        if named:
            assert named.group(1) not in files, f"{block.where}: {named.group(1)} is given twice"
            files[named.group(1)] = block.source
    return files


_PLUGIN_CHECK = """
import json, sys, warnings
import torch, timm
import mixer_plugins as mp
from mixer_plugins.testing import check_mixer

spec = mp.get_spec("running_mean")
results = check_mixer("causal_mean", raise_on_failure=False)
with warnings.catch_warnings():
    warnings.simplefilter("error")   # average pooling: no warning about a class token a causal mixer hides
    model = timm.create_model("vit_tiny", mixer="causal_mean", class_token=False, global_pool="avg",
                              img_size=32, patch_size=8, depth=2, num_classes=3)
out = model(torch.randn(2, 3, 32, 32))
print(json.dumps({"name": spec.name, "distribution": spec.distribution,
                  "module": type(model.blocks[0].attn.mixer).__module__,
                  "failed": [f"{r.check}: {r.message}" for r in results if not r.passed], "checks": len(results),
                  "shape": list(out.shape), "finite": bool(torch.isfinite(out).all())}))
"""


@pytest.mark.slow  # pip builds and installs the package, then a fresh interpreter imports torch and timm
def test_plugin_guide_package_installs_passes_the_kit_and_goes_into_timm(tmp_path):
    """The package of docs/plugins.md, exactly as the page gives it, installed offline (no build isolation, so the
    build backend must be installed: the dev extra has hatchling) into a folder put on ``PYTHONPATH``: its entry
    point is found from the installed metadata, the kit passes and timm builds a ViT with it."""
    pytest.importorskip("hatchling", reason="the guide's package builds with hatchling (the dev extra installs it)")
    files = plugin_package_files()
    assert set(files) == {"pyproject.toml", "my_mixers/__init__.py"}, sorted(files)
    project, site = tmp_path / "my-mixers", tmp_path / "site"
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text, encoding="utf-8")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                              "--disable-pip-version-check", "--target", str(site), str(project)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(REPO),
                                                                     os.environ.get("PYTHONPATH", "")]))}
    out = subprocess.run([sys.executable, "-c", _PLUGIN_CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["name"], report["distribution"], report["module"]) == ("causal_mean", "my-mixers", "my_mixers")
    assert report["failed"] == [] and report["checks"] >= 10
    assert report["shape"] == [2, 3] and report["finite"]


def test_mlbtc_cost_claim_holds(doc_env):
    """The text: cost equals the parameter count for every construction except Kronecker."""
    namespace = run_example(_example(DOCS / "structured_attention.md", "import torch", "MLBTC.kronecker"))
    MLBTC, kron = namespace["MLBTC"], namespace["kron"]  # the class as the page imports it
    assert (sum(p.numel() for p in kron.parameters()), kron.macs_per_vector()) == (1280, 24576)
    others = [MLBTC.low_rank(512, 512, rank=16), MLBTC.monarch((16, 32), (16, 32)),
              MLBTC.btt((16, 32), (16, 32), rank=4), MLBTC.block_diagonal(512, 512, blocks=8),
              MLBTC.mlr(512, 512, ranks=[16, 8, 4, 4])]
    for m in others:
        assert m.macs_per_vector() == sum(p.numel() for p in m.parameters()), m
    assert "1,280 parameters, 24,576 multiply-adds" in (DOCS / "structured_attention.md").read_text()


def test_timm_reload_example_restores_the_saved_weights(doc_env):
    """The timm page's export-and-reload example gives back the model it saved, weights included (a reload without
    ``pretrained=True`` would rebuild the architecture with fresh weights)."""
    namespace = run_example(_example(DOCS / "timm.md", "import timm", "local-dir:exported"))
    saved, reloaded = namespace["swapped"].state_dict(), namespace["reloaded"].state_dict()
    assert saved.keys() == reloaded.keys()
    differ = [name for name in saved if not torch.equal(saved[name], reloaded[name])]
    assert not differ, f"the reloaded model differs from the saved one in {len(differ)} tensors, e.g. {differ[:3]}"


def test_causal_command_examples_only_name_mixers_that_run_causally():
    """A ``--direction causal`` example must not name a mixer that would be skipped (e.g. a bidirectional one)."""
    checked = 0
    for path in PAGES:
        for block in blocks(path):
            for line in block.source.splitlines():
                if "--direction causal" not in line or "--mixers" not in line:
                    continue
                args = shlex.split(line.split("#")[0])
                names = args[args.index("--mixers") + 1].split(",")
                for name in names:
                    assert mp.get_spec(name).direction in ("causal", "either"), f"{block.where}: {name} is not causal"
                checked += 1
    assert checked


# -- the pages as a whole ------------------------------------------------------------------------------------

def _prose(path: Path) -> str:
    """A page without its fenced code blocks."""
    return re.sub(r"^```.*?^```\s*$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_links_between_pages_resolve():
    broken = []
    for path in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_each_section_is_written_once():
    """README links to docs/ and never copies it; no two pages share a heading or a paragraph."""
    headings: dict[str, str] = {}
    paragraphs: dict[str, str] = {}
    clashes = []
    for path in PAGES:
        where = str(path.relative_to(REPO))
        text = _prose(path)
        for heading in re.findall(r"^#+ (.+)$", text, re.M):
            if heading in headings:
                clashes.append(f"heading {heading!r}: {headings[heading]} and {where}")
            headings.setdefault(heading, where)
        for paragraph in re.split(r"\n\s*\n", text):
            key = " ".join(paragraph.split())
            if len(key) < 120:
                continue
            if key in paragraphs:
                clashes.append(f"paragraph {key[:60]!r}...: {paragraphs[key]} and {where}")
            paragraphs.setdefault(key, where)
    assert not clashes, clashes


def test_readme_keeps_the_exact_test_command():
    text = README.read_text(encoding="utf-8")
    assert "make test" in text and "make run" in text and ".ci/run" in text
    assert "make test" in (REPO / ".ci" / "run").read_text()


# -- the site ------------------------------------------------------------------------------------------------

SITE_MODULES = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with ``mkdocs build --strict`` (every test of the built pages reads this build)."""
    for module in SITE_MODULES:
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (the docs extra: pip install -e '.[docs]')")
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return site


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_mkdocs_build_strict(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "Quick start" in home and 'href="install/"' in home    # the README, with its links made relative
    assert 'id="mixer_plugins.kernels.scan.ssd"' in _page(site, "api/kernels")
    assert 'id="mixer_plugins.create_mixer"' in _page(site, "api/package")


# -- the API reference ---------------------------------------------------------------------------------------

RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`?")
LITERAL_MARK = re.compile(r"\S::(?=\s|$)|(?<!\S)::(?=\s|$)|^\s*:::", re.M)  # reST's "text::", a lone "::", ":::"


def rest_artefacts(page_html: str) -> list[str]:
    """reST that reached the reader: a role (``:class:``...), a literal-block marker (``text::``) or an unprocessed
    mkdocstrings directive, in a page's text outside code (where ``a::b`` is C++ or an op name)."""
    text = re.sub(r"<(pre|code|script|style)\b.*?</\1>", " ", page_html, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return [text[max(0, m.start() - 50):m.end() + 30].replace("\n", " ")
            for pattern in (RAW_ROLE, LITERAL_MARK) for m in pattern.finditer(text)]


def test_no_rest_markup_in_the_built_site(site):
    pages = sorted(site.rglob("*.html"))
    assert len([p for p in pages if "/api/" in p.as_posix()]) >= 10
    found = {str(p.relative_to(site)): hits for p in pages if (hits := rest_artefacts(p.read_text(encoding="utf-8")))}
    assert not found, found


def test_rest_artefact_check_can_fail():
    assert rest_artefacts("<p>Raises :class:<code>~mixer_plugins.MixerError</code> when</p>")
    assert rest_artefacts("<p>Quick start::</p><pre>import x</pre>")
    assert rest_artefacts("<p>::: mixer_plugins.kernels</p>")
    assert not rest_artefacts("<p>the op <code>mixer_plugins::toeplitz_fft</code> and <code>:class:</code></p>")


def test_api_reference_puts_the_entry_points_before_the_errors(site):
    package = _page(site, "api/package")
    first_error = package.index('id="mixer_plugins.errors.MixerError"')
    for name in ("create_mixer", "list_mixers", "get_spec", "register_mixer", "MatrixMixer", "MixerSpec",
                 "MixerConfig"):
        assert package.index(f'id="mixer_plugins.{name}"') < first_error, name


def test_api_reference_has_a_page_per_area(site):
    expected = {
        "api/parallel": "mixer_plugins.parallel.context_parallel",
        "api/timm": "mixer_plugins.backbones.timm.swap_mixer",
        "api/fairseq2": "mixer_plugins.backbones.fairseq2.setup_fairseq2_extension",
        "api/mup": "mixer_plugins.layers.mup.mup_init",
        "api/layers": "mixer_plugins.layers.MLBTC",
        "api/testing": "mixer_plugins.testing.check_mixer",
        "api/registry": "mixer_plugins.registry.MixerRegistry",
    }
    for page, anchor in expected.items():
        assert f'id="{anchor}"' in _page(site, page), (page, anchor)


def test_api_reference_documents_every_built_in_mixer_and_its_options(site):
    """docs/api/mixers.md is written from the registry (docs/hooks.py): every mixer of ours has its section, its class
    and config from the docstrings, and a row per option."""
    page = _page(site, "api/mixers")
    built_in = [name for name in mp.list_mixers() if mp.get_spec(name).distribution == "mixer-plugins"]
    assert len(built_in) >= 19
    for name in built_in:
        spec = mp.get_spec(name)
        section = page[page.index(f'<h2 id="{name}">'):]
        section = section[:section.index("<h2 ", 1)] if "<h2 " in section[1:] else section
        builder = f"{spec.builder.__module__}.{spec.builder.__qualname__}"
        assert f'id="{builder}"' in section, (name, builder)
        assert f'id="{spec.config.__module__}.{spec.config.__qualname__}"' in page, name
        for option in spec.option_names():
            assert f"<code>{option}</code>" in section, (name, option)


def test_every_page_opens_with_prose():
    """A page's first block after its title is a paragraph or a list (a summary), never a table, code or a
    reference directive."""
    bad = []
    for path in PAGES:
        if path == DOCS / "index.md":  # the README's text replaces it (docs/hooks.py)
            continue
        text = path.read_text(encoding="utf-8")
        blocks_ = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
        first = next((b for b in blocks_ if not b.startswith("#")), "")
        if first.startswith(("```", "|", ":::", "<!--", "!!!")) or not first:
            bad.append(f"{path.relative_to(REPO)}: {first[:60]!r}")
    assert not bad, bad
