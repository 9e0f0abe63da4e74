"""The training loop of ``mixer-plugins demo`` and ``mixer-plugins compare`` (:func:`train`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ..errors import MixerError

__all__ = ["TrainLog", "check_positive", "train"]

BatchT = TypeVar("BatchT", bound=Sized)


@dataclasses.dataclass
class TrainLog:
    """What :func:`train` recorded, per evaluation: ``(step, metric)`` and ``(step, mean training loss since the
    previous evaluation, weighted by batch size)``."""

    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    train_loss: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    #: wall seconds of the training steps (forward, backward, update); batches and evaluations not counted
    seconds: float = 0.0


def check_positive(settings: object, *names: str, prefix: str = "") -> None:
    """Raise :class:`~mixer_plugins.MixerError` unless each attribute ``names`` of ``settings`` is a positive int."""
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MixerError(f"{prefix}{name} must be a positive integer, got {value!r}")


def train(model: nn.Module, batches: Iterator[BatchT], loss: Callable[[BatchT], Tensor],
          optimizer: torch.optim.Optimizer, *, steps: int, evaluate: Callable[[], float], eval_every: int,
          scheduler: Any = None, clip_norm: float | None = None,
          on_step: Callable[[int, TrainLog], None] | None = None) -> TrainLog:
    """Train ``model`` for ``steps`` steps on ``batches`` (``loss(batch)`` runs the model and returns the loss);
    ``evaluate()`` (which may switch the model to eval mode: it is switched back) every ``eval_every`` steps and at
    the end. ``scheduler``: a learning-rate scheduler stepped after every optimizer step. ``on_step(step, log)``
    after every step (progress). A non-finite loss raises :class:`FloatingPointError`."""
    log = TrainLog()
    model.train()
    total, count = 0.0, 0
    for step in range(1, steps + 1):
        batch = next(batches)
        start = time.perf_counter()
        value = loss(batch)
        if not torch.isfinite(value):
            raise FloatingPointError(f"training loss became {value.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        log.seconds += time.perf_counter() - start
        total += value.item() * len(batch)
        count += len(batch)
        if step % eval_every == 0 or step == steps:
            log.curve.append((step, evaluate()))
            log.train_loss.append((step, total / count))
            total, count = 0.0, 0
            model.train()
        if on_step is not None:
            on_step(step, log)
    return log
