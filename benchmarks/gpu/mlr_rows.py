"""MLR attention and sliding-window rows for the GPU script: forward+backward times of the mixers against
``attention`` (SDPA), with the targets' verdicts, then the correctness of the Triton kernels.

    python benchmarks/gpu/mlr_rows.py --out DIR            # on a CUDA machine (a minute, compiles included)
    TRITON_INTERPRET=1 python benchmarks/gpu/mlr_rows.py --dry --out DIR   # CPU dry run, tiny shapes

Writes ``DIR/mlr_rows.json`` and ``DIR/mlr_rows.md`` (after every row, so a cut run keeps what it measured):

* ``rows``: d_model 768, heads of 64, bf16, 65,536 tokens a batch, L = 16k first (the targets), then 4k,
  forward+backward (gradients cleared between timed calls), the median of the timed calls: at each length
  ``mlr_attention`` with its default options and ``sliding_window_attention`` with a window of 512 against
  bidirectional ``attention``, then ``mlr_attention`` with the paper's levels (causal) against causal ``attention``;
  each with the ratio and its target's verdict (``targets.py``: MLR <= 2.0x SDPA, stretch 1.3x; the window <= 0.25x
  at 16k);
* ``targets``: those verdicts, as ``summary.py`` reads them;
* ``checks``: the ``triton`` backend of ``kernels.mlr_attention`` (the mixer's default levels, bidirectional and
  padded; the paper's levels, causal) and of ``kernels.local_attention`` (window 512, 4 global tokens) against the
  ``torch`` backend in float32: the largest error of the output and of each gradient, relative to the reference's
  largest value.

The step's deadline (``--deadline-at``, ``--budget-s`` or ``MIXER_PLUGINS_GPU_DEADLINE_AT``; ``deadline.py``) is
checked inside the timing loops and between rows. ``benchmarks/gpu/run.sh`` runs this file. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import deadline as deadlines  # noqa: E402  (benchmarks/gpu/deadline.py)
import targets as target_list  # noqa: E402  (benchmarks/gpu/targets.py)
from throughput import fast_interpreter  # noqa: E402  (benchmarks/gpu/throughput.py)

from mixer_plugins.tools.benchmarking import time_calls  # noqa: E402

PAPER_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]


@dataclass
class Setup:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    d_model: int = 768
    head_dim: int = 64
    tokens: int = target_list.TOKENS
    lengths: tuple[int, ...] = (target_list.LONG, target_list.SHORT)   # the targets' long length first
    window: int = target_list.WINDOW
    reps: int = 10
    check_length: int = 1024
    paper_blocks: int = 512  # the paper's level-1 block (then halving down to 8)

    @property
    def heads(self) -> int:
        return self.d_model // self.head_dim


SMOKE = Setup(device="cpu", dtype=torch.float32, d_model=32, head_dim=8, tokens=32, lengths=(16, 8), window=4, reps=1,
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
    verdict: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)


#: the step's deadline (set by main; see deadline.py)
DEADLINE = deadlines.Deadline()


def _median_ms(fn, reps: int, device: str) -> float:
    """The median of up to ``reps`` timed calls after one warm-up (compiles); fewer past the step's deadline."""
    return time_calls(fn, rounds=reps, warmup=1, device=device, deadline=DEADLINE.at).median(None) * 1e3


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


