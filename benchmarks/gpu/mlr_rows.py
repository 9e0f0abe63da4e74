"""MLR attention and sliding-window rows for the GPU script: correctness of the Triton kernels first, then
forward+backward times of the mixers against ``attention`` (SDPA).

    python benchmarks/gpu/mlr_rows.py --out DIR            # on a CUDA machine (a few minutes, compiles included)
    TRITON_INTERPRET=1 python benchmarks/gpu/mlr_rows.py --smoke --out DIR   # CPU dry run, tiny shapes

Writes ``DIR/mlr_rows.json`` and ``DIR/mlr_rows.md`` (after every row, so a cut run keeps what it measured):

* ``checks``: the ``triton`` backend of ``kernels.mlr_attention`` (the mixer's default levels, bidirectional and
  padded; the paper's levels, causal) and of ``kernels.local_attention`` (window 512, 4 global tokens) against the
  ``torch`` backend in float32: the largest error of the output and of each gradient, relative to the reference's
  largest value;
* ``rows``: d_model 768, heads of 64, bf16, 65,536 tokens a batch, L = 4k and 16k, forward+backward (gradients
  cleared between timed calls), the median of the timed calls: ``mlr_attention`` with its default options and with
  the paper's levels (causal), ``sliding_window_attention`` with a window of 512, each with the ``attention`` row it
  is compared to (same direction) and the ratio, with the GPU targets beside them.

``benchmarks/gpu/run.sh`` runs this file. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

PAPER_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]


@dataclass
class Setup:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    d_model: int = 768
    head_dim: int = 64
    tokens: int = 65536
    lengths: tuple[int, ...] = (4096, 16384)
    window: int = 512
    reps: int = 10
    check_length: int = 1024
    paper_blocks: int = 512  # the paper's level-1 block (then halving down to 8)

    @property
    def heads(self) -> int:
        return self.d_model // self.head_dim


SMOKE = Setup(device="cpu", dtype=torch.float32, d_model=32, head_dim=8, tokens=32, lengths=(16,), window=4, reps=1,
              check_length=24, paper_blocks=8)


@dataclass
class Row:
    name: str
    length: int
    batch: int
    ms: float | None = None
    attention_ms: float | None = None
    ratio: float | None = None
    target: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, reps: int, device: str) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _paper_ranks(head_dim: int) -> list[int]:
    """The paper's rank list at head dim 64; at other (smaller) head dims, eight levels summing to it."""
    return PAPER_RANKS if head_dim == 64 else [head_dim - 7] + [1] * 7


