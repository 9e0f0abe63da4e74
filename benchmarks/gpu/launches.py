"""How many kernels one call launches: on CUDA from the profiler, anywhere from a trace of the dispatched ops.

``count_launches(fn)`` runs ``fn()`` once and returns a :class:`Launches`: the total and a count per kernel (or op).

* On CUDA (``profiler=True``): the CUDA kernels the PyTorch profiler records (every launch, cuBLAS and Triton alike).
* Anywhere (the trace; how CI counts on a CPU under ``TRITON_INTERPRET=1``): every Triton kernel launch (the
  launcher of ``triton.jit`` kernels, interpreted or compiled, is wrapped while ``fn`` runs), plus every dispatched
  ATen op that launches a kernel on a GPU, recorded by a ``TorchDispatchMode``. An ATen op counts one launch unless
  it only makes a view or an alias (a schema whose outputs alias an input without writing it: ``view``, ``split``,
  ``t``, ``expand``, ...; ``contiguous``, ``reshape`` and ``to`` count when they copied) or only allocates (``empty``,
  ``new_empty``, ...): matmuls, reductions, elementwise ops, copies and fills are one kernel each on a GPU (cuBLAS may
  split a matmul in two, and a composite op such as ``select_backward`` may be a fill and a copy; that is not
  counted). Our custom
  ops are opened: their own launches are the Triton kernels and ATen ops they run inside.

``python benchmarks/gpu/launches.py [--dry]`` prints the counts of one Hydra block (forward and backward).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen ops that allocate without launching a kernel
ALLOCATING = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "detach",
              "_unsafe_view", "promote_types", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
#: ATen ops that make the host wait for the device (values read back, or an output size that depends on values)
SYNCING = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique",
           "_unique2", "allclose"}


@dataclass
class Launches:
    """Kernel launches of one call: ``total`` and ``by_name`` (kernel or op name -> launches)."""

    total: int = 0
    by_name: dict[str, int] = field(default_factory=dict)
    #: ops that wait for the device (``.item()``, ``nonzero``, ...): a CUDA graph cannot capture them
    syncs: int = 0
    #: > 0 while a Triton kernel launches (the interpreter's own tensor work then is not the program's)
    launching: int = 0

    def add(self, name: str, n: int = 1) -> None:
        self.total += n
        self.by_name[name] = self.by_name.get(name, 0) + n

    def table(self) -> str:
        rows = sorted(self.by_name.items(), key=lambda kv: (-kv[1], kv[0]))
        return "\n".join([f"{n:4d}  {name}" for name, n in rows] + [f"{self.total:4d}  total"])


def _aliasing(func) -> bool:
    """Whether the op's schema says its outputs alias an input (views; also ``contiguous``, ``reshape``, ``to``, which
    copy only when they must)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _storages(obj) -> set[int]:
    from torch.utils._pytree import tree_leaves

    return {t.untyped_storage().data_ptr() for t in tree_leaves(obj) if isinstance(t, torch.Tensor)}


def launches_a_kernel(func, args=(), out=None) -> bool:
    """Whether the ATen op ``func`` launched a kernel on a GPU (see the module docstring): not an allocation, and not
    an aliasing op whose outputs (``out``) all share an input's (``args``) storage."""
    name = func.name().split("::")[-1].split(".")[0]
    if name in ALLOCATING:
        return False
    if _aliasing(func):
        return not _storages(out) <= _storages(args)   # a view costs nothing; a copy made for it costs one kernel
    return True


def _implementations() -> dict[str, Callable]:
    """Our custom ops' Python implementations (what each op runs on its tensors), by op name: the trace runs these
    in place of the op, so that the ATen ops they dispatch inside are seen too."""
    impls: dict[str, Callable] = {}
    with contextlib.suppress(ImportError):
        from mixer_plugins.kernels.scan import triton_kernels as chunked
        from mixer_plugins.kernels.scan import triton_one_chunk as one

        impls.update({"quasiseparable_triton": lambda *a: tuple(chunked._scan_fwd(*a)),
                      "quasiseparable_triton_backward": chunked._scan_bwd,
                      "quasiseparable_triton_one_chunk": lambda *a: tuple(one._fwd(*a)),
                      "quasiseparable_triton_one_chunk_backward": one._bwd})
    with contextlib.suppress(ImportError):
        from mixer_plugins.kernels.conv import triton_kernels as conv
        from mixer_plugins.kernels.norm import triton_kernels as norm

        impls.update({"gated_rmsnorm_triton": norm._norm_fwd, "gated_rmsnorm_triton_backward": norm._norm_bwd,
                      "depthwise_conv1d_triton": conv._conv_fwd, "depthwise_conv1d_triton_backward": conv._conv_bwd})
    return impls


