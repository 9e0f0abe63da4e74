"""Where the time of the SSM mixers goes on CPU: op mix, page faults and GFLOP/s per part.

Run (from the repository root)::

    python benchmarks/profile_scan.py                              # quasi + semiseparable, L = 1024, 4096, 16384
    python benchmarks/profile_scan.py --mixers quasiseparable --lengths 4096 --threads 2 --top 15
    python benchmarks/profile_scan.py --json profile.json          # the figures, machine-readable

For each mixer and length it times one forward+backward of the whole mixer (dim 256, batch 1 by default) and of
each of its parts run alone on inputs of the shapes they see inside the mixer:

* ``scan``        the kernel (:func:`~mixer_plugins.kernels.quasiseparable` or :func:`~mixer_plugins.kernels.ssd`);
* ``conv+silu``   the depthwise short convolution with its fused SiLU;
* ``norm``        the gated RMSNorm;
* ``projections`` in_proj and out_proj.

Per part it prints the median time, its share of the whole mixer's time, the FLOPs ``FlopCounterMode`` counts,
GFLOP/s, the number of aten ops one call dispatches (``torch.profiler``) and the minor page faults
(``getrusage``'s ``ru_minflt``) of one call. ``--ops`` lists the most frequent aten ops of the whole mixer.
Times on a shared machine are fragile: compare figures of one run, and rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH, when set, wins

from mixer_plugins.tools.benchmarking import build_mixer, count_flops, time_calls  # noqa: E402

PARTS = ("scan", "conv+silu", "norm", "projections")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_(t.is_floating_point())


def _backward_all(outputs: list[torch.Tensor]) -> None:
    torch.autograd.backward([o for o in outputs], [torch.ones_like(o) for o in outputs])


def part_calls(mixer, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One forward+backward of the whole mixer and of each part, as zero-argument functions."""
    with torch.no_grad():
        ctx = mixer.prepare(x, None)
        y = mixer.mix(ctx)
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    leaves = {k: (_leaf(v) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    scan_ctx = type(ctx)(**leaves)
    conv_in = _leaf(torch.randn(x.shape[0], x.shape[1], mixer.conv1d.in_channels))
    y_flat, z = _leaf(y.flatten(2)), _leaf(ctx.z)
    x_leaf = _leaf(x)

    def whole() -> None:
        x_leaf.grad = None
        mixer(x_leaf).sum().backward()

    def scan() -> None:
        _backward_all([mixer.mix(scan_ctx)])

    def conv() -> None:
        _backward_all([mixer.conv1d(conv_in, silu=True)])

    def norm() -> None:
        _backward_all([mixer.gated_norm(y_flat, z)])

    def projections() -> None:
        _backward_all([mixer.in_proj(x_leaf), mixer.out_proj(y_flat)])

    return {"whole": whole, "scan": scan, "conv+silu": conv, "norm": norm, "projections": projections}


def op_mix(fn: Callable[[], None]) -> Counter:
    """aten ops (by name) that one call of ``fn`` dispatches, as the profiler records them (nested ones too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})


def page_faults(fn: Callable[[], None]) -> int:
    """Minor page faults of one call of ``fn``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def profile(mixer_name: str, length: int, *, dim: int = 256, batch: int = 1, repeats: int = 3) -> dict:
    """The figures of one mixer at one length (see the module docstring)."""
    torch.manual_seed(0)
    mixer = build_mixer(mixer_name, dim, length)
    mixer.train()
    x = torch.randn(batch, length, dim)
    calls = part_calls(mixer, x)
    rows = {}
    for name, fn in calls.items():
        flops = count_flops(fn)
        seconds = time_calls(fn, rounds=repeats).median(None)
        ops = op_mix(fn)
        rows[name] = {"seconds": seconds, "flops": flops, "gflops_per_second": flops / seconds / 1e9,
                      "aten_ops": sum(ops.values()), "page_faults": page_faults(fn),
                      "top_ops": dict(ops.most_common(12))}
    whole = rows["whole"]["seconds"]
    for row in rows.values():
        row["share"] = row["seconds"] / whole
    return {"mixer": mixer_name, "length": length, "dim": dim, "batch": batch, "threads": torch.get_num_threads(),
            "parts": rows}


def format_report(result: dict, *, top: int = 0) -> str:
    lines = [f"{result['mixer']}  L={result['length']}  dim={result['dim']}  batch={result['batch']}  "
             f"threads={result['threads']}  (forward+backward)",
             f"  {'part':<12} {'ms':>9} {'share':>6} {'GFLOP':>8} {'GFLOP/s':>8} {'aten ops':>9} {'faults':>8}"]
    for name, row in result["parts"].items():
        lines.append(f"  {name:<12} {row['seconds'] * 1e3:9.1f} {row['share']:6.0%} {row['flops'] / 1e9:8.2f} "
                     f"{row['gflops_per_second']:8.1f} {row['aten_ops']:9d} {row['page_faults']:8d}")
    if top:
        ops = result["parts"]["whole"]["top_ops"]
        lines.append("  most frequent aten ops of the whole mixer: "
                     + ", ".join(f"{k[6:]} {v}" for k, v in list(ops.items())[:top]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", default="quasiseparable,semiseparable")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="list this many most frequent aten ops (0: none)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.mixers.split(","):
        for length in (int(v) for v in args.lengths.split(",")):
            result = profile(name.strip(), length, dim=args.dim, batch=args.batch, repeats=args.repeats)
            results.append(result)
            print(format_report(result, top=args.top), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
