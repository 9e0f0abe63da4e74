"""Float32 accuracy of the Triton scan kernels at any decay, against the ``reference`` backend in float64.

Both kernel families (the chunked kernels of ``triton_kernels`` and the one-chunk kernels of ``triton_one_chunk``)
run in float32 on inputs whose heads decay at ``A dt`` from -0.1 (barely) to -40 (every pair but the nearest is
below float32's resolution), one head per decay and one group per head, so that every gradient is measured per decay:
the output and the gradient of every input (x, dt, A, B, C, the diagonal, ``dt_bias``, the states), each relative to
its largest entry. The log-decay gradient (dA, and dt through ``A dt``) is where a scan loses accuracy at strong
decay: each pair's term must enter once, with its own decay, not as a total minus a prefix. The reference gets the
same (float32) inputs, so the errors are the kernels' own.

As ``tests/ops/test_scan_triton.py``: on a machine without CUDA this module runs in a fresh interpreter with
``TRITON_INTERPRET=1``, started by ``tests/ops/test_triton_suite_scan_numerics.py``
(``MIXER_PLUGINS_TRITON_FRESH=1`` marks that run); collected in any other process it is skipped.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fast_interpreter, triton_kernels_module  # noqa: F401  (fast_interpreter: an autouse fixture)

from mixer_plugins.kernels import directional_scan, quasiseparable, ssd

#: the kernels, where they run (CPU tensors under the interpreter, CUDA ones otherwise) and the module's marks
qs_triton, DEVICE, pytestmark = triton_kernels_module("mixer_plugins.kernels.scan.triton_kernels")
one_chunk = pytest.importorskip("mixer_plugins.kernels.scan.triton_one_chunk")

#: ``A dt`` of each head: A = -1 and dt = |A dt| * uniform(0.5, 1.5) per token
DECAYS = (-0.1, -1.0, -5.0, -10.0, -25.0, -40.0)
#: the largest error of any gradient, relative to its largest entry (per head); or ``GRAD_FACTOR`` times the float32
#: reference's own error, where that is larger: dA of the head at -40 is a sum of terms of both signs, each about
#: exp(-20) of the other heads', and its true value a hundred times smaller than their sizes, so float32 itself gets
#: it to about 6e-6 (the summation order decides the rest)
GRAD_BOUND, GRAD_FACTOR = 1e-5, 3.0
#: the output's error may be at most this many times the error of the float32 reference (the materialized matrix
#: with its per-pair segment sums, the best float32 can do) plus ``OUT_SLACK``
OUT_FACTOR, OUT_SLACK = 2.0, 1e-7

#: the dimension of each input (and output) that holds the heads (B and C: one group per head)
HEAD_DIM = {"y": 2, "final": 1, "x": 2, "dt": 2, "A": 0, "B": 2, "C": 2, "dt_bwd": 2, "A_bwd": 0, "B_bwd": 2,
            "C_bwd": 2, "diag": 2, "dt_bias": 0, "D": 0, "initial_states": 1}

#: (bidirectional, shifted, dt_bias and softplus): causal (the chunked kernels: ``ssd`` with D and both states),
#: causal shifted, bidirectional ("add"), Hydra
MODES = {"causal": (False, False, False), "causal_shifted": (False, True, False), "bidirectional": (True, False, False),
         "hydra": (True, True, True)}


def one_chunk_max() -> int:
    from mixer_plugins.kernels.scan import ONE_CHUNK_MAX

    return ONE_CHUNK_MAX


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def _leaves(length: int, bidirectional: bool, bias: bool, states: bool, p: int = 4, n: int = 8) -> dict:
    """float64 leaves holding float32 values (the reference and the kernels see the same inputs)."""
    g = torch.Generator().manual_seed(0)
    h = len(DECAYS)
    magnitude = torch.tensor([-v for v in DECAYS], dtype=torch.float64)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def step_sizes():
        return magnitude * (torch.rand(1, length, h, generator=g, dtype=torch.float64) + 0.5)

    t = dict(x=normal(1, length, h, p), dt=step_sizes(), A=-torch.ones(h, dtype=torch.float64),
             B=normal(1, length, h, n), C=normal(1, length, h, n))
    if bidirectional:
        t.update(dt_bwd=step_sizes(), A_bwd=-torch.ones(h, dtype=torch.float64), B_bwd=normal(1, length, h, n),
                 C_bwd=normal(1, length, h, n), diag=normal(1, length, h))
    if states:
        t.update(D=normal(h), initial_states=normal(1, h, p, n))
    if bias:   # raw step sizes: softplus(raw + dt_bias) is the step size above
        t["dt_bias"] = normal(h)
        for name in ("dt", "dt_bwd"):
            t[name] = _inverse_softplus(t[name]) - t["dt_bias"]
    return {k: v.float().double() for k, v in t.items()}


def _scan(kernels: str, mode: str, chunk: int):
    """The call under test: ``fn(leaves, backend)`` -> output(s)."""
    bidirectional, shift, bias = MODES[mode]
    size = chunk if kernels == "chunked" else one_chunk_max()   # one-chunk: a single chunk, in tiles of ``chunk``
    extra = dict(dt_softplus=True) if bias else {}
    if bidirectional:
        return lambda t, backend: quasiseparable(**t, shift=shift, chunk_size=size, backend=backend, **extra)
    if kernels == "chunked" and not shift:
        return lambda t, backend: ssd(**t, chunk_size=size, return_final_states=True, backend=backend, **extra)
    return lambda t, backend: directional_scan(**t, shift=shift, chunk_size=size, backend=backend, **extra)


def _run(fn, leaves: dict, dtype: torch.dtype, backend: str, cotangents):
    """Outputs and the gradients of every leaf (``<name>``: tensor) for the given output cotangents."""
    ts = {k: v.to(device=DEVICE, dtype=dtype).detach().requires_grad_() for k, v in leaves.items()}
    out = fn(ts, backend)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs, list(ts.values()), [c.to(device=DEVICE, dtype=dtype) for c in cotangents])
    return outs, dict(zip(ts, grads))


def _per_head(value: torch.Tensor, truth: torch.Tensor, name: str) -> list[float]:
    """max |value - truth| / max |truth| over each head's entries."""
    v, r = (t.detach().double().cpu().movedim(HEAD_DIM[name], 0) for t in (value, truth))
    return [((v[i] - r[i]).abs().max() / r[i].abs().max()).item() for i in range(len(DECAYS))]