def _paper_blocks(setup: Setup) -> list[int | None]:
    first = setup.paper_blocks
    return [None] + [max(1, first >> i) for i in range(len(PAPER_RANKS) - 1)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def checks(setup: Setup) -> list[dict]:
    """The Triton backends against the torch backend in float32 (output and every gradient)."""
    from mixer_plugins import kernels

    gen = torch.Generator().manual_seed(0)
    length, heads, p = setup.check_length, 4, setup.head_dim
    mask = torch.arange(length)[None, :] < torch.tensor([length, length - length // 3])[:, None]
    cases = {
        "mlr defaults (bidirectional, padded)": (
            "mlr", dict(ranks=[p // 4] * 4, block_sizes=[None, 32, 16, 8], causal=False, mask=mask)),
        "mlr paper levels (causal)": ("mlr", dict(ranks=_paper_ranks(p),
                                                  block_sizes=_paper_blocks(setup), causal=True)),
        f"local window {setup.window} + 4 globals": ("local", dict(window=setup.window, num_global=4, mask=mask)),
    }
    results = []
    for name, (op, kw) in cases.items():
        e = sum(kw["ranks"]) if op == "mlr" else p
        leaves = [torch.randn(2, length, heads, e if i < 2 else p, generator=gen).to(setup.device) for i in range(3)]
        kw = {k: (v.to(setup.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        fn = kernels.mlr_attention if op == "mlr" else kernels.local_attention
        outs = {}
        for backend in ("triton", "torch"):
            ts = [t.clone().requires_grad_() for t in leaves]
            try:
                y = fn(*ts, backend=backend, **kw)
                y.backward(torch.ones_like(y))
                outs[backend] = [y.detach(), *(t.grad for t in ts)]
            except Exception as err:  # a failed check is a row, not the end of the run
                outs[backend] = f"{type(err).__name__}: {err}"[:300]
        failed = [o for o in outs.values() if isinstance(o, str)]
        if failed:
            results.append({"case": name, "error": failed[0]})
            continue
        errors = {k: _rel(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), outs["triton"], outs["torch"])}
        results.append({"case": name, **{k: float(f"{v:.2e}") for k, v in errors.items()},
                        "ok": max(errors.values()) < 1e-3})
    return results


def _mixer_ms(name: str, length: int, batch: int, setup: Setup, causal: bool | None, **options) -> float:
    import mixer_plugins as mp

    if causal is not None:
        options["causal"] = causal
    mixer = mp.create_mixer(name, setup.d_model, num_heads=setup.heads, **options).to(setup.device, setup.dtype)
    x = torch.randn(batch, length, setup.d_model, device=setup.device, dtype=setup.dtype, requires_grad=True)

    def step() -> None:
        mixer.zero_grad(set_to_none=True)
        x.grad = None
        mixer(x).sum().backward()

    return _median_ms(step, setup.reps, setup.device)


def rows(setup: Setup, on_row=None) -> list[Row]:
    """The timed rows; ``on_row(rows)`` is called after each one."""
    candidates = [
        ("mlr_attention defaults", "mlr_attention", None, {}, "<= 2.0 (stretch 1.3)"),
        ("mlr_attention paper levels, causal", "mlr_attention", True,
         {"ranks": _paper_ranks(setup.head_dim), "block_sizes": _paper_blocks(setup)}, "<= 2.0 (stretch 1.3)"),
        (f"sliding_window_attention w={setup.window}", "sliding_window_attention", None, {"window": setup.window},
         "<= 0.25 at 16k"),
    ]
    out: list[Row] = []
    attention: dict[tuple[int, bool | None], float] = {}
    for length in setup.lengths:
        batch = max(1, setup.tokens // length)
        for label, name, causal, options, target in candidates:
            row = Row(label, length, batch, target=target)
            try:
                key = (length, causal)
                if key not in attention:
                    attention[key] = _mixer_ms("attention", length, batch, setup, causal)
                row.attention_ms = round(attention[key], 3)
                row.ms = round(_mixer_ms(name, length, batch, setup, causal, **options), 3)
                row.ratio = round(row.ms / row.attention_ms, 3)
            except Exception as err:
                row.note = f"{type(err).__name__}: {err}"[:300]
            out.append(row)
            if on_row is not None:
                on_row(out)
    return out


def _markdown(setup: Setup, check_rows: list[dict], time_rows: list[Row]) -> str:
    lines = [f"# MLR attention on {setup.device} ({str(setup.dtype).removeprefix('torch.')}, d_model {setup.d_model}, "
             f"heads of {setup.head_dim}, {setup.tokens} tokens a batch)", "", "## checks (triton vs torch, float32)",
             "", "| case | out | dq | dk | dv | ok |", "|---|---|---|---|---|---|"]
    for c in check_rows:
        if "error" in c:
            lines.append(f"| {c['case']} | {c['error']} | | | | no |")
        else:
            lines.append(f"| {c['case']} | {c['out']} | {c['dq']} | {c['dk']} | {c['dv']} | "
                         f"{'yes' if c['ok'] else 'no'} |")
    lines += ["", "## forward+backward", "", "| mixer | L | batch | ms | attention ms | ratio | target | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in time_rows:
        lines.append(f"| {r.name} | {r.length} | {r.batch} | {r.ms if r.ms is not None else '-'} | "
                     f"{r.attention_ms if r.attention_ms is not None else '-'} | "
                     f"{r.ratio if r.ratio is not None else '-'} | {r.target} | {r.note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for mlr_rows.json and mlr_rows.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (set TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else Setup()
    args.out.mkdir(parents=True, exist_ok=True)
    check_rows = checks(setup)

    def write(time_rows: list[Row]) -> None:
        info = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(setup).items()}
        (args.out / "mlr_rows.json").write_text(json.dumps(
            {"setup": info, "checks": check_rows, "rows": [asdict(r) for r in time_rows]}, indent=2))
        (args.out / "mlr_rows.md").write_text(_markdown(setup, check_rows, time_rows))

    write([])
    time_rows = rows(setup, on_row=write)
    print(_markdown(setup, check_rows, time_rows))
    return 0 if all(c.get("ok") for c in check_rows) and all(r.ms is not None for r in time_rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
