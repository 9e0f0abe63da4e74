"""``mixer-plugins bench --decode``: per-token decoding times against the context, on tiny sizes."""

from __future__ import annotations

import json

import pytest

from mixer_plugins.tools.benchmarking import DecodeTiming
from mixer_plugins.tools.cli import main
from mixer_plugins.tools.cli.bench import decode_table


def test_bench_decode_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, plot = tmp_path / "decode.json", tmp_path / "decode.png"
    argv = ["bench", "--decode", "--mixers", "ssd,swa,quasi", "--lengths", "8,24", "--decode-steps", "3",
            "--dim", "32", "--option", "ssd.head_dim=16", "--option", "ssd.d_state=8", "--option", "swa.window=4",
            "--option", "attention.num_heads=4", "--json", str(out_json), "--plot", str(plot), "--threads", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    header = captured.out.splitlines()[0]
    assert "L=8: ms/token (p25-p75)" in header and "L=24/L=8" in header and "attention / mixer at L=24" in header
    assert {"semiseparable", "sliding_window_attention", "attention"} <= {line.split()[0] for line in
                                                                           captured.out.splitlines()[1:4]}
    assert "skipped: quasiseparable" in captured.err and "bidirectional" in captured.err
    report = json.loads(out_json.read_text())
    assert report["complete"] and report["settings"]["contexts"] == [8, 24]
    timings = report["timings"]
    assert {(t["mixer"], t["context"]) for t in timings} == {
        (m, c) for m in ("attention", "semiseparable", "sliding_window_attention") for c in (8, 24)}
    assert all(len(t["token_seconds"]) == 3 and t["p25_seconds"] <= t["median_seconds"] <= t["p75_seconds"]
               for t in timings)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_decode_table_ratios():
    timings = [DecodeTiming("a", 10, 1, 8, "cpu", [1.0, 1.0, 1.0]), DecodeTiming("a", 100, 1, 8, "cpu", [2.0] * 3),
               DecodeTiming("b", 10, 1, 8, "cpu", [4.0] * 3), DecodeTiming("b", 100, 1, 8, "cpu", [8.0] * 3)]
    table = decode_table(timings, baseline="b", markdown=True).splitlines()
    assert table[2].split("|")[-3:-1] == [" 2.00x ", " 4.00x "]   # a: 2x growth; b / a at L=100 = 4x
    assert table[3].split("|")[-3:-1] == [" 2.00x ", " 1.00x "]
    assert DecodeTiming("c", 1, 1, 1, "cpu", [1.0, 2.0, 3.0, 10.0]).quantile(0.5) == 2.5
