"""The scan's numbers at the extremes users reach: every backend that runs here, float32 and float64, decays from
mild (A dt = -0.01 per token) to strong (-40), chunk sizes 16 to 256, causal and bidirectional, shifted or not,
with and without initial states: the output and every gradient against the float64 ``reference`` backend.

Relative error = max |error| / max |true value| per tensor. The bounds:

* float64: 1e-12 for the output and every gradient;
* float32: the output within 5e-7 (1e-6 for the ``reference`` backend, whose one L x L product sums every token),
  every gradient, the decay rates' included, within 1e-5: the accuracy of per-pair segment sums, the released code's
  order of operations. A chunked scan that forms its decays as differences of chunk-wide cumulative sums misses that
  by orders of magnitude at strong decay (its decay gradient is wrong outright).

Where a gradient is ill-conditioned on these inputs (a decay rate's gradient is a sum over tokens, and a
bidirectional scan with one ``A`` adds both directions' sums, which can cancel), the float32 ``reference`` loses
digits too: a fast path is then held to four times the float32 reference's own error on the same inputs. Run this
file as a script to print the table of errors.
"""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch
from torch import Tensor

import mixer_plugins as mp
from mixer_plugins import kernels
from mixer_plugins.kernels._native_check import native_unavailable

F64 = torch.float64
DECAYS = (-0.01, -0.1, -1.0, -2.0, -5.0, -10.0, -25.0, -40.0)
CHUNKS = (16, 64, 256)
LENGTH = 300                        # two chunks of 256, nineteen of 16
KINDS = ("causal", "causal_states", "bidirectional", "bidirectional_shared_A", "bidirectional_unshifted")
BOUND_F64 = 1e-12
BOUND_F32_OUT = 5e-7
BOUND_F32_GRAD = 1e-5


def _backends() -> list[str]:
    out = ["reference", "torch"]
    if native_unavailable(torch.device("cpu")) is None:
        out.append("native")
    return out


def _inputs(kind: str, decay: float, dtype: torch.dtype) -> dict[str, Tensor]:
    """Leaves of one scan (float64, then cast): dt scaled so that A dt is about ``decay`` per token."""
    g = torch.Generator().manual_seed(round(-1000 * decay) + len(kind))
    b, length, h, p, n = 1, LENGTH, 2, 8, 8

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=F64)

    A = torch.tensor([-1.0, -0.6], dtype=F64)
    dt = (torch.rand(b, length, h, generator=g, dtype=F64) + 0.5) * abs(decay) / A.abs()
    t = {"x": randn(b, length, h, p), "dt": dt, "A": A, "B": randn(b, length, 1, n), "C": randn(b, length, 1, n)}
    if kind == "causal_states":
        t["init"] = randn(b, h, p, n)
    if kind.startswith("bidirectional"):
        t.update(B_bwd=randn(b, length, 1, n), C_bwd=randn(b, length, 1, n), diag=randn(b, length, h))
        if kind != "bidirectional_shared_A":
            t["A_bwd"] = torch.tensor([-0.8, -1.3], dtype=F64)
    return {k: v.to(dtype).requires_grad_() for k, v in t.items()}


def _run(kind: str, t: dict[str, Tensor], chunk: int, backend: str) -> list[Tensor]:
    """The scan's outputs (y, and the final state with initial states) for ``t``."""
    if kind.startswith("causal"):
        if "init" in t:
            return list(kernels.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, initial_states=t["init"],
                                    return_final_states=True, backend=backend))
        return [kernels.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, backend=backend)]
    return [kernels.quasiseparable(t["x"], t["dt"], t["A"], t["B"], t["C"], B_bwd=t["B_bwd"], C_bwd=t["C_bwd"],
                                   A_bwd=t.get("A_bwd"), diag=t["diag"], shift=kind != "bidirectional_unshifted",
                                   chunk_size=chunk, backend=backend)]


def _values_and_grads(kind: str, decay: float, chunk: int, backend: str, dtype: torch.dtype) -> dict[str, Tensor]:
    t = _inputs(kind, decay, dtype)
    outs = _run(kind, t, chunk, backend)
    g = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum() for o in outs)
    loss.backward()
    result = {f"out{i}": o.detach().double() for i, o in enumerate(outs)}
    result.update({f"d{k}": v.grad.double() for k, v in t.items()})
    return result


