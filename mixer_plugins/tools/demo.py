"""``mixer-plugins demo``: small timm ViTs that differ only in their token mixer, trained on scikit-learn's digits.

Every model is the same timm ``vit_tiny`` shrunk to the task (width 64, 2 blocks, 4 heads, 2 x 2 patches: 16 tokens,
no class token, average pooling) with one mixer in every block, started from the same seed and trained on the same
batches in the same order. What it writes to ``--out`` and how the mixers' options are fitted to the model size:
``docs/cli.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._text import format_table, markdown_table
from ..backbones.options import head_dim_for
from ..errors import MissingExtraError, MixerError, NotMaterializableError
from ..registry import default_registry
from . import DEFAULT_MIXERS
from .benchmarking import count_flops, error_summary, format_flops
from .progress import progress_bar
from .training import TrainLog, check_positive, train

__all__ = [
    "DEFAULT_MIXERS",
    "DemoConfig",
    "DemoData",
    "MixerResult",
    "adapted_mixer_options",
    "build_model",
    "capture_first_block_matrix",
    "load_digits_data",
    "results_table",
    "run_demo",
    "small_model_options",
]

NUM_CLASSES = 10
IMAGE_SIZE = 8


@dataclasses.dataclass
class DemoConfig:
    """Settings of the digits experiment (the defaults are what ``mixer-plugins demo`` runs)."""

    mixers: tuple[str, ...] = DEFAULT_MIXERS
    epochs: int = 15
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.05
    embed_dim: int = 64
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 2.0
    patch_size: int = 2
    test_fraction: float = 0.2
    #: use only the first N training images (the quick smoke run); None = all of them.
    train_limit: int | None = None
    seed: int = 0
    #: per-mixer options, by canonical mixer name; they override the size adaptations.
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: which head the heat maps show: an index, or "mean" (average over heads).
    head: int | str = "mean"
    #: index (into the test set) of the image whose mixer matrices are drawn.
    sample: int = 0
    out: Path = Path("demo_output")
    progress: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "epochs", "batch_size", "embed_dim", "depth", "num_heads", "patch_size")
        if self.lr <= 0 or self.weight_decay < 0 or self.mlp_ratio <= 0:
            raise MixerError("lr and mlp_ratio must be positive and weight_decay non-negative")
        if IMAGE_SIZE % self.patch_size:
            raise MixerError(f"patch_size must divide the {IMAGE_SIZE}-pixel image side: one of 1, 2, 4, 8; "
                             f"got {self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise MixerError(f"the width ({self.embed_dim}) must be divisible by the head count ({self.num_heads})")
        if not 0 < self.test_fraction < 1:
            raise MixerError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.train_limit is not None and self.train_limit < self.batch_size:
            raise MixerError(f"train_limit ({self.train_limit}) must be at least the batch size ({self.batch_size})")
        if not self.mixers:
            raise MixerError("at least one mixer is needed")
        # Canonical names everywhere (aliases accepted; unknown names fail here with "did you mean").
        self.mixers = tuple(dict.fromkeys(default_registry.get_spec(name).name for name in self.mixers))
        options = {}
        for name, values in self.options.items():
            canonical = default_registry.get_spec(name).name
            if canonical not in self.mixers:
                raise MixerError(f"options given for mixer {canonical!r}, which is not among {', '.join(self.mixers)}")
            options[canonical] = dict(values)
        self.options = options
        self.out = Path(self.out)

    @property
    def tokens(self) -> int:
        """Tokens per image: one per patch."""
        return (IMAGE_SIZE // self.patch_size) ** 2


@dataclasses.dataclass
class DemoData:
    """Normalized digits, ``(n, 1, 8, 8)`` float32 images and int64 labels, split by the seed."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


