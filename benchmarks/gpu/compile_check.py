"""Compile every Triton kernel of mixer-plugins for a GPU, on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``, how CI checks the kernels' arithmetic) runs kernels as NumPy
code: it accepts much that the GPU compiler refuses (``tl.dot`` tiles under 16, mixed operand dtypes, ...) and
never shows what a kernel costs in registers or shared memory. This script runs the kernels' host code on small
CPU tensors with Triton's launcher replaced by a compile-only one aimed at a CUDA target (default sm_90, the H100
and H200), so every kernel specialization the host code launches goes through Triton's whole pipeline down to
``ptxas``, which ships with Triton: no GPU and no driver are needed.

Usage (from the repository root)::

    python benchmarks/gpu/compile_check.py [--arch 90] [--json OUT.json]

Prints one line per compiled kernel (compile seconds, shared memory, registers and stack/local bytes per thread,
read from the cubin with ``cuobjdump``, which also ships with Triton) and exits non-zero if a kernel fails to compile,
needs more shared memory than the target has, or, in a family listed in :data:`SPILL_FREE` (and a case not in
:data:`SPILLS_ALLOWED`), spills registers.
``tests/ops/test_triton_compile.py`` runs it in CI.
Must run in a fresh process without ``TRITON_INTERPRET`` (the kernels must be compiled, not interpreted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

#: shared memory per block, in bytes, by compute capability (the opt-in maximum a kernel may use)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

#: kernel families that must not spill: no stack frame and no local memory per thread
SPILL_FREE = ("norm", "conv", "scan", "scan1", "mlr", "local", "decode")
#: cases of those families that may: the scans on float32 inputs, whose 3xTF32 matmuls (three products on split
#: operands, for float32 accuracy) do not fit in registers at these tiles (their spills are printed)
SPILLS_ALLOWED = ("scan: float32", "scan1: float32")


@dataclass
class Compiled:
    kernel: str
    case: str
    seconds: float
    shared_bytes: int
    registers: int = -1     # per thread; -1: not read (no cuobjdump)
    stack_bytes: int = -1   # per thread: the stack frame ptxas gives spilled registers
    local_bytes: int = -1   # per thread


def resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, local bytes) per thread of the one kernel in ``cubin``, read with the
    ``cuobjdump`` that ships with Triton; ``(-1, -1, -1)`` if it cannot be run."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return -1, -1, -1
    found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
    return found.get("REG", -1), found.get("STACK", -1), found.get("LOCAL", -1)


@contextmanager
def compile_only(arch: int, record: Callable[[str, float, object], None]) -> Iterator[None]:
    """While active, launching a ``triton.jit`` kernel compiles it for CUDA ``arch`` and runs nothing."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _CompileOnlyDriver:  # what JITFunction.run asks of the active driver
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        record(self.__name__, time.perf_counter() - start, kernel)
        return kernel

    previous = driver._active
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original
        driver._active = previous


