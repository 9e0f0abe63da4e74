"""The synthetic tasks of ``mixer-plugins compare``, generated on the fly (no downloads), and the digits task.

Every task makes :class:`Batch` es: ``inputs`` (token ids ``(B, L)`` or features ``(B, L, F)``), ``targets`` and a
bool ``graded`` mask of the positions that are scored. Batches are a pure function of a ``torch.Generator``, so a
seed fixes them. Every answer is predicted at its query's own position and appears as an input only before it, so
the same sequences are fair to causal and bidirectional mixers (``docs/compare.md``, "Causal and bidirectional
mixers"; ``tests/tools/test_compare.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F

from ...errors import MixerError
from ..training import check_positive

if TYPE_CHECKING:  # pragma: no cover
    from ..demo import DemoData

__all__ = [
    "TASKS",
    "Batch",
    "DigitsTask",
    "InContextRegressionTask",
    "MultiQueryRecallTask",
    "SelectiveCopyingTask",
    "Task",
    "make_task",
]

IGNORE = -100


@dataclasses.dataclass
class Batch:
    """One batch: ``inputs`` (long ``(B, L)`` or float ``(B, L, F)``), ``targets`` (long ``(B, L)`` class ids, float
    ``(B, L)`` values, or long ``(B,)`` labels for pooled tasks) and ``graded`` (bool, the shape of ``targets``)."""

    inputs: Tensor
    targets: Tensor
    graded: Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.inputs[start:stop], self.targets[start:stop], self.graded[start:stop])


@dataclasses.dataclass
class Task:
    """Base class of the tasks. Subclasses are dataclasses whose fields are the difficulty knobs."""

    #: registry name (``--task``).
    name: ClassVar[str] = ""
    #: what :meth:`metric` measures, for tables and plots.
    metric_name: ClassVar[str] = "accuracy"
    #: True when a larger metric is better.
    higher_is_better: ClassVar[bool] = True
    #: "tokens" (integer ids embedded by a table) or "features" (vectors, embedded linearly).
    input_kind: ClassVar[str] = "tokens"
    #: "token" (one prediction per graded position) or "mean" (one per sequence, from the mean over tokens).
    readout: ClassVar[str] = "token"
    #: one-line description for ``--list-tasks`` and the docs.
    summary: ClassVar[str] = ""

    # -- shapes the backbone needs --------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        raise NotImplementedError

    @property
    def input_size(self) -> int:
        """Vocabulary size (tokens) or feature width (features)."""
        raise NotImplementedError

    @property
    def output_size(self) -> int:
        """Classes (a classification task) or 1 (regression)."""
        raise NotImplementedError

    @property
    def chance(self) -> float | None:
        """The metric of a model that ignores the context (a uniform guess among the possible answers, or predicting
        0 for regression): the verdicts call a model at chance unless it is significantly better. None: unknown."""
        return None

    # -- data -------------------------------------------------------------------------------------
    def sample(self, n: int, generator: torch.Generator) -> Batch:
        """``n`` fresh examples drawn with ``generator``."""
        raise NotImplementedError

    def train_batches(self, batch_size: int, generator: torch.Generator, seed: int = 0) -> Iterator[Batch]:
        """Endless training batches (fresh samples by default; ``seed`` picks the split of fixed data sets)."""
        while True:
            yield self.sample(batch_size, generator)

    def test_set(self, size: int, seed: int) -> Batch:
        """The held-out examples every model is scored on (independent of the training stream)."""
        return self.sample(size, torch.Generator().manual_seed(1_000_003 + seed))

    # -- loss and metric --------------------------------------------------------------------------
    def loss(self, outputs: Tensor, batch: Batch) -> Tensor:
        """Cross-entropy on the graded positions (classification); regression tasks override."""
        return F.cross_entropy(outputs[batch.graded], batch.targets[batch.graded])

    def metric(self, outputs: Tensor, batch: Batch) -> float:
        """Accuracy on the graded positions; regression tasks override."""
        return float((outputs[batch.graded].argmax(-1) == batch.targets[batch.graded]).float().mean())

    def knobs(self) -> dict[str, Any]:
        """The difficulty knobs (the dataclass fields, ``seq_len_`` shown as ``seq_len``) and their values."""
        return {f.name.rstrip("_"): getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs().items())
        return f"{self.name} ({knobs}): {self.seq_len} tokens, metric {self.metric_name}"


def _distinct(n: int, pool: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` distinct draws from ``range(pool)`` per row, in random order: a long ``(n, count)`` tensor."""
    return torch.rand(n, pool, generator=generator).argsort(-1)[:, :count]


