"""Throughput tables of the GPU check (run by ``benchmarks/gpu/run.sh``; ``--dry`` runs tiny shapes on the CPU).

Tables, for d_model 768, head dim 64, state 64, bf16, 65,536 tokens per batch, forward and forward+backward (gradients
taken with ``torch.autograd.grad``, so nothing accumulates between timed calls), with peak memory:

* ``vit``: a timm ViT-B/16 training step (bf16 autocast, batch 64, AdamW, gradients set to None each step) with
  attention and with ``mixer='quasi'`` (eager, and under ``torch.compile`` last, as the budget allows);
* ``launches``: the CUDA kernels one mixer launches forward and backward at ViT-B's sizes (Hydra against attention;
  ``benchmarks/gpu/launches.py``);
* ``parts``: where a Hydra mixer's forward+backward time goes at ViT-B's sizes (scan, short conv, norm, projections,
  the rest as glue), against attention's (projections, SDPA);
* ``scan``: our fused quasiseparable (``backend="triton"``); the released Hydra's computation (mamba-ssm's causal
  kernel in one call on the batch doubled with its time-reversed copy, then the shifts and the diagonal) and causal
  Mamba-2 SSD (mamba-ssm), both at chunk 64 and 256; our chunked PyTorch quasiseparable (``backend="torch"``); SDPA
  attention (flash) at the same width; L = 4k and 16k first (the targets), then 1k and 64k;
* ``attention``, ``window`` (not measured by default; ``benchmarks/gpu/mlr_rows.py`` measures MLR and sliding-window
  attention): ``mlr_attention`` and ``sliding_window_attention`` against ``attention`` (SDPA).

mamba-ssm is loaded through ``tests/mamba_files.py`` (a wheel without its CUDA extensions). A candidate that cannot run
here (no mamba-ssm, out of memory) is reported with its reason, never silently dropped. Results go to
``OUT/throughput.json`` and ``OUT/throughput.md``, rewritten after every row, so a run stopped from outside keeps what
it measured. ``--budget-s``: once that many seconds have passed, the candidates left are reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setup:
    """Shapes and timing of one run."""

    device: str
    dtype: torch.dtype
    d_model: int = 768
    head_dim: int = 64
    state: int = 64
    expand: int = 2
    tokens: int = 65_536
    lengths: tuple[int, ...] = (4096, 16384, 1024, 65536)
    chunks: tuple[int, ...] = (64, 256)
    warmup: int = 2
    iters: int = 5
    vit_batch: int = 64
    vit_kwargs: dict = field(default_factory=dict)
    vit_length: int = 197

    @property
    def heads(self) -> int:
        return self.expand * self.d_model // self.head_dim


GPU = Setup(device="cuda", dtype=torch.bfloat16)
DRY = Setup(device="cpu", dtype=torch.float32, d_model=32, head_dim=8, state=4, tokens=64, lengths=(16, 32),
            warmup=0, iters=1, vit_batch=2, vit_length=5,
            vit_kwargs=dict(img_size=32, patch_size=16, embed_dim=32, depth=1, num_heads=2))


@dataclass
class Row:
    table: str
    candidate: str
    length: int
    batch: int
    mode: str
    ms: float | None = None
    peak_mib: float | None = None
    note: str = ""
    flop_ratio: float | None = None  # attention table: the candidate's FLOPs / attention's at the same shape


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], setup: Setup) -> tuple[float, float | None]:
    """Median milliseconds of ``fn`` and its peak memory (MiB, CUDA only)."""
    for _ in range(setup.warmup):
        fn()
    _sync(setup.device)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(setup.iters):
        t0 = time.perf_counter()
        fn()
        _sync(setup.device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if setup.device == "cuda" else None
    times.sort()
    return times[len(times) // 2], peak


def _scan_inputs(setup: Setup, batch: int, length: int, requires_grad: bool) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    h, p, n = setup.heads, setup.head_dim, setup.state

    def rand(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(setup.device, setup.dtype)
        return t.requires_grad_(requires_grad)

    return dict(
        x=rand(batch, length, h, p), dt=rand(batch, length, h, scale=0.5), B=rand(batch, length, 1, n),
        C=rand(batch, length, 1, n),
        A=(-torch.rand(h, generator=g) - 0.5).to(setup.device, torch.float32).requires_grad_(requires_grad),
    )


def _leaves(inputs: dict) -> list[torch.Tensor]:
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(step: Callable[[], torch.Tensor], backward: bool, leaves: list[torch.Tensor] | None = None
         ) -> Callable[[], None]:
    """``step`` timed as the forward, or as the forward and the gradients of ``leaves`` (``torch.autograd.grad``:
    nothing accumulates between calls); without ``leaves``, ``backward()`` after setting the grads to None."""
    def fn():
        out = step()
        if not backward:
            return
        if leaves:
            torch.autograd.grad(out.float().sum(), leaves)
            return
        out.float().sum().backward()
    return fn


def _mamba():
    """mamba-ssm's ``mamba_chunk_scan_combined``, imported through ``tests/mamba_files.py`` (a wheel built without
    its CUDA extensions cannot be imported the ordinary way); ImportError says why not."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import mamba_files

    module = mamba_files.install()
    if module is None:
        raise ImportError("mamba-ssm is not installed")
    return module.mamba_chunk_scan_combined


