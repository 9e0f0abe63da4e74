"""Attention / mixer forward+backward time ratios, in interleaved rounds.

Run (from the repository root)::

    python benchmarks/speed_ratios.py                                   # L = 1024, 4096, 16384; 2 threads
    python benchmarks/speed_ratios.py --lengths 1024 --rounds 7
    python benchmarks/speed_ratios.py --json benchmarks/results/DATE-cpu-speed-ratios/run1.json
    python benchmarks/speed_ratios.py --table run1.json run2.json    # docs/performance.md's table from results

Every round times one forward+backward of each mixer in turn (dim 256, batch 1 by default), so that a change in
the machine's load touches all of them alike; the ratio ``attention time / mixer time`` is taken per round and
reported as its median and [min, max] over the rounds (``mixer_plugins.tools.benchmarking.time_calls``, with each call's
minor page faults). :mod:`benchmarks.test_bench_speed` asserts the targets on
these figures.

``--json`` writes the results file ``docs/performance.md`` quotes: the date, the command, torch's version, the
threads, the allocator's environment and the rows. ``--table`` measures nothing: it prints the page's table from
such files (one entry per file in each cell), and the documentation test checks that the page shows it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH, when set, wins

from mixer_plugins.tools.benchmarking import Timings, build_mixer, mixer_step, time_calls  # noqa: E402

REFERENCE = "attention"


def step(name: str, length: int, *, dim: int = 256, batch: int = 1) -> Callable[[], None]:
    """One forward+backward of a freshly built mixer (seeded) as a zero-argument function."""
    torch.manual_seed(0)
    mixer = build_mixer(name, dim, length)
    mixer.train()
    x = torch.randn(batch, length, dim, requires_grad=True)
    return mixer_step(mixer, x, "forward_backward")


def vit_step(mixer: str, *, batch: int, **model_options) -> Callable[[], None]:
    """One SGD training step (forward, cross-entropy, backward, update) of our timm ViT-S/16 (``vit_small``)
    with ``mixer`` on random 224 x 224 images (197 tokens), as a zero-argument function."""
    import timm

    import mixer_plugins  # noqa: F401  (the timm hook)

    torch.manual_seed(0)
    model = timm.create_model("vit_small", mixer=mixer, num_classes=10, **model_options)  # ViT-S/16
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    size = model_options.get("img_size", 224)
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, 10, (batch,))

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return run


#: Training steps each ViT runs before the timed ones: a fresh process needs a few steps before the allocator's heap
#: settles (its page faults per step fall over the first steps), and the target is the steady state of a training
#: run.
VIT_WARMUP = 3


def length_row(times: Timings, names: list[str], length: int, threads: int, rounds: int) -> dict:
    """One length's row of the results file: median seconds and page faults per call, and the ratios
    ``attention time / mixer time`` per round (median, min, max)."""
    return {"length": length, "threads": threads, "rounds": rounds,
            "median_seconds": {n: times.median(n) for n in times.seconds},
            "median_page_faults": {n: statistics.median(f) for n, f in times.faults.items()},
            "ratios": {n: times.ratio(REFERENCE, n) for n in names}}


#: the mixers of docs/performance.md's table and how its header names them
TABLE_COLUMNS = {"quasiseparable": "attention / `quasiseparable` (Hydra)",
                 "semiseparable": "attention / `semiseparable` (Mamba-2 SSD)"}


def results_document(rows: list[dict], argv: list[str], threads: int) -> dict:
    """What ``--json`` writes: the rows with when, how and with what they were measured."""
    return {"recorded": datetime.date.today().isoformat(), "command": " ".join(["benchmarks/speed_ratios.py", *argv]),
            "torch": torch.__version__, "threads": threads, "machine": platform.machine(),
            "cpus": os.cpu_count(), "allocator_env": {k: v for k, v in os.environ.items()
                                                      if k.startswith("MALLOC_") or k == "LD_PRELOAD"},
            "rows": rows}


def markdown_table(documents: list[dict]) -> str:
    """docs/performance.md's table: per length, each document's ``median [min, max]`` of attention / mixer."""
    def cell(row: dict, name: str) -> str:
        r = row["ratios"][name]
        return f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"

    lengths = sorted({row["length"] for doc in documents for row in doc["rows"] if "length" in row})
    lines = ["| L | " + " | ".join(TABLE_COLUMNS.values()) + " |", "|---" * (len(TABLE_COLUMNS) + 1) + "|"]
    for length in lengths:
        rows = [row for doc in documents for row in doc["rows"] if row.get("length") == length]
        lines.append(f"| {length} | " + " | ".join(", ".join(cell(row, name) for row in rows)
                                                   for name in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", default="quasiseparable,semiseparable")
    parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated ('' for none)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vit", action="store_true",
                        help="also time a ViT-S/16 training step (batch 32) with mixer='quasi' against attention")
    parser.add_argument("--json", type=Path, default=None, help="write the results file (see the module's docstring)")
    parser.add_argument("--table", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: print docs/performance.md's table from these results files")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table([json.loads(path.read_text()) for path in args.table]))
        return 0
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.mixers.split(",")]
    results = []
    for length in (int(v) for v in args.lengths.split(",") if v.strip()):
        times = time_calls({name: step(name, length, dim=args.dim) for name in [*names, REFERENCE]}, rounds=args.rounds)
        row = length_row(times, names, length, args.threads, args.rounds)
        line = f"L={length:6d}  " + "  ".join(
            f"{REFERENCE}/{n}: {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" for n, r in row["ratios"].items())
        line += "  | page faults per call: " + ", ".join(
            f"{n} {f:.0f}" for n, f in row["median_page_faults"].items())
        print(line, flush=True)
        results.append(row)
    if args.vit:
        times = time_calls({"quasi": vit_step("quasi", batch=32), REFERENCE: vit_step(REFERENCE, batch=32)},
                           rounds=args.rounds, warmup=VIT_WARMUP)
        ratio = times.ratio("quasi", REFERENCE)
        results.append({"vit_small_step": {"median_seconds": {n: times.median(n) for n in times.seconds},
                                           "quasi_over_attention": ratio}})
        print(f"ViT-S/16 training step, batch 32: quasi/attention time {ratio['median']:.2f} "
              f"[{ratio['min']:.2f}, {ratio['max']:.2f}]", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = results_document(results, list(sys.argv[1:] if argv is None else argv), args.threads)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
