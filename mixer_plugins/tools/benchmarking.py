"""Measuring mixers: time, FLOPs (counted by PyTorch) and peak memory, shared by ``mixer-plugins bench``,
the benchmark suites and scripts in ``benchmarks/`` and the GPU check's scripts (``benchmarks/gpu/``).

* Time: :func:`time_calls` is the one timing loop; :class:`Timings` holds every call's seconds and minor page faults,
  with medians, quantiles and per-round ratios.
* FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on the same forward (our custom ops
  register their formulas, so the counter sees the scans and FFTs); :meth:`MatrixMixer.flops` is the
  analytic count it is checked against.
* Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the rise of the process's peak resident set over
  the run, with malloc as a normal process has it (:func:`peak_memory`; ``docs/cli.md``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from . import DIRECTIONS, MODES

resource: ModuleType | None
try:
    import resource
except ImportError:  # pragma: no cover - not on Unix: no page-fault counts
    resource = None

__all__ = [
    "DIRECTIONS",
    "MODES",
    "DecodeTiming",
    "Measurement",
    "SweepProblem",
    "Timings",
    "build_mixer",
    "count_flops",
    "error_summary",
    "format_bytes",
    "format_flops",
    "format_seconds",
    "measure",
    "mixer_step",
    "peak_memory",
    "quantile",
    "sweep",
    "time_calls",
    "time_decoding",
]



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
    #: "causal" or "bidirectional": the direction the mixer actually ran in.
    direction: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """Tokens (batch x length) processed per second."""
        return self.batch * self.length / self.seconds

    @property
    def flops_per_second(self) -> float:
        """Achieved FLOP/s: the FLOPs FlopCounterMode counted divided by the median time."""
        return self.flops / self.seconds

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(tokens_per_second=self.tokens_per_second, flops_per_second=self.flops_per_second)
        return out


def build_mixer(name: str, dim: int, length: int, *, causal: bool | None = None,
                options: Mapping[str, Any] | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Any:
    """Build a mixer for a run at ``length``, its options filled in by the shared resolver
    (:mod:`mixer_plugins.backbones.options`): ``max_seq_len=length`` where the mixer has that option, and the
    direction ``causal`` (True/False; None keeps the mixer's default) where it has a ``causal`` option. A mixer
    that cannot run in the requested direction raises :class:`~mixer_plugins.MixerError`."""
    from ..backbones.options import HostModel, resolve_config
    from ..registry import default_registry

    spec = default_registry.get_spec(name)
    config, _ = resolve_config(spec, HostModel(dim=dim, max_seq_len=length, causal=causal), options)
    mixer = spec.build(config)
    return mixer.to(device=device, dtype=dtype)


def mixer_step(mixer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str) -> Callable[[], None]:
    """One call of ``mixer`` on ``x`` as a function: a forward without gradients, or a forward+backward."""
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


# -- timing ----------------------------------------------------------------------------------------------

def _minor_faults() -> int:
    """This process's minor page faults so far (first touches of pages the kernel had to map); 0 off Unix."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


@dataclasses.dataclass
class Timings:
    """What :func:`time_calls` measured: per function, the seconds of each timed call (``seconds[key][i]`` is round
    ``i``) and the minor page faults of each; ``note`` says why fewer calls were made than asked (a deadline)."""

    seconds: dict[Hashable, list[float]]
    faults: dict[Hashable, list[int]]
    note: str = ""

    def quantile(self, key: Hashable, q: float) -> float:
        """The ``q`` quantile of ``key``'s times (linear interpolation)."""
        return quantile(self.seconds[key], q)

    def median(self, key: Hashable) -> float:
        """The median of ``key``'s times."""
        return statistics.median(self.seconds[key])

    def ratio(self, num: Hashable, den: Hashable) -> dict[str, float]:
        """``num``'s time over ``den``'s, taken per round: the median, min and max over the rounds."""
        ratios = sorted(n / d for n, d in zip(self.seconds[num], self.seconds[den]))
        return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between the sorted values)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def time_calls(fns: Mapping[Any, Callable[[], object]] | Callable[[], object], *, rounds: int = 3,
               warmup: int = 1, device: str | torch.device | None = None, sync: Callable[[], None] | None = None,
               shuffle: int | None = None, deadline: float | None = None) -> Timings:
    """Wall time of every call of the functions ``fns`` (a mapping, or one function, keyed ``None``), interleaved.

    ``warmup`` untimed rounds, then ``rounds`` timed ones; each round calls every function once, in turn, so that a
    change in the machine's load touches all of them alike. With ``shuffle`` (a seed), the order is drawn anew every
    round: every function follows every other one alike (a call right after one that streamed a large buffer
    through the processor's caches is slower). ``sync`` (by default ``torch.cuda.synchronize`` on a CUDA
    ``device``) is called before and after each timed call. Past ``deadline`` (``time.time()``), the loop stops
    after the round it is in, keeping at least one timed round, and ``note`` says how many were made.
    """
    calls: dict[Hashable, Callable[[], object]] = dict(fns) if isinstance(fns, Mapping) else {None: fns}
    if sync is None and device is not None and torch.device(device).type == "cuda":
        sync = functools.partial(torch.cuda.synchronize, torch.device(device))
    order = random.Random(shuffle) if shuffle is not None else None
    timings = Timings({key: [] for key in calls}, {key: [] for key in calls})

    def passed() -> bool:
        return deadline is not None and time.time() > deadline

    def keys() -> list[Hashable]:
        out = list(calls)
        if order is not None:
            order.shuffle(out)
        return out

    warm = done = 0
    while warm < warmup:
        for key in keys():
            calls[key]()
        warm += 1
        if passed():
            break
    while done < rounds:
        for key in keys():
            if sync is not None:
                sync()
            faults = _minor_faults()
            t0 = time.perf_counter()
            calls[key]()
            if sync is not None:
                sync()
            timings.seconds[key].append(time.perf_counter() - t0)
            timings.faults[key].append(_minor_faults() - faults)
        done += 1
        if passed():
            break
    if done < rounds or warm < warmup:
        timings.note = f"cut at the deadline: {done} of {rounds} timed calls, {warm} of {warmup} warm-ups"
    return timings