def released_hydra(inputs: dict, chunk: int) -> torch.Tensor:
    """The released Hydra's scan: one call of mamba-ssm's causal kernel on the batch doubled with its time-reversed
    copy (the backward direction's generators), then each half shifted one step, the backward half flipped back, and
    the diagonal added (here the forward generators serve both directions, as in the timed ``quasiseparable``)."""
    scan = _mamba()
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    doubled = [torch.cat([t, t.flip(1)], dim=0) for t in (x, dt, B, C)]
    y = scan(doubled[0], doubled[1], A, doubled[2], doubled[3], chunk, dt_softplus=True)
    y_f, y_b = y.chunk(2, dim=0)
    y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))
    y_b = F.pad(y_b.flip(1)[:, 1:], (0, 0, 0, 0, 0, 1))
    return y_f + y_b + x * inputs["diag"][..., None]


def scan_rows(setup: Setup) -> list[Row]:
    from mixer_plugins import kernels

    rows = []
    for length in setup.lengths:
        batch = max(1, setup.tokens // length)
        for mode in ("forward", "forward_backward"):
            backward = mode == "forward_backward"
            inputs = _scan_inputs(setup, batch, length, backward)
            inputs["diag"] = torch.randn(batch, length, setup.heads, device=setup.device).to(setup.dtype)
            leaves = _leaves(inputs)

            def qs(backend, inputs=inputs):
                return lambda: kernels.quasiseparable(
                    inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], diag=inputs["diag"], shift=True,
                    chunk_size=64, dt_softplus=True, backend=backend)

            def ssd(chunk, inputs=inputs):
                return lambda: _mamba()(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk,
                                        dt_softplus=True)

            heads_attn = setup.d_model // setup.head_dim
            q = torch.randn(batch, heads_attn, length, setup.head_dim, device=setup.device, dtype=setup.dtype,
                            requires_grad=backward)

            candidates = {"QS fused (ours, triton)": (qs("triton"), leaves)}
            for chunk in setup.chunks:
                candidates[f"released Hydra (mamba-ssm, one call, doubled batch) chunk {chunk}"] = (
                    lambda chunk=chunk, inputs=inputs: released_hydra(inputs, chunk), leaves)
                candidates[f"causal SSD (mamba-ssm) chunk {chunk}"] = (ssd(chunk), leaves)
            candidates["QS chunked (ours, torch)"] = (qs("torch"), leaves)
            candidates["SDPA attention"] = (lambda q=q: F.scaled_dot_product_attention(q, q, q),
                                            [q] if backward else [])
            for name, (step, grads_of) in candidates.items():
                rows.append(_measure("scan", name, length, batch, mode, _run(step, backward, grads_of), setup))
    return rows


