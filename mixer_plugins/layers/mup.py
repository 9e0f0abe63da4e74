"""muP (maximal-update parametrization) for models built from our mixers, or from any ``nn.Linear`` layers.

Everything here follows one rule, the fan-in rule of the structured-attention paper's code (Kuang et al. 2025):

* every matrix-like parameter with fan-in ``f`` is initialised ``N(0, 1/f)`` and trained with Adam at learning
  rate ``lr * base_width / f``; ``lr`` is therefore the learning rate of a dense matrix of fan-in ``base_width``
  (the width at which ``lr`` was tuned);
* vector-like parameters (biases, norm gains) and embedding tables have fan-in 1 and train at ``lr``; their init
  does not depend on width;
* structured cores use their *own* fan-in (a BTT right core contracts ``d`` inputs, its left core ``c * s``), which
  is what makes a width-``D`` BTT layer's learning rate scale like ``1/sqrt(D)`` instead of ``1/D``;
* the readout is zero-initialised, and so is the query side of attention (so that logits are exactly 0 at init at
  every width); other output projections may be, with ``mup_init(zero_init=[...])`` (the paper's code zeroes them);
* attention logits are scaled by ``multiplier / d`` (muP) instead of ``1 / sqrt(d)`` (standard), so that they
  stay O(1) once queries and keys align during training.

Modules tell this file about their parameters with two optional attributes:

* ``mup_fan_in: dict[str, int]``: local parameter name -> fan-in (structured cores, raw ``nn.Parameter`` maps);
* ``mup_zero_init``: local parameter names that muP initialises to zero (output layers; the query side of
  attention, so that logits are exactly 0 at init at every width), or ``(name, rows)`` pairs to zero only some rows
  (a ``slice`` of the leading axis, e.g. the query rows of a fused q/k/v projection).

``nn.Linear``, convolutions, ``nn.Embedding``, norms and 1-D parameters need no declaration. Any other parameter
with two or more dimensions raises, naming it: guessing a fan-in would silently give a wrong learning rate.

Typical use::

    from mixer_plugins.layers import mup
    mup.mup_init(model)
    optimizer = torch.optim.AdamW(mup.mup_param_groups(model, lr=3e-3, base_width=64), lr=3e-3)

and :func:`coord_check` verifies a parametrization: it trains the same model at several widths for a few steps and
records the RMS of every module's output; under muP the RMS does not depend on width.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = [
    "AttentionLogitsProbe", "CoordCheckModel", "CoordCheckResult", "MixerFactory", "attention_logit_scale",
    "coord_check", "mup_fan_ins", "mup_init", "mup_param_groups", "RMS_CAP_EPS", "rms_cap", "rms_cap_target",
    "standard_init",
]

LogitRule = Literal["standard", "mup"]
_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


# -- attention logits and the RMS cap ---------------------------------------------------------------------------------

def attention_logit_scale(dot_dim: int, rule: LogitRule = "standard", multiplier: float = 1.0) -> float:
    """The factor applied to a ``dot_dim``-dimensional query-key dot product.

    ``"standard"``: ``multiplier / sqrt(dot_dim)``; right at initialisation, when queries and keys are independent
    and their dot product grows like ``sqrt(dot_dim)``. ``"mup"``: ``multiplier / dot_dim``; right after training,
    when they are correlated and the dot product grows like ``dot_dim``. The paper's code uses ``8 / d`` (multiplier
    8), which equals ``1 / sqrt(d)`` at ``d = 64``.
    """
    if dot_dim <= 0:
        raise ValueError(f"dot_dim must be positive, got {dot_dim}")
    if multiplier <= 0:
        raise ValueError(f"multiplier must be positive, got {multiplier}")
    if rule == "standard":
        return multiplier / math.sqrt(dot_dim)
    if rule == "mup":
        return multiplier / dot_dim
    raise ValueError(f"unknown logit scaling rule {rule!r}; expected 'standard' or 'mup'")


#: Added to the mean square under the root in :func:`rms_cap`, as the structured-attention code does.
RMS_CAP_EPS = 1e-8


def rms_cap_target(fan_in: int, fan_out: int) -> float:
    """The RMS cap ``kappa = sqrt(min(fan_in, fan_out)) / fan_in`` of a structured core (the muP spectral std)."""
    if fan_in <= 0 or fan_out <= 0:
        raise ValueError(f"fan_in and fan_out must be positive, got {fan_in} and {fan_out}")
    return math.sqrt(min(fan_in, fan_out)) / fan_in


def rms_cap(weight: Tensor, fan_in: int, fan_out: int) -> Tensor:
    """``weight / max(1, rms(weight) / kappa)`` with ``rms = sqrt(mean(weight^2) + 1e-8)``: shrink a core whose RMS
    exceeds :func:`rms_cap_target`.

    Applied in the forward pass (gradients flow through the rescale), as the structured-attention code does for its
    BTT and Bilinear-MLR cores: it keeps a core's scale bounded when a large learning rate would inflate it. At the
    muP init the factor is about 1 (a rank-``s`` BTT left core is shrunk by about ``sqrt(s)``).
    """
    kappa = rms_cap_target(fan_in, fan_out)
    rms = (weight.pow(2).mean() + RMS_CAP_EPS).sqrt()  # the paper's code adds 1e-8 under the root
    return weight / torch.clamp(rms / kappa, min=1.0)


# -- fan-ins, init and learning rates ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _ParamInfo:
    name: str
    module: nn.Module
    local_name: str
    param: nn.Parameter
    fan_in: int          # 1 for vector-like parameters
    matrix: bool         # False for vector-like parameters and embedding tables (width-independent LR)


def _fan_in_of(module: nn.Module, local: str, param: Tensor, full: str,
               overrides: Mapping[str, int]) -> tuple[int, bool]:
    if full in overrides:
        return int(overrides[full]), param.dim() >= 2
    declared = getattr(module, "mup_fan_in", None) or {}
    if local in declared:
        return int(declared[local]), True
    if param.dim() <= 1:
        return 1, False
    if isinstance(module, nn.Embedding):
        return 1, False  # a lookup table: each row is read alone (one-hot input), so its fan-in is 1
    if isinstance(module, nn.Linear) and local == "weight":
        return module.in_features, True
    if isinstance(module, nn.modules.conv._ConvNd) and local == "weight":
        return param[0].numel(), True  # in_channels / groups * prod(kernel_size)
    raise ValueError(
        f"muP cannot tell the fan-in of parameter {full!r} (shape {tuple(param.shape)}, in a "
        f"{type(module).__name__}); declare it in that module's `mup_fan_in` dict, or pass "
        f"fan_in_overrides={{{full!r}: FAN_IN}}"
    )


def _param_infos(model: nn.Module, overrides: Mapping[str, int] | None = None) -> list[_ParamInfo]:
    overrides = dict(overrides or {})
    unknown = set(overrides) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if unknown:
        raise ValueError(f"fan_in_overrides names parameters the model does not have: {sorted(unknown)}")
    infos, seen = [], set()
    for mod_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied parameters are counted once, under their first name
                continue
            seen.add(id(param))
            full = f"{mod_name}.{local}" if mod_name else local
            fan_in, matrix = _fan_in_of(module, local, param, full, overrides)
            if fan_in <= 0:
                raise ValueError(f"fan-in of {full!r} must be positive, got {fan_in}")
            infos.append(_ParamInfo(full, module, local, param, fan_in, matrix))
    return infos


def mup_fan_ins(model: nn.Module, *, fan_in_overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """Parameter name -> the fan-in muP uses for it (1 for vector-like parameters and embedding tables)."""
    return {i.name: i.fan_in for i in _param_infos(model, fan_in_overrides)}


def _zero_init_rows(model: nn.Module, patterns: Iterable[str]) -> dict[str, slice]:
    """Full parameter name -> the rows (leading-axis slice) that muP sets to zero; ``slice(None)`` is all of it."""
    rows: dict[str, slice] = {}
    for mod_name, module in model.named_modules():
        for entry in getattr(module, "mup_zero_init", ()) or ():
            local, part = entry if isinstance(entry, tuple) else (entry, slice(None))
            rows[f"{mod_name}.{local}" if mod_name else local] = part
    all_names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        matched = fnmatch.filter(all_names, pattern)
        if not matched:
            raise ValueError(f"zero_init pattern {pattern!r} matches no parameter of the model")
        rows.update(dict.fromkeys(matched, slice(None)))
    return rows


@torch.no_grad()
def mup_init(model: nn.Module, *, zero_init: Iterable[str] = (), embedding_std: float = 0.02,
             fan_in_overrides: Mapping[str, int] | None = None) -> nn.Module:
    """Initialise ``model`` in place for muP and return it.

    Matrices (``nn.Linear``/conv weights, declared cores): ``N(0, 1/fan_in)``. Parameters named in a module's
    ``mup_zero_init`` (or the rows it names) or matching a ``zero_init`` glob (e.g. ``"head.weight"``,
    ``"*.proj.weight"``): zeros.
    Embedding tables: ``N(0, embedding_std**2)``. Norm gains: ones; biases: zeros. Other vector parameters (e.g. an
    SSM's decay rates) keep their own init: it is width-independent already.
    """
    zeros = _zero_init_rows(model, zero_init)
    for info in _param_infos(model, fan_in_overrides):
        p = info.param
        if info.name in zeros and zeros[info.name] == slice(None):
            p.zero_()
        elif isinstance(info.module, nn.Embedding) and info.local_name == "weight":
            p.normal_(0.0, embedding_std)
        elif info.matrix:
            p.normal_(0.0, 1.0 / math.sqrt(info.fan_in))
        elif isinstance(info.module, _NORM_TYPES) and info.local_name == "weight":
            p.fill_(1.0)
        elif info.local_name == "bias":
            p.zero_()
        if info.name in zeros:
            p[zeros[info.name]] = 0.0  # some rows only, e.g. the query rows of a fused q/k/v projection
    return model


@torch.no_grad()
def standard_init(model: nn.Module, *, std: float = 0.02,
                  fan_in_overrides: Mapping[str, int] | None = None) -> nn.Module:
    """The standard parametrization (SP) used as the coordinate check's negative control: every matrix and embedding
    ``N(0, std**2)`` whatever its width, norm gains ones, biases zeros."""
    for info in _param_infos(model, fan_in_overrides):
        p = info.param
        if info.matrix or isinstance(info.module, nn.Embedding):
            p.normal_(0.0, std)
        elif isinstance(info.module, _NORM_TYPES) and info.local_name == "weight":
            p.fill_(1.0)
        elif info.local_name == "bias":
            p.zero_()
    return model


def mup_param_groups(model: nn.Module, lr: float, *, base_width: int, weight_decay: float = 0.0,
                     fan_in_overrides: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """Optimizer parameter groups with muP learning rates; pass them to any ``torch.optim`` optimizer.

    A matrix with fan-in ``f`` trains at ``lr * base_width / f``; vector-like parameters and embedding tables at
    ``lr``. ``base_width`` is the width at which ``lr`` was tuned (so at that width dense hidden matrices train at
    exactly ``lr``). Weight decay applies to matrices only. Parameters that share a learning rate share a group; each
    group also carries ``names``, ``fan_in`` and ``lr_multiplier`` (for inspection; optimizers ignore them). Frozen
    parameters (``requires_grad=False``) are left out. This rule is for Adam-type optimizers.
    """
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if base_width <= 0:
        raise ValueError(f"base_width must be positive, got {base_width}")
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for info in _param_infos(model, fan_in_overrides):
        if not info.param.requires_grad:
            continue
        key = (info.fan_in, info.matrix)
        if key not in groups:
            multiplier = base_width / info.fan_in if info.matrix else 1.0
            groups[key] = {
                "params": [],
                "names": [],
                "lr": lr * multiplier,
                "lr_multiplier": multiplier,
                "fan_in": info.fan_in,
                "weight_decay": weight_decay if info.matrix else 0.0,
            }
        groups[key]["params"].append(info.param)
        groups[key]["names"].append(info.name)
    return list(groups.values())


# -- coordinate check -------------------------------------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, width: int, ratio: int):
        super().__init__()
        self.fc = nn.Linear(width, ratio * width)
        self.act = nn.GELU()
        self.out = nn.Linear(ratio * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.fc(x)))


#: Builds one mixer of the given width: ``factory(width) -> nn.Module`` mapping (batch, length, width) to itself.
MixerFactory = Callable[[int], nn.Module]


class _Block(nn.Module):
    def __init__(self, width: int, mixer: MixerFactory, mlp_ratio: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.mixer = mixer(width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = _MLP(width, mlp_ratio)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.mixer(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class CoordCheckModel(nn.Module):
    """A small pre-LN sequence model for coordinate checks and examples.

    ``read_in`` (Linear ``in_dim -> width``), ``depth`` blocks of ``x + mixer(LN(x))`` and ``x + MLP(LN(x))``,
    a final LN and ``readout`` (Linear ``width -> out_dim``). The readout and each MLP's output layer are declared
    zero-init for muP. ``mixer(width)`` builds each block's mixer (any module called as ``mixer(x, mask=mask)``);
    :class:`mixer_plugins.testing.MixerCoordCheckModel` takes a registered mixer name instead.
    """

    mup_zero_init = ("readout.weight",)

    def __init__(self, width: int, mixer: MixerFactory, *, depth: int = 2, in_dim: int = 8, out_dim: int = 1,
                 mlp_ratio: int = 4):
        super().__init__()
        if not callable(mixer):
            raise TypeError(f"mixer must be a callable width -> nn.Module, got {type(mixer).__name__}")
        self.read_in = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(_Block(width, mixer, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.readout = nn.Linear(width, out_dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.read_in(x)
        for block in self.blocks:
            h = block(h, mask)
        return self.readout(self.norm(h))


@dataclasses.dataclass
class CoordCheckResult:
    """Activation RMS per module, width and step, recorded by :func:`coord_check`.

    ``rms[name]`` is a ``(len(widths), steps + 1)`` tensor: the RMS of the module's output on the fixed batch before
    update ``t``. ``delta[name]`` is ``(len(widths), steps)``: the RMS of the change of that output caused by update
    ``t`` (forward at ``t + 1`` minus forward at ``t``).
    """

    widths: list[int]
    steps: int
    parametrization: str
    rms: dict[str, Tensor]
    delta: dict[str, Tensor]
    losses: Tensor  # (len(widths), steps + 1): training loss of each step's batch

    def _series(self) -> Iterable[tuple[str, int, Tensor]]:
        for name, table in self.rms.items():
            for t in range(table.shape[1]):
                yield name, t, table[:, t]
        for name, table in self.delta.items():
            for t in range(table.shape[1]):
                yield f"{name} (change)", t, table[:, t]

    def spreads(self, *, floor: float = 1e-8) -> list[tuple[str, int, float, float]]:
        """``(quantity, step, log2 ratio, log2 trend)`` per quantity and step, worst first.

        The ratio is ``log2(rms at the largest width / rms at the smallest)``; the trend is the least-squares slope
        of ``log2 rms`` against ``log2 width`` times ``log2(w_max / w_min)`` (the same quantity, fitted through every
        width, so one noisy width cannot hide or fake a trend). Entries whose RMS is below ``floor`` at every width
        (outputs of zero-initialised layers at step 0) are skipped; one that is below it at some widths only counts
        as an infinite spread.
        """
        lw = torch.log2(torch.tensor(self.widths, dtype=torch.float64))
        lw_c = lw - lw.mean()
        span = float(lw[-1] - lw[0])
        out = []
        for name, step, values in self._series():
            values = values.double()
            if (values < floor).all():
                continue
            if (values < floor).any():
                out.append((name, step, math.inf, math.inf))
                continue
            lv = torch.log2(values)
            ratio = float(lv[-1] - lv[0])
            slope = float((lw_c * (lv - lv.mean())).sum() / (lw_c * lw_c).sum())
            out.append((name, step, ratio, slope * span))
        out.sort(key=lambda r: -max(abs(r[2]), abs(r[3])))
        return out

    def max_spread(self) -> float:
        """The largest ``|log2 ratio|`` or ``|log2 trend|`` over every quantity and step."""
        spreads = self.spreads()
        return max((max(abs(r), abs(t)) for _, _, r, t in spreads), default=0.0)

    def passes(self, tol: float = 0.5) -> bool:
        """True when no quantity's RMS changes across widths by ``tol`` or more (in log2), at any step."""
        return self.max_spread() < tol

    def table(self, rows: int = 10) -> str:
        """The ``rows`` worst quantities, readable."""
        lines = [f"coordinate check ({self.parametrization}), widths {self.widths}, {self.steps} steps",
                 f"{'quantity':50s} {'step':>4s} {'log2 ratio':>10s} {'log2 trend':>10s}"]
        for name, step, ratio, trend in self.spreads()[:rows]:
            lines.append(f"{name:50s} {step:4d} {ratio:10.3f} {trend:10.3f}")
        return "\n".join(lines)


def coord_check(build_model: Callable[[int], nn.Module], widths: Sequence[int], steps: int = 10, *,
                data: tuple[Tensor, Tensor] | Callable[[int], tuple[Tensor, Tensor]],
                probe: tuple[Tensor, Tensor] | None = None,
                loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None, lr: float = 3e-3,
                parametrization: Literal["mup", "sp"] = "mup", base_width: int | None = None,
                zero_init: Iterable[str] = (), sp_init_std: float = 0.02, seed: int = 0, seeds: int = 1,
                include: Callable[[str, nn.Module], bool] | None = None, logits: bool = False) -> CoordCheckResult:
    """Train ``build_model(width)`` for ``steps`` Adam steps at each width and record every module's output RMS.

    ``data`` is the training batch ``(inputs, targets)``, or a function ``step -> (inputs, targets)`` (a stream: the
    same batches at every width). Activations are recorded on ``probe`` (default: the step-0 batch) before every
    update and after the last, in eval mode without gradients, so every step and width is measured on the same input.
    ``loss_fn(model(inputs), targets)`` defaults to the mean squared error.

    ``parametrization="mup"``: :func:`mup_init` and :func:`mup_param_groups` (``base_width`` defaults to the smallest
    width). ``"sp"`` (the negative control): :func:`standard_init` (std ``sp_init_std``) and one learning rate for
    every parameter. The attention-logit rule is part of the model: build it with ``logit_scaling="mup"`` for muP and
    ``"standard"`` for SP. Every width starts from the same seed. Optimizer: AdamW, betas (0.9, 0.95), no weight decay,
    ``eps=1e-12`` (negligible next to any gradient, as muP needs; the paper's code uses 1e-20).

    ``include(name, module)`` picks the modules to record (default: every module except the root). A module called
    several times per forward is recorded over all its calls together. ``seeds > 1`` repeats the whole check with
    seeds ``seed, seed + 1, ...`` and averages the RMS values (as the reference muP tooling does): at small widths a
    single run's RMS of a freshly trained quantity is noisy.

    ``logits=True`` also records the pre-softmax attention logits of every mixer that exposes
    ``attention_logits(x, mask=None)`` (:class:`AttentionLogitsProbe`), as ``"<module>.logits"``: the quantity that
    shows a wrong logit-scale rule (``1/sqrt(d)`` instead of ``1/d`` under muP) when the head size grows with width.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if parametrization not in ("mup", "sp"):
        raise ValueError(f"parametrization must be 'mup' or 'sp', got {parametrization!r}")
    widths = sorted(int(w) for w in widths)
    if len(widths) < 2 or len(set(widths)) != len(widths):
        raise ValueError(f"coord_check needs at least two distinct widths, got {widths}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    batch_at = data if callable(data) else (lambda _step: data)
    probe_inputs, _ = probe if probe is not None else batch_at(0)
    loss_fn = loss_fn or (lambda out, tgt: (out - tgt).pow(2).mean())
    base = base_width or widths[0]

    runs = []  # (rms, delta, losses) per seed, then per width
    for run_seed in range(seed, seed + seeds):
        for width in widths:
            torch.manual_seed(run_seed)
            model = build_model(width)
            if parametrization == "mup":
                mup_init(model, zero_init=zero_init)
                groups = mup_param_groups(model, lr, base_width=base)
            else:
                standard_init(model, std=sp_init_std)
                groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
            runs.append(_train_one_width(model, optimizer, steps, batch_at, probe_inputs, loss_fn, include, logits))

    def seed_mean(rows: list[list[float]]) -> Tensor:  # (seeds * widths, n) -> (widths, n), averaged over seeds
        return torch.tensor(rows, dtype=torch.float64).view(seeds, len(widths), -1).mean(0)

    def table(records: Sequence[dict[str, list[float]]]) -> dict[str, Tensor]:
        names = set.intersection(*(set(record) for record in records))  # recorded at every width and seed
        return {name: seed_mean([record[name] for record in records]) for name in sorted(names)}

    rms, delta, losses = zip(*runs)
    return CoordCheckResult(widths=widths, steps=steps, parametrization=parametrization, rms=table(rms),
                            delta=table(delta), losses=seed_mean(list(losses)))


#: Suffix of the recorded attention logits of a module that exposes them (see :class:`AttentionLogitsProbe`).
LOGITS_SUFFIX = ".logits"


@runtime_checkable
class AttentionLogitsProbe(Protocol):
    """What a module implements so that :func:`coord_check` also records its attention logits.

    ``attention_logits`` takes the module's forward arguments (``x``, ``mask=``) and returns the pre-softmax logits,
    (batch, heads, L, L), scale included, before any mask. :func:`coord_check` calls it (without gradients) right
    after the module's forward and records the result as ``"<module name>.logits"``, like any output: RMS per step and
    the RMS of each update's change. The structured softmax mixers implement it; so does plain attention inside
    :class:`mixer_plugins.testing.MixerCoordCheckModel`.
    """

    def attention_logits(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor: ...


class _ActivationRecorder:
    """Forward hooks that record, for one forward, each module's output RMS and flattened output, and the attention
    logits of modules that expose them (:class:`AttentionLogitsProbe`)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], logits: bool = False):
        self.modules = modules
        self.logits = logits
        self.sums: dict[str, list[float]] = {}
        self.outputs: dict[str, list[Tensor]] = {}
        self._paused = False

    def _record(self, name: str, tensor: object) -> None:
        if self._paused or not isinstance(tensor, Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            return
        flat = tensor.detach().double().reshape(-1)
        acc = self.sums.setdefault(name, [0.0, 0])
        acc[0] += float(flat.pow(2).sum())
        acc[1] += flat.numel()
        self.outputs.setdefault(name, []).append(flat)

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._record(name, output[0] if isinstance(output, (tuple, list)) and output else output)
        return hook

    def _logits_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
            if self._paused:
                return
            self._paused = True  # the probe's own submodule calls are not the model's activations
            try:
                assert isinstance(module, AttentionLogitsProbe), "hooked only on modules that expose their logits"
                logits = module.attention_logits(*args, **kwargs)
            finally:
                self._paused = False
            self._record(name + LOGITS_SUFFIX, logits)
        return hook

    @torch.no_grad()
    def run(self, model: nn.Module, inputs: Tensor) -> tuple[dict[str, float], dict[str, Tensor]]:
        """Eval-mode forward on ``inputs``: (RMS per module, flattened output per module)."""
        self.sums, self.outputs = {}, {}
        handles = [module.register_forward_hook(self._hook(name)) for name, module in self.modules]
        if self.logits:
            handles += [module.register_forward_hook(self._logits_hook(name), with_kwargs=True)
                        for name, module in self.modules if callable(getattr(module, "attention_logits", None))]
        was_training = model.training
        try:
            model.eval()
            model(inputs)
        finally:
            model.train(was_training)
            for handle in handles:
                handle.remove()
        rms = {name: math.sqrt(sumsq / count) for name, (sumsq, count) in self.sums.items()}
        return rms, {name: torch.cat(parts) for name, parts in self.outputs.items()}


def _train_one_width(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                     batch_at: Callable[[int], tuple[Tensor, Tensor]], probe_inputs: Tensor,
                     loss_fn: Callable[[Tensor, Tensor], Tensor], include: Callable[[str, nn.Module], bool] | None,
                     logits: bool = False) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float]]:
    """Train ``steps`` steps; per module, the probe RMS before each update and after the last, and the RMS of each
    update's change of the probe output; and the training losses."""
    recorder = _ActivationRecorder([(name, module) for name, module in model.named_modules()
                                    if name and (include is None or include(name, module))], logits=logits)
    rms: dict[str, list[float]] = {}
    delta: dict[str, list[float]] = {}
    losses: list[float] = []
    previous: dict[str, Tensor] = {}
    model.train()
    for step in range(steps + 1):
        step_rms, current = recorder.run(model, probe_inputs)
        for name, value in step_rms.items():
            rms.setdefault(name, [math.nan] * (steps + 1))[step] = value
        for name, flat in current.items():
            if step > 0 and name in previous and previous[name].shape == flat.shape:
                change = (flat - previous[name]).pow(2).mean().sqrt().item()
                delta.setdefault(name, [math.nan] * steps)[step - 1] = change
        previous = current
        inputs, targets = batch_at(step)
        loss = loss_fn(model(inputs), targets)
        losses.append(float(loss.detach()))
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return rms, delta, losses