def _table(errors: dict[str, list[float]], decays=DECAYS) -> str:
    head = "A*dt".ljust(16) + "".join(f"{v:>9}" for v in decays)
    return "\n".join([head] + [name.ljust(16) + "".join(f"{e:9.1e}" for e in errs) for name, errs in errors.items()])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("kernels", ["chunked", "one_chunk"])
def test_float32_accuracy_at_any_decay(kernels, chunk, mode, monkeypatch):
    """Output and every gradient against the float64 reference, per decay: gradients within ``GRAD_BOUND`` of
    their largest entry (or a small factor of the float32 reference's own error, where float32 cannot do better),
    dA included (dA alone was 2 to 500 times its own size off at ``A dt = -25``, when the log-decay gradient was
    formed as a total minus a prefix); the output within a small factor of the float32 reference's own error.
    Lengths of 2.25 chunks (or tiles): a partial last one."""
    bidirectional, shift, bias = MODES[mode]
    length = chunk * 9 // 4
    monkeypatch.setattr(one_chunk, "TILE", chunk)
    ran = []
    for module, name in ((qs_triton, "_scan_fwd"), (one_chunk, "_fwd")):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name):
            ran.append(_name)
            return _original(*args)

        monkeypatch.setattr(module, name, spy)
    fn = _scan(kernels, mode, chunk)
    leaves = _leaves(length, bidirectional, bias, states=kernels == "chunked" and mode == "causal")
    g = torch.Generator().manual_seed(1)
    shapes = [(1, length, len(DECAYS), 4)] + ([(1, len(DECAYS), 4, 8)] if "initial_states" in leaves else [])
    cotangents = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]

    truth, truth_grads = _run(fn, leaves, torch.float64, "reference", cotangents)
    floor, floor_grads = _run(fn, leaves, torch.float32, "reference", cotangents)
    ran.clear()
    outs, grads = _run(fn, leaves, torch.float32, "triton", cotangents)
    assert set(ran) == {"_scan_fwd" if kernels == "chunked" else "_fwd"}, ran

    names = ["y", "final"][:len(outs)]
    errors = {name: _per_head(o, t, name) for name, o, t in zip(names, outs, truth)}
    floors = {name: _per_head(o, t, name) for name, o, t in zip(names, floor, truth)}
    errors.update({f"d{name}": _per_head(grads[name], truth_grads[name], name) for name in grads})
    floors.update({f"d{name}": _per_head(floor_grads[name], truth_grads[name], name) for name in grads})
    shown = [name for name in floors if not name.startswith("d") or name.startswith("dA")]
    table = _table({**errors, **{f"{name} (f32 ref)": floors[name] for name in shown}})
    print(f"\n{kernels}, chunk {chunk}, {mode}, length {length}\n{table}")
    for name in names:
        for decay, err, ref in zip(DECAYS, errors[name], floors[name]):
            assert err <= OUT_FACTOR * ref + OUT_SLACK, f"{name} at A*dt={decay}: {err:.2e}\n{table}"
    for name, errs in errors.items():
        if name.startswith("d"):
            for decay, err, ref in zip(DECAYS, errs, floors[name]):
                bound = max(GRAD_BOUND, GRAD_FACTOR * ref)
                assert math.isfinite(err) and err <= bound, f"{name} at A*dt={decay}: {err:.2e}\n{table}"