_DEADLINE: list[float] = []  # time.monotonic() after which nothing more is measured (set by main)
OVER_BUDGET = "not run: the time budget (--budget-s) was spent"
#: called with each row as soon as it is measured (main writes the tables then)
_ON_ROW: list[Callable[[Row], None]] = []


def _over_budget() -> bool:
    return bool(_DEADLINE) and time.monotonic() > _DEADLINE[0]


def _emit(row: Row) -> Row:
    for hook in _ON_ROW:
        hook(row)
    return row


def _measure(table: str, name: str, length: int, batch: int, mode: str, fn: Callable[[], None], setup: Setup) -> Row:
    row = Row(table, name, length, batch, mode)
    if _over_budget():
        row.note = OVER_BUDGET
        return _emit(row)
    try:
        row.ms, row.peak_mib = timed(fn, setup)
    except Exception as err:  # report, never drop
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return _emit(row)


def _mixer_row(label: str, name: str, length: int, batch: int, mode: str, setup: Setup, **options) -> Row:
    """One row of the attention table: mixer ``name`` (with ``options``) timed on (batch, length, d_model) inputs,
    its FLOPs over attention's in the note and in ``flop_ratio``; an error becomes the row's note."""
    import mixer_plugins as mp

    heads = setup.d_model // setup.head_dim
    backward = mode == "forward_backward"
    try:
        mixer = mp.create_mixer(name, setup.d_model, num_heads=heads, **options).to(setup.device, setup.dtype)
        x = torch.randn(batch, length, setup.d_model, device=setup.device, dtype=setup.dtype, requires_grad=backward)
        row = _measure("attention", label, length, batch, mode, _run(lambda m=mixer, x=x: m(x), backward), setup)
        ratio = mixer.flops(batch, length) / mp.create_mixer("attention", setup.d_model,
                                                             num_heads=heads).flops(batch, length)
        row.note = (row.note + f" FLOPs/attention={ratio:.2f}").strip()
        row.flop_ratio = ratio
    except Exception as err:
        row = _emit(Row("attention", label, length, batch, mode, note=f"{type(err).__name__}: {err}"[:200]))
    return row


