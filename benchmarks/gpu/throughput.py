"""Throughput tables of the GPU check (run by ``benchmarks/gpu/run.sh``; ``--dry`` runs tiny shapes on the CPU).

d_model 768, head dim 64, state 64, bf16, 65,536 tokens per batch unless said otherwise; forward and forward+backward
(gradients taken with ``torch.autograd.grad`` for a fixed output gradient, so nothing accumulates between timed calls),
with peak memory. The tables of the check, in run.sh's order (each is one step, with its own deadline):

* ``qs16k``: our fused quasiseparable scan (``backend="triton"``, Hydra's: shift, diagonal, raw dt with softplus) at
  L = 16k, then SDPA attention (flash) at the same width for reference; forward+backward first;
* ``vit``: a ViT-B/16 training step (bf16 autocast, batch 64, AdamW, gradients set to None each step), eager: timm's
  own ``vit_base_patch16_224``, our ``vit_base`` with ``mixer='attention'``, and ``vit_base`` with ``mixer='quasi'``;
* ``launches``: the CUDA kernels one Hydra mixer launches forward and backward at ViT-B's width, one chunk
  (197 tokens) and chunked (1024), in float32 and under bf16 autocast, and attention's (``benchmarks/gpu/launches.py``:
  the profiler on CUDA, the trace in ``--dry``);
* ``vit_compiled``: the quasi ViT-B/16 step under ``torch.compile`` (inductor);
* ``mamba``: mamba-ssm at L = 16k, each of its Triton kernels pinned to one config (no autotuning): causal Mamba-2
  SSD and the released Hydra's computation (mamba-ssm's causal kernel in one call on the batch doubled with its
  time-reversed copy, then the shifts and the diagonal), at chunk ``targets.MAMBA_CHUNK``.

Further tables, not run by the check unless asked (``MIXER_PLUGINS_GPU_EXTRAS``): ``parts`` (where a Hydra mixer's
forward+backward time goes at ViT-B's sizes, against attention's), ``scan`` (the scans at L = 4k, 16k, 1k, 64k: ours,
mamba-ssm at chunk 64 and 256, our chunked PyTorch scan, SDPA), ``attention`` and ``window`` (``mlr_attention`` and
``sliding_window_attention`` against ``attention``; ``benchmarks/gpu/mlr_rows.py`` is the check's MLR step).

The values judged against the targets (``benchmarks/gpu/targets.py``) are written beside the rows. mamba-ssm is loaded
through ``tests/mamba_files.py`` (a wheel without its CUDA extensions). A candidate that cannot run here (no mamba-ssm,
out of memory) is reported with its reason, never silently dropped. Results go to ``OUT/NAME.json`` and ``OUT/NAME.md``
(``--name``, default ``throughput``), rewritten after every row, so a run stopped from outside keeps what it measured.
The step's deadline (``--deadline-at``, ``--budget-s`` or ``MIXER_PLUGINS_GPU_DEADLINE_AT``; ``deadline.py``) is
checked inside the timing loops and between rows: once it has passed, the rows left are reported as not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:   # loaded from its file by benchmarks/test_bench_gpu.py: its siblings' folder
    sys.path.insert(0, str(HERE))

import deadline as deadlines  # noqa: E402  (benchmarks/gpu/deadline.py)
import targets as target_list  # noqa: E402  (benchmarks/gpu/targets.py)

from mixer_plugins.tools.benchmarking import peak_memory, time_calls  # noqa: E402


@dataclass(frozen=True)
class Setup:
    """Shapes and timing of one run."""

    device: str
    dtype: torch.dtype
    d_model: int = 768
    head_dim: int = 64
    state: int = 64
    expand: int = 2
    tokens: int = target_list.TOKENS
    lengths: tuple[int, ...] = (4096, 16384, 1024, 65536)   # the ``scan`` table's
    long_length: int = target_list.LONG                      # the ``qs16k`` and ``mamba`` tables'
    chunks: tuple[int, ...] = (64, 256)                      # mamba-ssm's chunks in the ``scan`` table
    mamba_chunk: int = target_list.MAMBA_CHUNK               # and in the ``mamba`` table
    warmup: int = 2
    iters: int = 5
    vit_batch: int = 64
    vit_kwargs: dict = field(default_factory=dict)
    vit_length: int = 197
    # the ``launches`` table: one Hydra mixer of width launch_dim (launch_options), one chunk and chunked:
    # (length, batch, chunk_size or None for the mixer's default); one chunk at the ViT step's batch, whose kernels
    # the ``vit`` step has compiled
    launch_dim: int = 768
    launch_options: dict = field(default_factory=dict)
    launch_cases: tuple[tuple[int, int, int | None], ...] = ((197, 64, None), (1024, 8, None))

    @property
    def heads(self) -> int:
        return self.expand * self.d_model // self.head_dim

    @property
    def dry(self) -> bool:
        return self.device == "cpu"


GPU = Setup(device="cuda", dtype=torch.bfloat16)
DRY = Setup(device="cpu", dtype=torch.float32, d_model=32, head_dim=8, state=4, tokens=64, lengths=(16, 32),
            long_length=32, mamba_chunk=16, warmup=0, iters=1, vit_batch=2, vit_length=5,
            vit_kwargs=dict(img_size=32, patch_size=16, embed_dim=32, depth=1, num_heads=2),
            launch_dim=32, launch_options=dict(head_dim=16, d_state=8), launch_cases=((16, 1, 64), (32, 1, 16)))


@dataclass
class Row:
    table: str
    candidate: str
    length: int
    batch: int
    mode: str
    ms: float | None = None
    peak_mib: float | None = None        # CUDA: the most allocated during the timed calls, above what was before
    note: str = ""
    flop_ratio: float | None = None  # attention table: the candidate's FLOPs / attention's at the same shape
    peak_total_mib: float | None = None  # CUDA: the same, inputs included


#: the step's deadline (set by main; see deadline.py)
DEADLINE = deadlines.Deadline()


def timed(fn: Callable[[], object], setup: Setup) -> tuple[float, float | None, float | None, str]:
    """Median milliseconds of ``fn``, its peak memory above what was allocated before and in all (MiB, CUDA only),
    and a note when the step's deadline cut the calls short."""
    cuda = setup.device == "cuda"
    with peak_memory(setup.device) if cuda else contextlib.nullcontext({}) as memory:
        times = time_calls(fn, rounds=setup.iters, warmup=setup.warmup, device=setup.device, deadline=DEADLINE.at)
    peak = total = None
    if cuda:
        peak, total = memory["peak_bytes"] / 2**20, memory["total_bytes"] / 2**20
    return times.median(None) * 1e3, peak, total, times.note


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
    """``step`` timed as the forward, or as the forward and the gradients of ``leaves`` for a fixed output gradient
    (made at the first call; ``torch.autograd.grad``: nothing accumulates between calls); without ``leaves``,
    ``backward()`` after setting the grads to None."""
    cotangent: list[torch.Tensor] = []

    def fn():
        out = step()
        if not backward:
            return
        if not cotangent:
            cotangent.append(torch.randn_like(out))
        if leaves:
            torch.autograd.grad(out, leaves, cotangent[0])
            return
        out.backward(cotangent[0])
    return fn