def _scan_inputs(dtype, seg, diag, directions, groups, state, head_dim, heads, length, softplus):
    """One sequence's scan inputs as the Triton backends take them: x, the forward and backward generators (dt, A,
    B, C; ``None`` for an absent direction), the diagonal, the segment ids and the step-size bias."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, length, heads, head_dim, generator=g).to(dtype)
    dt = torch.rand(1, length, heads, generator=g).to(dtype)
    A = -torch.rand(heads, generator=g)
    B = torch.randn(1, length, groups, state, generator=g).to(dtype)
    C = torch.randn(1, length, groups, state, generator=g).to(dtype)
    fwd = (dt, A, B, C) if "f" in directions else (None,) * 4
    bwd = (dt, A, B, C) if "b" in directions else (None,) * 4
    d = torch.randn(1, length, heads, generator=g).to(dtype) if diag else None
    s = torch.zeros(1, length, dtype=torch.int32) if seg else None
    return x, fwd, bwd, d, s, (torch.zeros(heads) if softplus else None)


def _scan_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """The chunked scan's kernels (``kernels.scan.triton_kernels``), forward and backward, as the backend launches
    them: raw step sizes prepared in the kernels, inputs read through their strides."""
    import math

    import torch

    from mixer_plugins.kernels.scan import triton_kernels as scan

    def case(dtype, shift, seg, diag, directions, init, groups, state, head_dim, heads=4, length=200, softplus=True,
             a_log=False):
        def go():
            x, fwd, bwd, d, s, bias = _scan_inputs(dtype, seg, diag, directions, groups, state, head_dim, heads,
                                                   length, softplus)
            st = torch.zeros(1, heads, head_dim, state) if init else None
            prep = (bias, 0.0, math.inf, softplus, shift, 64)
            y, states, lg, cb, dtc, final = scan._scan_fwd(x, *fwd, *bwd, d, st, s, *prep, init, a_log=a_log)
            scan._scan_bwd(torch.randn_like(x), final if init else None, x, *fwd, *bwd, d, s, *prep, states, lg, cb,
                           dtc, init, a_log=a_log)
        name = (f"{str(dtype).removeprefix('torch.')} dirs={directions} shift={shift} seg={seg} diag={diag} "
                f"init={init} g={groups} n={state} p={head_dim} heads={heads} a_log={a_log}")
        return name, go

    # Hydra (both directions, shift, free diagonal, shared B/C; A formed from A_log in the kernels, as the block
    # calls it) in both input dtypes, with and without segments
    yield case(torch.bfloat16, True, False, True, "fb", False, 1, 64, 64, a_log=True)
    yield case(torch.float32, True, True, True, "fb", False, 1, 64, 64, a_log=True)
    # causal SSD (forward alone, initial state), and the reversed single direction; odd sizes padded to blocks
    yield case(torch.bfloat16, False, True, False, "f", True, 2, 128, 64, softplus=False)
    yield case(torch.float16, False, False, False, "b", False, 2, 16, 24)


def _one_chunk_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """The one-chunk scan's kernels (``kernels.scan.triton_one_chunk``): a ViT's 197 tokens in tiles of 64."""
    import math

    import torch

    from mixer_plugins.kernels.scan import triton_one_chunk as one

    def case(dtype, shift, seg, diag, directions, groups, state, head_dim, heads=4, length=197, softplus=True,
             a_log=False):
        def go():
            x, fwd, bwd, d, s, bias = _scan_inputs(dtype, seg, diag, directions, groups, state, head_dim, heads,
                                                   length, softplus)
            prep = (bias, 0.0, math.inf, softplus, shift)
            y, cb, dtc = one._fwd(x, *fwd, *bwd, d, s, *prep, a_log=a_log)
            one._bwd(torch.randn_like(x), x, *fwd, *bwd, d, s, *prep, cb, dtc, a_log=a_log)
        name = (f"{str(dtype).removeprefix('torch.')} dirs={directions} shift={shift} seg={seg} diag={diag} "
                f"g={groups} n={state} p={head_dim} heads={heads} L={length} a_log={a_log}")
        return name, go

    yield case(torch.bfloat16, True, False, True, "fb", 1, 64, 64, a_log=True)      # a ViT-B Hydra block's scan
    yield case(torch.float32, True, True, True, "fb", 1, 64, 64, a_log=True)
    yield case(torch.float16, False, False, False, "f", 2, 16, 24, length=100)


def _mlr_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    import torch

    from mixer_plugins.kernels.mlr_attention import triton_kernels as mlr

    def case(dtype, causal, masked, ranks, block_sizes, length=300, heads=2, p=64, window=None, num_global=0):
        def go():
            g = torch.Generator().manual_seed(0)
            e = sum(ranks)
            q, k = (torch.randn(1, length, heads, e, generator=g).to(dtype).requires_grad_(True) for _ in range(2))
            v = torch.randn(1, length, heads, p, generator=g).to(dtype).requires_grad_(True)
            key_len = torch.full((1,), length, dtype=torch.int32) if masked else None
            spec = mlr.MLRSpec(tuple(ranks), tuple(0 if s is None else s for s in block_sizes),
                               tuple(1.0 / r for r in ranks), window is None, causal, window, num_global)
            # as mlr_triton launches them (its device check would refuse CPU tensors here)
            y = mlr._MLRFunction.apply(q, k, v, key_len, spec, mlr.Tiles.default(dtype, max(e, p)))
            y.float().sum().backward()
        name = (f"{str(dtype).removeprefix('torch.')} causal={causal} mask={masked} ranks={ranks} "
                f"blocks={block_sizes}" + ("" if window is None else f" window={window} globals={num_global}"))
        return name, go

    # the paper's levels (causal) and the mixer's defaults (head dim 32, bidirectional, padded)
    yield case(torch.bfloat16, True, False, (32, 8, 6, 4, 4, 4, 4, 2), (None, 512, 256, 128, 64, 32, 16, 8))
    yield case(torch.bfloat16, False, True, (8, 8, 8, 8), (None, 32, 16, 8), p=32)
    # no global level (pairs sharing none score 0); float32 operands; float16
    yield case(torch.float16, False, True, (16, 8, 4, 4), (96, 48, 12, 3))
    yield case(torch.float32, True, False, (16, 16, 16, 16), (None, 256, 64, 16))


def _local_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """``kernels.local_attention``'s Triton backend: the MLR kernels with a band (one global level)."""
    import torch

    from mixer_plugins.kernels.mlr_attention import triton_kernels as mlr

    def case(dtype, causal, masked, num_global, length=300, heads=2, e=64, window=100):
        def go():
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, length, heads, e, generator=g).to(dtype).requires_grad_(True)
                       for _ in range(3))
            key_len = torch.full((1,), length, dtype=torch.int32) if masked else None
            spec = mlr.MLRSpec((e,), (0,), (e ** -0.5,), False, causal, window, num_global)
            y = mlr._MLRFunction.apply(q, k, v, key_len, spec, mlr.Tiles.default(dtype, e))
            y.float().sum().backward()
        name = f"{str(dtype).removeprefix('torch.')} causal={causal} mask={masked} globals={num_global} e={e}"
        return name, go

    yield case(torch.bfloat16, True, False, 0)
    yield case(torch.bfloat16, True, False, 0, e=128)   # head dim 128: other tiles
    yield case(torch.bfloat16, False, True, 3, e=128)
    yield case(torch.float32, False, True, 3)