def attention_rows(setup: Setup) -> list[Row]:
    rows = []
    for length in [n for n in setup.lengths if n <= 16384]:
        batch = max(1, setup.tokens // length)
        for mode in ("forward", "forward_backward"):
            for name in ("mlr_attention", "attention"):
                rows.append(_mixer_row(name, name, length, batch, mode, setup))
    return rows


def window_rows(setup: Setup) -> list[Row]:
    """``sliding_window_attention`` (window 512; on CUDA the Triton ``local_attention`` kernel) in the attention
    table at L 4k and 16k, beside ``attention``'s rows from :func:`attention_rows` (its FLOP ratio in the note)."""
    rows = []
    window = 512 if setup.device == "cuda" else 4
    lengths = [n for n in setup.lengths if n in (4096, 16384)] or list(setup.lengths)
    for length in lengths:
        batch = max(1, setup.tokens // length)
        for mode in ("forward", "forward_backward"):
            rows.append(_mixer_row(f"sliding_window_attention w={window}", "sliding_window_attention", length, batch,
                                   mode, setup, window=window))
    return rows


def _vit(setup: Setup, mixer: str | None):
    import timm

    import mixer_plugins  # noqa: F401  (registers our timm names)

    kwargs = setup.vit_kwargs or {}
    extra = {"mixer": mixer} if mixer else {}
    return timm.create_model("vit_base_patch16_224" if not mixer else "vit_base", **extra, **kwargs).to(setup.device)


def vit_rows(setup: Setup, compiled: bool = True) -> list[Row]:
    """A timm ViT-B/16 training step with attention and with ``mixer='quasi'`` (eager), then the quasi model under
    ``torch.compile`` (inductor; compiles first, within the budget)."""
    from mixer_plugins import kernels

    rows = []
    kwargs = setup.vit_kwargs or {}
    size = kwargs.get("img_size", 224)
    length = (size // kwargs.get("patch_size", 16)) ** 2 + 1
    runs = [("ViT-B/16 attention", None, False), ("ViT-B/16 quasi", "quasi", False)]
    if compiled:
        runs.append(("ViT-B/16 quasi (torch.compile)", "quasi", True))
    for label, mixer, compile_it in runs:
        try:
            if _over_budget():
                rows.append(_emit(Row("vit", label, length, setup.vit_batch, "train_step", note=OVER_BUDGET)))
                continue
            model = _vit(setup, mixer)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            # inductor on CUDA; in the dry run (CPU) aot_eager traces the same graphs without C++ code generation
            forward = torch.compile(model, backend="inductor" if setup.device == "cuda" else "aot_eager") \
                if compile_it else model
            images = torch.randn(setup.vit_batch, 3, size, size, device=setup.device)
            labels = torch.randint(0, model.num_classes, (setup.vit_batch,), device=setup.device)
            autocast = torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.device == "cuda")

            def step(forward=forward, opt=opt, images=images, labels=labels, autocast=autocast):
                opt.zero_grad(set_to_none=True)
                with autocast:
                    loss = F.cross_entropy(forward(images), labels)
                loss.backward()
                opt.step()

            # on CUDA the dispatcher picks the Triton kernels itself; the dry run asks for them (the interpreter)
            ctx = kernels.use_backend("triton") if setup.device == "cpu" and mixer else contextlib.nullcontext()
            with ctx:
                row = _measure("vit", label, length, setup.vit_batch, "train_step", step, setup)
            if row.ms:
                row.note = (row.note + f" {setup.vit_batch / (row.ms / 1e3):.1f} images/s").strip()
        except Exception as err:
            row = _emit(Row("vit", label, length, setup.vit_batch, "train_step",
                            note=f"{type(err).__name__}: {err}"[:200]))
        rows.append(row)
    return rows


def _launches():
    """``benchmarks/gpu/launches.py`` (the launch counter), loaded from its file."""
    if "gpu_launches" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_launches", Path(__file__).with_name("launches.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_launches"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_launches"]


def _mixer_at_vit(setup: Setup, name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    import mixer_plugins as mp

    heads = setup.d_model // setup.head_dim
    options = {"num_heads": heads} if name == "attention" else {}
    if name == "quasi" and setup.device == "cpu":
        options = dict(head_dim=setup.head_dim, d_state=setup.state)
    mixer = mp.create_mixer(name, setup.d_model, **options).to(setup.device)
    x = torch.randn(setup.vit_batch, setup.vit_length, setup.d_model, device=setup.device, requires_grad=True)
    return mixer, x


def launch_rows(setup: Setup) -> list[Row]:
    """Kernel launches of one mixer forward and backward at ViT-B's sizes (bf16 autocast on CUDA; the ``ms`` column
    holds the count): Hydra (``quasi``) against attention. On CUDA from the profiler, in ``--dry`` from the trace."""
    from mixer_plugins import kernels

    launches = _launches()
    rows = []
    for name in ("quasi", "attention"):
        row = Row("launches", name, setup.vit_length, setup.vit_batch, "forward_backward")
        try:
            mixer, x = _mixer_at_vit(setup, name)
            step = launches.block_step(mixer, x, torch.bfloat16 if setup.device == "cuda" else None)
            ctx = kernels.use_backend("triton") if setup.device == "cpu" else contextlib.nullcontext()
            with ctx:
                step()   # compile first
                counts = launches.count_launches(step, profiler=setup.device == "cuda")
            row.ms = float(counts.total)
            top = sorted(counts.by_name.items(), key=lambda kv: -kv[1])[:6]
            row.note = f"launches (not ms); syncs {counts.syncs}; " + ", ".join(f"{k[:40]} {v}" for k, v in top)
        except Exception as err:
            row.note = f"{type(err).__name__}: {err}"[:200]
        rows.append(_emit(row))
    return rows


def part_rows(setup: Setup) -> list[Row]:
    """Forward+backward time of each part of a Hydra mixer at ViT-B's sizes in bf16 (its own inputs, so each part's
    kernels alone): the scan, the short conv + SiLU, the gated norm, the two projections (and the diagonal's), the
    whole mixer, and the rest of the whole as glue; attention's projections, SDPA and whole mixer beside them."""
    from mixer_plugins import kernels

    rows = []
    dtype = setup.dtype
    hydra, x = _mixer_at_vit(setup, "quasi")
    attn, _ = _mixer_at_vit(setup, "attention")
    b, L, dim = setup.vit_batch, setup.vit_length, setup.d_model
    h, p, n = hydra.scan_heads, hydra.head_dim, hydra.d_state
    dev = setup.device

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_(True)

    xs = r(b, L, dim)
    proj_in = (r(b, L, dim), hydra.in_proj.weight.detach().to(dtype).requires_grad_(True))
    proj_out = (r(b, L, hydra.out_width), hydra.out_proj.weight.detach().to(dtype).requires_grad_(True))
    proj_diag = (r(b, L, hydra.d_inner), hydra.fc_D.weight.detach().to(dtype).requires_grad_(True))
    conv = (r(b, L, hydra.conv1d.in_channels), hydra.conv1d.weight[:, 0].detach().to(dtype).requires_grad_(True),
            hydra.conv1d.bias.detach().to(dtype).requires_grad_(True))
    norm = (r(b, L, hydra.out_width), r(b, L, hydra.out_width), hydra.norm.weight.detach().requires_grad_(True))
    scan = dict(x=r(b, L, h, p), dt=r(b, L, h, scale=0.5), A=(-torch.rand(h, device=dev) - 0.5).requires_grad_(True),
                B=r(b, L, hydra.ngroups, n), C=r(b, L, hydra.ngroups, n), dt_bwd=r(b, L, h, scale=0.5),
                B_bwd=r(b, L, hydra.ngroups, n), C_bwd=r(b, L, hydra.ngroups, n), diag=r(b, L, h))
    qkv = (r(b, L, dim), r(3 * dim, dim, scale=dim ** -0.5))
    heads = dim // setup.head_dim
    qh = [r(b, heads, L, setup.head_dim) for _ in range(3)]
    parts = {
        "Hydra: scan": (lambda: kernels.quasiseparable(**scan, shift=True, chunk_size=hydra.chunk_size,
                                                      dt_softplus=True), _leaves(scan)),
        "Hydra: short conv + SiLU": (lambda: kernels.depthwise_conv1d(*conv, causal=False, silu=True), list(conv)),
        "Hydra: gated norm": (lambda: kernels.gated_rmsnorm(*norm, 1e-5, True), list(norm)),
        "Hydra: projections": (lambda: (F.linear(*proj_in).sum() + F.linear(*proj_out).sum()
                                        + F.linear(*proj_diag).sum()), [*proj_in, *proj_out, *proj_diag]),
        "Hydra: whole mixer": (lambda: hydra(xs), [xs, *hydra.parameters()]),
        "attention: projections": (lambda: F.linear(*qkv).sum() + F.linear(xs, qkv[1][:dim]).sum(),
                                   [*qkv, xs]),
        "attention: SDPA": (lambda: F.scaled_dot_product_attention(*qh), qh),
        "attention: whole mixer": (lambda: attn(xs), [xs, *attn.parameters()]),
    }
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")
    ctx = kernels.use_backend("triton") if dev == "cpu" else contextlib.nullcontext()
    measured: dict[str, float] = {}
    with ctx:
        for name, (step, leaves) in parts.items():
            def fn(step=step, leaves=leaves):
                with autocast:
                    out = step()
                torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)
            row = _measure("parts", name, L, b, "forward_backward", fn, setup)
            if row.ms is not None:
                measured[name] = row.ms
            rows.append(row)
    whole = measured.get("Hydra: whole mixer")
    if whole is not None:
        glue = whole - sum(v for k, v in measured.items() if k.startswith("Hydra:") and k != "Hydra: whole mixer")
        rows.append(_emit(Row("parts", "Hydra: glue (whole minus the parts)", L, b, "forward_backward",
                              ms=glue, note="dt, A, diagonal's bias, splits, casts, gradient sums")))
    return rows


def environment(setup: Setup) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": setup.device,
            "dtype": str(setup.dtype).removeprefix("torch."), "d_model": setup.d_model, "head_dim": setup.head_dim,
            "state": setup.state, "heads": setup.heads, "tokens_per_batch": setup.tokens}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if setup.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        from importlib.metadata import version

        info["mamba_ssm"] = version("mamba-ssm")
    except Exception:
        info["mamba_ssm"] = None
    if setup.device == "cuda":
        from mixer_plugins.kernels import backend_report

        info["backends_on_cuda"] = "; ".join(
            f"{r.op}/{r.backend}: {'yes' if r.available else r.reason}" for r in backend_report(["cuda"])
            if r.op in ("ssd", "quasiseparable", "mlr_attention") and r.backend in ("triton", "mamba_ssm"))
    return info