@functools.cache
def _truth(kind: str, decay: float) -> dict[str, Tensor]:
    return _values_and_grads(kind, decay, LENGTH, "reference", F64)


def _bound(name: str, dtype: torch.dtype, backend: str, kind: str, decay: float) -> float:
    if dtype == F64:
        return BOUND_F64
    if name.startswith("out"):
        return BOUND_F32_OUT if backend != "reference" else 2 * BOUND_F32_OUT
    if backend == "reference":
        return BOUND_F32_GRAD
    return max(BOUND_F32_GRAD, 4 * _errors(kind, decay, LENGTH, "reference", torch.float32)[name])


@functools.cache
def _errors(kind: str, decay: float, chunk: int, backend: str, dtype: torch.dtype) -> dict[str, float]:
    truth = _truth(kind, decay)
    got = _values_and_grads(kind, decay, chunk, backend, dtype)
    return {k: ((got[k] - v).abs().max() / v.abs().max()).item() for k, v in truth.items()}


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", _backends())
def test_every_gradient_matches_the_float64_reference_at_every_decay(backend, kind, dtype):
    bad = []
    for decay in DECAYS:
        for chunk in CHUNKS if backend != "reference" else (LENGTH,):
            for name, err in _errors(kind, decay, chunk, backend, dtype).items():
                bound = _bound(name, dtype, backend, kind, decay)
                if not err <= bound:   # (a NaN fails too)
                    bad.append(f"A dt = {decay}, chunk {chunk}: {name} relative error {err:.2e} > {bound:.1e}")
    assert not bad, f"{backend} {kind} {dtype}:\n" + "\n".join(bad)


def _bf16_errors(kind: str, decay: float, backend: str) -> dict[str, float]:
    """Relative errors of a scan under bf16 autocast on what a block hands the op there (x, B, C, the diagonal and
    the initial state in bfloat16; the step sizes and decay rates in float32), against the float64 reference on the
    same (rounded) values; the output comes back in bfloat16, and so does the gradient that reaches it."""
    t = _inputs(kind, decay, F64)
    half = {k: (v.detach().float() if k in ("dt", "A", "A_bwd") else v.detach().to(torch.bfloat16)).requires_grad_()
            for k, v in t.items()}
    exact = {k: v.detach().double().requires_grad_() for k, v in half.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = _run(kind, half, 64, backend)
    assert outs[0].dtype == torch.bfloat16       # (a final state keeps float32)
    want = _run(kind, exact, 64, "reference")
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(o.shape, generator=g, dtype=F64) for o in outs]
    sum((o.float() * w.float()).sum() for o, w in zip(outs, weights)).backward()
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    pairs = [(f"out{i}", o, w) for i, (o, w) in enumerate(zip(outs, want))]
    pairs += [(f"d{k}", half[k].grad, exact[k].grad) for k in half]
    return {name: ((got.double() - ref.detach()).abs().max() / ref.detach().abs().max()).item()
            for name, got, ref in pairs}


@pytest.mark.parametrize("kind", ["causal_states", "bidirectional"])
def test_bf16_inputs_under_autocast_lose_no_more_than_bf16_rounding(kind):
    # bfloat16 rounds at 4e-3; a gradient that sums many rounded terms (a decay rate's) loses more, and the
    # materialized reference under the same autocast loses it too: the chunked scan may add nothing to that
    for decay in DECAYS:
        ref = _bf16_errors(kind, decay, "reference")
        for name, err in _bf16_errors(kind, decay, "torch").items():
            bound = max(1e-2, 2 * ref[name])
            assert err <= bound, f"A dt = {decay}: {name} relative error {err:.2e} > {bound:.1e}"


# -- the mixers ------------------------------------------------------------------------------------------------

def _strong_decay_hydra(dtype: torch.dtype) -> torch.nn.Module:
    """A small Hydra (quasiseparable) mixer with A = -30 and step sizes about 1 (A dt about -30 per token)."""
    torch.manual_seed(0)
    mixer = mp.create_mixer("quasiseparable", dim=32, d_state=8, head_dim=8, chunk_size=64)
    with torch.no_grad():
        mixer.ssm.A_log.fill_(math.log(30.0))
        mixer.ssm.dt_bias.fill_(math.log(math.e - 1))             # softplus(raw + bias) = 1 where raw = 0
        heads = mixer.ssm.dt_bias.shape[0]
        mixer.in_proj.weight[-2 * heads:].mul_(0.01)              # raw step sizes near 0: dt about 1
    return mixer.to(dtype)