def load_digits_data(seed: int = 0, test_fraction: float = 0.2, train_limit: int | None = None) -> DemoData:
    """scikit-learn's digits (shipped with it: no download), a stratified train/test split fixed by ``seed``,
    normalized with the training set's mean and standard deviation."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise MissingExtraError(
            "the demo needs scikit-learn (for its digits data set); install the demo extra: "
            "pip install 'mixer-plugins[demo]'"
        ) from None
    digits = load_digits()
    images = digits.images.astype("float32")
    train_idx, test_idx = train_test_split(range(len(images)), test_size=test_fraction, random_state=seed,
                                           stratify=digits.target)
    x = torch.from_numpy(images)[:, None]
    y = torch.from_numpy(digits.target).long()
    train_x, train_y, test_x, test_y = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    if train_limit is not None:
        train_x, train_y = train_x[:train_limit], train_y[:train_limit]
    mean, std = train_x.mean(), train_x.std()
    return DemoData((train_x - mean) / std, train_y, (test_x - mean) / std, test_y)


def small_model_options(fields: Mapping[str, Any], tokens: int) -> dict[str, Any]:
    """``d_state=16`` and ``chunk_size`` at most ``tokens``, where the mixer's config has those fields (``fields``):
    what the demo and ``compare`` set for their small models."""
    out: dict[str, Any] = {"d_state": 16} if "d_state" in fields else {}
    default = fields["chunk_size"].get_default() if "chunk_size" in fields else None
    if isinstance(default, int) and default > tokens:
        out["chunk_size"] = tokens
    return out


def adapted_mixer_options(name: str, config: DemoConfig) -> dict[str, Any]:
    """The mixer's options for the demo's model size (see ``docs/cli.md``), then ``config.options``."""
    spec = default_registry.get_spec(name)
    user = dict(config.options.get(spec.name, {}))
    head_size = head_dim_for(spec, config.embed_dim, config.num_heads, user)
    adapted = dict([head_size]) if head_size is not None else {}
    return {**adapted, **small_model_options(spec.config.model_fields, config.tokens), **user}


def build_model(name: str, config: DemoConfig) -> nn.Module:
    """The demo's timm ViT with mixer ``name`` in every block (seeded with ``config.seed``)."""
    import timm

    from ..backbones import timm as _timm_adapter  # noqa: F401  (registers our timm model names)

    torch.manual_seed(config.seed)
    return timm.create_model(
        "vit_tiny", mixer=name, mixer_options=adapted_mixer_options(name, config),
        img_size=IMAGE_SIZE, patch_size=config.patch_size, in_chans=1, num_classes=NUM_CLASSES,
        embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads, mlp_ratio=config.mlp_ratio,
        class_token=False, global_pool="avg",
    )


def capture_first_block_matrix(model: nn.Module, image: Tensor) -> Tensor:
    """The materialized matrix ``(1, heads, L, L)`` of the mixer in the model's first block, for one image.

    A forward pre-hook on the block's timm adapter records the mixer's input (the normalized tokens), and the
    mixer materializes its matrix for exactly that input. Raises :class:`NotMaterializableError` for non-linear
    mixers and :class:`MixerError` when the first block holds no mixer adapter.
    """
    from ..backbones.timm import TimmMixerAttention

    adapter = model.get_submodule("blocks.0.attn")
    if not isinstance(adapter, TimmMixerAttention):
        raise MixerError(f"the first block's token mixer is {type(adapter).__name__}, not a mixer-plugins adapter")
    materialize = getattr(adapter.mixer, "materialize", None)
    if materialize is None:
        raise NotMaterializableError(f"mixer {adapter.mixer_name!r} has no materialize()")
    captured: list[Tensor] = []
    handle = adapter.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(image[None])
            matrix = materialize(captured[0])
        model.train(was_training)
    finally:
        handle.remove()
    return matrix


@dataclasses.dataclass
class MixerResult:
    """What one mixer's model achieved (or why it could not run)."""

    mixer: str
    test_accuracy: float | None = None
    parameters: int | None = None
    flops_per_image: int | None = None
    train_seconds: float | None = None
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    matrix: Tensor | None = None
    matrix_note: str = ""
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "matrix"}
        out["matrix_shape"] = list(self.matrix.shape) if self.matrix is not None else None
        return out


def _evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 512) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += int((model(x[i:i + batch]).argmax(-1) == y[i:i + batch]).sum())
    return correct / len(x)


def _epochs(config: DemoConfig, data: DemoData) -> Iterator[Tensor]:
    """The training batches (index tensors), epoch after epoch, each epoch in a new order drawn from the seed (the
    same batches in the same order for every mixer)."""
    order = torch.Generator().manual_seed(config.seed)
    while True:
        permutation = torch.randperm(len(data.train_x), generator=order)
        yield from permutation.split(config.batch_size)


