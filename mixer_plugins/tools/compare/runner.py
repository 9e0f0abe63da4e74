"""The Python API of ``mixer-plugins compare``: train one backbone per mixer and seed on a task, and summarize.

Everything is fixed by the seeds: seed ``s`` seeds the model's initialization (``torch.manual_seed(s)`` just before
it is built) and the training stream (a ``torch.Generator`` seeded with ``s``, the same batches for every mixer),
and the test set (seeded from ``s`` independently of the training stream). With the same threads, two runs give the
same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..._text import format_table, markdown_table
from ...errors import MixerError
from ..benchmarking import error_summary, format_flops
from ..cli.args import set_threads
from ..progress import progress_bar
from ..training import check_positive, train
from .models import (
    MixerEntry,
    SequenceModel,
    check_entry,
    model_flops,
    parameter_count,
    parse_mixers,
)
from .stats import judge, mean_var
from .tasks import Batch, Task, make_task

__all__ = ["CompareConfig", "CompareResult", "EntrySummary", "Ordering", "RunResult", "compare", "train_run"]


@dataclasses.dataclass(frozen=True)
class Ordering:
    """An ordering a paper reports: ``better`` beats ``worse`` (labels of the comparison's entries) on the metric."""

    better: str
    worse: str
    claim: str = ""


@dataclasses.dataclass
class CompareConfig:
    """What to compare and how to train. ``mixers`` takes entries or the ``--mixers`` syntax
    (``NAME``, ``NAME(key=value,...)``, ``LABEL=NAME(...)``, comma-separated; ``all`` = every registered mixer)."""

    task: str = "mqar"
    task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mixers: str | Sequence[str | MixerEntry] = "attention,quasiseparable,toeplitz"
    seeds: Sequence[int] = (0, 1)
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: float = 0.1
    eval_every: int = 50
    test_size: int = 256
    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 2.0
    positions: bool = True
    #: add an embedding of the previous token to each position (see SequenceModel); the recall presets set it.
    token_shift: bool = False
    causal: bool = False
    out: Path | None = None
    progress: bool = True
    #: worker processes that train (mixer, seed) runs side by side; the numbers do not depend on it (each run
    #: is fixed by its seed and the torch thread count, which the workers copy from the caller).
    jobs: int = 1
    #: preset name and the orderings to check (filled by presets; empty for ad-hoc comparisons).
    preset: str | None = None
    orderings: Sequence[Ordering] = ()
    #: a smoke run (``--quick``): too short to judge the orderings, so their verdicts say so
    quick: bool = False
    #: ``mixers`` parsed into entries (by the constructor; ``mixers`` then holds the same list)
    entries: list[MixerEntry] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive(self, "steps", "batch_size", "eval_every", "test_size", "width", "depth", "heads", "jobs")
        if self.lr <= 0 or self.weight_decay < 0 or self.mlp_ratio <= 0 or not 0 <= self.warmup < 1:
            raise MixerError("lr and mlp_ratio must be positive, weight_decay non-negative and warmup in [0, 1)")
        self.seeds = tuple(int(s) for s in self.seeds)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise MixerError(f"seeds must be distinct and at least one, got {self.seeds}")
        self.entries = parse_mixers(self.mixers)
        self.mixers = self.entries
        self.task_options = dict(self.task_options)
        task = self.build_task()  # bad task names and knobs fail before training
        for entry in self.entries:  # and so do bad options (or a mixer that cannot run in this comparison)
            check_entry(entry, width=self.width, heads=self.heads, seq_len=task.seq_len, causal=self.causal)
        labels = {e.label for e in self.entries}
        for ordering in self.orderings:
            for label in (ordering.better, ordering.worse):
                if label not in labels:
                    raise MixerError(f"ordering refers to {label!r}, which is not among {', '.join(sorted(labels))}")
        if self.out is not None:
            self.out = Path(self.out)

    def build_task(self) -> Task:
        return make_task(self.task, **self.task_options)

    def build_model(self, task: Task, entry: MixerEntry) -> SequenceModel:
        """The backbone of this comparison with ``entry``'s mixer (untrained; seed first for a fixed start)."""
        return SequenceModel(task, entry, width=self.width, depth=self.depth, heads=self.heads,
                             mlp_ratio=self.mlp_ratio, positions=self.positions, token_shift=self.token_shift,
                             causal=self.causal)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["mixers"] = [e.as_dict() for e in self.entries]
        out["orderings"] = [dataclasses.asdict(o) for o in self.orderings]
        out["out"] = str(self.out) if self.out is not None else None
        out["seeds"] = list(self.seeds)
        out["task_options"] = dict(self.task_options)
        return out


@dataclasses.dataclass
class RunResult:
    """One trained model: a mixer entry and a seed."""

    label: str
    seed: int
    metric: float | None = None
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    train_loss: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    parameters: int | None = None
    flops: int | None = None
    train_seconds: float | None = None
    #: CPU time of the whole run (building, training steps, evaluations) in the process that ran it.
    cpu_seconds: float | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


@dataclasses.dataclass
class EntrySummary:
    """One mixer entry over its seeds: mean and standard deviation (over seeds, ``n - 1``) of the final metric."""

    label: str
    mean: float | None
    std: float | None
    seeds: int
    parameters: int | None
    flops: int | None
    train_seconds: float | None
    error: str | None = None
    #: mean CPU time of a run (None when the runs did not record it, e.g. results saved by an older version)
    cpu_seconds: float | None = None


@dataclasses.dataclass
class CompareResult:
    """Every run of a comparison, with the summaries, tables and ordering checks built from them."""

    config: CompareConfig
    task: Task
    runs: list[RunResult]
    reference: dict[str, float] = dataclasses.field(default_factory=dict)
    #: ``wall_seconds`` of the whole comparison, ``cpu_seconds`` (the runs' CPU time summed over processes),
    #: ``jobs`` and ``threads``: what the run cost, for sizing (wall time overstates it on a loaded machine).
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def metric_name(self) -> str:
        return self.task.metric_name

    def summaries(self) -> list[EntrySummary]:
        out = []
        for entry in self.config.entries:
            runs = [r for r in self.runs if r.label == entry.label]
            done = [r for r in runs if r.error is None]
            if not done:
                error = next((r.error for r in runs if r.error), "not run")
                out.append(EntrySummary(entry.label, None, None, 0, None, None, None, error))
                continue
            mean, var = mean_var([r.metric for r in done if r.metric is not None])  # every finished run has one
            failed = [r for r in runs if r.error]
            if failed:
                note = f"{len(failed)} seed(s) failed: {failed[0].error}"
            elif len(done) < len(self.config.seeds):  # a comparison cut short (its results.json as it was kept)
                note = f"{len(done)} of {len(self.config.seeds)} seeds run"
            else:
                note = None
            out.append(EntrySummary(entry.label, mean, math.sqrt(var), len(done), done[0].parameters, done[0].flops,
                                    _mean([r.train_seconds for r in done]), note, _mean([r.cpu_seconds for r in done])))
        return out

    def seed_metrics(self, label: str) -> list[float]:
        """The final metric of every finished run of entry ``label``, in seed order."""
        return [r.metric for r in self.runs if r.label == label and r.error is None and r.metric is not None]

    def check_orderings(self) -> list[dict[str, Any]]:
        """For each expected ordering: the two means and stds, Welch's ``p`` and the verdict of
        :func:`~mixer_plugins.tools.compare.stats.judge` (``not measured`` when an entry failed, ``not judged (quick
        run)`` for a quick run)."""
        by_label = {s.label: s for s in self.summaries()}
        checks = []
        for ordering in self.config.orderings:
            a, b = by_label[ordering.better], by_label[ordering.worse]
            p_value: float | None = None
            reasons: tuple[str, ...] = ()
            if self.config.quick:
                verdict = "not judged (quick run)"
            elif a.mean is None or b.mean is None:
                verdict = "not measured (a run failed)"
            else:
                judgement = judge(self.seed_metrics(a.label), self.seed_metrics(b.label),
                                  higher_is_better=self.task.higher_is_better, chance=self.task.chance)
                verdict, p_value, reasons = judgement.verdict, judgement.p_value, judgement.reasons
            checks.append({"better": a.label, "worse": b.label, "claim": ordering.claim, "better_mean": a.mean,
                           "better_std": a.std, "worse_mean": b.mean, "worse_std": b.std,
                           "seeds": min(a.seeds, b.seeds), "p_value": p_value, "chance": self.task.chance,
                           "verdict": verdict, "reasons": list(reasons)})
        return checks

    def recount(self) -> CompareResult:
        """This result with every run's parameters and FLOPs counted again by the installed code (the models are
        built, not trained): a saved result's costs as this version counts them."""
        counted: dict[str, tuple[int, int | None]] = {}
        task = self.config.build_task()
        for entry in self.config.entries:
            model = self.config.build_model(task, entry)
            counted[entry.label] = (parameter_count(model), model_flops(model))
        runs = [dataclasses.replace(r, parameters=counted[r.label][0], flops=counted[r.label][1])
                if r.error is None else r for r in self.runs]
        return CompareResult(self.config, self.task, runs, dict(self.reference), dict(self.timing))

    # -- text ------------------------------------------------------------------------------------
    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for s in self.summaries():
            if s.mean is None:
                rows.append((s.label, "-", "-", "-", "-", "-", f"FAILED: {s.error}"))
                continue
            cpu = "-" if s.cpu_seconds is None else f"{s.cpu_seconds:.1f} s"
            rows.append((s.label, _fmt(s.mean, s.std), format_flops(s.parameters),
                         format_flops(s.flops), f"{s.train_seconds:.1f} s", cpu, s.error or ""))
        return rows

    def table(self, *, markdown: bool = False) -> str:
        """Mean ± std of the metric over seeds, parameters, FLOPs per example (forward), mean train time (wall time
        of the training steps) and mean CPU time of a run (building, training, evaluations)."""
        headers = ("mixer", f"{self.metric_name} ({'higher' if self.task.higher_is_better else 'lower'} is better)",
                   "parameters", "FLOPs / example", "train time / seed", "CPU time / seed", "note")
        return (markdown_table if markdown else format_table)(headers, self._rows())

    def orderings_table(self, *, markdown: bool = False) -> str:
        checks = self.check_orderings()
        if not checks:
            return ""
        rows = [(f"{c['better']} > {c['worse']}", _fmt(c["better_mean"], c["better_std"]),
                 _fmt(c["worse_mean"], c["worse_std"]), str(c["seeds"]), _fmt_p(c["p_value"]), c["verdict"],
                 c["claim"]) for c in checks]
        headers = ("expected ordering", "better (mean ± std)", "worse (mean ± std)", "seeds", "p (Welch)", "verdict",
                   "what the paper says")
        return (markdown_table if markdown else format_table)(headers, rows)

    def report(self) -> str:
        """The settings, the table, the reference (if any) and the orderings' verdicts, as markdown (the body of
        ``results.md``; ``mixer-plugins compare --from results.json`` prints it)."""
        text = [self.describe(), "", self.table(markdown=True)]
        if self.reference:
            text += ["", "Reference: " + ", ".join(f"{k} = {v:.3f}" for k, v in self.reference.items())]
        if self.config.orderings:
            text += ["", self.orderings_table(markdown=True)]
        return "\n".join(text)

    def describe(self) -> str:
        c = self.config
        return (f"task {self.task.describe()}; backbone width {c.width}, {c.depth} blocks, {c.heads} heads, "
                f"{'causal' if c.causal else 'default-direction'} mixers{', token shift' if c.token_shift else ''}; "
                f"{c.steps} steps of batch {c.batch_size}, "
                f"AdamW lr {c.lr:g}; seeds {', '.join(map(str, c.seeds))}; test set {c.test_size} examples")

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.as_dict(),
            "task": {"name": self.task.name, "knobs": self.task.knobs(), "metric": self.metric_name,
                     "higher_is_better": self.task.higher_is_better, "seq_len": self.task.seq_len},
            "reference": self.reference,
            "timing": self.timing,
            "summaries": [dataclasses.asdict(s) for s in self.summaries()],
            "orderings": self.check_orderings(),
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }

    @classmethod
    def load(cls, path: Path | str) -> CompareResult:
        """A result saved by :meth:`write` (its ``results.json``, or the folder holding it), e.g. to redraw plots."""
        path = Path(path)
        data = json.loads((path / "results.json" if path.is_dir() else path).read_text())
        settings = dict(data["config"])
        settings["mixers"] = [MixerEntry(m["name"], m["options"], m["label"]) for m in settings["mixers"]]
        settings["orderings"] = tuple(Ordering(**o) for o in settings["orderings"])
        config = CompareConfig(**settings)
        runs = [RunResult(**{**run, "curve": [tuple(p) for p in run["curve"]],
                             "train_loss": [tuple(p) for p in run["train_loss"]]}) for run in data["runs"]]
        return cls(config, config.build_task(), runs, data.get("reference", {}), data.get("timing", {}))

    def write(self, out: Path) -> list[Path]:
        """``results.json``, ``results.md`` and the two plots (when matplotlib is installed) under ``out``."""
        from .report import save_curves, save_final

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "results.json", out / "results.md"]
        written[0].write_text(json.dumps(self.as_dict(), indent=2, default=str))
        title = f"# compare: {self.config.preset or self.task.name}"
        written[1].write_text(f"{title}\n\n{self.report()}\n")
        written.append(save_curves(self, out / "curves.png"))
        written.append(save_final(self, out / "final.png"))
        return written


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean of ``values`` (at least one), None when one is missing."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if len(known) == len(values) else None


