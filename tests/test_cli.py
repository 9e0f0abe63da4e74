"""The ``mixer-plugins`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mixer_plugins._text import format_table
from mixer_plugins.tools.cli import main


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


def test_every_command_and_option_has_help(capsys):
    from mixer_plugins.tools.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)
    for name, subparser in sub.choices.items():
        assert COMMANDS[name].help, f"command {name!r} has no help"
        for action in subparser._actions:
            assert action.help, f"{name}: argument {action.option_strings or action.dest} has no help"
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        for action in subparser._actions:
            for option in action.option_strings:
                assert option in out, f"{name} --help does not document {option}"


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--bogus"], "unrecognized arguments"),
    (["bench", "--dim", "x"], "positive integer"),
    (["show"], "required"),
    (["bench-table"], "required"),
    (["flops", "--length", "-3"], "positive integer"),
])
def test_new_commands_bad_arguments_one_line(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mixer-plugins: error:") and fragment in err


def test_multi_line_errors_become_one_line(capsys, monkeypatch):
    import mixer_plugins.tools.cli as cli
    from mixer_plugins import InvalidMixerOptions

    def fail(args):
        raise InvalidMixerOptions("attention", ["head_dim=0: must be > 0", "scale=0: must be > 0"])

    monkeypatch.setitem(cli.COMMANDS, "list", cli.Command("list", fail))
    assert main(["list"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mixer-plugins: error: invalid options for mixer 'attention': head_dim=0: must be > 0; "
                   "scale=0: must be > 0")