def rows(setup: Setup, on_row=None, dry: bool = False) -> tuple[list[Row], list[dict]]:
    """The timed rows, long length first, and the targets' measurements; ``on_row(rows, measurements)`` is called
    after each row. Past the step's deadline the rows left are reported as not measured."""
    candidates = [  # (label, mixer, causal, options, target key at the long and the short length)
        ("mlr_attention defaults", "mlr_attention", None, {}, ("mlr_16k", "mlr_4k")),
        (f"sliding_window_attention w={setup.window}", "sliding_window_attention", None, {"window": setup.window},
         ("window_16k", None)),
        ("mlr_attention paper levels, causal", "mlr_attention", True,
         {"ranks": _paper_ranks(setup.head_dim), "block_sizes": _paper_blocks(setup)},
         ("mlr_paper_16k", "mlr_paper_4k")),
    ]
    gpu = torch.cuda.get_device_name() if setup.device == "cuda" else None
    out: list[Row] = []
    measured: list[dict] = []
    attention: dict[tuple[int, bool | None], float] = {}
    for index, length in enumerate(setup.lengths):
        batch = max(1, setup.tokens // length)
        for label, name, causal, options, keys in candidates:
            key = keys[index] if index < len(keys) else None
            target = target_list.BY_KEY[key] if key else None
            row = Row(label, length, batch, target=target.bound_text() if target else "")
            if DEADLINE.passed():
                row.note = deadlines.NOT_STARTED
            else:
                try:
                    if (length, causal) not in attention:
                        attention[(length, causal)] = _mixer_ms("attention", length, batch, setup, causal)
                    row.attention_ms = round(attention[(length, causal)], 3)
                    row.ms = round(_mixer_ms(name, length, batch, setup, causal, **options), 3)
                    row.ratio = round(row.ms / row.attention_ms, 3)
                except Exception as err:
                    row.note = f"{type(err).__name__}: {err}"[:300]
                    if setup.device == "cuda":
                        torch.cuda.empty_cache()
            if key:
                m = target_list.measurement(key, row.ratio, note=row.note, dry=dry, gpu=gpu, length=length)
                row.verdict = m["verdict"] + (" (dry run)" if dry else f" (stretch {m['stretch']})" if m["stretch"]
                                              else "")
                measured.append(m)
            out.append(row)
            if on_row is not None:
                on_row(out, measured)
    return out, measured


def _markdown(setup: Setup, check_rows: list[dict], time_rows: list[Row]) -> str:
    lines = [f"# MLR attention on {setup.device} ({str(setup.dtype).removeprefix('torch.')}, d_model {setup.d_model}, "
             f"heads of {setup.head_dim}, {setup.tokens} tokens a batch)", "", "## forward+backward", "",
             "| mixer | L | batch | ms | attention ms | ratio | target | verdict | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in time_rows:
        lines.append(f"| {r.name} | {r.length} | {r.batch} | {r.ms if r.ms is not None else '-'} | "
                     f"{r.attention_ms if r.attention_ms is not None else '-'} | "
                     f"{r.ratio if r.ratio is not None else '-'} | {r.target} | {r.verdict} | {r.note} |")
    lines += ["", "## checks (triton vs torch, float32)", "", "| case | out | dq | dk | dv | ok |",
              "|---|---|---|---|---|---|"]
    for c in check_rows:
        if "error" in c:
            lines.append(f"| {c['case']} | {c['error']} | | | | no |")
        else:
            lines.append(f"| {c['case']} | {c['out']} | {c['dq']} | {c['dk']} | {c['dv']} | "
                         f"{'yes' if c['ok'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for mlr_rows.json and mlr_rows.md")
    parser.add_argument("--dry", "--smoke", dest="dry", action="store_true",
                        help="tiny shapes on CPU (set TRITON_INTERPRET=1)")
    parser.add_argument("--deadline-at", type=float, default=None,
                        help=f"seconds since the epoch after which nothing more is measured (default: "
                             f"${deadlines.ENV} where set)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds from now after which nothing more is measured")
    args = parser.parse_args(argv)
    setup = SMOKE if args.dry else Setup()
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry to check the script on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    DEADLINE.at = deadlines.Deadline.from_args(args.deadline_at, args.budget_s).at
    deadlines.interrupt_on_term()
    info = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(setup).items()}
    info["gpu"] = torch.cuda.get_device_name() if setup.device == "cuda" else None
    state: dict = {"rows": [], "targets": [], "checks": []}

    def write() -> None:
        deadlines.write_text(args.out / "mlr_rows.json", json.dumps(
            {"setup": info, "rows": [asdict(r) for r in state["rows"]], "targets": state["targets"],
             "checks": state["checks"]}, indent=2))
        deadlines.write_text(args.out / "mlr_rows.md", _markdown(setup, state["checks"], state["rows"]))

    def on_row(time_rows: list[Row], measured: list[dict]) -> None:
        state["rows"], state["targets"] = list(time_rows), list(measured)
        r = time_rows[-1]
        print(f"{r.name} L={r.length}: {r.ms} ms, attention {r.attention_ms} ms, ratio {r.ratio} {r.verdict} {r.note}",
              flush=True)
        write()

    write()
    try:
        with fast_interpreter() if args.dry else contextlib.nullcontext():
            rows(setup, on_row=on_row, dry=args.dry)
            if DEADLINE.passed():
                state["checks"] = [{"case": "(all)", "error": deadlines.NOT_STARTED}]
            else:
                state["checks"] = checks(setup)
    except KeyboardInterrupt:   # the step's hard limit (run.sh's timeout): keep what was measured
        write()
        print("stopped at the step's limit: the rows left not measured", flush=True)
        return 130
    write()
    print(_markdown(setup, state["checks"], state["rows"]))
    cut = deadlines.NOT_STARTED
    if (any(r.ms is None and r.note != cut for r in state["rows"])
            or any(not c.get("ok") and c.get("error") != cut for c in state["checks"])):
        return 1
    return deadlines.EXIT_CUT if any(r.note == cut for r in state["rows"]) or any(
        c.get("error") == cut for c in state["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