def _mamba(pinned: bool = False):
    """mamba-ssm's ``mamba_chunk_scan_combined``, imported through ``tests/mamba_files.py`` (a wheel built without
    its CUDA extensions cannot be imported the ordinary way); ImportError says why not. ``pinned``: each of its SSD
    kernels runs one config, no autotuning (:func:`pin_mamba_autotune`, once)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import mamba_files

    module = mamba_files.install()
    if module is None:
        raise ImportError("mamba-ssm is not installed")
    if pinned and not PINNED:
        pin_mamba_autotune()
    return module.mamba_chunk_scan_combined


#: the configs pin_mamba_autotune chose, by kernel
PINNED: dict[str, str] = {}


def _pinned_config(configs: list) -> object:
    """The config a pinned mamba-ssm kernel runs: the first with 64 x 64 tiles (``BLOCK_SIZE_M`` and
    ``BLOCK_SIZE_N`` where it has them; every matmul kernel of its SSD lists one), else its first."""
    def tiles_64(config) -> bool:
        return all(config.kwargs.get(k, 64) == 64 for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N"))

    return next((c for c in configs if tiles_64(c)), configs[0])


def pin_mamba_autotune() -> dict[str, str]:
    """Every autotuned kernel of mamba-ssm's SSD modules keeps one config (:func:`_pinned_config`), so a cold run
    compiles one specialization per kernel and benchmarks none (its autotuning compiles and times ~110 configs).
    Returns and records (:data:`PINNED`) what each kernel runs."""
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if not name.startswith("mamba_ssm.ops.triton.ssd") or module is None:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Autotuner) and attr not in PINNED:
                config = _pinned_config(list(value.configs))
                value.configs = [config]
                PINNED[attr] = str(config)
    return PINNED


def released_hydra(inputs: dict, chunk: int, pinned: bool = False) -> torch.Tensor:
    """The released Hydra's scan: one call of mamba-ssm's causal kernel on the batch doubled with its time-reversed
    copy (the backward direction's generators), then each half shifted one step, the backward half flipped back, and
    the diagonal added (here the forward generators serve both directions, as in the timed ``quasiseparable``)."""
    scan = inputs["mamba"] if "mamba" in inputs else _mamba(pinned)
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    doubled = [torch.cat([t, t.flip(1)], dim=0) for t in (x, dt, B, C)]
    y = scan(doubled[0], doubled[1], A, doubled[2], doubled[3], chunk, dt_softplus=True)
    y_f, y_b = y.chunk(2, dim=0)
    y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))
    y_b = F.pad(y_b.flip(1)[:, 1:], (0, 0, 0, 0, 0, 1))
    return y_f + y_b + x * inputs["diag"][..., None]


FUSED = "QS fused (ours, triton)"
SDPA = "SDPA attention"


def _released(chunk: int) -> str:
    return f"released Hydra (mamba-ssm, one call, doubled batch) chunk {chunk}"


def _ssd(chunk: int) -> str:
    return f"causal SSD (mamba-ssm) chunk {chunk}"


def _scan_candidates(setup: Setup, batch: int, length: int, backward: bool, which: tuple[str, ...],
                     chunks: tuple[int, ...], pinned: bool = False
                     ) -> dict[str, Callable[[], tuple[Callable, list]]]:
    """name -> a factory of (step, leaves) for the scan candidates ``which`` (in that order: ``ours``, ``mamba`` at
    each of ``chunks``, ``torch``, ``sdpa``) at (batch, length). Inputs are made when a factory is first called (the
    scans share theirs; SDPA's are its own), so a row's peak memory holds no later row's inputs and a row past the
    deadline makes none."""
    from mixer_plugins import kernels

    inputs: dict = {}

    def scan_inputs() -> tuple[dict, list]:
        if not inputs:
            inputs.update(_scan_inputs(setup, batch, length, backward))
            inputs["diag"] = torch.randn(batch, length, setup.heads, device=setup.device).to(setup.dtype)
            inputs["leaves"] = _leaves(inputs)
        return inputs, inputs["leaves"]

    def qs(backend):
        def make():
            t, leaves = scan_inputs()
            return (lambda: kernels.quasiseparable(t["x"], t["dt"], t["A"], t["B"], t["C"], diag=t["diag"], shift=True,
                                                   chunk_size=64, dt_softplus=True, backend=backend)), leaves
        return make

    def mamba(chunk, released):
        def make():
            t, leaves = scan_inputs()
            if "mamba" not in t:
                try:   # resolved once, outside the timed calls
                    t["mamba"] = _mamba(pinned)
                except ImportError as err:
                    def missing(*args, err=err, **kwargs):
                        raise err
                    t["mamba"] = missing
            if released:
                return (lambda: released_hydra(t, chunk, pinned)), leaves
            return (lambda: t["mamba"](t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, dt_softplus=True)), leaves
        return make

    def sdpa():
        heads_attn = setup.d_model // setup.head_dim
        q = torch.randn(batch, heads_attn, length, setup.head_dim, device=setup.device, dtype=setup.dtype,
                        requires_grad=backward)
        return (lambda: F.scaled_dot_product_attention(q, q, q)), ([q] if backward else [])

    candidates: dict[str, Callable[[], tuple[Callable, list]]] = {}
    for kind in which:
        if kind == "ours":
            candidates[FUSED] = qs("triton")
        elif kind == "mamba":
            for chunk in chunks:
                candidates[_released(chunk)] = mamba(chunk, True)
                candidates[_ssd(chunk)] = mamba(chunk, False)
        elif kind == "torch":
            candidates["QS chunked (ours, torch)"] = qs("torch")
        elif kind == "sdpa":
            candidates[SDPA] = sdpa
    return candidates


def _scan_table(table: str, setup: Setup, lengths: tuple[int, ...], modes: tuple[str, ...], which: tuple[str, ...],
                chunks: tuple[int, ...], pinned: bool = False) -> list[Row]:
    rows = []
    for length in lengths:
        batch = max(1, setup.tokens // length)
        for mode in modes:
            backward = mode == "forward_backward"
            for name, make in _scan_candidates(setup, batch, length, backward, which, chunks, pinned).items():
                fn = None
                if not DEADLINE.passed():
                    try:
                        step, grads_of = make()
                        fn = _run(step, backward, grads_of)
                    except Exception as err:   # inputs that do not fit: the row says so
                        rows.append(_emit(Row(table, name, length, batch, mode,
                                              note=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")))
                        continue
                rows.append(_measure(table, name, length, batch, mode, fn, setup))
            fn = make = None   # this mode's inputs freed before the next mode's are made
            if setup.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def scan_rows(setup: Setup) -> list[Row]:
    """The ``scan`` table: every scan candidate at each of ``setup.lengths``, forward, then forward+backward."""
    return _scan_table("scan", setup, setup.lengths, ("forward", "forward_backward"),
                       ("ours", "mamba", "torch", "sdpa"), setup.chunks)


def qs16k_rows(setup: Setup) -> list[Row]:
    """The fused scan at the long length (16k), then SDPA for reference; forward+backward first (the targets)."""
    return _scan_table("qs16k", setup, (setup.long_length,), ("forward_backward", "forward"), ("ours", "sdpa"), ())


def mamba_rows(setup: Setup) -> list[Row]:
    """mamba-ssm at the long length, one chunk size, each kernel pinned to one config (no autotuning)."""
    rows = _scan_table("mamba", setup, (setup.long_length,), ("forward_backward", "forward"), ("mamba",),
                       (setup.mamba_chunk,), pinned=True)
    if PINNED:
        rows.append(_emit(Row("mamba", "(pinned configs)", setup.long_length, 0, "", note="; ".join(
            f"{k}: {v}" for k, v in sorted(PINNED.items())))))
    return rows


#: called with each row as soon as it is measured (main writes the tables then)
_ON_ROW: list[Callable[[Row], None]] = []


def _emit(row: Row) -> Row:
    for hook in _ON_ROW:
        hook(row)
    return row


def _measure(table: str, name: str, length: int, batch: int, mode: str, fn: Callable[[], None] | None,
             setup: Setup) -> Row:
    row = Row(table, name, length, batch, mode)
    if fn is None or DEADLINE.passed():
        row.note = deadlines.NOT_STARTED
        return _emit(row)
    try:
        row.ms, row.peak_mib, row.peak_total_mib, row.note = timed(fn, setup)
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


#: the ViT-B/16 runs of each table: (label, timm model name, mixer or None, under torch.compile)
VIT_RUNS: dict[str, tuple[tuple[str, str, str | None, bool], ...]] = {
    "vit": (("ViT-B/16 attention (timm)", "vit_base_patch16_224", None, False),
            ("ViT-B/16 attention (vit_base)", "vit_base", "attention", False),
            ("ViT-B/16 quasi", "vit_base", "quasi", False)),
    "vit_compiled": (("ViT-B/16 quasi (torch.compile)", "vit_base", "quasi", True),),
}


def _vit(setup: Setup, model_name: str, mixer: str | None):
    import timm

    import mixer_plugins  # noqa: F401  (registers our timm names)

    kwargs = setup.vit_kwargs or {}
    extra = {"mixer": mixer} if mixer else {}
    return timm.create_model(model_name, **extra, **kwargs).to(setup.device)


def _vit_table(table: str, setup: Setup) -> list[Row]:
    """A ViT-B/16 training step (bf16 autocast on CUDA) for each of ``VIT_RUNS[table]``; a compiled model is
    compiled by its first (warm-up) call, within the step's deadline."""
    from mixer_plugins import kernels

    rows = []
    kwargs = setup.vit_kwargs or {}
    size = kwargs.get("img_size", 224)
    length = (size // kwargs.get("patch_size", 16)) ** 2 + 1
    for label, model_name, mixer, compile_it in VIT_RUNS[table]:
        try:
            if DEADLINE.passed():
                rows.append(_measure(table, label, length, setup.vit_batch, "train_step", None, setup))
                continue
            model = _vit(setup, model_name, mixer)
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
            ctx = kernels.use_backend("triton") if setup.dry and mixer == "quasi" else contextlib.nullcontext()
            with ctx:
                row = _measure(table, label, length, setup.vit_batch, "train_step", step, setup)
            if row.ms:
                row.note = (row.note + f" {setup.vit_batch / (row.ms / 1e3):.1f} images/s").strip()
            del model, opt, forward, step
        except Exception as err:
            row = _emit(Row(table, label, length, setup.vit_batch, "train_step",
                            note=f"{type(err).__name__}: {err}"[:200]))
        if setup.device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def vit_rows(setup: Setup) -> list[Row]:
    """The eager ViT-B/16 training steps: timm's own model and our ``vit_base`` with attention, then with quasi."""
    return _vit_table("vit", setup)


def vit_compiled_rows(setup: Setup) -> list[Row]:
    """The quasi ViT-B/16 training step under ``torch.compile`` (inductor on CUDA, aot_eager in ``--dry``)."""
    return _vit_table("vit_compiled", setup)


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


#: the Hydra mixer's launch rows: (candidate, which of Setup.launch_cases, autocast to bf16), then attention's;
#: bf16 first (what users run, and what the earlier steps compiled)
LAUNCH_ROWS = (("quasi one chunk bf16 autocast", 0, True), ("quasi chunked bf16 autocast", 1, True),
               ("quasi one chunk fp32", 0, False), ("quasi chunked fp32", 1, False))


def launch_rows(setup: Setup) -> list[Row]:
    """Kernel launches of one Hydra mixer (``quasi``) forward and backward at ViT-B's width (the ``ms`` column holds
    the count), for a sequence of one chunk and a chunked one, in float32 and under bf16 autocast; then attention's
    (bf16 autocast, one chunk's length). On CUDA from the profiler (the trace's count in the note), in ``--dry`` from
    the trace (as CI counts)."""
    from mixer_plugins import kernels

    launches = _launches()
    cuda = setup.device == "cuda"
    rows = []
    cases = [(label, *setup.launch_cases[case], bf16) for label, case, bf16 in LAUNCH_ROWS]
    cases.append(("attention bf16 autocast", *setup.launch_cases[0][:2], None, True))
    for label, length, batch, chunk, bf16 in cases:
        row = Row("launches", label, length, batch, "forward_backward")
        if DEADLINE.passed():
            row.note = deadlines.NOT_STARTED
            rows.append(_emit(row))
            continue
        try:
            if label.startswith("quasi"):
                options = dict(setup.launch_options, **({"chunk_size": chunk} if chunk else {}))
                mixer = launches.hydra_block(setup.launch_dim, **options)
            else:
                import mixer_plugins as mp

                mixer = mp.create_mixer("attention", setup.launch_dim, num_heads=setup.launch_dim // 64 or 1)
            mixer = mixer.to(setup.device)
            x = torch.randn(batch, length, setup.launch_dim, device=setup.device, requires_grad=True)
            step = launches.block_step(mixer, x, torch.bfloat16 if bf16 else None)
            # the dry run asks for the Triton kernels (the interpreter); on CUDA the dispatcher picks them itself
            ctx = kernels.use_backend("triton") if setup.dry and label.startswith("quasi") else contextlib.nullcontext()
            with ctx:
                if cuda:
                    step()   # compile first
                counts = launches.count_launches(step, profiler=cuda)
                traced = launches.count_launches(step) if cuda else counts
            row.ms = float(counts.total)
            top = sorted(counts.by_name.items(), key=lambda kv: -kv[1])[:6]
            row.note = (f"launches (not ms); {'profiler' if cuda else 'trace'}; trace {traced.total}; syncs "
                        f"{traced.syncs}; " + ", ".join(f"{k[:40]} {v}" for k, v in top))
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


def _find(rows: list[Row], candidate: str, *, table: str | None = None, length: int | None = None,
          mode: str = "forward_backward") -> Row | None:
    for r in rows:
        if (r.candidate.startswith(candidate) and (table is None or r.table == table)
                and (length is None or r.length == length) and r.mode == mode):
            return r
    return None


def _why(*rows: Row | None) -> str:
    return "; ".join(f"{r.candidate}: {r.note or 'no value'}" for r in rows if r is not None and r.ms is None)


def targets(rows: list[Row], *, dry: bool = False, gpu: str | None = None) -> list[dict]:
    """The measurements of the targets (``targets.py``) that these rows bear on, one per target with a related row
    (its value None, and why, where a row did not run). ``benchmarks/test_bench_gpu.py`` asserts them on a GPU."""
    out: list[dict] = []

    def add(key: str, value: float | None, note: str, length: int | None) -> None:
        out.append(target_list.measurement(key, value, note=note, dry=dry, gpu=gpu, length=length))

    def ratio(key: str, num: Row | None, den: Row | None) -> None:
        if num is None and den is None:
            return
        value = num.ms / den.ms if num and den and num.ms and den.ms else None
        add(key, value, _why(num, den), (num or den).length)

    fused = [r for r in rows if r.candidate == FUSED and r.mode == "forward_backward"
             and (r.table == "qs16k" or (r.table == "scan" and r.length == target_list.LONG))]
    if fused:
        r = fused[0]
        add("qs16k_ms", r.ms, r.note, r.length)
        peak = None if r.peak_total_mib is None else r.peak_total_mib * 2**20 / 1e9
        note = r.note if r.ms is None else (f"{r.peak_mib / 1024:.2f} GiB above the inputs" if peak is not None
                                             else "no peak memory off CUDA")
        add("qs16k_peak_gb", peak, note, r.length)

    quasi = _find(rows, "ViT-B/16 quasi", table="vit", mode="train_step")
    ratio("vit_step_timm", quasi, _find(rows, "ViT-B/16 attention (timm)", mode="train_step"))
    ratio("vit_step_ours", quasi, _find(rows, "ViT-B/16 attention (vit_base)", mode="train_step"))

    for key, label in (("launches_one_chunk_fp32", "quasi one chunk fp32"),
                       ("launches_one_chunk_bf16", "quasi one chunk bf16 autocast"),
                       ("launches_chunked_fp32", "quasi chunked fp32"),
                       ("launches_chunked_bf16", "quasi chunked bf16 autocast")):
        r = _find(rows, label, table="launches")
        if r is not None:
            add(key, r.ms, _why(r), r.length)

    for key, length in (("mlr_16k", target_list.LONG), ("mlr_4k", target_list.SHORT)):
        ratio(key, _find(rows, "mlr_attention", table="attention", length=length),
              _find(rows, "attention", table="attention", length=length))
    window = _find(rows, "sliding_window_attention", table="window", length=target_list.LONG)
    if window is not None:
        ratio("window_16k", window, _find(rows, "attention", table="attention", length=target_list.LONG))
    return out


#: the tables of the GPU check, in run.sh's order, then the others
CHECK_TABLES = ("qs16k", "vit", "launches", "vit_compiled", "mamba")
TABLES = (*CHECK_TABLES, "parts", "scan", "attention", "window")


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
    failed = [r for r in rows if r.candidate in ("(part failed)", "(cut)")]
    if failed:
        lines += ["## parts that failed or were cut", "", *[f"* {r.table}: {r.note}" for r in failed], ""]
    if checks:
        lines += ["## targets", "", markdown_table(
            ["target", "L", "value", "bound", "verdict", "stretch", "note"],
            [[c["target"], c["length"], "-" if c["value"] is None else f"{c['value']:.3g}", c["bound"],
              c["verdict"] + (" (dry run)" if c["dry"] else ""), c["stretch"], c["note"]] for c in checks]), ""]
    return "\n".join(lines)


def write(out: Path, info: dict, rows: list[Row], name: str = "throughput") -> str:
    """Writes ``out/NAME.json`` and ``out/NAME.md`` from the rows so far; returns the Markdown."""
    checks = targets(rows, dry=info.get("device") == "cpu", gpu=info.get("gpu"))
    deadlines.write_text(out / f"{name}.json", json.dumps(
        {"environment": info, "rows": [asdict(r) for r in rows], "targets": checks}, indent=2, default=str))
    text = markdown(info, rows, checks)
    deadlines.write_text(out / f"{name}.md", text)
    return text


@contextlib.contextmanager
def fast_interpreter() -> Iterator[None]:
    """The Triton interpreter's speed shims of the test suite (``tests/helpers.py``'s ``interpreter_shims``), for
    ``--dry``: semantics unchanged, a no-op where the interpreter differs."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import helpers

    with helpers.interpreter_shims():
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for NAME.json and NAME.md")
    parser.add_argument("--name", default="throughput", help="the results files' name (default: throughput)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (the Triton interpreter)")
    parser.add_argument("--tables", default=",".join(CHECK_TABLES),
                        help=f"comma-separated tables to measure, in order (default: {','.join(CHECK_TABLES)}; all: "
                             f"{','.join(TABLES)})")
    parser.add_argument("--deadline-at", type=float, default=None,
                        help=f"seconds since the epoch after which nothing more is measured (default: "
                             f"${deadlines.ENV} where set)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds from now after which nothing more is measured")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry to check the script on the CPU")
    setup = DRY if args.dry else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    DEADLINE.at = deadlines.Deadline.from_args(args.deadline_at, args.budget_s).at
    deadlines.interrupt_on_term()
    info = environment(setup)
    rows: list[Row] = []
    parts = {"qs16k": qs16k_rows, "vit": vit_rows, "launches": launch_rows, "vit_compiled": vit_compiled_rows,
             "mamba": mamba_rows, "scan": scan_rows, "attention": attention_rows, "window": window_rows,
             "parts": part_rows}
    chosen = args.tables.split(",")
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; choose from {sorted(parts)}")
    _ON_ROW[:] = [lambda row: (rows.append(row), write(args.out, info, rows, args.name),
                               print(f"{row.table}: {row.candidate} L={row.length} {row.mode}: "
                                     f"{'-' if row.ms is None else f'{row.ms:.3f}'} {row.note}", flush=True))]
    write(args.out, info, rows, args.name)
    cut = False
    with fast_interpreter() if args.dry else contextlib.nullcontext():
        for name in chosen:
            try:
                parts[name](setup)
            except KeyboardInterrupt:   # the step's hard limit (run.sh's timeout): keep what was measured
                _emit(Row(name, "(cut)", 0, 0, "", note="stopped at the step's limit: the rows left not measured"))
                cut = True
                break
            except Exception:
                traceback.print_exc()
                _emit(Row(name, "(part failed)", 0, 0, "", note=traceback.format_exc(limit=1)[-200:]))
            print(f"{name}: done", flush=True)
    text = write(args.out, info, rows, args.name)
    print(text)
    if cut:
        return 130
    failed_parts = [r for r in rows if r.candidate == "(part failed)"]
    if failed_parts or any(math.isnan(r.ms) for r in rows if r.ms is not None):
        return 1
    return deadlines.EXIT_CUT if any(r.note == deadlines.NOT_STARTED for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
