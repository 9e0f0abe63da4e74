"""Throughput tables of the GPU check (run by ``benchmarks/gpu/run.sh``; ``--dry`` runs tiny shapes on the CPU).

Tables, for d_model 768, head dim 64, state 64, bf16, 65,536 tokens per batch, L in {1k, 4k, 16k, 64k}, forward and
forward+backward, with peak memory:

* scans: our fused quasiseparable (``backend="triton"``); quasiseparable through mamba-ssm's causal kernel run twice
  (the released Hydra way, ``backend="mamba_ssm"``); causal Mamba-2 SSD (mamba-ssm); our chunked PyTorch
  quasiseparable (``backend="torch"``); SDPA attention (flash) at the same width;
* attention: ``mlr_attention`` (its fastest backend) against ``attention`` (SDPA), with their FLOP ratio;
* a timm ViT-B/16 training step (bf16, batch 64) with ``mixer='quasi'`` and with attention: images per second.

A candidate that cannot run here (no mamba-ssm, no Triton backend, out of memory) is reported with its reason, never
silently dropped. Results go to ``OUT/throughput.json`` and ``OUT/throughput.md``, rewritten after each table, so a
run stopped from outside keeps what it measured. ``--budget-s``: once that many seconds have passed, the candidates
left are reported as not run (the GPU script gives the whole run 8 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


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
    lengths: tuple[int, ...] = (1024, 4096, 16384, 65536)
    warmup: int = 2
    iters: int = 5
    vit_batch: int = 64
    vit_kwargs: dict = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return self.expand * self.d_model // self.head_dim


GPU = Setup(device="cuda", dtype=torch.bfloat16)
DRY = Setup(device="cpu", dtype=torch.float32, d_model=32, head_dim=8, state=4, tokens=64, lengths=(16, 32),
            warmup=0, iters=1, vit_batch=2,
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


def _run(step: Callable[[], torch.Tensor], backward: bool) -> Callable[[], None]:
    def fn():
        out = step()
        if backward:
            out.float().sum().backward()
    return fn


def scan_rows(setup: Setup) -> list[Row]:
    from mixer_plugins import kernels

    rows = []
    for length in setup.lengths:
        batch = max(1, setup.tokens // length)
        for mode in ("forward", "forward_backward"):
            backward = mode == "forward_backward"
            inputs = _scan_inputs(setup, batch, length, backward)

            def qs(backend, inputs=inputs):
                return lambda: kernels.quasiseparable(
                    inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], shift=True, chunk_size=64,
                    dt_softplus=True, backend=backend)

            def ssd(backend, inputs=inputs):
                return lambda: kernels.ssd(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                                           chunk_size=64, dt_softplus=True, backend=backend)

            heads_attn = setup.d_model // setup.head_dim
            q = torch.randn(batch, heads_attn, length, setup.head_dim, device=setup.device, dtype=setup.dtype,
                            requires_grad=backward)

            def sdpa(q=q):
                return lambda: F.scaled_dot_product_attention(q, q, q)

            candidates = {
                "QS fused (ours, triton)": qs("triton"),
                "QS via mamba-ssm x2 (released Hydra)": qs("mamba_ssm"),
                "causal SSD (mamba-ssm)": ssd("mamba_ssm"),
                "QS chunked (ours, torch)": qs("torch"),
                "SDPA attention": sdpa(),
            }
            for name, step in candidates.items():
                rows.append(_measure("scan", name, length, batch, mode, _run(step, backward), setup))
    return rows


_DEADLINE: list[float] = []  # time.monotonic() after which nothing more is measured (set by main)
OVER_BUDGET = "not run: the time budget (--budget-s) was spent"


def _over_budget() -> bool:
    return bool(_DEADLINE) and time.monotonic() > _DEADLINE[0]


def _measure(table: str, name: str, length: int, batch: int, mode: str, fn: Callable[[], None], setup: Setup) -> Row:
    row = Row(table, name, length, batch, mode)
    if _over_budget():
        row.note = OVER_BUDGET
        return row
    try:
        row.ms, row.peak_mib = timed(fn, setup)
    except Exception as err:  # report, never drop
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return row


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
        row = Row("attention", label, length, batch, mode, note=f"{type(err).__name__}: {err}"[:200])
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


def vit_rows(setup: Setup) -> list[Row]:
    import timm

    import mixer_plugins  # noqa: F401  (registers our timm names)

    rows = []
    kwargs = setup.vit_kwargs or {}
    size = kwargs.get("img_size", 224)
    for label, extra in (("ViT-B/16 attention", {}), ("ViT-B/16 quasi", {"mixer": "quasi"})):
        try:
            model = timm.create_model("vit_base_patch16_224" if not extra else "vit_base", **extra, **kwargs)
            model = model.to(setup.device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            images = torch.randn(setup.vit_batch, 3, size, size, device=setup.device)
            labels = torch.randint(0, model.num_classes, (setup.vit_batch,), device=setup.device)
            autocast = torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.device == "cuda")

            def step(model=model, opt=opt, images=images, labels=labels, autocast=autocast):
                with autocast:
                    loss = F.cross_entropy(model(images), labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            row = _measure("vit", label, (size // kwargs.get("patch_size", 16)) ** 2 + 1, setup.vit_batch,
                           "train_step", step, setup)
            if row.ms:
                row.note = f"{setup.vit_batch / (row.ms / 1e3):.1f} images/s"
        except Exception as err:
            row = Row("vit", label, 0, setup.vit_batch, "train_step", note=f"{type(err).__name__}: {err}"[:200])
        rows.append(row)
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


def targets(rows: list[Row]) -> list[dict]:
    """The issue's targets, computed from the rows (asserted by benchmarks/test_bench_gpu.py on a GPU)."""
    def ms(candidate, length, mode="forward_backward"):
        for r in rows:
            if r.candidate == candidate and r.length == length and r.mode == mode:
                return r.ms
        return None

    out = []
    for length in sorted({r.length for r in rows if r.table == "scan"}):
        fused = ms("QS fused (ours, triton)", length)
        twice = ms("QS via mamba-ssm x2 (released Hydra)", length)
        causal = ms("causal SSD (mamba-ssm)", length)
        sdpa = ms("SDPA attention", length)
        if fused and twice:
            out.append({"target": "fused QS fwd+bwd >= 1.5x faster than mamba-ssm x2", "length": length,
                        "value": twice / fused, "bound": 1.5, "held": twice / fused >= 1.5})
        if fused and causal:
            out.append({"target": "fused QS throughput >= 0.85x causal SSD", "length": length,
                        "value": causal / fused, "bound": 0.85, "held": causal / fused >= 0.85})
        if fused and sdpa and length == 16384:
            out.append({"target": "fused QS fwd+bwd >= 5x faster than SDPA at 16k", "length": length,
                        "value": sdpa / fused, "bound": 5.0, "held": sdpa / fused >= 5.0})
    for length in (4096, 16384):
        mlr = [r for r in rows if r.table == "attention" and r.candidate == "mlr_attention" and r.length == length
               and r.mode == "forward_backward" and r.ms]
        attn = ms("attention", length)
        if mlr and attn and mlr[0].flop_ratio:
            # time ratio to SDPA within 1.2x of the FLOP ratio, i.e. (time ratio / FLOP ratio) <= 1.2
            value = (mlr[0].ms / attn) / mlr[0].flop_ratio
            out.append({"target": "MLR fwd+bwd time ratio to SDPA <= 1.2x its FLOP ratio", "length": length,
                        "value": value, "bound": 1.2, "held": value <= 1.2})
    return out


