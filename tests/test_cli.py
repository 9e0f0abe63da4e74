"""The ``mixer-plugins`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mixer_plugins.cli import format_table, main


def test_list_prints_a_table_of_every_mixer(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:2] == ["name", "aliases"] and "distribution" in header
    assert any(line.startswith("attention ") and "softmax_attention, mha" in line for line in out.splitlines())
    assert any(line.startswith("ema ") and "mixer-plugins-example" in line for line in out.splitlines())


def test_info_shows_options_with_types_defaults_and_help(capsys):
    assert main(["info", "mha"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention: ")
    row = next(line for line in out.splitlines() if line.startswith("num_heads"))
    assert "int" in row and "8" in row and "number of attention heads" in row


@pytest.mark.parametrize("argv, fragment", [
    (["info", "attentoin"], "did you mean 'attention'"),
    (["frobnicate"], "invalid choice"),
    (["info"], "required"),
    (["list", "--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_exit_non_zero_with_one_line(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mixer-plugins: error:")
    assert fragment in err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "mixer-plugins"
    assert script.exists(), "the mixer-plugins console script is not installed next to this python"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert out.returncode == 0
    import mixer_plugins

    assert out.stdout.strip() == mixer_plugins.__version__


def test_format_table_aligns_columns():
    text = format_table(("a", "bb"), [("xxx", "y"), ("z", "wwww")])
    lines = text.splitlines()
    assert lines[0] == "a    bb" and lines[1] == "---  ----" and lines[2] == "xxx  y"
