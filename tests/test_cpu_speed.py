"""The CPU paths' structure (the CPU-speed issue): threads per op size, and an op count that does not grow with
the number of chunks. No timing here: speed targets live in benchmarks/test_bench_speed.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixer_plugins as mp
from mixer_plugins import kernels
from mixer_plugins.kernels import _threads
from mixer_plugins.kernels._scan import Direction, ScanInputs, reference_scan
from mixer_plugins.kernels._scan import custom_op as custom_op_module
from mixer_plugins.kernels._scan import native as native_scan

F64 = torch.float64


@pytest.fixture
def two_threads_adaptive():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads(two_threads_adaptive, monkeypatch):
    # these tests assert thread counts; the suite shares the machine (pytest-xdist), so the reading of other
    # processes' load (tested on its own below) is turned off here
    monkeypatch.setenv("MIXER_PLUGINS_ADAPTIVE_THREADS", "0")


def test_threads_for_runs_small_sections_on_one_thread_and_restores(two_threads):
    with _threads.threads_for(1000, "cpu") as threads:
        assert threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with _threads.threads_for(_threads.PARALLEL_MIN_ELEMENTS, "cpu") as threads:
        assert threads == 2 and torch.get_num_threads() == 2
    with _threads.threads_for(1000, "meta"):   # other devices: the setting is left alone
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), _threads.threads_for(1000, "cpu"):
        raise RuntimeError("restored even on an error")
    assert torch.get_num_threads() == 2


def test_the_threshold_can_be_set_from_the_environment(two_threads, monkeypatch):
    monkeypatch.setenv("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", "0")
    assert _threads.section_threads(10, "cpu") == 2               # everything parallel
    monkeypatch.setenv("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", str(1 << 40))
    assert _threads.section_threads(1 << 30, "cpu") == 1          # everything on one thread
    monkeypatch.setenv("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", "many")
    assert _threads.parallel_min_elements() == _threads.PARALLEL_MIN_ELEMENTS   # not a number: the default


class _Machine:
    """A stand-in for ``/proc``: runnable tasks on the machine and of this process, and a clock."""

    def __init__(self, monkeypatch, cores=2):
        self.runnable, self.own, self.now = 1, 1, 100.0
        monkeypatch.setattr(_threads, "_runnable_tasks", lambda: self.runnable)
        monkeypatch.setattr(_threads, "_own_runnable_tasks", lambda: self.own)
        monkeypatch.setattr(_threads, "_cores", lambda: cores)
        self.allowed = cores                                    # the CPU affinity: every core unless pinned
        monkeypatch.setattr(_threads, "_allowed_cores", lambda: self.allowed)
        monkeypatch.setattr(_threads, "_clock", lambda: self.now)
        monkeypatch.setattr(_threads, "_last_sample", (float("-inf"), None, None))
        monkeypatch.delenv("MIXER_PLUGINS_ADAPTIVE_THREADS", raising=False)

    def later(self):
        self.now += _threads.LOAD_SAMPLE_SECONDS + 1e-3


def test_large_sections_use_only_the_cores_other_processes_leave_free(two_threads_adaptive, monkeypatch):
    machine = _Machine(monkeypatch)
    large = _threads.PARALLEL_MIN_ELEMENTS
    assert _threads.section_threads(large, "cpu") == 2            # quiet: only our own thread runs
    machine.runnable, machine.own = 3, 2                          # ours, our spinning worker, and one other
    machine.later()
    assert _threads.section_threads(large, "cpu") == 2            # one busy reading alone changes nothing
    machine.later()
    assert _threads.section_threads(large, "cpu") == 1            # two in a row: one core is taken
    assert _threads.section_threads(1000, "cpu") == 1             # (small sections are on one thread anyway)
    assert _threads.section_threads(large, "meta") == 2           # other devices are left alone
    machine.runnable = 5                                          # more busy tasks than cores: still one
    machine.later()
    assert _threads.section_threads(large, "cpu") == 1
    with _threads.threads_for(large, "cpu") as threads:
        assert threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    machine.runnable, machine.own = 1, 1                          # the other process ended: all threads again
    machine.later()
    assert _threads.section_threads(large, "cpu") == 2
    machine.runnable = 4                                          # readings are kept for LOAD_SAMPLE_SECONDS
    assert _threads.section_threads(large, "cpu") == 2


def test_adaptive_threads_can_be_turned_off_and_are_off_where_proc_is_unreadable(two_threads_adaptive, monkeypatch):
    machine = _Machine(monkeypatch)
    machine.runnable, machine.own = 4, 1
    for _ in range(2):
        machine.later()
        _threads.free_cores()
    assert _threads.section_threads(_threads.PARALLEL_MIN_ELEMENTS, "cpu") == 1
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("MIXER_PLUGINS_ADAPTIVE_THREADS", off)
        assert _threads.free_cores() is None
        assert _threads.section_threads(_threads.PARALLEL_MIN_ELEMENTS, "cpu") == 2
    monkeypatch.setenv("MIXER_PLUGINS_ADAPTIVE_THREADS", "1")
    monkeypatch.setattr(_threads, "_runnable_tasks", lambda: None)    # no /proc (not Linux)
    machine.later()
    machine.later()
    assert _threads.free_cores() is None
    assert _threads.section_threads(_threads.PARALLEL_MIN_ELEMENTS, "cpu") == 2


def test_adaptive_threads_are_off_for_a_process_pinned_to_some_cores(two_threads_adaptive, monkeypatch):
    # a container's cpuset on a busy machine: the machine-wide count says nothing about our own cores
    machine = _Machine(monkeypatch, cores=8)
    machine.runnable, machine.own = 12, 1
    machine.later()
    machine.later()
    assert _threads.section_threads(_threads.PARALLEL_MIN_ELEMENTS, "cpu") == 1   # every core of the machine busy
    machine.allowed = 2
    machine.later()
    machine.later()
    assert _threads.free_cores() is None
    assert _threads.section_threads(_threads.PARALLEL_MIN_ELEMENTS, "cpu") == 2   # the threads torch was given


def _loaded(machine):
    """One other process keeps one of the two cores busy, in two readings in a row."""
    machine.runnable, machine.own = 2, 1
    machine.later()
    _threads.free_cores()
    machine.later()
    assert _threads.free_cores() == 1


def _spied_mixer(name, monkeypatch, seen, dim=16, dtype=F64):
    """A mixer whose ``mix`` records the threads it runs with, forward ("fwd") and backward ("bwd")."""
    torch.manual_seed(0)
    mixer = mp.create_mixer(name, dim, **mp.default_registry.get_spec(name).test_options).to(dtype)
    real_mix = mixer.mix

    def mix(ctx):
        seen.append(("fwd", torch.get_num_threads()))
        y = real_mix(ctx)
        if y.requires_grad:
            y.register_hook(lambda grad: seen.append(("bwd", torch.get_num_threads())))
        return y

    monkeypatch.setattr(mixer, "mix", mix)
    return mixer


def _loss_and_grads(mixer, x):
    out = mixer(x)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    leaves = [x, *mixer.parameters()]
    return out.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("name", ["quasiseparable", "semiseparable", "attention", "toeplitz"])
def test_a_whole_mixer_call_runs_on_the_cores_other_processes_leave_free(name, two_threads_adaptive, monkeypatch):
    # the ops between the sections (copies, gates, the engine's gradient sums) follow the load too, forward and
    # backward; the results are those of the quiet machine's call, and the setting is restored after the backward
    machine = _Machine(monkeypatch)
    seen: list[tuple[str, int]] = []
    mixer = _spied_mixer(name, monkeypatch, seen)
    x = torch.randn(2, 24, 16, dtype=F64, requires_grad=True)
    quiet_out, quiet_grads = _loss_and_grads(mixer, x)
    assert seen == [("fwd", 2), ("bwd", 2)] and torch.get_num_threads() == 2
    seen.clear()
    _loaded(machine)
    out, grads = _loss_and_grads(mixer, x)
    assert seen == [("fwd", 1), ("bwd", 1)], seen
    seen.clear()
    h = x * 1.0                                              # the ops before the mixer keep the caller's threads
    h.register_hook(lambda grad: seen.append(("before the mixer", torch.get_num_threads())))
    mixer(h).sum().backward()
    assert seen == [("fwd", 1), ("bwd", 1), ("before the mixer", 2)], seen
    assert torch.get_num_threads() == 2                      # restored after the forward and after the backward
    torch.testing.assert_close(out, quiet_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, quiet_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not x._backward_hooks                             # nothing is left on the caller's tensor


def test_the_backward_follows_the_load_when_it_runs_not_when_the_forward_ran(two_threads_adaptive, monkeypatch):
    machine = _Machine(monkeypatch)
    seen: list[tuple[str, int]] = []
    mixer = _spied_mixer("quasiseparable", monkeypatch, seen)
    x = torch.randn(1, 20, 16, dtype=F64, requires_grad=True)
    out = mixer(x)                                           # quiet forward
    _loaded(machine)
    out.sum().backward()                                     # loaded backward
    assert seen == [("fwd", 2), ("bwd", 1)] and torch.get_num_threads() == 2
    seen.clear()
    out = mixer(x)                                           # loaded forward
    machine.runnable = 1
    machine.later()
    machine.later()
    out.sum().backward()                                     # quiet backward
    assert seen == [("fwd", 1), ("bwd", 2)] and torch.get_num_threads() == 2


@pytest.mark.parametrize("case", ["input_needs_no_grad", "parameters_only", "no_grad", "raises"])
def test_the_threads_are_restored_however_the_backward_ends(case, two_threads_adaptive, monkeypatch):
    machine = _Machine(monkeypatch)
    seen: list[tuple[str, int]] = []
    mixer = _spied_mixer("semiseparable", monkeypatch, seen)
    x = torch.randn(1, 20, 16, dtype=F64, requires_grad=case != "input_needs_no_grad")
    _loaded(machine)
    if case == "no_grad":
        with torch.no_grad():
            mixer(x)
        assert seen == [("fwd", 1)] and torch.get_num_threads() == 2
        return
    out = mixer(x)
    if case == "raises":                                     # a hook after ours fails half-way through the backward
        def fail(grad):
            raise RuntimeError("half-way")

        out.register_hook(fail)
        with pytest.raises(RuntimeError, match="half-way"):
            out.sum().backward()
        mixer(torch.randn(1, 20, 16, dtype=F64))             # the next call restores what the failed one left
        assert torch.get_num_threads() == 2 and not _threads._PENDING
        return
    if case == "parameters_only":                            # the input's gradient is never computed
        torch.autograd.grad(out.sum(), list(mixer.parameters()))
    else:
        out.sum().backward()
    assert ("bwd", 1) in seen and torch.get_num_threads() == 2 and not _threads._PENDING


def test_a_checkpointed_mixer_keeps_the_backward_threads_through_its_recomputation(two_threads_adaptive, monkeypatch):
    from torch.utils.checkpoint import checkpoint

    machine = _Machine(monkeypatch)
    seen: list[tuple[str, int]] = []
    mixer = _spied_mixer("quasiseparable", monkeypatch, seen)
    x = torch.randn(1, 20, 16, dtype=F64, requires_grad=True)
    want = torch.autograd.grad(mixer(x).sum(), x)[0]
    seen.clear()
    _loaded(machine)
    for reentrant in (False, True):
        x.grad = None
        checkpoint(mixer, x, use_reentrant=reentrant).sum().backward()
        got = x.grad
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert seen and all(threads == 1 for _, threads in seen), (reentrant, seen)
        assert torch.get_num_threads() == 2 and not _threads._PENDING
        seen.clear()


def test_mixer_threads_leaves_other_calls_alone(two_threads_adaptive, monkeypatch):
    machine = _Machine(monkeypatch)
    _loaded(machine)
    x = torch.randn(1, 4, 8)
    assert _threads.mixer_threads(x.to("meta")) is None      # other devices
    assert _threads.mixer_threads([1.0]) is None             # not a tensor: the mixer's own check reports it
    monkeypatch.setenv("MIXER_PLUGINS_ADAPTIVE_THREADS", "0")
    assert _threads.mixer_threads(x) is None                 # turned off
    monkeypatch.delenv("MIXER_PLUGINS_ADAPTIVE_THREADS")
    torch.set_num_threads(1)
    assert _threads.mixer_threads(x) is None                 # one thread: nothing to give up
    torch.set_num_threads(2)
    scope = _threads.mixer_threads(x)
    assert scope is not None and scope.x is x                # no gradient wanted: the input itself
    with scope:
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_a_compiled_mixer_under_load_matches_eager(two_threads_adaptive, monkeypatch):
    # under torch.compile the call is traced as it is (no hooks, no thread changes inside the graph)
    from compile_helpers import inductor_settings

    machine = _Machine(monkeypatch)
    _loaded(machine)
    torch.manual_seed(0)
    mixer = mp.create_mixer("attention", 16, num_heads=2)
    x = torch.randn(2, 12, 16, requires_grad=True)
    want = _loss_and_grads(mixer, x)
    with inductor_settings():
        compiled = torch.compile(mixer, backend="inductor", fullgraph=True)
        got = _loss_and_grads(compiled, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads Linux's /proc")
def test_the_load_readings_count_this_thread_as_runnable():
    assert _threads._own_runnable_tasks() >= 1       # the thread reading is running
    assert _threads._runnable_tasks() >= 1
    free = _threads._sample_free_cores()
    assert 0 <= free <= os.cpu_count()


def _inputs(b=2, length=37, h=4, p=3, g=2, n=5, requires_grad=True):
    torch.manual_seed(0)
    leaves = [torch.randn(b, length, h, p, dtype=F64), torch.rand(b, length, h, dtype=F64) * 0.5,
              -torch.rand(h, dtype=F64) - 0.1, torch.randn(b, length, g, n, dtype=F64),
              torch.randn(b, length, g, n, dtype=F64), torch.rand(b, length, h, dtype=F64) * 0.5,
              torch.randn(b, length, g, n, dtype=F64), torch.randn(b, length, g, n, dtype=F64),
              torch.randn(b, length, h, dtype=F64)]
    return [t.requires_grad_(requires_grad) for t in leaves]


def test_eager_scan_backward_runs_single_threaded_when_small_and_matches_the_reference(two_threads, monkeypatch):
    monkeypatch.setattr(native_scan, "USE_NATIVE", False)  # the PyTorch path's threads (the native one: below)
    x, dt, A, B, C, dt_b, B_b, C_b, diag = leaves = _inputs()
    seen = []
    original = custom_op_module._scan   # the scan either path runs (factored decays or the general one)

    def spy(inputs, **kwargs):
        out = original(inputs, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        y.register_hook(lambda grad: seen.append(torch.get_num_threads()))
        return out

    monkeypatch.setattr(custom_op_module, "_scan", spy)
    y = kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, B_bwd=B_b, C_bwd=C_b, diag=diag, chunk_size=8,
                               backend="torch")
    loss = (y * y.cos()).sum()
    grads = torch.autograd.grad(loss, leaves)
    assert seen == [1] and torch.get_num_threads() == 2   # the backward ran on one thread, then restored

    ref_inputs = ScanInputs(x=x, forward=Direction(dt, A, B, C), backward=Direction(dt_b, A, B_b, C_b), diag=diag,
                            shift=True, chunk_size=8)
    y_ref = reference_scan(ref_inputs)
    grads_ref = torch.autograd.grad((y_ref * y_ref.cos()).sum(), leaves)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11)


def test_eager_ssd_final_state_gradients_match_the_reference():
    x, dt, A, B, C = _inputs()[:5]
    init = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True)
    y, final = kernels.ssd(x, dt, A, B, C, 8, initial_states=init, return_final_states=True, backend="torch")
    y_ref, final_ref = reference_scan(ScanInputs(x=x, forward=Direction(dt, A, B, C), initial_state=init,
                                                 chunk_size=8), return_final_state=True)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    leaves = (x, dt, A, B, C, init)
    grads = torch.autograd.grad(y.sum() + (final ** 2).sum(), leaves)
    grads_ref = torch.autograd.grad(y_ref.sum() + (final_ref ** 2).sum(), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11)


def test_the_eager_scan_says_it_is_not_twice_differentiable():
    x, dt, A, B, C = _inputs(length=9)[:5]
    y = kernels.quasiseparable(x, dt, A, B, C, chunk_size=4, backend="torch")
    gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


#: The state pass's per-chunk steps (see ``chunked._StatePass``): a fused multiply-add into a slice per chunk.
_STEP_OPS = (torch.ops.aten.addcmul.out, torch.ops.aten.mul.out)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched, and records the intra-op threads of each per-chunk step of the state pass."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.step_threads: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if func in _STEP_OPS:
            self.step_threads.append(torch.get_num_threads())
        return func(*args, **(kwargs or {}))

    @property
    def batched(self) -> int:
        """The ops that are not per-chunk steps."""
        return self.count - len(self.step_threads)


def _scan_ops(length: int, *, heads: int = 2, head_dim: int = 16, state: int = 16) -> _CountOps:
    torch.manual_seed(0)
    h, p, n = heads, head_dim, state
    x = torch.randn(1, length, h, p, requires_grad=True)
    dt = torch.rand(1, length, h) * 0.1
    A = -torch.rand(h) - 0.5
    B, C = torch.randn(1, length, 1, n), torch.randn(1, length, 1, n)
    with _CountOps() as counter:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=64, backend="torch").sum().backward()
    return counter


def test_scan_op_count_does_not_grow_with_the_number_of_chunks_but_for_the_state_steps():
    # 32 chunks and 256 chunks of 64 tokens: the longer scan's ops are the same few, batched over the chunks of a
    # tile, not a loop over tiles of a few chunks each. Only the state pass between chunks steps chunk by chunk,
    # one small fused multiply-add (one chunk's state) per chunk and direction, forward and backward.
    short, long = _scan_ops(2048), _scan_ops(16384)
    assert long.batched <= 1.5 * short.batched, (short.batched, long.batched)
    assert len(long.step_threads) - len(short.step_threads) <= 2 * 2 * (256 - 32), (short.count, long.count)


def test_the_state_pass_steps_run_on_one_thread(monkeypatch):
    # Each per-chunk step of the state pass is a parallel region when its chunk state reaches the grain (here
    # 8 x 64 x 64 = 32768 elements, Hydra's): it must then run on one thread, so that a descheduled thread cannot
    # stall every one of them. (The threshold 0 would make every section parallel: the steps are still on one.)
    monkeypatch.delenv("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        counter = _scan_ops(4 * 64, heads=8, head_dim=64, state=64)
    finally:
        torch.set_num_threads(previous)
    assert counter.step_threads and set(counter.step_threads) == {1}, counter.step_threads


def test_an_all_finite_scan_makes_no_full_size_selection(monkeypatch):
    monkeypatch.setattr(native_scan, "USE_NATIVE", False)  # about the PyTorch path's intra-chunk weights
    # The intra-chunk weights' excluded pairs enter as an additive -inf bias and its backward is written out: no
    # masked_fill or where over the (chunk x chunk) blocks, forward or backward, when every value is finite
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    h, p, n, q, length = 4, 16, 16, 32, 256
    x = torch.randn(1, length, h, p, requires_grad=True)
    dt = (torch.rand(1, length, h) * 0.1).requires_grad_(True)
    A = -torch.rand(h) - 0.5
    B, C = torch.randn(1, length, 1, n, requires_grad=True), torch.randn(1, length, 1, n, requires_grad=True)
    block = length * q * h
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        kernels.quasiseparable(x, dt, A, B, C, chunk_size=q, backend="torch").sum().backward()
    selections = [(e.name, e.input_shapes) for e in prof.events()
                  if e.name in ("aten::masked_fill", "aten::masked_fill_", "aten::where")
                  and e.input_shapes and e.input_shapes[0] and torch.Size(e.input_shapes[0]).numel() >= block]
    assert selections == []
    assert any(e.name == "aten::bmm" for e in prof.events())   # the profile did see the scan


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
def test_the_state_pass_matches_the_recurrence_values_and_gradients(reverse, with_init):
    # chunked._StatePass (chunk by chunk, written-out backward) against the recurrence H_c = a_c H_{c-1} + S_c
    # written with plain autograd, float64, including a broken chain (a_c = 0) and the final state's gradient
    from mixer_plugins.kernels._scan.chunked import _StatePass

    torch.manual_seed(0)
    b, nchunks, g, r, p, n = 2, 5, 1, 3, 4, 2
    states = torch.randn(b, nchunks, g, r, p, n, dtype=torch.float64, requires_grad=True)
    log_carry = -torch.rand(b, nchunks, g, r, dtype=torch.float64)
    log_carry[0, 2, 0, 1] = float("-inf")
    log_carry.requires_grad_(True)
    init = torch.randn(b, g, r, p, n, dtype=torch.float64, requires_grad=True) if with_init else None

    def recurrence():
        h = torch.zeros_like(states[:, 0]) if init is None else init
        entering = [None] * nchunks
        for c in (reversed(range(nchunks)) if reverse else range(nchunks)):
            entering[c] = h
            h = torch.exp(log_carry[:, c])[..., None, None] * h + states[:, c]
        return torch.stack(entering, dim=1), h

    leaves = [t for t in (states, log_carry, init) if t is not None]
    weights = (torch.randn(b, nchunks, g, r, p, n, dtype=torch.float64), torch.randn(b, g, r, p, n,
                                                                                     dtype=torch.float64))
    got, want = _StatePass.apply(states, log_carry[..., None, None], init, reverse), recurrence()
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for use in ((0, 1), (0,), (1,)):  # both outputs, the entering states only, the final state only
        loss_got = sum((got[i] * weights[i]).sum() for i in use)
        loss_want = sum((want[i] * weights[i]).sum() for i in use)
        grads_got = torch.autograd.grad(loss_got, leaves, retain_graph=True)
        grads_want = torch.autograd.grad(loss_want, leaves, retain_graph=True)
        for a, e in zip(grads_got, grads_want):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_a_conv_or_norm_pass_of_several_tiles_uses_all_threads(two_threads, monkeypatch):
    # A tile holds the element budget rounded down to whole rows (768 channels: 1365 rows, just under 2^20), so
    # sizing the threads by one tile's exact elements kept every pass of Hydra's conv on one thread at any length
    from mixer_plugins.kernels._tiling import section_elements, time_tiles
    from mixer_plugins.kernels.conv import torch as conv_torch

    monkeypatch.delenv("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", raising=False)
    monkeypatch.setattr(conv_torch, "USE_NATIVE", False)  # the PyTorch passes (the native kernel is one region)
    width = 768
    many = time_tiles(16384, width, conv_torch.TILE_ELEMENTS, torch.device("cpu"))
    short = _threads.PARALLEL_MIN_ELEMENTS // width // 2             # a pass smaller than the threshold
    one = time_tiles(short, width, conv_torch.TILE_ELEMENTS, torch.device("cpu"))
    assert len(many) > 1 and len(one) == 1
    assert _threads.section_threads(section_elements(many, width, conv_torch.TILE_ELEMENTS), "cpu") == 2
    assert _threads.section_threads(section_elements(one, width, conv_torch.TILE_ELEMENTS), "cpu") == 1
    seen = []
    real_silu = torch.nn.functional.silu

    def spy(t, inplace=False):
        seen.append(torch.get_num_threads())
        return real_silu(t, inplace=inplace)

    monkeypatch.setattr(conv_torch.F, "silu", spy)
    x = torch.randn(1, 16384, width)
    conv_torch._depthwise_conv1d_op(x, torch.randn(width, 4), None, 3, 0, True)
    assert seen and set(seen) == {2}, seen


@pytest.mark.parametrize("shape", [(5, 7), (2, 5, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_linear_is_f_linear_forward_and_backward(shape, with_bias, dtype):
    # kernels.linear runs F.linear's own products: the same values and gradients, bit for bit, and differentiable twice
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 7, dtype=dtype, requires_grad=True)
    b = torch.randn(3, dtype=dtype, requires_grad=True) if with_bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    got, want = kernels.linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert torch.equal(a, e)
    only_x = torch.autograd.grad(kernels.linear(x, w.detach(), None if b is None else b.detach()), x, g)[0]
    assert torch.equal(only_x, torch.autograd.grad(F.linear(x, w.detach(), None if b is None else b.detach()), x,
                                                   g)[0])
    if dtype == F64:
        assert torch.autograd.gradgradcheck(kernels.linear, (x, w, b))
    with torch.no_grad():
        assert torch.equal(kernels.linear(x, w, b), want)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "2d", "4d"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_large_projections_are_f_linear_bit_for_bit(layout, with_bias):
    # above MIN_ELEMENTS kernels.linear runs its own autograd Function (threads that follow the load): still
    # F.linear's products, values and gradients, for every input layout F.linear treats its own way
    import torch.nn.functional as F

    from mixer_plugins.kernels import _linear

    torch.manual_seed(0)
    shapes = {"contiguous": (1, 16384, 256), "strided": (1, 16384, 300), "2d": (16384, 256), "4d": (2, 2, 4096, 256)}
    leaf = x = torch.randn(*shapes[layout], requires_grad=True)
    if layout == "strided":
        x = leaf[..., :256]                                    # a slice of a wider tensor, as the blocks' pieces
    w = torch.randn(512, 256, requires_grad=True)
    b = torch.randn(512, requires_grad=True) if with_bias else None
    leaves = [t for t in (leaf, w, b) if t is not None]
    assert _linear._elements(x, w) >= _linear.MIN_ELEMENTS
    got, want = kernels.linear(x, w, b), F.linear(x, w, b)
    assert got.grad_fn is not None and "_Linear" in type(got.grad_fn).__name__
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert torch.equal(a, e)


def test_linear_forward_and_backward_use_only_the_free_cores(two_threads_adaptive, monkeypatch):
    # with another process keeping one of 2 cores busy, the projection's products run on one thread, forward and
    # backward (as the scan, conv and norm sections do); the caller's setting is restored after each
    from mixer_plugins.kernels import _linear

    machine = _Machine(monkeypatch)
    sections = []
    monkeypatch.setattr(_linear, "threads_for", _recording(_linear.threads_for, sections))
    x = torch.randn(2048, 1024, requires_grad=True)   # a product of MIN_ELEMENTS (2^21) elements
    w = torch.randn(1024, 1024, requires_grad=True)
    kernels.linear(x[:1024], w).sum().backward()        # smaller products are plain F.linear: no section
    assert sections == []
    seen_at_output = []
    y = kernels.linear(x, w)
    y.register_hook(lambda grad: seen_at_output.append(torch.get_num_threads()))
    y.sum().backward()
    assert sections == [2, 2] and seen_at_output == [2]          # quiet machine: all threads
    machine.runnable, machine.own = 3, 2                          # one other busy process
    machine.later()
    _threads.section_threads(1 << 30, "cpu")
    machine.later()
    sections.clear()
    seen_at_output.clear()
    y = kernels.linear(x, w)
    y.register_hook(lambda grad: seen_at_output.append(torch.get_num_threads()))
    y.sum().backward()
    assert sections == [1, 1] and seen_at_output == [2]           # both sections on the free core, then restored
    assert torch.get_num_threads() == 2 and x.grad is not None and w.grad is not None


def _recording(threads_for, into):
    import contextlib

    @contextlib.contextmanager
    def recording(elements, device):
        with threads_for(elements, device) as n:
            into.append(n)
            yield n
    return recording


def test_linear_is_plain_f_linear_under_cpu_autocast():
    import torch.nn.functional as F

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = kernels.linear(x, w), F.linear(x, w)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got.grad_fn.name() == want.grad_fn.name()


def test_the_block_projects_through_linear_unless_the_projection_is_wrapped_or_hooked(monkeypatch):
    # a plain out_proj goes through kernels.linear; a hooked one (or any other module) is called as itself
    import mixer_plugins as mp
    import mixer_plugins.mixers.block as block

    calls = []
    original = block.linear
    monkeypatch.setattr(block, "linear", lambda *args: calls.append(len(args)) or original(*args))
    mixer = mp.create_mixer("quasiseparable", 32, head_dim=8, d_state=8, chunk_size=8)
    x = torch.randn(2, 12, 32)
    want = mixer(x)
    plain_calls = len(calls)
    assert plain_calls >= 3   # in_proj's pieces and out_proj
    fired = []
    handle = mixer.out_proj.register_forward_hook(lambda module, args, out: fired.append(out.shape))
    calls.clear()
    torch.testing.assert_close(mixer(x), want, rtol=0, atol=0)
    handle.remove()
    assert fired == [torch.Size([2, 12, 32])] and len(calls) == plain_calls - 1
    seen = []   # a process-wide module hook must see out_proj called as a module too
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(module) if module is mixer.out_proj else None)
    calls.clear()
    try:
        torch.testing.assert_close(mixer(x), want, rtol=0, atol=0)
    finally:
        handle.remove()
    assert seen == [mixer.out_proj] and len(calls) == plain_calls - 1
