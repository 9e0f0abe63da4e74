"""The GPU targets of mixer-plugins, stated once.

Every bound the GPU check judges is here: the table scripts (``throughput.py``, ``mlr_rows.py``) attach a
measurement to a target by its ``key`` with :func:`measurement`, and ``summary.py`` prints one verdict row per
target, in this order, from whatever the run measured. The targets must hold on an H100 (the summary records the GPU
each value came from). No torch here: the summary runs where nothing else could be imported.

A verdict is ``held`` (the value is within the bound), ``missed``, or ``not measured`` (no value: the step was cut,
failed or not run, the candidate could not run, or a dry run on the CPU, whose values mean nothing and are shown as
such). A target with a ``stretch`` bound also gets the stretch's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the sequence length of the long-sequence targets, and the shorter one measured after it
LONG, SHORT = 16384, 4096
#: tokens per batch of the long-sequence rows (batch = TOKENS // length: 4 at 16k, 16 at 4k)
TOKENS = 65_536
#: mamba-ssm's chunk size in its comparison rows (Mamba-2's default), one pinned kernel config each (no autotune)
MAMBA_CHUNK = 256
#: the sliding window of the window rows
WINDOW = 512

HELD, MISSED, NOT_MEASURED = "held", "missed", "not measured"


@dataclass(frozen=True)
class Target:
    """One bound: ``value <= bound`` holds it (every target here is an upper bound)."""

    key: str
    text: str
    bound: float
    unit: str
    step: str                   # the run.sh step that measures it
    stretch: float | None = None

    def bound_text(self) -> str:
        unit = "x" if self.unit == "x" else f" {self.unit}"
        stretch = f" (stretch {_fmt(self.stretch)}{unit})" if self.stretch is not None else ""
        return f"<= {_fmt(self.bound)}{unit}{stretch}"


def _fmt(x: float) -> str:
    return f"{x:g}"


_VIT = "ViT-B/16 train step (eager, bf16 autocast, batch 64, AdamW): quasi (our vit_base) / attention"
_LAUNCH = "kernel launches of one Hydra mixer (quasi, ViT-B width) forward+backward"

TARGETS: tuple[Target, ...] = (
    Target("qs16k_ms", "fused quasiseparable (Hydra's scan, Triton) fwd+bwd at L = 16k (batch 4, bf16): time",
           5.5, "ms", "qs16k"),
    Target("qs16k_peak_gb", "fused quasiseparable fwd+bwd at L = 16k: peak memory (inputs included)",
           3.5, "GB", "qs16k"),
    Target("vit_step_timm", f"{_VIT} (timm's vit_base_patch16_224)", 2.0, "x", "vit", stretch=1.6),
    Target("vit_step_ours", f"{_VIT} (our vit_base, mixer='attention')", 2.0, "x", "vit", stretch=1.6),
    Target("launches_one_chunk_fp32", f"{_LAUNCH}, one chunk (197 tokens), float32", 40, "launches", "launches"),
    Target("launches_one_chunk_bf16", f"{_LAUNCH}, one chunk (197 tokens), bf16 autocast", 40, "launches",
           "launches"),
    Target("launches_chunked_fp32", f"{_LAUNCH}, chunked (1024 tokens), float32", 40, "launches", "launches"),
    Target("launches_chunked_bf16", f"{_LAUNCH}, chunked (1024 tokens), bf16 autocast", 40, "launches", "launches"),
    Target("mlr_16k", "MLR attention (mlr_attention, defaults) fwd+bwd / attention (SDPA) at L = 16k", 2.0, "x",
           "mlr", stretch=1.3),
    Target("window_16k", f"sliding_window_attention (window {WINDOW}) fwd+bwd / attention (SDPA) at L = 16k",
           0.25, "x", "mlr"),
    Target("mlr_paper_16k", "MLR attention (the paper's levels, causal) fwd+bwd / causal attention at L = 16k",
           2.0, "x", "mlr", stretch=1.3),
    Target("mlr_4k", "MLR attention (mlr_attention, defaults) fwd+bwd / attention (SDPA) at L = 4k", 2.0, "x", "mlr",
           stretch=1.3),
    Target("mlr_paper_4k", "MLR attention (the paper's levels, causal) fwd+bwd / causal attention at L = 4k", 2.0,
           "x", "mlr", stretch=1.3),
    Target("no_spills_sm90", "Triton kernels compiled for sm_90 (bf16, production shapes): kernels that spill", 0,
           "spilling kernels", "compile check"),
)

BY_KEY = {t.key: t for t in TARGETS}


def verdict(target: Target, value: float | None, *, dry: bool = False) -> tuple[str, str]:
    """(verdict, stretch verdict) of ``value`` against ``target``; a dry run's value is never judged."""
    if value is None or dry:
        return NOT_MEASURED, ""
    held = HELD if value <= target.bound else MISSED
    if target.stretch is None:
        return held, ""
    return held, HELD if value <= target.stretch else MISSED


def measurement(key: str, value: float | None, *, note: str = "", dry: bool = False, gpu: str | None = None,
                length: int | None = None) -> dict:
    """A table script's value for target ``key`` (None: not measured, ``note`` says why), as the results files and
    the summary hold it (``held``: the verdict as a bool, None when not measured)."""
    target = BY_KEY[key]   # a KeyError here is a typo in a table script
    held, stretch = verdict(target, value, dry=dry)
    return {"key": key, "target": target.text, "bound": target.bound_text(), "value": value, "verdict": held,
            "held": None if held == NOT_MEASURED else held == HELD, "stretch": stretch, "dry": dry, "gpu": gpu,
            "length": length, "note": note}