def count_flops(fn: Callable[[], None]) -> int:
    """Total FLOPs ``FlopCounterMode`` counts while ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# -- peak memory -----------------------------------------------------------------------------------------

# glibc mallopt parameters, used only by peak_memory(tuned=True). Inside such a block, buffers of 64 KiB and
# more are mmapped, so freeing one really lowers the resident set. After it, the process must allocate as it
# normally would: a low mmap threshold left in place makes every large tensor a fresh mmap (page faults on first
# touch) and slowed forward+backward timings 2-3x. glibc's default threshold is dynamic (it rises to at most
# 32 MiB as large buffers are freed) and mallopt cannot switch that back on, so after the block we set what the
# dynamic rule converges to for tensor workloads: 32 MiB, with the matching trim threshold. The default
# measurement never calls mallopt: its figure is the one a normal process sees.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MEASURING_MMAP_THRESHOLD = 1 << 16
_NORMAL_MMAP_THRESHOLD = 32 << 20
_NORMAL_TRIM_THRESHOLD = 2 * _NORMAL_MMAP_THRESHOLD


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, with the prototypes used here; None off Linux or without glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - non-glibc Linux
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        libc.mallinfo2.restype = _MallInfo2
    return libc


def _plug_free_heap_chunks(libc: ctypes.CDLL) -> list[int]:
    """Allocate (without touching) the large free chunks of the main heap; returns the pointers to free later.

    Large buffers freed before the block sit in malloc's free lists (their pages released by ``malloc_trim``).
    Allocations inside the block would reuse them instead of being mmapped, fault their pages back in and keep
    them after being freed, so the peak would depend on what ran before (measured: 79-118 MiB for a run whose
    own peak is 63 MiB). Holding those chunks for the duration of the block sends every large allocation to
    ``mmap``. Only malloc's chunk headers are written, so the plugs themselves cost a page each at most.
    """
    if not hasattr(libc, "mallinfo2"):  # older glibc: no plugging, the peak may then include reuse
        return []
    plugs: list[int] = []
    size = int(libc.mallinfo2().fordblks)
    while size >= _MEASURING_MMAP_THRESHOLD:
        mmapped_before = libc.mallinfo2().hblkhd
        pointer = libc.malloc(size)
        info = libc.mallinfo2()
        if pointer and info.hblkhd == mmapped_before:  # served from the heap's free memory: keep it
            plugs.append(pointer)
            size = min(size, int(info.fordblks))
        else:  # no free chunk this large (it was mmapped, or failed): try smaller
            if pointer:
                libc.free(pointer)
            size //= 2
    return plugs


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)  # pragma: no cover


@contextlib.contextmanager
def peak_memory(device: str | torch.device = "cpu", *, tuned: bool = False) -> Iterator[dict[str, int | None]]:
    """``with peak_memory(dev) as m: ...`` then ``m["peak_bytes"]``: the peak extra memory of the block
    (None where it cannot be measured, e.g. CPU memory off Linux); on CUDA also ``m["total_bytes"]``, the peak
    with what was allocated before the block.

    On CPU the allocator is left as a normal process has it (only garbage is collected and free heap pages
    returned before the baseline, so memory freed earlier does not hide this block's). ``tuned=True`` measures
    with malloc's mmap threshold forced down inside the block (and changes the process's malloc settings for
    good): a lower, allocator-tuned figure, to be reported as such, never as the peak a user would see.
    """
    device = torch.device(device)
    result: dict[str, int | None] = {"peak_bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        total = torch.cuda.max_memory_allocated(device)
        result.update(total_bytes=total, peak_bytes=total - base)
        return
    libc = _libc()
    plugs: list[int] = []
    if libc and tuned:
        libc.mallopt(_M_MMAP_THRESHOLD, _MEASURING_MMAP_THRESHOLD)
    try:
        try:
            gc.collect()
            if libc:
                libc.malloc_trim(0)
                if tuned:
                    plugs = _plug_free_heap_chunks(libc)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set size
            base = _status_bytes("VmRSS")
        except OSError:
            yield result
            return
        yield result
        result["peak_bytes"] = max(0, _status_bytes("VmHWM") - base)
    finally:
        if libc and tuned:
            for pointer in plugs:
                libc.free(pointer)
            libc.mallopt(_M_MMAP_THRESHOLD, _NORMAL_MMAP_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, _NORMAL_TRIM_THRESHOLD)


# -- one measurement -------------------------------------------------------------------------------------

def measure(name: str, *, dim: int = 256, length: int = 1024, batch: int = 1, mode: str = "forward",
            causal: bool | None = None, options: dict[str, Any] | None = None, device: str = "cpu",
            dtype: torch.dtype = torch.float32, warmup: int = 1, repeats: int = 3,
            memory: bool = True, seed: int = 0) -> Measurement:
    """Time, count FLOPs and measure peak memory of one mixer at one size."""
    from ..registry import default_registry

    dev = torch.device(device)
    torch.manual_seed(seed)
    mixer = build_mixer(name, dim, length, causal=causal, options=options, device=dev, dtype=dtype)
    mixer.train(mode == "forward_backward")
    x = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=mode == "forward_backward")
    run = mixer_step(mixer, x, mode)
    seconds = time_calls(run, rounds=repeats, warmup=warmup, device=dev).median(None)
    flops = count_flops(run)
    try:
        analytic = int(mixer.flops(batch, length))
        if mode == "forward_backward":
            analytic *= 3  # the usual estimate: backward = 2 x forward
    except NotImplementedError:
        analytic = None
    peak = None
    if memory:
        with peak_memory(dev) as mem:  # collects garbage itself before the baseline
            run()
        peak = mem["peak_bytes"]
    direction = "causal" if getattr(mixer, "causal", False) else "bidirectional"
    return Measurement(mixer=default_registry.get_spec(name).name, length=length, batch=batch, dim=dim, mode=mode,
                       device=str(dev), seconds=seconds, flops=flops, analytic_flops=analytic,
                       peak_memory_bytes=peak, direction=direction)


# -- a sweep over mixers and lengths (mixer-plugins bench) -----------------------------------------------

@dataclasses.dataclass
class SweepProblem:
    """A (mixer, length) the sweep could not measure: ``kind`` is "skipped" (not attempted) or "failed"."""

    mixer: str
    length: int | None
    kind: str
    reason: str


def error_summary(err: BaseException) -> str:
    """``"SequenceLengthError: first line of the message"``: how a failed mixer is reported in tables."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def sweep(mixers: Sequence[str], lengths: Sequence[int], *, dim: int = 256, batch: int = 1, mode: str = "forward",
          direction: str = "default", options: dict[str, dict[str, Any]] | None = None, device: str = "cpu",
          dtype: torch.dtype = torch.float32, warmup: int = 1, repeats: int = 3, memory: bool = True,
          on_start: Callable[[str, int], None] | None = None, on_done: Callable[[str, int], None] | None = None,
          on_record: Callable[[list[Measurement], list[SweepProblem]], None] | None = None,
          ) -> tuple[list[Measurement], list[SweepProblem]]:
    """Measure every mixer at every length (shortest first); what cannot run is reported, never raised.

    Mixers that cannot run in ``direction`` are skipped; a failure at one length (bad options for that
    length, an error in the mixer) is recorded and the sweep goes on; after running out of memory the
    longer lengths of that mixer are skipped. ``options[name]`` are the mixer's options. ``on_start(mixer,
    length)`` and ``on_done(mixer, length)`` are called around each (mixer, length), measured or not (progress);
    ``on_record(results, problems)`` after each with everything so far (e.g. to save partial results).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    from ..backbones.options import direction_problem
    from ..registry import default_registry

    causal = None if direction == "default" else direction == "causal"
    options = options or {}
    results: list[Measurement] = []
    problems: list[SweepProblem] = []
    for name in mixers:
        reason = direction_problem(default_registry.get_spec(name), causal) if causal is not None else None
        out_of_memory_at: int | None = None
        for length in sorted(lengths):
            if on_start is not None:
                on_start(name, length)
            if reason is not None:
                problems.append(SweepProblem(name, length, "skipped", reason))
            elif out_of_memory_at is not None:
                problems.append(SweepProblem(name, length, "skipped",
                                             f"ran out of memory at length {out_of_memory_at}"))
            else:
                try:
                    results.append(measure(name, dim=dim, length=length, batch=batch, mode=mode, causal=causal,
                                           options=options.get(name), device=device, dtype=dtype, warmup=warmup,
                                           repeats=repeats, memory=memory))
                except (MemoryError, torch.OutOfMemoryError) as err:
                    out_of_memory_at = length
                    problems.append(SweepProblem(name, length, "failed", error_summary(err)))
                except Exception as err:  # noqa: BLE001 - one broken mixer must not end the whole sweep
                    problems.append(SweepProblem(name, length, "failed", error_summary(err)))
                finally:
                    # gc.collect costs ~0.4 s in a big process: leave it to peak_memory, which needs it
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
            if on_record is not None:
                on_record(results, problems)
            if on_done is not None:
                on_done(name, length)
    return results, problems


# -- decoding (mixer-plugins bench --decode) -------------------------------------------------------------

@dataclasses.dataclass
class DecodeTiming:
    """The time of each timed decoding step of one mixer after ``context`` tokens: medians and spread."""

    mixer: str
    context: int
    batch: int
    dim: int
    device: str
    token_seconds: list[float]

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the per-token times (linear interpolation)."""
        return quantile(self.token_seconds, q)

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "median_seconds": self.median,
                **{f"p{q}_seconds": self.quantile(q / 100) for q in (10, 25, 75, 90)}}


