"""What the tests share: independent oracles written from the definitions (not from the library's reference
backend), random inputs, test files run in a fresh interpreter, throwaway installed distributions, small gloo process
groups, and ``torch.compile`` against eager."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


def triton_kernels_module(name: str) -> tuple[Any, str, list[pytest.MarkDecorator]]:
    """The module prelude of a Triton kernel test file: on a machine without CUDA it runs only in the fresh
    interpreter the Triton suite starts (each ``tests/ops/test_triton_suite*.py`` sets ``MIXER_PLUGINS_TRITON_FRESH=1``
    and ``TRITON_INTERPRET=1``) and is skipped in any other process. Returns the kernels module ``name``, the device
    its tensors live on (CPU under the interpreter, else CUDA) and the module's ``pytestmark``."""
    if os.environ.get("MIXER_PLUGINS_TRITON_FRESH") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels' CPU checks run in a fresh interpreter (tests/ops/test_triton_suite*.py)",
                    allow_module_level=True)
    pytest.importorskip("triton")
    module = pytest.importorskip(name)
    device = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
    why = module.available(device)
    return module, device, [pytest.mark.triton,
                            pytest.mark.skipif(why is not None, reason=f"triton kernels cannot run on {device}: {why}")]


# -- what an op allocates ------------------------------------------------------------------------------------

class LargestTensor(TorchDispatchMode):
    """Records ``largest``, the most elements of any tensor an op returned while the mode was active, and ``total``,
    the elements of all of them (views included: an upper bound of what was allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.total += t.numel()
        return out


# -- throwaway installed distributions ---------------------------------------------------------------------

def make_fake_distribution(root: Path, dist_name: str, entry_points: dict[str, str],
                           modules: dict[str, str] | None = None,
                           group: str = "mixer_plugins.mixers") -> Path:
    """Write a throwaway installed distribution (a ``.dist-info`` folder plus modules) under ``root``.

    Put ``root`` on ``sys.path`` and ``importlib.metadata`` sees it exactly like a pip-installed package.
    """
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist_name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1.0\n")
    lines = [f"[{group}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


# -- gloo process groups: one function on every rank ---------------------------------------------------------


#: A rank stuck in a collective (another rank failed) gives up after this long instead of hanging the test.
TIMEOUT_S = 240


def free_port() -> int:
    """A TCP port nobody listens on at the moment, on 127.0.0.1 only."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"       # loopback only
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; their results in rank order.

    ``fn`` must be a module-level function (it is pickled by reference). A failing rank raises here.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        torch_mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# -- torch.compile (inductor) against eager ------------------------------------------------------------------

TOL = dict(rtol=1e-4, atol=1e-5)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def inductor_settings() -> Iterator[None]:
    """One compile per graph: no recompiles for dynamic shapes (every call has the same shapes); compile in this
    process (starting a pool of workers costs more than it saves on a small runner)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=8), \
            inductor_config.patch(compile_threads=1):
        yield
    torch._dynamo.reset()


@contextlib.contextmanager
def dropout_off(module: nn.Module) -> Iterator[None]:
    """Dropout probabilities set to 0 for a while (``nn.Dropout`` modules and float ``dropout`` attributes): the
    compiled graph draws its random numbers in another order than eager, so training is compared without them."""
    saved = []
    for sub in module.modules():
        for attr in ("p", "dropout", "attn_dropout"):
            value = getattr(sub, attr, None)
            if isinstance(value, float) and value > 0 and (attr != "p" or isinstance(sub, nn.Dropout)):
                saved.append((sub, attr, value))
                setattr(sub, attr, 0.0)
    try:
        yield
    finally:
        for sub, attr, value in saved:
            setattr(sub, attr, value)


def assert_train_and_eval_match(module: nn.Module, inputs: tuple, loss_fn, *, fullgraph: bool = True) -> None:
    """A training step (loss, every parameter gradient) and an eval forward of ``torch.compile(module)`` equal
    eager's. Training is compared with dropout off (see :func:`dropout_off`); eval runs with the module's dropout
    probabilities, which eval must ignore."""
    compiled = torch.compile(module, backend="inductor", fullgraph=fullgraph)
    module.train()
    results = []
    with dropout_off(module):
        for run in (module, compiled):
            loss = loss_fn(run(*inputs))
            loss.backward()
            results.append((loss.detach(), _grads(module)))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, **TOL)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-3, atol=1e-4, msg=name)
    module.eval()
    with torch.no_grad():
        torch.manual_seed(7)
        expected = module(*inputs)
        torch.manual_seed(8)  # another seed: eval must not depend on the random state (dropout off)
        torch.testing.assert_close(compiled(*inputs), expected, **TOL)


# -- the Triton interpreter -----------------------------------------------------------------------------------

@contextlib.contextmanager
def interpreter_shims() -> Iterator[None]:
    """Test-speed shims for the triton 3.5 interpreter (semantics unchanged): the :func:`fast_interpreter` fixture of
    the Triton test modules, and the GPU script's ``--dry`` tables.

    * it re-patches ``triton.language`` on every device-function call (``tl.sum``, ``tl.cumsum``, ...); the
      patch is permanent and idempotent, so it is done once per kernel module;
    * it checks every int32 index operation for overflow; the test shapes are far from int32 limits.
    Together they halve the run time. Skipped silently if the interpreter internals differ.
    """
    try:
        from triton.runtime import interpreter as interp
        original_patch = interp._patch_lang
        original_options = interp.interpreter_builder.options
        fast_options = dataclasses.replace(original_options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        yield
        return
    done: set[int] = set()

    def patch_once(fn):
        if id(fn.__globals__) not in done:
            original_patch(fn)
            done.add(id(fn.__globals__))

    interp._patch_lang = patch_once
    interp.interpreter_builder.options = fast_options
    try:
        yield
    finally:
        interp._patch_lang = original_patch
        interp.interpreter_builder.options = original_options


@pytest.fixture(autouse=True, scope="module")
def fast_interpreter():
    """The speed shims of :func:`interpreter_shims` around every test module that imports this fixture."""
    with interpreter_shims():
        yield


def triton_file_runner(test_file: str) -> Callable[[], None]:
    """The test of a ``tests/ops/test_triton_suite*.py`` module: runs ``test_file`` (under ``tests/``), a Triton kernel
    test file, in a fresh interpreter under ``TRITON_INTERPRET=1`` on machines without CUDA. The kernels are defined in
    interpreter mode when their module is imported, and the interpreter's state does not reliably survive what other
    tests do in the same process; a fresh process makes the check exact and repeatable (the child's failures are shown).
    One file per module, so that the test workers (``--dist loadfile``) share them."""

    @pytest.mark.triton
    @pytest.mark.slow  # a Triton-interpreter suite in a fresh process
    @pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the Triton tests run in this process")
    def run() -> None:
        pytest.importorskip("triton")
        assert_passes_fresh(test_file, {"TRITON_INTERPRET": "1", "MIXER_PLUGINS_TRITON_FRESH": "1"}, timeout=1200)

    return run
