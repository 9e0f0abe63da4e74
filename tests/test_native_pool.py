"""The native kernels' output pool (``OutputPool`` in ``kernels/_native/common.h``): outputs of 8 MiB and more
reuse the buffers of freed outputs (no fresh pages to fault in each call), with the same values as fresh memory
(a reused buffer is dirty: the zero-filled outputs must be zeroed again), within its cap
(``MIXER_PLUGINS_NATIVE_POOL_MB``: idle buffers beyond it are freed, 0 turns the pool off)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from mixer_plugins import kernels
from mixer_plugins.kernels import _native
from mixer_plugins.kernels._scan import Direction, ScanInputs
from mixer_plugins.kernels._scan import native as native_scan
from mixer_plugins.kernels.norm import gated_rmsnorm

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native kernels cannot be built here")

MIB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert _native.load(), _native.unavailable_reason()


def _stats():
    cached, reused, allocated, cap = torch.ops.mixer_plugins_native.pool_stats()
    return {"cached": cached, "reused": reused, "allocated": allocated, "cap": cap}


def test_a_freed_large_output_is_reused_and_small_ones_are_not_pooled():
    y = torch.randn(1, 4096, 640)           # 10 MiB: a pooled output
    z = torch.randn(1, 4096, 640)
    w = torch.rand(640) + 0.5
    torch.ops.mixer_plugins_native.pool_release()   # (what earlier tests in this process left idle: not near the cap)
    before = _stats()
    first = gated_rmsnorm(y, z, w, eps=1e-5, backend="torch")
    where, want = first.data_ptr(), first.clone()
    del first                               # its buffer goes back to the pool, not to the allocator
    assert _stats()["cached"] >= before["cached"] + 10 * MIB
    second = gated_rmsnorm(y, z, w, eps=1e-5, backend="torch")
    assert second.data_ptr() == where and _stats()["reused"] == before["reused"] + 1
    torch.testing.assert_close(second, want, rtol=0, atol=0)
    small = _stats()
    gated_rmsnorm(y[:, :64], z[:, :64], w, eps=1e-5, backend="torch")   # 160 KiB: the allocator's
    assert {k: _stats()[k] for k in ("reused", "allocated")} == {k: small[k] for k in ("reused", "allocated")}


def test_reused_dirty_buffers_give_the_same_scan_as_the_pytorch_path(monkeypatch):
    # the scan's outputs and gradients are zero-filled and accumulated into: a reused buffer holds the last call's
    # values, which must not leak into this one's
    gen = torch.Generator().manual_seed(0)
    b, length, heads, p, n = 1, 4096, 8, 64, 16      # x and y: 8 MiB, pooled

    def direction():
        return Direction(dt=torch.rand(b, length, heads, generator=gen) * 0.1, A=-torch.rand(heads, generator=gen),
                         B=torch.randn(b, length, 1, n, generator=gen), C=torch.randn(b, length, 1, n, generator=gen))

    inputs = ScanInputs(x=torch.randn(b, length, heads, p, generator=gen), forward=direction(), backward=direction(),
                        shift=True, chunk_size=64)
    leaves = [inputs.x] + [t for d in (inputs.forward, inputs.backward) for t in (d.dt, d.A, d.B, d.C)]
    cot = torch.randn(b, length, heads, p, generator=gen)

    def run(native):
        monkeypatch.setattr(native_scan, "USE_NATIVE", native)
        x, dt, A, B, C, dt_b, A_b, B_b, C_b = ls = [t.detach().clone().requires_grad_(True) for t in leaves]
        y = kernels.quasiseparable(x, dt, A, B, C, dt_bwd=dt_b, A_bwd=A_b, B_bwd=B_b, C_bwd=C_b, shift=True,
                                   chunk_size=64, backend="torch")
        return [y.detach(), *torch.autograd.grad(y, ls, cot)]

    assert native_scan.applies(inputs)
    want = run(False)
    dirty = [t.clone() for t in run(True)]   # this call's outputs, freed: the pool's buffers hold their values
    before = _stats()
    again = run(True)
    assert _stats()["reused"] > before["reused"]
    for got, first, ref in zip(again, dirty, want):
        torch.testing.assert_close(got, first, rtol=0, atol=0)          # deterministic: same as the first call
        torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)      # and the PyTorch path's (float32)


def _in_subprocess(code: str, pool_mb: str) -> str:
    env = dict(os.environ, MIXER_PLUGINS_NATIVE_POOL_MB=pool_mb)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


_CAP_CODE = """
    import torch
    from mixer_plugins.kernels import _native
    from mixer_plugins.kernels.norm import gated_rmsnorm
    assert _native.load()
    y, z, w = torch.randn(1, 4096, 640), torch.randn(1, 4096, 640), torch.rand(640) + 0.5
    outs = [gated_rmsnorm(y * k, z, w, eps=1e-5, backend="torch") for k in range(3)]   # three live 10 MiB outputs
    del outs
    cached, reused, allocated, cap = torch.ops.mixer_plugins_native.pool_stats()
    torch.ops.mixer_plugins_native.pool_release()
    print(cached, allocated, cap, torch.ops.mixer_plugins_native.pool_stats()[0])
"""


def test_the_pool_keeps_at_most_its_cap_idle_and_can_be_turned_off():
    cached, allocated, cap, after_release = map(int, _in_subprocess(_CAP_CODE, "24").split())
    assert cap == 24 * MIB and allocated == 3
    assert cached == 20 * MIB and after_release == 0   # two 10 MiB buffers fit under 24 MiB, the third was freed
    cached, allocated, cap, _ = map(int, _in_subprocess(_CAP_CODE, "0").split())
    assert (cached, allocated, cap) == (0, 0, 0)         # off: every output from the allocator


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_gets_a_pool_of_its_own():
    # (a lock another thread held at the fork must not deadlock the child; the parent's idle buffers stay its own)
    y, z, w = torch.randn(1, 4096, 640), torch.randn(1, 4096, 640), torch.rand(640) + 0.5
    gated_rmsnorm(y, z, w, eps=1e-5, backend="torch")      # leaves a 10 MiB buffer idle in this process's pool
    assert _stats()["cached"] >= 10 * MIB
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its pool, run a pooled op, exit without pytest's teardown
        try:
            fresh = _stats()
            out = gated_rmsnorm(y, z, w, eps=1e-5, backend="torch")
            del out
            os.write(write, f"{fresh['cached']} {fresh['allocated']} {_stats()['cached']}".encode())
        finally:
            os._exit(0)
    os.close(write)
    reply = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert reply.split() == ["0", "0", str(10 * MIB)], reply
