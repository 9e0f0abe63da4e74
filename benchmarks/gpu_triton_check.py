"""One prepared GPU session for the Triton kernels: correctness at real sizes, then timings.

    python benchmarks/gpu_triton_check.py            # on a CUDA machine (a few minutes, compile included)
    TRITON_INTERPRET=1 python benchmarks/gpu_triton_check.py --smoke   # CPU dry run of this script, tiny shapes

For each case: the fused Triton scan (forward + backward) against the chunked ``torch`` backend in float32
(max abs error of y and of every gradient, relative to the reference's max), then the median time of
forward and forward + backward for both. MLR attention: the fused kernels against the mixer's ``mix``.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _timeit(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up), synchronizing CUDA."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def scan_case(b, L, h, p, g, n, chunk, dtype, device, reps, seq: bool) -> None:
    from mixer_plugins.kernels import quasiseparable

    def quasiseparable_triton(**a):
        return quasiseparable(**a, backend="triton")

    gen = torch.Generator(device="cpu").manual_seed(0)

    def r(*s, positive=False):
        t = torch.rand(*s, generator=gen) * 0.9 + 0.1 if positive else torch.randn(*s, generator=gen)
        return t

    base = dict(x=r(b, L, h, p), dt=r(b, L, h, positive=True) * 0.1, A=-r(h, positive=True), B=r(b, L, g, n),
                C=r(b, L, g, n), dt_bwd=r(b, L, h, positive=True) * 0.1, B_bwd=r(b, L, g, n), C_bwd=r(b, L, g, n),
                diag=r(b, L, h))
    seq_idx = None
    if seq:
        seq_idx = (torch.arange(L)[None].expand(b, L) >= L // 3).to(torch.int32).to(device)

    def leaves(dt_):
        out = {}
        for k, v in base.items():
            keep_fp32 = k in ("dt", "dt_bwd", "A")
            out[k] = v.to(device, torch.float32 if keep_fp32 else dt_).requires_grad_()
        return out

    kw = dict(shift=True, chunk_size=chunk, seq_idx=seq_idx)
    t_leaves, r_leaves = leaves(dtype), leaves(torch.float32)
    y_t = quasiseparable_triton(**t_leaves, **kw)
    y_r = quasiseparable(**r_leaves, backend="torch", **kw)
    dy = torch.randn_like(y_r)
    g_t = torch.autograd.grad(y_t, list(t_leaves.values()), dy.to(y_t.dtype))
    g_r = torch.autograd.grad(y_r, list(r_leaves.values()), dy)
    errs = {"y": _rel_err(y_t, y_r)}
    errs.update({f"d{k}": _rel_err(a, c) for k, a, c in zip(t_leaves, g_t, g_r)})
    worst = max(errs, key=errs.get)
    shape = f"b={b} L={L} h={h} p={p} g={g} n={n} Q={chunk} {str(dtype)[6:]}{' seq' if seq else ''}"
    print(f"scan {shape}: max rel err {errs[worst]:.2e} ({worst})", flush=True)

    def fwd(fn, lv):
        return lambda: fn(**lv, **kw)

    def fwd_bwd(fn, lv):
        return lambda: torch.autograd.grad(fn(**lv, **kw), list(lv.values()), dy.to(lv["x"].dtype))

    def torch_backend(**a):
        return quasiseparable(**a, backend="torch")

    for name, fn, lv in (("triton", quasiseparable_triton, t_leaves), ("torch", torch_backend, r_leaves)):
        tf = _timeit(fwd(fn, lv), reps)
        tb = _timeit(fwd_bwd(fn, lv), reps)
        print(f"    {name:7s} fwd {tf * 1e3:8.3f} ms   fwd+bwd {tb * 1e3:8.3f} ms", flush=True)


def mlr_case(b, L, dim, heads, causal, tile, device, reps) -> None:
    from mixer_plugins import create_mixer
    from mixer_plugins.kernels._triton.mlr import mlr_attention_triton

    mixer = create_mixer("mlr_attention", dim=dim, num_heads=heads, causal=causal).to(device)
    x = torch.randn(b, L, dim, device=device)
    with torch.no_grad():
        ctx = mixer.prepare(x, None)
    q, k, v = (t.detach().requires_grad_() for t in (ctx.q, ctx.k, ctx.values))
    ctx.q, ctx.k, ctx.values = q, k, v

    def fused():
        return mlr_attention_triton(q, k, v, mixer.ranks, mixer.block_sizes, mixer.level_scales,
                                    block_divide=mixer.block_divide, causal=causal, tile_size=tile)

    y_t, y_r = fused(), mixer.mix(ctx)
    dy = torch.randn_like(y_r)
    g_t = torch.autograd.grad(y_t, (q, k, v), dy)
    g_r = torch.autograd.grad(y_r, (q, k, v), dy)
    errs = [_rel_err(y_t, y_r)] + [_rel_err(a, c) for a, c in zip(g_t, g_r)]
    print(f"mlr b={b} L={L} dim={dim} heads={heads} causal={causal} tile={tile}: rel err y/dq/dk/dv "
          + " ".join(f"{e:.1e}" for e in errs), flush=True)
    for name, fn in (("triton", fused), ("mixer", lambda: mixer.mix(ctx))):
        tf = _timeit(fn, reps)
        tb = _timeit(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dy), reps)
        print(f"    {name:7s} fwd {tf * 1e3:8.3f} ms   fwd+bwd {tb * 1e3:8.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    device = "cpu" if interpret else "cuda"
    reps = 1 if args.smoke else args.reps
    t0 = time.time()
    if args.smoke:
        scan_case(1, 9, 2, 2, 1, 3, 4, torch.float32, device, reps, seq=True)
        mlr_case(1, 9, 16, 2, True, 4, device, reps)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            scan_case(2, 2048, 8, 64, 1, 64, 64, dtype, device, reps, seq=False)
        scan_case(2, 1000, 4, 64, 2, 64, 64, torch.float32, device, reps, seq=True)
        scan_case(4, 4096, 16, 64, 1, 128, 64, torch.bfloat16, device, reps, seq=False)
        for causal in (False, True):
            mlr_case(2, 1024, 512, 8, causal, 64, device, reps)
        mlr_case(2, 1000, 256, 4, False, 64, device, reps)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