def _scatter_slots(n: int, region: int, count: int, generator: torch.Generator, *, offset: int = 0) -> Tensor:
    """``count`` distinct positions per row among ``offset .. offset + region - 1``, increasing: where the recall
    queries and the copied tokens go."""
    return _distinct(n, region, count, generator).sort(-1).values + offset


class _TokenSequence:
    """Shapes shared by the token tasks: a ``seq_len_`` knob, and one vocabulary for the inputs and the classes."""

    seq_len_: int
    vocab_size: int

    @property
    def seq_len(self) -> int:
        return self.seq_len_

    @property
    def input_size(self) -> int:
        return self.vocab_size

    @property
    def output_size(self) -> int:
        return self.vocab_size


@dataclasses.dataclass
class MultiQueryRecallTask(_TokenSequence, Task):
    """Multi-query associative recall (MQAR, Zoology, Arora et al. 2023), answered at the query positions.

    Token 0 is a blank; keys are ``1 .. K`` and values ``K+1 .. vocab_size-1`` with ``K = (vocab_size - 1) // 2``.
    A sequence is ``num_kv_pairs`` key-value pairs with distinct keys (``k1 v1 k2 v2 ...``), then a query section
    of ``seq_len - 2 * num_kv_pairs`` positions: ``num_queries`` of them (random, in order) hold keys from the
    context (distinct, in random order), the others blanks. At a query the target is the value that followed that
    key in the context; nothing else is graded. Metric: accuracy over the queries.
    """

    seq_len_: int = 64
    num_kv_pairs: int = 8
    vocab_size: int = 64
    num_queries: int | None = None

    name: ClassVar[str] = "mqar"
    summary: ClassVar[str] = "multi-query associative recall: keys queried after the key-value context"

    def __post_init__(self) -> None:
        check_positive(self, "seq_len_", "num_kv_pairs", "vocab_size", prefix=f"{self.name}: ")
        if self.num_queries is None:
            self.num_queries = self.num_kv_pairs
        check_positive(self, "num_queries", prefix=f"{self.name}: ")
        keys = (self.vocab_size - 1) // 2
        if self.num_kv_pairs > keys:
            raise MixerError(f"mqar: num_kv_pairs={self.num_kv_pairs} distinct keys need vocab_size >= "
                             f"{2 * self.num_kv_pairs + 1}")
        if self.num_queries > self.num_kv_pairs:
            raise MixerError(f"mqar: num_queries ({self.num_queries}) must be at most num_kv_pairs "
                             f"({self.num_kv_pairs}) (each key is queried once)")
        if 2 * self.num_kv_pairs + self.num_queries > self.seq_len_:
            raise MixerError(f"mqar: seq_len ({self.seq_len_}) must hold the {2 * self.num_kv_pairs} context tokens "
                             f"and the {self.num_queries} queries")

    @property
    def chance(self) -> float:
        """One over the number of values (a guess among them)."""
        return 1.0 / (self.vocab_size - 1 - (self.vocab_size - 1) // 2)

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        pairs, length = self.num_kv_pairs, self.seq_len_
        queries = self.num_kv_pairs if self.num_queries is None else self.num_queries
        num_keys = (self.vocab_size - 1) // 2
        num_values = self.vocab_size - 1 - num_keys
        keys = _distinct(n, num_keys, pairs, generator) + 1
        values = torch.randint(0, num_values, (n, pairs), generator=generator) + 1 + num_keys
        inputs = torch.zeros(n, length, dtype=torch.long)
        inputs[:, 0:2 * pairs:2] = keys
        inputs[:, 1:2 * pairs:2] = values
        slots = _scatter_slots(n, length - 2 * pairs, queries, generator, offset=2 * pairs)
        which = _distinct(n, pairs, queries, generator)
        rows = torch.arange(n)[:, None]
        inputs[rows, slots] = keys.gather(1, which)
        targets = torch.full((n, length), IGNORE, dtype=torch.long)
        targets[rows, slots] = values.gather(1, which)
        return Batch(inputs, targets, targets != IGNORE)


@dataclasses.dataclass
class SelectiveCopyingTask(_TokenSequence, Task):
    """Selective copying (Mamba, Gu and Dao 2023): copy the scattered data tokens, in order, after the context.

    Token 0 is noise, 1 the copy marker, ``2 .. vocab_size-1`` data. The first ``seq_len - num_tokens`` positions
    are noise with ``num_tokens`` data tokens at random positions; the last ``num_tokens`` positions are markers,
    and the target at the ``i``-th marker is the ``i``-th data token. Metric: accuracy over the markers.
    """

    seq_len_: int = 64
    num_tokens: int = 8
    vocab_size: int = 16

    name: ClassVar[str] = "copying"
    summary: ClassVar[str] = "selective copying: the data tokens scattered among noise, in order, at the markers"

    def __post_init__(self) -> None:
        check_positive(self, "seq_len_", "num_tokens", "vocab_size", prefix=f"{self.name}: ")
        if self.vocab_size < 3:
            raise MixerError("copying: vocab_size must be at least 3 (noise, marker and one data token)")
        if 2 * self.num_tokens > self.seq_len_:
            raise MixerError(f"copying: seq_len ({self.seq_len_}) must be at least 2 * num_tokens "
                             f"({2 * self.num_tokens})")

    @property
    def chance(self) -> float:
        """One over the number of data tokens (a guess among them)."""
        return 1.0 / (self.vocab_size - 2)

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        count, length = self.num_tokens, self.seq_len_
        context = length - count
        data = torch.randint(2, self.vocab_size, (n, count), generator=generator)
        slots = _scatter_slots(n, context, count, generator)
        inputs = torch.zeros(n, length, dtype=torch.long)
        rows = torch.arange(n)[:, None]
        inputs[rows, slots] = data
        inputs[:, context:] = 1
        targets = torch.full((n, length), IGNORE, dtype=torch.long)
        targets[:, context:] = data
        return Batch(inputs, targets, targets != IGNORE)


@dataclasses.dataclass
class InContextRegressionTask(Task):
    """In-context linear regression (Garg et al. 2022), as in the structured-attention paper's regression task.

    Each sequence has its own ``w ~ N(0, I_dim)``; ``x ~ N(0, I_dim)`` and ``y = w . x / sqrt(dim) + noise * eps``
    (so ``Var y = 1 + noise^2``). The first ``num_examples`` tokens are ``[x, y, 0]``, the last ``num_queries`` are
    ``[x, 0, 1]`` (the last feature flags a query); the target at a query is its ``y``. Metric: mean squared error
    over the queries divided by ``Var y`` (1.0 = predicting 0; least squares reaches the noise floor once
    ``num_examples`` is well above ``dim``). Lower is better.
    """

    dim: int = 16
    num_examples: int = 32
    num_queries: int = 8
    noise: float = 0.0

    name: ClassVar[str] = "regression"
    metric_name: ClassVar[str] = "normalized MSE"
    higher_is_better: ClassVar[bool] = False
    input_kind: ClassVar[str] = "features"
    summary: ClassVar[str] = "in-context linear regression: predict y at query x from (x, y) examples"

    def __post_init__(self) -> None:
        check_positive(self, "dim", "num_examples", "num_queries", prefix=f"{self.name}: ")
        if self.noise < 0:
            raise MixerError(f"regression: noise must be non-negative, got {self.noise}")

    @property
    def seq_len(self) -> int:
        return self.num_examples + self.num_queries

    @property
    def input_size(self) -> int:
        return self.dim + 2

    @property
    def output_size(self) -> int:
        return 1

    @property
    def chance(self) -> float:
        """Predicting 0 scores 1 (the metric is normalized by ``Var y``)."""
        return 1.0

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        length = self.seq_len
        w = torch.randn(n, self.dim, generator=generator)
        x = torch.randn(n, length, self.dim, generator=generator)
        y = torch.einsum("bld,bd->bl", x, w) / math.sqrt(self.dim)
        if self.noise:
            y = y + self.noise * torch.randn(n, length, generator=generator)
        inputs = torch.zeros(n, length, self.dim + 2)
        inputs[..., : self.dim] = x
        inputs[:, : self.num_examples, self.dim] = y[:, : self.num_examples]
        inputs[:, self.num_examples:, self.dim + 1] = 1.0
        graded = torch.zeros(n, length, dtype=torch.bool)
        graded[:, self.num_examples:] = True
        return Batch(inputs, y, graded)

    def loss(self, outputs: Tensor, batch: Batch) -> Tensor:
        return F.mse_loss(outputs[..., 0][batch.graded], batch.targets[batch.graded])

    def metric(self, outputs: Tensor, batch: Batch) -> float:
        return float(self.loss(outputs, batch) / (1.0 + self.noise ** 2))

    def least_squares_metric(self, batch: Batch, ridge: float = 1e-6) -> float:
        """The metric of (nearly unregularized) least squares on each sequence's examples: the reference floor."""
        k = self.num_examples
        x, y = batch.inputs[:, :k, : self.dim], batch.inputs[:, :k, self.dim]
        gram = x.transpose(1, 2) @ x + ridge * torch.eye(self.dim)
        w = torch.linalg.solve(gram, (x.transpose(1, 2) @ y[..., None]))[..., 0]
        pred = torch.einsum("bld,bd->bl", batch.inputs[:, k:, : self.dim], w)
        return float(F.mse_loss(pred, batch.targets[:, k:]) / (1.0 + self.noise ** 2))


@dataclasses.dataclass
class DigitsTask(Task):
    """scikit-learn's bundled digits (8 x 8 images, 10 classes; no download) as a sequence of patches.

    Each image is cut into ``patch_size x patch_size`` patches (a token each, row-major; 16 tokens for 2 x 2);
    the label is predicted from the mean over tokens. The split (80/20, stratified) is fixed by the run's seed;
    training batches are epochs of the training images in a seeded random order. Metric: test accuracy.
    """

    patch_size: int = 2

    name: ClassVar[str] = "digits"
    input_kind: ClassVar[str] = "features"
    readout: ClassVar[str] = "mean"
    summary: ClassVar[str] = "scikit-learn's 8x8 digits as a sequence of patches (classification)"

    def __post_init__(self) -> None:
        if self.patch_size not in (1, 2, 4, 8):
            raise MixerError(f"digits: patch_size must divide 8 (1, 2, 4 or 8), got {self.patch_size}")
        self._data: dict[int, DemoData] = {}

    @property
    def seq_len(self) -> int:
        return (8 // self.patch_size) ** 2

    @property
    def input_size(self) -> int:
        return self.patch_size ** 2

    @property
    def output_size(self) -> int:
        return 10

    @property
    def chance(self) -> float:
        """One over the ten classes."""
        return 0.1

    def _patches(self, images: Tensor) -> Tensor:
        p = self.patch_size
        n = images.shape[0]
        grid = images.reshape(n, 8 // p, p, 8 // p, p).permute(0, 1, 3, 2, 4)
        return grid.reshape(n, self.seq_len, p * p)

    def _split(self, seed: int) -> DemoData:
        if seed not in self._data:
            from ..demo import load_digits_data
            self._data[seed] = load_digits_data(seed)
        return self._data[seed]

    def _batch(self, images: Tensor, labels: Tensor) -> Batch:
        return Batch(self._patches(images[:, 0]), labels, torch.ones_like(labels, dtype=torch.bool))

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        data = self._split(0)
        idx = torch.randint(0, len(data.train_x), (n,), generator=generator)
        return self._batch(data.train_x[idx], data.train_y[idx])

    def train_batches(self, batch_size: int, generator: torch.Generator, seed: int = 0) -> Iterator[Batch]:
        data = self._split(seed)
        while True:
            order = torch.randperm(len(data.train_x), generator=generator)
            for i in range(0, len(order) - batch_size + 1, batch_size):
                idx = order[i:i + batch_size]
                yield self._batch(data.train_x[idx], data.train_y[idx])

    def test_set(self, size: int, seed: int) -> Batch:
        data = self._split(seed)
        return self._batch(data.test_x[:size], data.test_y[:size])


TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (MultiQueryRecallTask, SelectiveCopyingTask, InContextRegressionTask, DigitsTask)
}


def make_task(name: str, **knobs: Any) -> Task:
    """Build a task by name (``mqar``, ``copying``, ``regression``, ``digits``) with its difficulty knobs.

    ``seq_len`` is accepted for the tasks whose length is a knob (``mqar``, ``copying``).
    """
    from ..._text import did_you_mean

    if name not in TASKS:
        raise MixerError(f"unknown task {name!r}{did_you_mean(name, list(TASKS))} (tasks: {', '.join(TASKS)})")
    cls = TASKS[name]
    fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    knobs = dict(knobs)
    if "seq_len" in knobs and "seq_len_" in fields:
        knobs["seq_len_"] = knobs.pop("seq_len")
    shown = [f.rstrip("_") for f in fields]
    for key in knobs:
        if key not in fields:
            raise MixerError(f"task {name!r} has no knob {key!r}{did_you_mean(key, shown)} (knobs: {', '.join(shown)})")
    return cls(**knobs)