def _norm_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """``kernels.gated_rmsnorm``'s Triton kernels, at the block's widths and the widest row they take."""
    import torch

    from mixer_plugins.kernels.norm import triton_kernels as norm

    def case(dtype, width, before, rows=64):
        def go():
            g = torch.Generator().manual_seed(0)
            y, z, grad = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(3))
            w = torch.ones(width)
            norm._norm_fwd(y, z, w, 1e-5, before)
            norm._norm_bwd(grad, y, z, w, 1e-5, before)
        return f"{str(dtype).removeprefix('torch.')} width={width} before={before}", go

    yield case(torch.bfloat16, 1536, True)       # ViT-B's Hydra (d_inner 1536)
    yield case(torch.float32, 64, False)         # per-group norms of a head's width
    yield case(torch.bfloat16, norm.MAX_WIDTH, False)


def _conv_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """``kernels.depthwise_conv1d``'s Triton kernels: the block's centred kernel 7 and Mamba's causal 4."""
    import torch

    from mixer_plugins.kernels.conv import triton_kernels as conv

    def case(dtype, k, causal, silu, bias, length=197, channels=1664):
        def go():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(2, length, channels, generator=g).to(dtype)
            w = torch.randn(channels, k, generator=g)
            b = torch.randn(channels, generator=g) if bias else None
            left = k - 1 if causal else (k - 1) // 2
            conv._conv_fwd(x, w, b, left, k - 1 - left, silu)
            conv._conv_bwd(torch.randn_like(x), x, w, b, left, k - 1 - left, silu)
        return f"{str(dtype).removeprefix('torch.')} k={k} causal={causal} silu={silu} bias={bias}", go

    yield case(torch.bfloat16, 7, False, True, True)     # ViT-B's Hydra: 1536 + 2 x 64 channels
    yield case(torch.bfloat16, 4, True, True, False)
    yield case(torch.float32, 3, False, False, True, channels=200)   # channels not a multiple of 16
    yield case(torch.bfloat16, conv.MAX_TAPS, True, True, True)