def _ms(rows: list[Row], candidate: str, length: int | None = None, mode: str = "forward_backward"):
    for r in rows:
        if r.candidate == candidate and (length is None or r.length == length) and r.mode == mode:
            return r.ms
    return None


def targets(rows: list[Row]) -> list[dict]:
    """The GPU targets, computed from the rows (asserted by benchmarks/test_bench_gpu.py on a GPU)."""
    out = []

    def add(target, length, value, bound, held):
        out.append({"target": target, "length": length, "value": value, "bound": bound, "held": held})

    for length in sorted({r.length for r in rows if r.table == "scan"}):
        fused = _ms(rows, "QS fused (ours, triton)", length)
        if not fused:
            continue
        if length in (4096, 16384):
            add("fused QS fwd+bwd <= 5.5 ms", length, fused, 5.5, fused <= 5.5)
        ssd = [v for c in (64, 256) if (v := _ms(rows, f"causal SSD (mamba-ssm) chunk {c}", length))]
        if ssd:
            add("fused QS throughput >= 0.85x one causal SSD pass (mamba-ssm, its better chunk)", length,
                min(ssd) / fused, 0.85, min(ssd) / fused >= 0.85)
        released = [v for c in (64, 256)
                    if (v := _ms(rows, f"released Hydra (mamba-ssm, one call, doubled batch) chunk {c}", length))]
        if released:
            add("fused QS fwd+bwd >= 1.5x faster than the released Hydra (better chunk)", length,
                min(released) / fused, 1.5, min(released) / fused >= 1.5)
        peak = [r.peak_mib for r in rows if r.candidate == "QS fused (ours, triton)" and r.length == length
                and r.mode == "forward_backward" and r.peak_mib]
        if peak and length in (4096, 16384):
            add("fused QS peak memory fwd+bwd <= 3.5 GB", length, peak[0] / 1024, 3.5, peak[0] / 1024 <= 3.5)
        sdpa = _ms(rows, "SDPA attention", length)
        if sdpa and length == 16384:
            add("fused QS fwd+bwd >= 5x faster than SDPA at 16k", length, sdpa / fused, 5.0, sdpa / fused >= 5.0)
    attn, quasi = _ms(rows, "ViT-B/16 attention", mode="train_step"), _ms(rows, "ViT-B/16 quasi", mode="train_step")
    if attn and quasi:
        add("ViT-B/16 train step quasi / attention <= 2.0 (stretch 1.6)", 197, quasi / attn, 2.0, quasi / attn <= 2.0)
    compiled = _ms(rows, "ViT-B/16 quasi (torch.compile)", mode="train_step")
    if compiled and quasi:
        add("compiled ViT-B/16 quasi step no slower than eager", 197, compiled / quasi, 1.0, compiled <= quasi)
    hydra_launches = _ms(rows, "quasi")
    if hydra_launches is not None:
        add("launches per Hydra mixer fwd+bwd <= 40", 197, hydra_launches, 40, hydra_launches <= 40)
    for length in (4096, 16384):
        mlr = [r for r in rows if r.table == "attention" and r.candidate == "mlr_attention" and r.length == length
               and r.mode == "forward_backward" and r.ms]
        attention = _ms(rows, "attention", length)
        if mlr and attention and mlr[0].flop_ratio:
            # time ratio to SDPA within 1.2x of the FLOP ratio, i.e. (time ratio / FLOP ratio) <= 1.2
            value = (mlr[0].ms / attention) / mlr[0].flop_ratio
            add("MLR fwd+bwd time ratio to SDPA <= 1.2x its FLOP ratio", length, value, 1.2, value <= 1.2)
    return out