class _Trace(TorchDispatchMode):
    def __init__(self, counts: Launches):
        super().__init__()
        self.counts = counts
        self.impls = _implementations()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mixer_plugins":
            impl = self.impls.get(func.name().split("::")[-1])
            if impl is None:   # an op the trace cannot open: one launch, named as such
                self.counts.add(f"{func.name()} (opaque)")
                return func(*args, **kwargs)
            with self:         # our op's own implementation, its launches traced
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        if not self.counts.launching and func.name().split("::")[-1].split(".")[0] in SYNCING:
            self.counts.syncs += 1
            return out
        if not self.counts.launching and func.namespace in ("aten", "prims") and launches_a_kernel(func, args, out):
            self.counts.add(func.name().replace("aten::", "aten."))
        return out


@contextlib.contextmanager
def _triton_launches(counts: Launches) -> Iterator[None]:
    """Count every launch of a ``triton.jit`` kernel while active: compiled kernels launch through
    ``JITFunction.run``, interpreted ones through the interpreter's ``GridExecutor``."""
    targets = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        targets.append((JITFunction, "run"))
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import GridExecutor

        targets.append((GridExecutor, "__call__"))
    originals = [(cls, attr, getattr(cls, attr)) for cls, attr in targets]

    def wrap(original):
        def launch(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                fn = getattr(self, "fn", None)
                counts.add("triton." + getattr(fn, "__name__", "kernel"))
            counts.launching += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counts.launching -= 1
        return launch

    for cls, attr, original in originals:
        setattr(cls, attr, wrap(original))
    try:
        yield
    finally:
        for cls, attr, original in originals:
            setattr(cls, attr, original)


def count_launches(fn: Callable[[], object], *, profiler: bool = False) -> Launches:
    """The kernels ``fn()`` launches: from the CUDA profiler (``profiler=True``, on CUDA) or from the trace."""
    counts = Launches()
    if profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                counts.add(event.name[:90])
        return counts
    with _triton_launches(counts), _Trace(counts):
        fn()
    return counts


def hydra_block(dim: int, **options) -> torch.nn.Module:
    """A Hydra mixer (the ``quasi`` block: in_proj, short conv, both scans, gated norm, out_proj)."""
    import mixer_plugins as mp

    return mp.create_mixer("quasi", dim, **options)


def block_step(mixer: torch.nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None) -> Callable[[], None]:
    """One forward and backward of ``mixer`` on ``x`` (autocast to ``autocast`` when given), with a fixed output
    gradient (so the step launches nothing but the mixer's own kernels)."""
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(x.shape, generator=gen, device="cpu").to(x.device, autocast or x.dtype)

    def step() -> None:
        mixer.zero_grad(set_to_none=True)
        x.grad = None
        ctx = torch.autocast(x.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            y = mixer(x)
        y.backward(probe)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="a tiny block on the CPU (Triton interpreter)")
    args = parser.parse_args(argv)
    if args.dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mixer_plugins import kernels

    device = "cpu" if args.dry else "cuda"
    dim, batch, length = (32, 2, 20) if args.dry else (768, 64, 197)
    options = dict(head_dim=16, d_state=8) if args.dry else {}
    mixer = hydra_block(dim, **options).to(device)
    x = torch.randn(batch, length, dim, device=device, requires_grad=True)
    with kernels.use_backend("triton"):
        step = block_step(mixer, x, None if args.dry else torch.bfloat16)
        step()   # compile and autotune first
        counts = count_launches(step, profiler=not args.dry)
    print(counts.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