def _decode_cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """``kernels.decode.ssd_decode_step``'s Triton kernels (the step, the windows' roll) at Mamba-2 blocks of width
    256 to 768 (heads 8 to 24 of 64, conv width up to 1792, kernel 4), float32 states under bfloat16 or float32
    inputs."""
    import torch

    from mixer_plugins.kernels.decode import triton_kernels as dec

    def case(dtype, heads, d_state, groups=1, mamba=True, batch=4, p=64, k=4):
        def go():
            g = torch.Generator().manual_seed(0)
            width = heads * p + 2 * groups * d_state
            proj = torch.randn(batch, width + heads, generator=g).to(dtype)   # xbc and dt: views of a projection
            w, bias = torch.randn(width, k, generator=g).to(dtype), torch.randn(width, generator=g).to(dtype)
            conv_state, state = torch.zeros(batch, width, k, dtype=dtype), torch.zeros(batch, heads, p, d_state)
            if mamba:   # softplus(dt + dt_bias), decay, D per head, B then C
                dec._decode_step(proj[:, :width], conv_state, w, bias, state, proj[:, width:], -torch.rand(heads),
                                 torch.ones(heads), None, torch.zeros(heads), True, 0.0, float("inf"), 1.0, True,
                                 False)
            else:       # linear attention: no dt, no decay, no bias, no SiLU, D per channel, C before B
                dec._decode_step(proj[:, :width], conv_state, w, None, state, None, None, torch.ones(heads, p), None,
                                 None, False, 0.0, float("inf"), 1.0, False, True)
        return (f"{str(dtype).removeprefix('torch.')} state=float32 heads={heads} p={p} n={d_state} g={groups} k={k} "
                f"{'mamba2' if mamba else 'linear'}"), go

    yield case(torch.bfloat16, 24, 128)                  # d_model 768: conv width 1792
    yield case(torch.float32, 24, 128)
    yield case(torch.bfloat16, 8, 64)                    # d_model 256
    yield case(torch.bfloat16, 16, 64, groups=2, mamba=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--only", choices=("scan", "scan1", "mlr", "local", "norm", "conv", "decode"),
                        help="compile one kernel family")
    parser.add_argument("--case", default="", help="compile only the cases whose name holds this text")
    parser.add_argument("--shared-limit", type=int, default=None,
                        help="bytes of shared memory per block to allow (default: the target's)")
    parser.add_argument("--strict", action="store_true", help="no case may spill (SPILLS_ALLOWED does not apply)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    results: list[Compiled] = []
    current = [""]

    def record(name: str, seconds: float, kernel) -> None:
        meta = kernel.metadata
        item = Compiled(name, current[0], round(seconds, 2), int(meta.shared), *resources(kernel.asm["cubin"]))
        results.append(item)
        print(f"  {name:24s} {seconds:6.1f} s  shared {item.shared_bytes // 1024:4d} KiB  regs {item.registers:4d}  "
              f"stack {item.stack_bytes:4d} B  local {item.local_bytes:4d} B", flush=True)

    failures: list[str] = []
    families = {"scan": _scan_cases, "scan1": _one_chunk_cases, "mlr": _mlr_cases, "local": _local_cases,
                "norm": _norm_cases, "conv": _conv_cases, "decode": _decode_cases}
    with compile_only(args.arch, record):
        for family, cases in families.items():
            if args.only and family != args.only:
                continue
            for name, go in cases():
                if args.case not in name:
                    continue
                current[0] = f"{family}: {name}"
                print(current[0], flush=True)
                try:
                    go()
                except Exception as err:  # report every failing case, not only the first
                    failures.append(f"{current[0]}: {type(err).__name__}: {err}")
                    print(f"  FAILED: {type(err).__name__}: {str(err)[:2000]}", flush=True)
    limit = args.shared_limit if args.shared_limit is not None else SHARED_LIMIT.get(args.arch)
    if limit is not None:
        failures += [f"{r.case}: {r.kernel} needs {r.shared_bytes} bytes of shared memory, sm_{args.arch} has {limit}"
                     for r in results if r.shared_bytes > limit]
    for r in results:
        if r.case.split(":")[0] not in SPILL_FREE or (r.case.startswith(SPILLS_ALLOWED) and not args.strict):
            continue
        if r.registers < 0:
            failures.append(f"{r.case}: {r.kernel}: its registers and spills could not be read (cuobjdump)")
        elif r.stack_bytes or r.local_bytes:
            failures.append(f"{r.case}: {r.kernel} spills: {r.stack_bytes} bytes of stack, {r.local_bytes} bytes of "
                            f"local memory per thread ({r.registers} registers)")
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "compiled": [asdict(r) for r in results],
                                         "failures": failures}, indent=2))
    print(f"{len(results)} kernel compilations for sm_{args.arch}, {len(failures)} failures")
    for failure in failures:
        print("FAILURE:", failure)
    return 1 if failures or not results else 0


if __name__ == "__main__":
    raise SystemExit(main())