def train_mixer(name: str, config: DemoConfig, data: DemoData) -> MixerResult:
    """Build, train and evaluate the model with mixer ``name`` (the shared loop,
    :func:`mixer_plugins.tools.training.train`, evaluated after every epoch; AdamW with a one-cycle schedule); then
    materialize its first block's matrix."""
    result = MixerResult(mixer=name)
    model = build_model(name, config)
    result.parameters = sum(p.numel() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        result.flops_per_image = count_flops(lambda: model(data.test_x[:1]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    batches = math.ceil(len(data.train_x) / config.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=config.epochs * batches,
                                                   pct_start=0.15)

    def on_step(step: int, log: TrainLog) -> None:
        bar.update(1)
        if step % batches == 0:
            bar.set_postfix(loss=f"{log.train_loss[-1][1]:.3f}", test_acc=f"{log.curve[-1][1]:.3f}")

    with progress_bar(config.epochs * batches, enabled=config.progress, desc=f"{name:>24s}", unit="step") as bar:
        log = train(model, _epochs(config, data), lambda idx: F.cross_entropy(model(data.train_x[idx]),
                                                                              data.train_y[idx]),
                    optimizer, steps=config.epochs * batches, scheduler=schedule, eval_every=batches,
                    evaluate=lambda: _evaluate(model, data.test_x, data.test_y),
                    on_step=on_step if bar is not None else None)
    result.history = [{"epoch": step // batches, "train_loss": loss, "test_accuracy": accuracy}
                      for (step, accuracy), (_, loss) in zip(log.curve, log.train_loss)]
    result.train_seconds = log.seconds
    result.test_accuracy = result.history[-1]["test_accuracy"]
    try:
        result.matrix = capture_first_block_matrix(model, data.test_x[config.sample])
    except NotMaterializableError as err:
        result.matrix_note = f"not materializable: {err}"
    return result


def results_table(results: Sequence[MixerResult], *, markdown: bool = False) -> str:
    """The demo's table: test accuracy, parameters, FLOPs per image, training time (and errors)."""
    headers = ("mixer", "test accuracy", "parameters", "FLOPs / image", "train time", "note")
    rows = []
    for r in results:
        if r.error is not None:
            rows.append((r.mixer, "-", "-", "-", "-", f"FAILED: {r.error}"))
            continue
        rows.append((r.mixer, f"{r.test_accuracy:.3f}", f"{r.parameters:,}", format_flops(r.flops_per_image),
                     f"{r.train_seconds:.1f} s", r.matrix_note))
    return markdown_table(headers, rows) if markdown else format_table(headers, rows)


def describe(config: DemoConfig, data: DemoData) -> str:
    """One line saying what was trained, on what."""
    return (f"digits: {len(data.train_x)} training / {len(data.test_x)} test images (seed {config.seed}); "
            f"timm vit_tiny width {config.embed_dim}, {config.depth} blocks, {config.num_heads} heads, "
            f"{config.patch_size}x{config.patch_size} patches ({config.tokens} tokens), {config.epochs} epochs, "
            f"batch {config.batch_size}, AdamW lr {config.lr:g}")


def run_demo(config: DemoConfig, *, log: Callable[[str], None] = print) -> list[MixerResult]:
    """Train every mixer of ``config``, print the table and write the plots and results to ``config.out``.

    A mixer that fails (bad options for this model size, an error while training) is reported in the table and
    in ``errors.log``; the other mixers still run. Returns one :class:`MixerResult` per mixer.
    """
    from .plotting import matrix_to_image, require_matplotlib, save_learning_curves, save_matrix_grid

    require_matplotlib()  # fail before training, not after, when the demo extra is missing
    data = load_digits_data(config.seed, config.test_fraction, config.train_limit)
    if not 0 <= config.sample < len(data.test_x):
        raise MixerError(f"sample must be an index into the {len(data.test_x)} test images, got {config.sample}")
    config.out.mkdir(parents=True, exist_ok=True)
    log(describe(config, data))
    results: list[MixerResult] = []
    errors: list[str] = []
    for name in config.mixers:
        try:
            results.append(train_mixer(name, config, data))
        except Exception as err:  # noqa: BLE001 - one mixer failing must not stop the comparison
            summary = error_summary(err)
            results.append(MixerResult(mixer=name, error=summary))
            errors.append(f"== {name}\n{traceback.format_exc()}")
            log(f"mixer {name!r} failed: {summary}")

    log("")
    log(results_table(results))
    (config.out / "results.md").write_text(describe(config, data) + "\n\n" + results_table(results, markdown=True)
                                           + "\n")
    (config.out / "results.json").write_text(json.dumps(
        {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
         "results": [r.as_dict() for r in results]}, indent=2))
    error_log = config.out / "errors.log"
    if errors:
        error_log.write_text("\n".join(errors))
    elif error_log.exists():
        error_log.unlink()  # a stale log from an earlier run would be misleading
    trained = [r for r in results if r.error is None]
    written = [config.out / "results.md", config.out / "results.json"]
    if trained:
        written.append(save_learning_curves({r.mixer: r.history for r in trained}, config.out / "learning_curves.png",
                                            title=f"digits, {config.tokens} tokens, width {config.embed_dim}"))
        label = "mean over heads" if config.head == "mean" else f"head {config.head}"
        matrices: dict[str, Tensor | str] = {}
        for r in trained:
            try:
                picture: Tensor | str = matrix_to_image(r.matrix, config.head) if r.matrix is not None else \
                    r.matrix_note
            except MixerError as err:  # e.g. --head 3 for a mixer with 2 heads: say so in its panel
                picture = str(err)
            matrices[f"{r.mixer} (block 0, {label})"] = picture
        sample_label = int(data.test_y[config.sample])
        written.append(save_matrix_grid(matrices, config.out / "matrices.png",
                                        input_image=data.test_x[config.sample, 0],
                                        input_title=f"test image {config.sample} (label {sample_label})"))
    if errors:
        written.append(error_log)
    log("")
    log("wrote " + ", ".join(str(p) for p in written))
    return results
