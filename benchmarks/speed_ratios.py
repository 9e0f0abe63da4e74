"""Attention / mixer forward+backward time ratios, in interleaved rounds, optionally under a competing process.

Run (from the repository root)::

    python benchmarks/speed_ratios.py                                   # L = 1024, 4096, 16384; 2 threads
    python benchmarks/speed_ratios.py --lengths 1024 --rounds 7 --competitor
    python benchmarks/speed_ratios.py --json ratios.json

Every round times one forward+backward of each mixer in turn (dim 256, batch 1 by default), so that a change in
the machine's load touches all of them alike; the ratio ``attention time / mixer time`` is taken per round and
reported as its median and [min, max] over the rounds. ``--competitor`` also measures every mixer while a
CPU-bound busy-loop process runs, and reports each mixer's slowdown (median time with / without it).
:mod:`benchmarks.test_bench_speed` asserts the targets on these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH, when set, wins

from mixer_plugins.tools.benchmarking import build_mixer, mixer_step  # noqa: E402

REFERENCE = "attention"
ADAPTIVE_ENV = "MIXER_PLUGINS_ADAPTIVE_THREADS"


def step(name: str, length: int, *, dim: int = 256, batch: int = 1) -> Callable[[], None]:
    """One forward+backward of a freshly built mixer (seeded) as a zero-argument function.

    The reference (:data:`REFERENCE`, SDPA attention) runs as plain PyTorch would run it: with the library's
    load-following threads off (``MIXER_PLUGINS_ADAPTIVE_THREADS=0`` for the call), so that its slowdown under a
    competing process is SDPA's own."""
    torch.manual_seed(0)
    mixer = build_mixer(name, dim, length)
    mixer.train()
    x = torch.randn(batch, length, dim, requires_grad=True)
    run = mixer_step(mixer, x, "forward_backward")
    if name != REFERENCE:
        return run

    def plain() -> None:
        before = os.environ.get(ADAPTIVE_ENV)
        os.environ[ADAPTIVE_ENV] = "0"
        try:
            run()
        finally:
            if before is None:
                del os.environ[ADAPTIVE_ENV]
            else:
                os.environ[ADAPTIVE_ENV] = before

    return plain


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


#: Training steps each ViT runs before the timed ones. A fresh process needs a few steps before glibc's heap settles
#: (the quasi ViT's minor page faults per step, measured 2026-12-01: ~1.6M, 0.5-0.75M, then 0.1-0.3M from the third
#: step on; its time 9.2, 7.4, then ~7.1 s; the attention model's stay near 0 and 4.7 s): the target is the
#: steady state of a training run, so the first steps are warm-up.
VIT_WARMUP = 3


def minor_faults() -> int:
    """This process's minor page faults so far (each a first touch of a 4 KiB page the kernel had to map)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_times(fns: dict[str, Callable[[], None]], rounds: int, *, warmup: int = 1,
                      faults: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Wall times of each function over ``rounds`` rounds, one call of each per round, in turn.

    ``faults``: a dict that receives each call's minor page faults, by name. On CPU they are the main source of
    run-to-run variance of the SSM mixers (glibc hands a step's memory back to the kernel and the next step
    faults it in again; see docs/performance.md, "What changed in session 6")."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            f0 = minor_faults()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if faults is not None:
                faults.setdefault(name, []).append(minor_faults() - f0)
    return times


def ratio_stats(reference: list[float], other: list[float]) -> dict[str, float]:
    """Per-round ``reference / other``: median, min and max."""
    ratios = sorted(r / o for r, o in zip(reference, other))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


@contextlib.contextmanager
def busy_competitor() -> Iterator[None]:
    """One CPU-bound busy-loop process (a bare Python interpreter spinning, single-threaded) for the duration of
    the block; it imports nothing, so it starts in milliseconds."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.1)  # let it start spinning
        yield
    finally:
        process.kill()
        process.wait()


def slowdowns(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, dict[str, float]]:
    """Each function's median time alone and with :func:`busy_competitor` running, in alternating blocks
    (alone, competing, alone, ...) so that a drift in the machine's load touches both; and their ratio.

    Each block first calls every function once untimed: the timed calls see the steady state of the block (a
    competitor that has been running for a while, or gone for a while), whichever function comes first. (The
    library's threads follow the machine's load from readings at least ``LOAD_SAMPLE_SECONDS`` apart; without the
    untimed calls the first function of each block would pay for the change alone.)"""
    alone: dict[str, list[float]] = {name: [] for name in fns}
    competing: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, value in interleaved_times(fns, 1, warmup=1).items():
            alone[name] += value
        with busy_competitor():
            for name, value in interleaved_times(fns, 1, warmup=1).items():
                competing[name] += value
    out = {}
    for name in fns:
        a, c = statistics.median(alone[name]), statistics.median(competing[name])
        out[name] = {"alone": a, "competing": c, "slowdown": c / a}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", default="quasiseparable,semiseparable")
    parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated ('' for none)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--competitor", action="store_true", help="also measure the slowdowns under a busy loop")
    parser.add_argument("--vit", action="store_true",
                        help="also time a ViT-S/16 training step (batch 32) with mixer='quasi' against attention")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.mixers.split(",")]
    results = []
    for length in (int(v) for v in args.lengths.split(",") if v.strip()):
        fns = {name: step(name, length, dim=args.dim) for name in [*names, REFERENCE]}
        faults: dict[str, list[int]] = {}
        times = interleaved_times(fns, args.rounds, faults=faults)
        row = {"length": length, "threads": args.threads, "rounds": args.rounds,
               "median_seconds": {n: statistics.median(t) for n, t in times.items()},
               "median_page_faults": {n: statistics.median(f) for n, f in faults.items()},
               "ratios": {n: ratio_stats(times[REFERENCE], times[n]) for n in names}}
        line = f"L={length:6d}  " + "  ".join(
            f"{REFERENCE}/{n}: {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" for n, r in row["ratios"].items())
        line += "  | page faults per call: " + ", ".join(
            f"{n} {f:.0f}" for n, f in row["median_page_faults"].items())
        if args.competitor:
            row["slowdowns"] = slowdowns(fns, max(1, args.rounds // 2))
            line += "  | slowdown with a competitor: " + ", ".join(
                f"{n} {s['slowdown']:.2f}x" for n, s in row["slowdowns"].items())
        print(line, flush=True)
        results.append(row)
    if args.vit:
        times = interleaved_times({"quasi": vit_step("quasi", batch=32), REFERENCE: vit_step(REFERENCE, batch=32)},
                                  args.rounds, warmup=VIT_WARMUP)
        ratio = ratio_stats(times["quasi"], times[REFERENCE])
        results.append({"vit_small_step": {"median_seconds": {n: statistics.median(t) for n, t in times.items()},
                                           "quasi_over_attention": ratio}})
        print(f"ViT-S/16 training step, batch 32: quasi/attention time {ratio['median']:.2f} "
              f"[{ratio['min']:.2f}, {ratio['max']:.2f}]", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
