"""Threads per op size: the CPU paths run their small ops on one thread.

Every PyTorch CPU op larger than its grain size (32768 elements) is a parallel region, and a parallel region
ends only when every thread of the team has finished its share. When the cores are shared (data-loader
workers, another job), one of those threads is often descheduled and the region waits for it for a whole
scheduler time slice, however little work it had: a path made of thousands of small parallel ops then slows
down far more than a path of a few large ones, such as SDPA. So the scan, the short convolution and the gated
norm run a section whose ops are small (:data:`PARALLEL_MIN_ELEMENTS`) on one thread, and only sections of
large ops on all of ``torch.get_num_threads()``. The setting is changed for the section and restored after it
(``torch.set_num_threads`` costs about a microsecond); it changes speed only, never a result.

The threshold is :data:`PARALLEL_MIN_ELEMENTS`, or the environment variable ``MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS``
when set (read at every section): raise it on a machine whose cores are always shared (everything small and
medium then runs on one thread), lower it (e.g. to 0) on a dedicated one.

**Shared cores.** Large sections do not run on more threads than the machine has cores left: on Linux the
runnable tasks that are not this process's own are read from ``/proc`` (at most every
:data:`LOAD_SAMPLE_SECONDS`), and while another process keeps cores busy a large section uses only the free ones
(at least one), as OpenMP's dynamic mode does. A quiet machine keeps all threads. Two readings in a row must agree
before threads are given up, so a short-lived task (a kernel worker waking for a moment) changes nothing. Set
``MIXER_PLUGINS_ADAPTIVE_THREADS=0`` to turn this off; elsewhere than Linux it is off, and so it is for a process
pinned to some of the machine's cores (a container's cpuset, ``taskset``): ``/proc/loadavg`` counts the whole
machine's tasks, which may run on other cores than ours.

**Whole mixer calls under load.** Sections cover the scan, conv, norm and projections, but a mixer's forward and
backward also run dozens of other PyTorch ops (copies, concatenations, elementwise gates, the autograd engine's
gradient sums), each a parallel region of its own. While other processes keep cores busy, :func:`mixer_threads`
runs a whole mixer call, forward and backward, on the free cores only (``MatrixMixer.forward`` does it for every
mixer): measured on 2 cores with one busy process, quasiseparable forward+backward at L = 1024 took 3.1x its time
alone with those ops on both threads and 1.7x with everything on one (SDPA: 2.1x). The backward is covered by two
tensor hooks: one on the mixer's output (its gradient arrives first: threads go down) and one on a view of its
input (its gradient is complete last: threads are restored), and the end of the backward pass restores them in any
case. On a quiet machine nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["LOAD_SAMPLE_SECONDS", "PARALLEL_MIN_ELEMENTS", "adaptive", "free_cores", "load_threads",
           "MixerThreads", "mixer_threads", "parallel_min_elements", "section_threads", "threads_for"]

#: Below this many elements in the largest tensor an op of the section writes, the section runs on one thread.
#: (An elementwise op of 2^18 float32 elements takes about 0.1 ms on one core.) Until session 5 it was 2^20, chosen
#: for the contention target; with the adaptive rule below handling shared cores, 2^18 was measured faster on a
#: quiet 2-core machine (L = 1024: quasiseparable 149 -> 110 ms, semiseparable 93 -> 77 ms forward+backward) and
#: the same at L = 4096 (see docs/performance.md).
PARALLEL_MIN_ELEMENTS = 1 << 18


def parallel_min_elements() -> int:
    """The threshold in force: ``MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS`` when it is a non-negative integer, else
    :data:`PARALLEL_MIN_ELEMENTS`."""
    value = os.environ.get("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", "").strip()
    if value.isdigit():
        return int(value)
    return PARALLEL_MIN_ELEMENTS


#: How long (seconds) one reading of the machine's runnable tasks is used before it is read again.
LOAD_SAMPLE_SECONDS = 0.02


def adaptive() -> bool:
    """Whether large sections adapt to the cores other processes keep busy (``MIXER_PLUGINS_ADAPTIVE_THREADS``,
    on unless set to ``0``, ``false``, ``no`` or ``off``)."""
    value = os.environ.get("MIXER_PLUGINS_ADAPTIVE_THREADS", "").strip().lower()
    return value not in ("0", "false", "no", "off")


def _runnable_tasks() -> int | None:
    """Runnable tasks on the whole machine now (the fourth field of ``/proc/loadavg``), None where unreadable."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _own_runnable_tasks() -> int:
    """This process's threads that are runnable now (state ``R`` in ``/proc/self/task/*/stat``): the reading thread
    itself, and thread-pool workers still spinning after a parallel region."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(")")  # the state follows the command name, which may hold spaces and parentheses
        if end >= 0 and stat[end + 2:end + 3] == "R":
            count += 1
    return count


_clock = time.monotonic


def _cores() -> int:
    """Cores of the machine (what the runnable tasks of ``/proc/loadavg`` share)."""
    return os.cpu_count() or 1


def _allowed_cores() -> int:
    """Cores this process may run on (its CPU affinity; a container's cpuset, ``taskset``), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return _cores()


_last_sample: tuple[float, int | None, int | None] = (float("-inf"), None, None)  # (time, free cores, previous)


def _sample_free_cores() -> int | None:
    """Cores not kept busy by other processes now: all cores minus the runnable tasks that are not ours. (Our own
    threads are read before and after the machine's count, and the larger count is taken: a worker that stops
    spinning between the two readings must not look like another process.)"""
    if _allowed_cores() < _cores():
        # pinned to some of the cores (a container's cpuset): the machine-wide count cannot tell whether the busy
        # tasks run on ours, and a busy machine would otherwise push this process down to one thread on cores
        # that may well be idle, so the rule is off
        return None
    before = _own_runnable_tasks()
    running = _runnable_tasks()
    if running is None:
        return None
    others = max(0, running - max(before, _own_runnable_tasks())) if running > 1 else 0
    return max(0, _cores() - others)


def free_cores() -> int | None:
    """Cores that other processes leave free (see the module docstring), or None when unknown or when
    :func:`adaptive` is off. Read at most every :data:`LOAD_SAMPLE_SECONDS`; the larger of the last two readings,
    so that one moment's busy task does not count."""
    global _last_sample
    if not adaptive():
        return None
    now = _clock()
    when, current, previous = _last_sample
    if now - when >= LOAD_SAMPLE_SECONDS:
        current, previous = _sample_free_cores(), current
        _last_sample = (now, current, previous)
    if current is None:
        return None
    return current if previous is None else max(current, previous)


def section_threads(elements: int, device: torch.device | str | None) -> int:
    """Threads for a section whose largest op writes ``elements`` elements on ``device``: one for small
    sections on CPU; else the current ``torch.get_num_threads()``, but no more than :func:`free_cores` (and at
    least one) while other processes keep cores busy."""
    threads = torch.get_num_threads()
    if device is not None and torch.device(device).type != "cpu":
        return threads
    if elements < parallel_min_elements():
        return 1
    free = free_cores()
    return threads if free is None else max(1, min(threads, free))


@contextlib.contextmanager
def threads_for(elements: int, device: torch.device | str | None) -> Iterator[int]:
    """Run the body with :func:`section_threads` intra-op threads (restored on exit); yields that number."""
    current = torch.get_num_threads()
    wanted = section_threads(elements, device)
    if wanted == current:
        yield current
        return
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(current)


def load_threads(device: torch.device | str | None) -> int | None:
    """Threads for a whole mixer call while other processes keep cores busy: the free cores (at least one) when they
    are fewer than ``torch.get_num_threads()``; None when nothing is to change (a quiet machine, one thread, another
    device than the CPU, :func:`adaptive` off, the load unknown)."""
    if device is not None and torch.device(device).type != "cpu":
        return None
    threads = torch.get_num_threads()
    if threads <= 1:
        return None
    free = free_cores()
    if free is None or free >= threads:
        return None
    return max(1, free)


class _BackwardThreads:
    """One mixer call's backward: threads go down when the output's gradient arrives (if the machine is loaded
    then) and come back when the input's gradient is complete, or at the end of the backward pass."""

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: int | None = None

    def start(self, grad: Tensor) -> None:
        wanted = load_threads(grad.device)
        if wanted is None or self.saved is not None or wanted >= torch.get_num_threads():
            return
        self.saved = torch.get_num_threads()
        torch.set_num_threads(wanted)
        # restored at the end of the backward pass even when the input's gradient is never computed (an input that
        # needs no gradient, ``torch.autograd.grad`` for the parameters only); after a backward that raised half-way
        # (the engine runs no callbacks then) the next mixer call outside a backward pass restores them
        torch.autograd.Variable._execution_engine.queue_callback(self.end)
        _PENDING.add(self)

    def end(self, grad: Tensor | None = None) -> None:
        if self.saved is not None:
            torch.set_num_threads(self.saved)
            self.saved = None
        _PENDING.discard(self)


#: Backward scopes whose threads are down (normally empty between calls; see _BackwardThreads.start).
_PENDING: set[_BackwardThreads] = set()


def _current_graph_task() -> int:
    """The autograd engine's current backward pass (-1 outside one; a checkpoint's recomputation runs inside one)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else current()


class MixerThreads:
    """One mixer call's threads (see :func:`mixer_threads`): a context manager for the forward, with the input to
    use (:attr:`x`) and :meth:`track` for the output."""

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self._scope: _BackwardThreads | None = None
        self._restore: int | None = None
        if torch.is_grad_enabled():
            self._scope = _BackwardThreads()
            if x.requires_grad:
                self.x = x.view_as(x)  # a non-leaf of this call only: its hook goes with the graph
                self.x.register_hook(self._scope.end)

    def track(self, out: Tensor) -> Tensor:
        """Register the backward's first hook on the mixer's output; returns the output."""
        if self._scope is not None and isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(self._scope.start)
        return out

    def __enter__(self) -> MixerThreads:
        wanted = load_threads(self.x.device)
        if wanted is not None and wanted < torch.get_num_threads():
            self._restore = torch.get_num_threads()
            torch.set_num_threads(wanted)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            torch.set_num_threads(self._restore)
            self._restore = None


def mixer_threads(x: object) -> MixerThreads | None:
    """The threads of one mixer call on the cores other processes leave free (see the module docstring), or None
    where nothing can change: not a plain CPU tensor, one thread, :func:`adaptive` off, under ``torch.compile``.

    Use::

        scope = mixer_threads(x)
        if scope is None:
            return body(x)
        with scope:                                # the forward runs on the free cores
            return scope.track(body(scope.x))      # scope.x: a view of x whose gradient hook ends the backward's

    Results never change, only the number of threads that compute them."""
    if torch.compiler.is_compiling():
        return None
    if _PENDING and _current_graph_task() == -1:  # outside a backward pass: one that raised left threads down
        for scope in list(_PENDING):
            scope.end()
    if (type(x) is not Tensor or x.device.type != "cpu" or torch.get_num_threads() <= 1  # type: ignore[attr-defined]
            or not adaptive()):
        return None
    return MixerThreads(x)
