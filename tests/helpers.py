"""What the tests share: independent oracles written from the definitions (not from the library's reference
backend), random inputs, and a way to run a test file in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


# -- the scans ---------------------------------------------------------------------------------------------

def recurrence_ssd(x, dt, A, B, C, D=None, z=None, initial_state=None, seq_idx=None):
    """The SSM recurrence ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t``, token by token (float64),
    a new segment (zero state) wherever ``seq_idx`` changes. Returns y and the final state."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    group = torch.arange(h) // (h // g)
    y = torch.zeros_like(x)
    final = torch.zeros(b, h, p, n, dtype=x.dtype)
    for bi in range(b):
        state = initial_state[bi].clone() if initial_state is not None else torch.zeros(h, p, n, dtype=x.dtype)
        for t in range(l):
            if seq_idx is not None and t > 0 and seq_idx[bi, t] != seq_idx[bi, t - 1]:
                state = torch.zeros(h, p, n, dtype=x.dtype)
            decay = torch.exp(A * dt[bi, t])                                              # (h,)
            inflow = dt[bi, t][:, None, None] * x[bi, t][:, :, None] * B[bi, t, group][:, None, :]
            state = decay[:, None, None] * state + inflow
            y[bi, t] = torch.einsum("hpn,hn->hp", state, C[bi, t, group])
        final[bi] = state
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, final


def flip_identity_qs(x, dt_f, dt_b, A, B_f, C_f, B_b, C_b, diag, shift, A_b=None):
    """Hydra's ``QS = shift(SS_f(x)) + flip(shift(SS_b(flip x))) + diag x``, with the recurrence as SS."""
    y_f, _ = recurrence_ssd(x, dt_f, A, B_f, C_f)
    y_b, _ = recurrence_ssd(x.flip(1), dt_b.flip(1), A if A_b is None else A_b, B_b.flip(1), C_b.flip(1))
    if shift:
        y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))   # shift down: row i reads SS(x)_{i-1}
        y_b = F.pad(y_b[:, :-1], (0, 0, 0, 0, 1, 0))   # in flipped time, likewise
    y = y_f + y_b.flip(1)
    if diag is not None:
        y = y + diag[..., None] * x
    return y


def random_inputs(b=2, l=13, h=4, p=3, g=2, n=5, dtype=F64, seed=0, requires_grad=False):
    """x (b, l, h, p), dt (b, l, h) in [0, 0.5), A (h,) in (-1.2, -0.2], B and C (b, l, g, n)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)

    x = r(b, l, h, p)
    dt = (0.5 * torch.rand(b, l, h, generator=gen, dtype=dtype)).requires_grad_(requires_grad)
    A = (-torch.rand(h, generator=gen, dtype=dtype) - 0.2).requires_grad_(requires_grad)
    return x, dt, A, r(b, l, g, n), r(b, l, g, n)


def segments(bounds, batch=2):
    """Integer segment ids (batch, bounds[-1]): segment s covers ``[bounds[s], bounds[s + 1])``."""
    seq_idx = torch.zeros(batch, bounds[-1], dtype=torch.long)
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        seq_idx[:, lo:hi] = s
    return seq_idx


# -- processes -----------------------------------------------------------------------------------------------

def run_test_file_fresh(test_file: str, env: dict[str, str], timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``tests/<test_file>`` with pytest in a fresh interpreter (no xdist, no cache), with ``env`` added to the
    environment and the checkout first on ``PYTHONPATH``; returns the result and the tail of its output."""
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    full.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         str(ROOT / "tests" / test_file)],
        cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    return result, result.stdout[-6000:] + result.stderr[-3000:]


def assert_passes_fresh(test_file: str, env: dict[str, str], timeout: int, *, allow_skips: bool = True) -> None:
    """Run ``tests/<test_file>`` as :func:`run_test_file_fresh` does and assert that it passed: exit code 0, some
    tests passed, none failed (and, with ``allow_skips=False``, none skipped)."""
    result, tail = run_test_file_fresh(test_file, env, timeout)
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
    if not allow_skips:
        assert "skipped" not in result.stdout, tail