TABLES = ("vit", "launches", "parts", "scan", "attention", "window")


def markdown(info: dict, rows: list[Row], checks: list[dict]) -> str:
    from mixer_plugins._text import markdown_table

    lines = ["# GPU check", "", markdown_table(["", ""], [[k, v] for k, v in info.items()]), ""]
    for table in TABLES:
        chosen = [r for r in rows if r.table == table]
        if not chosen:
            continue
        lines += [f"## {table}", "", markdown_table(
            ["candidate", "L", "batch", "mode", "ms", "peak MiB", "note"],
            [[r.candidate, r.length, r.batch, r.mode, "-" if r.ms is None else f"{r.ms:.2f}",
              "-" if r.peak_mib is None else f"{r.peak_mib:.0f}", r.note] for r in chosen]), ""]
    failed = [r for r in rows if r.candidate == "(part failed)"]
    if failed:
        lines += ["## parts that failed", "", *[f"* {r.table}: {r.note}" for r in failed], ""]
    if checks:
        lines += ["## targets", "", markdown_table(
            ["target", "L", "value", "bound", "held"],
            [[c["target"], c["length"], f"{c['value']:.2f}", c["bound"], c["held"]] for c in checks]), ""]
    return "\n".join(lines)


def write(out: Path, info: dict, rows: list[Row]) -> str:
    """Writes ``out/throughput.json`` and ``out/throughput.md`` from the rows so far; returns the Markdown."""
    checks = targets(rows)
    (out / "throughput.json").write_text(json.dumps(
        {"environment": info, "rows": [asdict(r) for r in rows], "targets": checks}, indent=2, default=str))
    text = markdown(info, rows, checks)
    (out / "throughput.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for throughput.json and throughput.md")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (the Triton interpreter)")
    parser.add_argument("--tables", default="vit,launches,parts,scan",
                        help=f"comma-separated tables to measure, in order (default: vit,launches,parts,scan; all: "
                             f"{','.join(TABLES)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds after which the candidates left are reported as not run")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry to check the script on the CPU")
    setup = DRY if args.dry else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    if args.budget_s is not None:
        _DEADLINE[:] = [time.monotonic() + args.budget_s]
    info = environment(setup)
    rows: list[Row] = []
    parts = {"scan": scan_rows, "attention": attention_rows, "window": window_rows, "vit": vit_rows,
             "launches": launch_rows, "parts": part_rows}
    chosen = args.tables.split(",")
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; choose from {sorted(parts)}")
    _ON_ROW[:] = [lambda row: (rows.append(row), write(args.out, info, rows),
                               print(f"{row.table}: {row.candidate} L={row.length} {row.mode}: "
                                     f"{'-' if row.ms is None else f'{row.ms:.3f}'} {row.note}", flush=True))]
    write(args.out, info, rows)
    for name in chosen:
        try:
            parts[name](setup)
        except Exception:
            traceback.print_exc()
            _emit(Row(name, "(part failed)", 0, 0, "", note=traceback.format_exc(limit=1)[-200:]))
        print(f"{name}: done", flush=True)
    text = write(args.out, info, rows)
    print(text)
    failed_parts = [r for r in rows if r.candidate == "(part failed)"]
    return 1 if failed_parts or any(math.isnan(r.ms) for r in rows if r.ms is not None) else 0


if __name__ == "__main__":
    raise SystemExit(main())
