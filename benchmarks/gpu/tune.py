"""Launch options of the fused quasiseparable scan kernels, timed on a GPU, and where its time goes.

Times the fused scan (``kernels.quasiseparable(..., backend="triton")``, shift on, bf16, d_model 768 = 24 heads of
64, state 64, 65,536 tokens as 4 x 16,384) forward and forward+backward under alternative ``num_warps`` /
``num_stages`` per kernel (``mixer_plugins.kernels.scan.triton_kernels.LAUNCH``; the defaults keep every kernel
spill-free at sm_90, an alternative may spill) and chunk sizes, next to causal Mamba-2 SSD through mamba-ssm at the
same shape; then profiles the default configuration (CUDA time per kernel and per
PyTorch op). Writes ``OUT/tune.json`` and ``OUT/tune.md``. Run by ``benchmarks/gpu/run.sh`` when
``MIXER_PLUGINS_GPU_TUNE=1``; ``--dry`` runs a tiny shape on the CPU (Triton interpreter) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

CONFIGS: list[tuple[str, dict, int]] = [  # (label, LAUNCH overrides, chunk size)
    ("defaults", {}, 64),
    ("dx, dbc num_warps=4", {"dx": {"num_warps": 4}, "dbc": {"num_warps": 4}}, 64),
    ("out, states num_warps=4", {"out": {"num_warps": 4}, "states": {"num_warps": 4}}, 64),
    ("dstate num_warps=4", {"dstate": {"num_warps": 4}}, 64),
    ("all num_stages=2", {k: {"num_stages": 2} for k in ("states", "out", "dstate", "dx", "dbc")}, 64),
    ("pass num_warps=8", {"pass": {"num_warps": 8}}, 64),
    ("chunk 128", {}, 128),
    ("chunk 32", {}, 32),
]


def _inputs(batch: int, length: int, heads: int, p: int, n: int, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_(True)

    return dict(x=r(batch, length, heads, p), dt=r(batch, length, heads, scale=0.5), B=r(batch, length, 1, n),
                C=r(batch, length, 1, n),
                A=(-torch.rand(heads, generator=g) - 0.5).to(device).requires_grad_(True))


def _time(fn, device: str, warmup: int, iters: int) -> float:
    from mixer_plugins.tools.benchmarking import time_calls

    return time_calls(fn, rounds=iters, warmup=warmup, device=device).median(None) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dry", action="store_true", help="tiny shape on the CPU (set TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from mixer_plugins import kernels
    from mixer_plugins._text import markdown_table
    from mixer_plugins.kernels.scan import triton_kernels as scan

    if args.dry:
        device, dtype, shape, warmup, iters = "cpu", torch.float32, (1, 40, 2, 16, 16), 0, 1
        configs = CONFIGS[:2]
    else:
        device, dtype, shape, warmup, iters = "cuda", torch.bfloat16, (4, 16384, 24, 64, 64), 3, 10
        configs = CONFIGS
    inputs = _inputs(*shape, device, dtype)
    leaves = list(inputs.values())

    def step(backend: str, chunk: int, backward: bool, op: str = "quasiseparable"):
        def run():
            fn = getattr(kernels, op)
            extra = {"shift": True} if op == "quasiseparable" else {}
            y = fn(**inputs, chunk_size=chunk, dt_softplus=True, backend=backend, **extra)
            if backward:
                torch.autograd.grad(y.float().sum(), leaves)
        return run

    rows = []
    default_launch = {k: dict(v) for k, v in scan.LAUNCH.items()}
    for label, launch, chunk in configs:
        scan.LAUNCH.clear()
        scan.LAUNCH.update({k: {**v, **launch.get(k, {})} for k, v in default_launch.items()})
        row = {"config": label, "chunk": chunk}
        try:
            row["forward_ms"] = _time(step("triton", chunk, False), device, warmup, iters)
            row["forward_backward_ms"] = _time(step("triton", chunk, True), device, warmup, iters)
        except Exception as err:  # a configuration the compiler refuses (shared memory, ...) is reported
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        rows.append(row)
        print(row, flush=True)
    scan.LAUNCH.clear()
    scan.LAUNCH.update(default_launch)
    reference = {}
    if not args.dry:
        try:
            # mamba-ssm's wheel without CUDA extensions is imported through the test shim (tests/mamba_files.py)
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
            import mamba_files

            mamba_files.install()
            reference["causal SSD (mamba-ssm) fwd ms"] = _time(step("mamba_ssm", 64, False, "ssd"), device, warmup,
                                                               iters)
            reference["causal SSD (mamba-ssm) fwd+bwd ms"] = _time(step("mamba_ssm", 64, True, "ssd"), device,
                                                                   warmup, iters)
        except Exception as err:
            reference["mamba-ssm"] = f"{type(err).__name__}: {err}"[:200]
    profile_rows = []
    try:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        run = step("triton", 64, True)
        run()
        with profile(activities=activities) as prof:
            for _ in range(3):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:20]
        for e in events:
            profile_rows.append({"name": e.key[:80], "calls_per_step": e.count / 3,
                                 "ms_per_step": getattr(e, key, 0) / 3 / 1e3})
    except Exception:
        profile_rows.append({"name": "(profile failed) " + traceback.format_exc(limit=1)[-160:], "calls_per_step": 0,
                             "ms_per_step": 0})
    info = {"shape (batch, L, heads, head_dim, state)": list(shape), "dtype": str(dtype), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    (args.out / "tune.json").write_text(json.dumps({"environment": info, "configs": rows, "reference": reference,
                                                    "profile": profile_rows}, indent=2))
    md = ["# Fused quasiseparable scan: launch options", "",
          markdown_table(["", ""], [[k, v] for k, v in {**info, **reference}.items()]), "",
          markdown_table(["config", "chunk", "fwd ms", "fwd+bwd ms", "note"],
                         [[r["config"], r["chunk"], f"{r.get('forward_ms', float('nan')):.3f}",
                           f"{r.get('forward_backward_ms', float('nan')):.3f}", r.get("error", "")] for r in rows]),
          "", "## Profile of the defaults (fwd+bwd, per step)", "",
          markdown_table(["kernel / op", "calls", "ms"],
                         [[r["name"], f"{r['calls_per_step']:.0f}", f"{r['ms_per_step']:.3f}"] for r in profile_rows])]
    text = "\n".join(md)
    (args.out / "tune.md").write_text(text)
    print(text)
    return 0 if any("forward_backward_ms" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
