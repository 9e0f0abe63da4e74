"""The ``mixer-plugins`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mixer_plugins as mp
from mixer_plugins._text import format_table
from mixer_plugins.tools.cli import main


def _rows(table: str) -> dict[str, str]:
    """The table's rows by their first cell, each with its continuation lines (wrapped cells) joined."""
    rows: dict[str, str] = {}
    last = None
    for line in table.splitlines()[2:]:
        if not line.strip():
            break
        if line.startswith(" "):
            rows[last] += " " + " ".join(line.split())
        else:
            last = line.split()[0]
            rows[last] = " ".join(line.split())
    return rows


def test_list_prints_a_table_of_every_mixer_in_120_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["name", "aliases"]
    assert max(len(line) for line in out.splitlines()) <= 120
    rows = _rows(out)
    assert sorted(rows) == mp.default_registry.names()
    assert "softmax_attention, mha" in rows["attention"] and "dense (softmax)" in rows["attention"]
    assert "from other distributions: ema (mixer-plugins-example)" in out


def test_info_shows_options_with_types_defaults_and_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["info", "mha"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention: ")
    row = next(line for line in out.splitlines() if line.startswith("num_heads"))
    assert "int" in row and "8" in row and "number of attention heads" in row


@pytest.mark.parametrize("columns", [60, 80, 100, 140])
def test_info_wraps_to_the_terminal_and_writes_types_as_a_user_does(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["info", "quasi"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    assert "Annotated" not in out and "typing." not in out and "<class" not in out
    if columns >= 80:  # a table: option, type, default, help
        lines = out.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("option "))
        assert lines[header].split() == ["option", "type", "default", "help"]
        rows = _rows("\n".join(lines[header:]))
        assert rows["A_init_range"].startswith("A_init_range (float, float) (1.0, 1.0)")
        assert rows["dt_limit"].startswith("dt_limit (float, float) (0.0, inf)")
        assert rows["max_seq_len"].startswith("max_seq_len int | None None")
        assert "channels per head" in rows["head_dim"]
    else:  # one paragraph per option
        assert "A_init_range: (float, float) = (1.0, 1.0)" in out and "max_seq_len: int | None = None" in out


def test_user_types():
    from typing import Annotated, Literal, Optional

    import annotated_types

    from mixer_plugins.tools.cli.layout import user_type

    assert user_type(Annotated[float, annotated_types.Gt(0)]) == "float"
    assert user_type(tuple[float, Annotated[float, annotated_types.Ge(0)]]) == "(float, float)"
    assert user_type(Optional[int]) == "int | None" and user_type(int | None) == "int | None"
    assert user_type(list[int]) == "list[int]" and user_type(list[Optional[int]]) == "list[int | None]"
    assert user_type(tuple[int, ...]) == "(int, ...)" and user_type(Literal["a", "b"]) == "'a' | 'b'"


def test_fit_table_wraps_the_wrapping_columns_within_the_width():
    from mixer_plugins.tools.cli.layout import fit_table

    rows = [("alpha", "one two three four five six", "x"), ("beta", "seven", "yy")]
    text = fit_table(("name", "words", "c"), rows, 24, wrapping=(1,), minimum=5)
    assert text is not None and max(len(line) for line in text.splitlines()) <= 24
    expected = "name words c ----- ------------- -- alpha one two three x four five six beta seven yy"
    assert " ".join(text.split()) == expected
    assert fit_table(("name", "words", "c"), rows, 10, wrapping=(1,), minimum=5) is None  # cannot fit


@pytest.mark.parametrize("argv, fragment", [
    (["info", "attentoin"], "did you mean 'attention'"),
    (["frobnicate"], "invalid choice"),
    (["info"], "required"),
    (["list", "--bogus"], "unrecognized arguments"),
    (["bench", "--lengths", "12x"], "expected a positive integer, got '12x'"),
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