def markdown(info: dict, rows: list[Row], checks: list[dict]) -> str:
    from mixer_plugins._text import markdown_table

    lines = ["# GPU check", "", markdown_table(["", ""], [[k, v] for k, v in info.items()]), ""]
    for table in ("scan", "attention", "vit"):
        chosen = [r for r in rows if r.table == table]
        if not chosen:
            continue
        lines += [f"## {table}", "", markdown_table(
            ["candidate", "L", "batch", "mode", "ms", "peak MiB", "note"],
            [[r.candidate, r.length, r.batch, r.mode, "-" if r.ms is None else f"{r.ms:.2f}",
              "-" if r.peak_mib is None else f"{r.peak_mib:.0f}", r.note] for r in chosen]), ""]
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
    parser.add_argument("--tables", default="scan,attention,window,vit",
                        help="comma-separated tables to measure (default: scan,attention,window,vit)")
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
    # "window": the sliding-window rows of the attention table (window_rows)
    parts = {"scan": scan_rows, "attention": attention_rows, "window": window_rows, "vit": vit_rows}
    unknown = set(args.tables.split(",")) - set(parts)
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; choose from {sorted(parts)}")
    for part in [parts[name] for name in parts if name in args.tables.split(",")]:
        try:
            rows += part(setup)
        except Exception:
            traceback.print_exc()
            rows.append(Row(part.__name__, "(part failed)", 0, 0, "", note=traceback.format_exc(limit=1)[-200:]))
        print(f"{part.__name__}: done", flush=True)
        text = write(args.out, info, rows)
    print(text)
    failed_parts = [r for r in rows if r.candidate == "(part failed)"]
    return 1 if failed_parts or any(math.isnan(r.ms) for r in rows if r.ms is not None) else 0


if __name__ == "__main__":
    raise SystemExit(main())