def _fmt(mean: float | None, std: float | None) -> str:
    return "-" if mean is None else f"{mean:.3f} ± {std:.3f}"


def _fmt_p(p: float | None) -> str:
    """Welch's p for the tables: ``-`` when not computed (fewer than two seeds), ``< 0.001`` when that small."""
    if p is None:
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _evaluate(model: SequenceModel, task: Task, test: Batch, batch: int = 256) -> float:
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(test), batch):
            part = test.slice(start, start + batch)
            total += task.metric(model(part.inputs), part) * len(part)
    return total / len(test)


def _lr_factor(step: int, total: int, warmup: float) -> float:
    warm = max(1, int(warmup * total))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_run(config: CompareConfig, task: Task, entry: MixerEntry, seed: int, test: Batch,
              *, on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train one model (``entry`` in the backbone) for ``config.steps`` steps with ``seed`` (the shared loop,
    :func:`mixer_plugins.tools.training.train`: linear warm-up then cosine decay, gradient norm clipped to 1);
    evaluate on ``test`` every ``config.eval_every`` steps and at the end. Raises whatever the mixer raises (the
    caller records it)."""
    cpu_start = time.process_time()
    torch.manual_seed(seed)
    model = config.build_model(task, entry)
    result = RunResult(entry.label, seed, parameters=parameter_count(model), flops=model_flops(model),
                       options=dict(model.options))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config.steps,
                                                                                    config.warmup))
    log = train(model, task.train_batches(config.batch_size, torch.Generator().manual_seed(seed), seed=seed),
                lambda batch: task.loss(model(batch.inputs), batch), optimizer, steps=config.steps,
                evaluate=lambda: _evaluate(model, task, test), eval_every=config.eval_every, scheduler=schedule,
                clip_norm=1.0, on_step=None if on_step is None else
                lambda step, log: on_step(step, log.curve[-1][1] if log.curve else float("nan")))
    result.curve, result.train_loss, result.train_seconds = log.curve, log.train_loss, log.seconds
    result.metric = result.curve[-1][1]
    result.cpu_seconds = time.process_time() - cpu_start
    return result


def _run_or_record(config: CompareConfig, task: Task, entry: MixerEntry, seed: int, test: Batch,
                   on_step: Callable[[int, float], None] | None = None) -> tuple[RunResult, str | None]:
    """:func:`train_run`, with a failure recorded in the result (and its traceback returned) instead of raised."""
    try:
        return train_run(config, task, entry, seed, test, on_step=on_step), None
    except Exception as err:  # noqa: BLE001 - one mixer failing must not stop the comparison
        return (RunResult(entry.label, seed, error=error_summary(err)),
                f"== {entry.label} seed {seed}\n{traceback.format_exc()}")


def _worker_run(config: CompareConfig, index: int, seed: int) -> tuple[RunResult, str | None]:
    """One (entry, seed) run in a worker process: the task and test set are rebuilt from the config and seed."""
    task = config.build_task()
    return _run_or_record(config, task, config.entries[index], seed, task.test_set(config.test_size, seed))


def compare(config: CompareConfig, *, log: Callable[[str], None] = print) -> CompareResult:
    """Train every mixer entry of ``config`` with every seed, print the table and (with ``config.out``) write
    ``results.json`` (rewritten after every finished run), ``results.md``, ``curves.png`` and ``final.png``. A failing
    mixer is reported in the table (and its traceback in ``errors.log``); the others still run. With
    ``config.jobs > 1``, spawned worker processes train the runs (see ``docs/compare.md`` for what that asks of a
    script), with the same numbers as ``jobs=1``.
    """
    if config.out is not None:
        from ..plotting import require_matplotlib

        require_matplotlib()  # fail before training, not after
    task = config.build_task()
    log(f"task: {task.describe()}")
    wall_start = time.perf_counter()
    cpu_start = _process_tree_cpu()
    tests = {seed: task.test_set(config.test_size, seed) for seed in config.seeds}
    jobs_list = [(index, entry, seed) for index, entry in enumerate(config.entries) for seed in config.seeds]
    total = len(jobs_list)
    finished: dict[tuple[int, int], RunResult] = {}
    errors: dict[tuple[int, int], str] = {}

    def record(index: int, seed: int, run: RunResult, error: str | None) -> None:
        key = (index, config.seeds.index(seed))
        finished[key] = run
        if error is not None:
            errors[key] = error
        if config.out is not None:  # keep what is done so far
            partial = CompareResult(config, task, _ordered(finished), timing=_timing(config, wall_start, finished))
            config.out.mkdir(parents=True, exist_ok=True)
            (config.out / "results.json").write_text(json.dumps(partial.as_dict(), indent=2, default=str))
        if run.error is None:
            log(f"{run.label} seed {run.seed}: {task.metric_name} {run.metric:.3f} ({run.train_seconds:.1f} s, "
                f"{run.cpu_seconds:.1f} s CPU)")
        else:
            log(f"{run.label} seed {run.seed} failed: {run.error}")

    if config.jobs > 1 and total > 1:
        import concurrent.futures
        import multiprocessing

        # spawn, not fork: a forked child of a process whose OpenMP pool has started can hang in it
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(config.jobs, total), mp_context=context,
                                                    initializer=set_threads,
                                                    initargs=(torch.get_num_threads(),)) as pool:
            # seed-major submission: an interrupted comparison has every entry for the first seeds
            order = sorted(jobs_list, key=lambda job: (config.seeds.index(job[2]), job[0]))
            futures = {pool.submit(_worker_run, config, index, seed): (index, seed) for index, _, seed in order}
            for future in concurrent.futures.as_completed(futures):
                index, seed = futures[future]
                record(index, seed, *future.result())
    else:
        for number, (index, entry, seed) in enumerate(jobs_list, 1):
            with progress_bar(config.steps, enabled=config.progress, unit="step", leave=False,
                              desc=f"[{number}/{total}] {entry.label} seed {seed}") as bar:

                def on_step(step: int, metric: float, bar: Any = bar) -> None:
                    bar.update(1)
                    if step % config.eval_every == 0:
                        bar.set_postfix({task.metric_name: f"{metric:.3f}"})

                run, error = _run_or_record(config, task, entry, seed, tests[seed], on_step if bar else None)
            record(index, seed, run, error)
    runs = _ordered(finished)
    reference = {}
    if hasattr(task, "least_squares_metric"):
        reference["least squares"] = sum(task.least_squares_metric(t) for t in tests.values()) / len(tests)
    result = CompareResult(config, task, runs, reference, _timing(config, wall_start, finished))
    # everything this comparison cost: this process and its (finished) workers, including their start-up
    result.timing["process_cpu_seconds"] = round(_process_tree_cpu() - cpu_start, 3)
    log("")
    log(result.describe())
    log(result.table())
    if config.orderings:
        log("")
        log(result.orderings_table())
    log(f"total: {result.timing['wall_seconds']:.1f} s wall, {result.timing['cpu_seconds']:.1f} s CPU in the runs, "
        f"{result.timing['process_cpu_seconds']:.1f} s CPU in all (jobs {config.jobs}, "
        f"{result.timing['threads']} thread(s) each)")
    if config.out is not None:
        written = result.write(config.out)
        error_log = config.out / "errors.log"
        if errors:
            error_log.write_text("\n".join(errors[key] for key in sorted(errors)))
            written.append(error_log)
        elif error_log.exists():
            error_log.unlink()
        log("wrote " + ", ".join(str(p) for p in written))
    return result


def _process_tree_cpu() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended."""
    try:
        import resource
    except ImportError:  # not on Unix: this process only
        return time.process_time()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _ordered(finished: Mapping[tuple[int, int], RunResult]) -> list[RunResult]:
    """The runs in entry order, then seed order (the order of ``jobs=1``), whatever order they finished in."""
    return [finished[key] for key in sorted(finished)]


def _timing(config: CompareConfig, wall_start: float, finished: Mapping[tuple[int, int], RunResult]) -> dict[str, Any]:
    return {"wall_seconds": round(time.perf_counter() - wall_start, 3),
            "cpu_seconds": round(sum(r.cpu_seconds or 0.0 for r in finished.values()), 3),
            "jobs": config.jobs, "threads": torch.get_num_threads()}