def time_decoding(mixers: Sequence[str], contexts: Sequence[int], *, dim: int = 256, batch: int = 1, steps: int = 32,
                  warmup: int = 4, options: Mapping[str, Mapping[str, Any]] | None = None, device: str = "cpu",
                  ) -> tuple[list[DecodeTiming], list[SweepProblem]]:
    """Per-token decoding times of each mixer (built causal) after each context length: ``(timings, problems)``.

    Every (mixer, context) pair is built and prefilled with ``context`` random tokens into a cache holding
    ``context + warmup + steps``; then all pairs are stepped one token at a time, taking turns token by token
    (:func:`time_calls`: ``warmup`` untimed turns first, the order shuffled at every turn), so every ratio (a mixer's
    growth with the context, two mixers at one context) compares times taken in the same moments of a possibly busy
    machine, with the processor's caches flushed by the same neighbours. A mixer that cannot run causally or step is
    a "skipped" problem, an error a "failed" one.
    """
    dev = torch.device(device)
    problems: list[SweepProblem] = []
    steppers: dict[tuple[str, int], Callable[[], object]] = {}
    x = torch.randn(batch, 1, dim, device=dev)
    for context in contexts:
        for name in mixers:
            try:
                torch.manual_seed(0)
                mixer = build_mixer(name, dim, context + warmup + steps, causal=True,
                                    options=(options or {}).get(name), device=dev).eval()
                if not mixer.can_step:
                    problems.append(SweepProblem(name, context, "skipped", mixer.step_problem()))
                    continue
                cache = mixer.allocate_cache(batch, context + warmup + steps)
                with torch.no_grad():
                    mixer.prefill(torch.randn(batch, context, dim, device=dev), cache)
                steppers[name, context] = functools.partial(mixer.step, x, cache)
            except Exception as err:  # noqa: BLE001 - one mixer's failure is reported, the rest still run
                kind = "skipped" if type(err).__name__ in ("MixerError", "StepNotSupportedError") else "failed"
                problems.append(SweepProblem(name, context, kind, error_summary(err)))
    with torch.no_grad():
        times = time_calls(steppers, rounds=steps, warmup=warmup, device=dev, shuffle=0).seconds
    timings = [DecodeTiming(name, context, batch, dim, str(dev), times[name, context]) for name, context in steppers]
    timings.sort(key=lambda t: (list(mixers).index(t.mixer), t.context))
    return timings, problems


def format_seconds(seconds: float | None) -> str:
    """``1.23 s``, ``45.6 ms``, ``789 us``."""
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def format_bytes(n: float | None) -> str:
    """``12.3 MiB``-style byte counts (binary prefixes); ``-`` when unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_flops(n: float | None) -> str:
    """``1.61 G``-style FLOP counts (decimal prefixes)."""
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"