@pytest.mark.parametrize("length", [65, 200, 513])
def test_hydra_decay_gradient_at_strong_decay_matches_float64(length):
    # Adam normalises each head's A_log update: a wrong small gradient would be a full-size random step
    grads = {}
    for dtype in (torch.float32, F64):
        mixer = _strong_decay_hydra(dtype)
        x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(length), dtype=F64).to(dtype)
        dy = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)
        (mixer(x) * dy).sum().backward()
        grads[dtype] = mixer.ssm.A_log.grad.double()
    err = (grads[torch.float32] - grads[F64]).abs().max() / grads[F64].abs().max()
    assert err <= 1e-4, f"A_log gradient off by {err:.2e} of its size at L = {length}"


@pytest.mark.parametrize("name", ["quasiseparable", "semiseparable", "mamba2_compat"])
def test_bf16_autocast_keeps_step_sizes_decay_rates_and_decays_in_float32(name, monkeypatch):
    # the projections are bfloat16 under autocast; the blocks hand the scan op the raw step sizes with dt_bias, and
    # the op forms dt = softplus(raw + dt_bias) and every decay in float32 from A = -exp(A_log) in float32, as the
    # float32 path forms them (mamba-ssm and the released Hydra keep both in float32)
    from mixer_plugins.compat import Mamba2
    scan_module = importlib.import_module("mixer_plugins.kernels.scan")

    torch.manual_seed(0)
    if name == "mamba2_compat":
        mixer = Mamba2(32, d_state=8, headdim=8, chunk_size=16)
        bias, A_log, heads = mixer.dt_bias, mixer.A_log, mixer.nheads
    else:
        mixer = mp.create_mixer(name, dim=32, d_state=8, head_dim=8)
        bias, A_log, heads = mixer.ssm.dt_bias, mixer.ssm.A_log, mixer.ssm.dt_bias.shape[0]
    projections: list[Tensor] = []
    mixer.in_proj.register_forward_hook(lambda module, args, out: projections.append(out))
    seen = []

    def recording(form):   # the directions the op's PyTorch and native forms receive
        def call(x, forward, backward=None, **kw):
            seen.append([d for d in (forward, backward) if d is not None])
            return form(x, forward, backward, **kw)
        return call

    for form in ("scan_chunked", "scan_native", "reference_scan"):
        monkeypatch.setattr(scan_module, form, recording(getattr(scan_module, form)))
    x = torch.randn(2, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixer(x)
        if not projections:   # the blocks call in_proj's weight themselves (one product, split into views)
            projections.append(mixer._in_proj_pieces(x)[1][-1])
    (raw_all,) = projections
    assert raw_all.dtype == torch.bfloat16
    raw = raw_all[..., -(2 if name == "quasiseparable" else 1) * heads:].float()
    want_A = -torch.exp(A_log.float())
    (directions,) = seen
    for k, direction in enumerate(directions):
        assert direction.dt.dtype == torch.float32 and direction.A.dtype == torch.float32
        want_dt = torch.nn.functional.softplus(raw[..., k * heads:(k + 1) * heads] + bias.float())
        torch.testing.assert_close(direction.dt, want_dt, rtol=1e-6, atol=0)
        torch.testing.assert_close(direction.A, want_A, rtol=1e-6, atol=0)
        # the decay factors over the whole row, as the float32 path forms them
        torch.testing.assert_close(torch.exp(direction.A * direction.dt.cumsum(1)),
                                   torch.exp(want_A * want_dt.cumsum(1)), rtol=1e-6, atol=1e-30)


def main() -> None:
    """Print the table: worst relative error of the output and of the gradients per backend, dtype, kind, decay."""
    for backend in _backends():
        for dtype in (torch.float32, F64):
            for kind in KINDS:
                for decay in DECAYS:
                    cells = []
                    for chunk in CHUNKS if backend != "reference" else (LENGTH,):
                        err = _errors(kind, decay, chunk, backend, dtype)
                        out = max(v for k, v in err.items() if k.startswith("out"))
                        grad_name = max((k for k in err if not k.startswith("out")), key=err.__getitem__)
                        cells.append(f"Q={chunk}: out {out:.1e} {grad_name} {err[grad_name]:.1e} dA {err['dA']:.1e}")
                    print(f"{backend:9s} {str(dtype)[6:]:7s} {kind:24s} {decay:6}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
