"""Measuring mixers: time, FLOPs (counted by PyTorch) and peak memory, shared by ``mixer-plugins bench``
and the pytest-benchmark suites in ``benchmarks/``.

* FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on the same forward (our custom ops
  register their formulas, so the counter sees the scans and FFTs); :meth:`MatrixMixer.flops` is the
  analytic count it is checked against.
* Peak memory on CUDA is ``torch.cuda.max_memory_allocated``. On CPU it is the rise of the process's
  peak resident set size over the run (Linux: ``/proc/self/clear_refs`` resets the peak, and large
  buffers are forced to ``mmap`` so freed memory really leaves the process). It includes allocator
  overhead, so compare it between mixers and lengths, not with tensor byte counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .registry import MixerError, default_registry

__all__ = [
    "Measurement",
    "build_mixer",
    "count_flops",
    "measure",
    "peak_memory",
    "time_call",
]

MODES = ("forward", "forward_backward")


@dataclasses.dataclass
class Measurement:
    """One (mixer, length, batch, mode) measurement."""

    mixer: str
    length: int
    batch: int
    dim: int
    mode: str
    device: str
    seconds: float
    flops: int
    analytic_flops: int | None
    peak_memory_bytes: int | None

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.length / self.seconds

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.seconds

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(tokens_per_second=self.tokens_per_second, flops_per_second=self.flops_per_second)
        return out


def build_mixer(name: str, dim: int, length: int, *, causal: bool | None = None,
                options: dict[str, Any] | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """Build a mixer for a run at ``length``: data-independent mixers get ``max_seq_len=length``;
    ``causal`` is set where the mixer has the option (and checked where it has not)."""
    spec = default_registry.get_spec(name)
    fields = spec.config.model_fields
    opts = dict(options or {})
    if "max_seq_len" in fields and "max_seq_len" not in opts:
        needs_length = fields["max_seq_len"].is_required() or opts.get("data_dependent") is False
        if needs_length:
            opts["max_seq_len"] = length
    if causal is not None:
        if "causal" in fields:
            opts.setdefault("causal", causal)
        elif causal and spec.direction != "causal":
            raise MixerError(f"mixer {spec.name!r} is {spec.direction} only; it has no causal form")
        elif not causal and spec.direction == "causal":
            raise MixerError(f"mixer {spec.name!r} is causal only; it has no bidirectional form")
    mixer = spec.build(spec.make_config(dim, **opts))
    return mixer.to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(mixer, x: torch.Tensor, mode: str) -> Callable[[], None]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "forward":
        def run() -> None:
            with torch.no_grad():
                mixer(x)
    else:
        def run() -> None:
            x.grad = None
            mixer(x).sum().backward()
    return run


def time_call(fn: Callable[[], None], *, device: torch.device, warmup: int = 1, repeats: int = 3,
              min_seconds: float = 0.0) -> float:
    """Median wall time of ``fn`` (synchronizing CUDA), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start) < min_seconds:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def count_flops(fn: Callable[[], None]) -> int:
    """Total FLOPs ``FlopCounterMode`` counts while ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# -- peak memory -----------------------------------------------------------------------------------------

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large buffers are mmapped and returned on free
        except OSError:  # pragma: no cover - non-glibc Linux
            _LIBC = False
    return _LIBC


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)  # pragma: no cover


@contextlib.contextmanager
def peak_memory(device: str | torch.device = "cpu") -> Iterator[dict[str, int | None]]:
    """``with peak_memory(dev) as m: ...`` then ``m["peak_bytes"]``: the peak extra memory of the block
    (None where it cannot be measured, e.g. CPU memory off Linux)."""
    device = torch.device(device)
    result: dict[str, int | None] = {"peak_bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        return
    libc = _libc()
    try:
        gc.collect()
        if libc:
            libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size
        base = _status_bytes("VmRSS")
    except OSError:
        yield result
        return
    yield result
    result["peak_bytes"] = max(0, _status_bytes("VmHWM") - base)


# -- one measurement -------------------------------------------------------------------------------------

def measure(name: str, *, dim: int = 256, length: int = 1024, batch: int = 1, mode: str = "forward",
            causal: bool | None = None, options: dict[str, Any] | None = None, device: str = "cpu",
            dtype: torch.dtype = torch.float32, warmup: int = 1, repeats: int = 3,
            memory: bool = True, seed: int = 0) -> Measurement:
    """Time, count FLOPs and measure peak memory of one mixer at one size."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    mixer = build_mixer(name, dim, length, causal=causal, options=options, device=dev, dtype=dtype)
    mixer.train(mode == "forward_backward")
    x = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=mode == "forward_backward")
    run = _step(mixer, x, mode)
    seconds = time_call(run, device=dev, warmup=warmup, repeats=repeats)
    flops = count_flops(run)
    try:
        analytic = int(mixer.flops(batch, length))
        if mode == "forward_backward":
            analytic *= 3  # the usual estimate: backward = 2 x forward
    except NotImplementedError:
        analytic = None
    peak = None
    if memory:
        gc.collect()
        with peak_memory(dev) as mem:
            run()
        peak = mem["peak_bytes"]
    return Measurement(mixer=default_registry.get_spec(name).name, length=length, batch=batch, dim=dim, mode=mode,
                       device=str(dev), seconds=seconds, flops=flops, analytic_flops=analytic,
                       peak_memory_bytes=peak)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_flops(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def ratio_table(measurements: Sequence[Measurement], baseline: str = "attention") -> list[dict[str, Any]]:
    """Rows with each measurement and its time ratio to the baseline mixer at the same size and mode."""
    base = {(m.length, m.batch, m.mode, m.dim): m.seconds for m in measurements if m.mixer == baseline}
    rows = []
    for m in measurements:
        ref = base.get((m.length, m.batch, m.mode, m.dim))
        row = m.as_dict()
        row["speedup_vs_" + baseline] = (ref / m.seconds) if ref else None
        rows.append(row)
    return rows