#: ``A dt`` of each head in the long-chunk output test: where a pair's decay is neither 1 nor negligible
FORWARD_DECAYS = (-0.1, -0.5, -1.0, -2.0, -5.0, -10.0)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("kernels", ["chunked", "one_chunk"])
def test_every_output_entry_keeps_float32_accuracy_in_long_chunks(kernels, shift, monkeypatch):
    """Chunks and tiles of 64 tokens (the largest), so that a chunk's cumulative log decay reaches 64 |A dt|, and
    positive inputs, so that every term of an output entry adds (no cancellation hides a term's error): each entry
    of the bidirectional scan within a small factor of the float32 reference's own error of that entry (the
    reference sums each pair's log decay over its own span). A log decay formed as the difference of two cumulative
    sums of the chunk carries their rounding, about |A dt| * 64 * 2^-24 absolute: errors of 1.4e-6 to 2e-6 at
    ``A dt`` from -1 to -5, three to nine times the float32 reference's."""
    monkeypatch.setattr(one_chunk, "TILE", 64)
    length, h = 144, len(FORWARD_DECAYS)
    g = torch.Generator().manual_seed(0)
    magnitude = torch.tensor([-v for v in FORWARD_DECAYS], dtype=torch.float64)

    def positive(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5

    leaves = dict(x=positive(1, length, h, 2), dt=magnitude * positive(1, length, h),
                  A=-torch.ones(h, dtype=torch.float64), B=positive(1, length, h, 4), C=positive(1, length, h, 4),
                  dt_bwd=magnitude * positive(1, length, h), B_bwd=positive(1, length, h, 4),
                  C_bwd=positive(1, length, h, 4))
    leaves = {k: v.float() for k, v in leaves.items()}
    size = 64 if kernels == "chunked" else one_chunk_max()

    def run(dtype, backend):
        t = {k: v.to(device=DEVICE, dtype=dtype) for k, v in leaves.items()}
        with torch.no_grad():
            return quasiseparable(**t, shift=shift, chunk_size=size, backend=backend).double().cpu()

    truth = run(torch.float64, "reference")
    error = ((run(torch.float32, "triton") - truth).abs() / truth.abs()).amax(dim=(0, 1, 3))
    floor = ((run(torch.float32, "reference") - truth).abs() / truth.abs()).amax(dim=(0, 1, 3))
    table = _table({"y (entrywise)": error.tolist(), "y (f32 ref)": floor.tolist()}, FORWARD_DECAYS)
    print(f"\n{kernels}, chunk 64, shift={shift}, length {length}\n{table}")
    for decay, err, ref in zip(FORWARD_DECAYS, error.tolist(), floor.tolist()):
        assert err <= 1.5 * ref + 2e-7, f"A*dt={decay}: {err:.2e}\n{table}"
