"""``mixer-plugins compare``: task generators keep their promises, runs are reproducible, presets and CLI work."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.errors import MixerError
from mixer_plugins.tools.compare import (
    PRESETS,
    CompareConfig,
    MixerEntry,
    Ordering,
    compare,
    make_task,
    parse_mixers,
    preset_config,
)
from mixer_plugins.tools.compare.cli import add_compare_parser, config_from_args, run_compare
from mixer_plugins.tools.compare.models import SequenceModel, adapted_options, model_flops
from mixer_plugins.tools.compare.tasks import IGNORE, DigitsTask

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quiet(*_args) -> None:
    pass


# -- tasks --------------------------------------------------------------------------------------------------------


def test_mqar_answer_is_determined_by_the_context():
    task = make_task("mqar", seq_len=40, num_kv_pairs=6, vocab_size=30, num_queries=5)
    batch = task.sample(64, _gen())
    assert batch.inputs.shape == (64, 40) and batch.inputs.dtype == torch.long
    assert int(batch.inputs.max()) < task.vocab_size
    num_keys = (task.vocab_size - 1) // 2
    for row in range(64):
        x, y, graded = batch.inputs[row], batch.targets[row], batch.graded[row]
        keys, values = x[0:12:2].tolist(), x[1:12:2].tolist()
        assert len(set(keys)) == 6 and all(1 <= k <= num_keys for k in keys)
        assert all(v > num_keys for v in values)
        positions = graded.nonzero()[:, 0].tolist()
        assert len(positions) == 5 and min(positions) >= 12
        queried = []
        for pos in positions:
            key = int(x[pos])
            assert key in keys
            # the answer is the value that followed the key in the context ...
            assert int(y[pos]) == values[keys.index(key)]
            # ... and is never an input at or after the query (no leak to bidirectional mixers)
            assert int(y[pos]) not in x[pos:].tolist()
            queried.append(key)
        assert len(set(queried)) == 5
        # everything else in the query section is blank and ungraded
        others = [p for p in range(12, 40) if p not in positions]
        assert all(int(x[p]) == 0 for p in others) and all(int(y[p]) == IGNORE for p in others)


def test_copying_targets_are_the_context_tokens_in_order():
    task = make_task("copying", seq_len=24, num_tokens=5, vocab_size=12)
    batch = task.sample(32, _gen(1))
    for row in range(32):
        x, y = batch.inputs[row], batch.targets[row]
        context = x[:19]
        data = context[context >= 2].tolist()
        assert len(data) == 5 and set(context[context < 2].tolist()) <= {0}
        assert x[19:].tolist() == [1] * 5
        assert y[19:].tolist() == data
        assert batch.graded[row].tolist() == [False] * 19 + [True] * 5


def test_regression_targets_follow_one_linear_map_per_sequence():
    task = make_task("regression", dim=6, num_examples=12, num_queries=3)
    batch = task.sample(16, _gen(2))
    assert batch.inputs.shape == (16, 15, 8)
    assert torch.all(batch.inputs[:, 12:, 6] == 0) and torch.all(batch.inputs[:, 12:, 7] == 1)
    assert torch.all(batch.inputs[:, :12, 7] == 0)
    assert torch.allclose(batch.inputs[:, :12, 6], batch.targets[:, :12])
    # the context determines the answer: least squares on the examples recovers the queries' targets exactly
    assert task.least_squares_metric(batch) < 1e-6
    # and the targets are not trivial: predicting zero scores about 1 (the metric's normalization)
    zero = task.metric(torch.zeros(16, 15, 1), batch)
    big = task.sample(4096, _gen(3))
    assert 0.2 < zero and abs(task.metric(torch.zeros(4096, 15, 1), big) - 1.0) < 0.1
    # with fewer examples than dimensions the answer is not determined
    under = make_task("regression", dim=6, num_examples=3, num_queries=3)
    assert under.least_squares_metric(under.sample(256, _gen(4))) > 0.2


def test_tasks_are_deterministic_for_a_seed():
    for name, knobs in [("mqar", {}), ("copying", {}), ("regression", {"dim": 4, "num_examples": 8})]:
        task = make_task(name, **knobs)
        a, b, c = task.sample(8, _gen(5)), task.sample(8, _gen(5)), task.sample(8, _gen(6))
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert not torch.equal(a.inputs, c.inputs)


@pytest.mark.slow  # imports scikit-learn (for its bundled digits)
def test_digits_task_is_patches_of_the_images():
    task = DigitsTask(patch_size=2)
    test = task.test_set(20, seed=0)
    assert test.inputs.shape == (20, 16, 4) and test.targets.shape == (20,)
    assert set(test.targets.tolist()) <= set(range(10))
    first = next(task.train_batches(8, _gen(), seed=0))
    assert first.inputs.shape == (8, 16, 4)


def test_task_knobs_are_validated():
    with pytest.raises(MixerError, match="num_kv_pairs"):
        make_task("mqar", num_kv_pairs=40, vocab_size=32)
    with pytest.raises(MixerError, match="did you mean 'num_kv_pairs'"):
        make_task("mqar", num_kv_pair=4)
    with pytest.raises(MixerError, match="did you mean 'mqar'"):
        make_task("mqr")
    with pytest.raises(MixerError, match="seq_len"):
        make_task("copying", seq_len=8, num_tokens=5)


# -- mixers entries and the backbone -------------------------------------------------------------------------------


def test_mixer_entries_parse_names_options_and_labels():
    entries = parse_mixers("attention, long_conv=toeplitz(data_dependent=False,head_dim=16), "
                           "mlr_attention(ranks=[4,4],block_sizes=[None,8])")
    assert [e.label for e in entries] == ["attention", "long_conv", "mlr_attention(ranks=[4, 4],block_sizes=[None, 8])"]
    assert entries[1].name == "toeplitz" and entries[1].options == {"data_dependent": False, "head_dim": 16}
    assert entries[2].options == {"ranks": [4, 4], "block_sizes": [None, 8]}
    assert parse_mixers("long_conv")[0].name == "toeplitz"  # aliases resolve to canonical names
    assert {e.name for e in parse_mixers("all")} == set(mp.list_mixers())
    with pytest.raises(MixerError, match="did you mean"):
        parse_mixers("atention")
    with pytest.raises(MixerError, match="unique"):
        parse_mixers("attention,attention")


def test_backbone_sizes_options_and_counts_flops():
    task = make_task("mqar", seq_len=16, num_kv_pairs=3, vocab_size=16)
    entry = MixerEntry("toeplitz", {"data_dependent": False})
    options = adapted_options(entry, width=32, heads=4, seq_len=16, causal=False)
    assert options["max_seq_len"] == 16 and options["head_dim"] == 16 and options["data_dependent"] is False
    model = SequenceModel(task, entry, width=32, depth=2, heads=4)
    out = model(task.sample(3, _gen()).inputs)
    assert out.shape == (3, 16, 16)
    mixer_flops = sum(block.mixer.flops(1, 16) for block in model.blocks)
    assert model_flops(model) > mixer_flops > 0
    with pytest.raises(MixerError, match="bidirectional only"):
        adapted_options(MixerEntry("quasiseparable"), width=32, heads=4, seq_len=16, causal=True)
    assert adapted_options(MixerEntry("attention"), width=32, heads=4, seq_len=16, causal=True)["causal"] is True


def test_plugin_mixers_can_be_compared():
    spec = mp.get_spec("attention")
    plugin = mp.MixerSpec(name="compare_test_plugin", config=spec.config, builder=spec.builder,
                          direction="either", data_dependent="yes")
    mp.register_mixer(plugin)
    try:
        config = CompareConfig(task="mqar", task_options={"seq_len": 12, "num_kv_pairs": 2, "vocab_size": 8},
                               mixers="compare_test_plugin(num_heads=2)", steps=2, eval_every=1, seeds=(0,),
                               test_size=8, width=16, progress=False)
        result = compare(config, log=_quiet)
        assert result.runs[0].error is None and len(result.runs[0].curve) == 2
    finally:
        mp.unregister_mixer("compare_test_plugin")


# -- runs ----------------------------------------------------------------------------------------------------------


def _tiny(**overrides) -> CompareConfig:
    settings = dict(task="copying", task_options={"seq_len": 12, "num_tokens": 3, "vocab_size": 8},
                    mixers="attention,long_conv=toeplitz(data_dependent=False)", steps=4, eval_every=2,
                    seeds=(0, 1), test_size=16, width=16, depth=1, heads=2, batch_size=8, progress=False)
    settings.update(overrides)
    return CompareConfig(**settings)


def test_a_run_is_reproducible_for_a_seed():
    first = compare(_tiny(), log=_quiet)
    second = compare(_tiny(), log=_quiet)
    for a, b in zip(first.runs, second.runs):
        assert a.error is None and a.curve == b.curve and a.train_loss == b.train_loss
    # another seed trains differently
    seed0 = [r for r in first.runs if r.seed == 0 and r.label == "attention"][0]
    seed1 = [r for r in first.runs if r.seed == 1 and r.label == "attention"][0]
    assert seed0.train_loss != seed1.train_loss


def test_summaries_orderings_and_json():
    config = _tiny(orderings=(Ordering("attention", "long_conv", "claim"),), seeds=(0, 1, 2))
    result = compare(config, log=_quiet)
    summaries = {s.label: s for s in result.summaries()}
    metrics = [r.metric for r in result.runs if r.label == "attention"]
    mean = sum(metrics) / 3
    assert math.isclose(summaries["attention"].mean, mean)
    assert math.isclose(summaries["attention"].std, (sum((m - mean) ** 2 for m in metrics) / 2) ** 0.5)
    check = result.check_orderings()[0]
    assert check["verdict"] in ("held", "did not hold") or check["verdict"].startswith("inconclusive (")
    saved = json.loads(json.dumps(result.as_dict(), default=str))
    assert len(saved["runs"]) == 6 and saved["orderings"][0]["better"] == "attention"
    assert "± " in result.table() and "attention > long_conv" in result.orderings_table()


def _set_metrics(result, values: dict[str, list[float]]) -> None:
    """Give the runs of ``result`` these final metrics (per label, in seed order)."""
    for label, metrics in values.items():
        runs = [r for r in result.runs if r.label == label]
        assert len(runs) == len(metrics)
        for run, value in zip(runs, metrics):
            run.metric = value


def test_ordering_verdicts():
    """Held only when significant (Welch, p < 0.05) over at least 3 seeds with the better entry above chance."""
    both = (Ordering("attention", "long_conv"), Ordering("long_conv", "attention"))
    one = compare(_tiny(seeds=(0,), orderings=both), log=_quiet)
    _set_metrics(one, {"attention": [0.9], "long_conv": [0.1]})
    assert [c["verdict"] for c in one.check_orderings()] == ["inconclusive (one seed)"] * 2
    assert one.check_orderings()[0]["p_value"] is None
    two = compare(_tiny(orderings=both), log=_quiet)
    _set_metrics(two, {"attention": [0.9, 0.8], "long_conv": [0.1, 0.2]})  # far apart, but two seeds
    assert [c["verdict"] for c in two.check_orderings()] == ["inconclusive (fewer than 3 seeds)"] * 2
    three = compare(_tiny(seeds=(0, 1, 2), orderings=both), log=_quiet)
    chance = three.task.chance
    assert chance == pytest.approx(1 / 6)  # copying with vocabulary 8: six data tokens
    _set_metrics(three, {"attention": [0.9, 0.8, 0.85], "long_conv": [0.3, 0.35, 0.32]})
    checks = three.check_orderings()
    assert [c["verdict"] for c in checks] == ["held", "did not hold"]
    assert checks[0]["p_value"] < 0.05 and checks[0]["seeds"] == 3 and checks[0]["chance"] == chance
    _set_metrics(three, {"attention": [0.7, 0.5, 0.6], "long_conv": [0.55, 0.6, 0.65]})
    assert three.check_orderings()[0]["verdict"] == "inconclusive (within noise)"
    _set_metrics(three, {"attention": [0.17, 0.18, 0.16], "long_conv": [0.1, 0.11, 0.1]})  # ahead, at chance
    assert three.check_orderings()[0]["verdict"] == "inconclusive (both at chance)"
    table = three.orderings_table()
    assert "p (Welch)" in table and "seeds" in table


def test_chance_levels_are_a_guess_among_the_answers():
    assert make_task("mqar", seq_len=32, num_kv_pairs=4, vocab_size=32).chance == 1 / 16  # 16 values
    assert make_task("copying", vocab_size=12).chance == 1 / 10                           # 10 data tokens
    regression = make_task("regression", dim=4, num_examples=8)
    assert regression.chance == 1.0 and not regression.higher_is_better                  # predicting 0
    assert DigitsTask().chance == 0.1


def test_welch_and_student_t_p_values():
    """The p-values (plain Python, no SciPy) at tabulated two-sided 5% critical values of Student's t, and Welch's
    test on worked numbers."""
    from mixer_plugins.tools.compare.stats import one_sample_t_test, student_t_two_sided_p, welch_t_test

    for df, critical in [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)]:
        assert student_t_two_sided_p(critical, df) == pytest.approx(0.05, abs=2e-4), df
    assert student_t_two_sided_p(0.0, 3) == pytest.approx(1.0)
    assert student_t_two_sided_p(float("inf"), 3) == 0.0
    # Welch: means 2 and 5, variances 1 and 4, n = 3 and 3 -> t = -3 / sqrt(5/3), df = (5/3)^2 / ((1/9 + 16/9) / 2)
    diff, p = welch_t_test([1.0, 2.0, 3.0], [3.0, 5.0, 7.0])
    df = (5 / 3) ** 2 / ((1 / 9 + 16 / 9) / 2)
    assert diff == -3.0 and p == pytest.approx(student_t_two_sided_p(3 / math.sqrt(5 / 3), df))
    assert welch_t_test([1.0, 1.0], [1.0, 1.0])[1] == 1.0 and welch_t_test([1.0, 1.0], [2.0, 2.0])[1] == 0.0
    assert one_sample_t_test([0.5, 0.5, 0.5], 0.5)[1] == 1.0
    with pytest.raises(ValueError):
        welch_t_test([1.0], [1.0, 2.0])


def test_verdicts_on_the_numbers_of_a_two_step_run():
    """Two steps, two seeds, both models near chance (0.063): no ordering is held, whatever the means say."""
    from mixer_plugins.tools.compare.stats import judge

    chance = 1 / 16
    seeds2 = judge([0.073, 0.073], [0.057, 0.053], higher_is_better=True, chance=chance)
    assert seeds2.verdict.startswith("inconclusive (fewer than 3 seeds") and seeds2.p_value is not None
    assert judge([0.073], [0.055], higher_is_better=True, chance=chance).verdict == "inconclusive (one seed)"
    seeds3 = judge([0.073, 0.066, 0.059], [0.055, 0.061, 0.052], higher_is_better=True, chance=chance)
    assert seeds3.verdict.startswith("inconclusive (both at chance")
    # lower is better (regression: predicting 0 scores 1)
    assert judge([0.2, 0.25, 0.22], [0.6, 0.55, 0.62], higher_is_better=False, chance=1.0).verdict == "held"
    assert judge([0.98, 1.01, 0.99], [1.0, 1.02, 1.01], higher_is_better=False,
                 chance=1.0).verdict.startswith("inconclusive (both at chance")


@pytest.mark.parametrize("seeds", ["0,1", "3"])
def test_a_two_step_preset_run_holds_no_ordering(capsys, seeds):
    """``mixer-plugins compare --preset hydra-classes --steps 2 --seeds 0,1``: every ordering is inconclusive (two
    seeds; and with three, both models at chance)."""
    from mixer_plugins.tools.cli import main

    assert main(["compare", "--preset", "hydra-classes", "--steps", "2", "--seeds", seeds, "--no-plots",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("attention > ", "toeplitz > ", "low_rank > ",
                                                                   "quasiseparable > "))]
    assert len(rows) == len(PRESETS["hydra-classes"].orderings), out
    assert all("inconclusive (" in row and " held " not in row for row in rows), out
    reason = "fewer than 3 seeds" if seeds == "0,1" else "both at chance"
    assert all(reason in row for row in rows), out


def test_a_saved_result_is_judged_again_and_recounted(tmp_path, capsys):
    """``--from``: a saved results.json's tables, its FLOPs counted by this version and its verdicts by this rule."""
    result = compare(_tiny(orderings=(Ordering("attention", "long_conv", "claim"),), out=tmp_path, seeds=(0, 1, 2)),
                     log=_quiet)
    saved = json.loads((tmp_path / "results.json").read_text())
    for run in saved["runs"]:
        run["flops"] = 1  # as an older version might have counted them
    for summary_run, value in zip(saved["runs"], (0.9, 0.8, 0.85, 0.3, 0.35, 0.32)):
        summary_run["metric"] = value
    (tmp_path / "old.json").write_text(json.dumps(saved))
    from mixer_plugins.tools.cli import main

    assert main(["compare", "--from", str(tmp_path / "old.json")]) == 0
    out = capsys.readouterr().out
    from mixer_plugins.tools.benchmarking import format_flops

    assert format_flops(result.runs[0].flops) in out and "| 1 |" not in out
    assert "| attention > long_conv | 0.850 ± 0.050 | 0.323 ± 0.025 | 3 | < 0.001 | held | claim |" in out
    assert main(["compare", "--from", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_failing_mixer_is_reported_and_the_others_run(monkeypatch):
    real = mp.create_mixer

    def create_mixer(name, *args, **kwargs):  # a mixer whose options are valid but which fails when built
        if name == "toeplitz":
            raise RuntimeError("cannot be built here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(mp, "create_mixer", create_mixer)
    config = _tiny(mixers="attention,broken=toeplitz(data_dependent=False)", seeds=(0,))
    result = compare(config, log=_quiet)
    by_label = {s.label: s for s in result.summaries()}
    assert by_label["attention"].mean is not None
    assert by_label["broken"].mean is None and "RuntimeError: cannot be built here" in by_label["broken"].error
    assert "FAILED" in result.table()


@pytest.mark.parametrize("entry, fragment", [
    ("quasi(d_state=abc)", "d_state"),
    ("quasi(d_sate=8)", "did you mean 'd_state'"),
    ("toeplitz(data_dependent=False,head_dim=7)", "head_dim"),
    ("attentoin", "did you mean 'attention'"),
    ("attention(num_heads=0)", "num_heads"),
    ("quasi(d_state=8", "parentheses"),
])
def test_every_mixer_entry_is_checked_before_any_training(monkeypatch, capsys, tmp_path, entry, fragment):
    from mixer_plugins.tools.compare import runner

    monkeypatch.setattr(runner, "train_run", lambda *a, **k: pytest.fail("trained before the entries were checked"))
    with pytest.raises(MixerError, match=fragment.replace("(", "\\(")):
        _tiny(mixers=f"attention,{entry}")
    args = _parse(["--mixers", f"attention,{entry}", "--out", str(tmp_path / "out"), "--no-progress"])
    assert run_compare(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mixer-plugins compare: error: ") and fragment in err
    assert not (tmp_path / "out").exists()                  # nothing written
    from mixer_plugins.tools.cli import main

    assert main(["compare", "--mixers", entry, "--quick", "--no-plots"]) == 2
    assert fragment in capsys.readouterr().err


def test_quick_runs_are_not_judged():
    assert preset_config("hydra-classes", quick=True).quick and not preset_config("hydra-classes").quick
    assert config_from_args(_parse(["--quick", "--no-plots"])).quick
    result = compare(_tiny(seeds=(0,), quick=True, orderings=(Ordering("attention", "long_conv", "claim"),)),
                     log=_quiet)
    assert [c["verdict"] for c in result.check_orderings()] == ["not judged (quick run)"]
    assert "not judged (quick run)" in result.orderings_table()


def test_no_preset_speaks_of_how_the_project_is_run():
    for preset in PRESETS.values():
        texts = [preset.paper, preset.reports, *(o.claim for o in preset.orderings)]
        assert not any(word in text.lower() for text in texts for word in ("issue", "session", "asked for")), preset


def test_regression_reports_the_least_squares_reference():
    config = _tiny(task="regression", task_options={"dim": 4, "num_examples": 10, "num_queries": 2},
                   mixers="attention", seeds=(0,))
    result = compare(config, log=_quiet)
    assert result.reference["least squares"] < 1e-3
    assert result.runs[0].metric > 0


# -- presets and the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_name_their_entries(name):
    config = preset_config(name)
    labels = {e.label for e in config.mixers}
    assert config.orderings and all(o.better in labels and o.worse in labels for o in config.orderings)
    assert PRESETS[name].reports and PRESETS[name].paper
    quick = preset_config(name, quick=True)
    assert quick.steps < config.steps and len(quick.seeds) == 1
    from mixer_plugins.tools.compare.stats import MIN_SEEDS

    assert len(config.seeds) >= MIN_SEEDS  # a full run can call its orderings held


def test_hydra_classes_includes_the_recall_outcome():
    config = preset_config("hydra-classes")
    assert config.task == "mqar"
    assert any(o.better == "attention" and o.worse == "long_conv" for o in config.orderings)
    long_conv = next(e for e in config.mixers if e.label == "long_conv")
    assert long_conv.name == "toeplitz" and long_conv.options["data_dependent"] is False


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_compare_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["compare", *argv])


def test_cli_quick_preset_run(tmp_path, capsys):
    args = _parse(["--preset", "structured-attention", "--quick", "--out", str(tmp_path), "--no-progress",
                   "--mixers", "attention,btt_attention(num_heads=2)", "--width", "16", "--heads", "2"])
    assert args.func is run_compare
    assert run_compare(args) == 0
    out = capsys.readouterr().out
    assert "btt_attention(num_heads=2)" in out and "normalized MSE" in out
    assert "not judged (quick run)" in out and "held" not in out and "issue" not in out
    for name in ("results.json", "results.md", "curves.png", "final.png"):
        assert (tmp_path / name).stat().st_size > 0
    # a saved result loads back (to redraw its plots or tables)
    from mixer_plugins.tools.compare import CompareResult

    loaded = CompareResult.load(tmp_path)
    assert [r.curve for r in loaded.runs] == [[tuple(p) for p in r["curve"]]
                                              for r in json.loads((tmp_path / "results.json").read_text())["runs"]]
    assert loaded.table() in out
    assert "normalized MSE" in (tmp_path / "results.md").read_text()


def test_cli_arguments_override_presets():
    args = _parse(["--preset", "hydra-classes", "--steps", "7", "--seeds", "0,4", "--task-option", "num_kv_pairs=2",
                   "--no-plots"])
    config = config_from_args(args)
    assert config.steps == 7 and config.seeds == (0, 4) and config.task_options == {"num_kv_pairs": 2}
    assert config.out is None and config.preset == "hydra-classes"
    assert config_from_args(_parse(["--seeds", "3", "--no-plots"])).seeds == (0, 1, 2)
    # fewer mixers keep the paper's orderings between the entries still compared
    fewer = config_from_args(_parse(["--preset", "hydra-classes", "--no-plots", "--mixers",
                                     "attention,long_conv=toeplitz(data_dependent=False),toeplitz"]))
    assert {(o.better, o.worse) for o in fewer.orderings} == {("attention", "long_conv"), ("toeplitz", "long_conv")}


def test_cli_reports_bad_input(capsys):
    assert run_compare(_parse(["--task", "mqar", "--task-option", "num_kv_pair=3", "--no-plots"])) == 2
    assert "did you mean 'num_kv_pairs'" in capsys.readouterr().err
    assert run_compare(_parse(["--preset", "hydra-clases"])) == 2
    assert "did you mean 'hydra-classes'" in capsys.readouterr().err
    assert run_compare(_parse(["--list"])) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("mqar", "copying", "regression", "digits", *PRESETS))


# -- worker processes, timing, partial results, the shared sampler -------------------------------------------------


def test_jobs_give_the_same_results_as_one_process(tmp_path):
    # two fresh worker processes (spawned) train the runs side by side; every number is that of jobs=1, in the
    # same order, whatever order the workers finish in
    torch.set_num_threads(1)
    config = _tiny(steps=3, seeds=(1, 0))
    one = compare(config, log=_quiet)
    two = compare(_tiny(steps=3, seeds=(1, 0), jobs=2), log=_quiet)
    assert [(r.label, r.seed) for r in two.runs] == [("attention", 1), ("attention", 0), ("long_conv", 1),
                                                     ("long_conv", 0)]
    for a, b in zip(one.runs, two.runs):
        assert b.error is None and (a.label, a.seed, a.curve, a.train_loss) == (b.label, b.seed, b.curve, b.train_loss)
    assert two.timing["jobs"] == 2 and two.timing["threads"] == 1
    # the workers' start-up is in the process-tree CPU time, not in the runs' own CPU time
    assert two.timing["process_cpu_seconds"] > two.timing["cpu_seconds"] > 0


def test_runs_record_cpu_time_and_results_are_kept_as_they_finish(tmp_path):
    seen = []

    def log(line: str) -> None:  # after each finished run, results.json already holds it
        if line.startswith(("attention seed", "long_conv seed")):
            seen.append(len(json.loads((tmp_path / "results.json").read_text())["runs"]))

    result = compare(_tiny(seeds=(0,), out=tmp_path), log=log)
    assert seen == [1, 2]
    for run in result.runs:
        assert run.cpu_seconds > 0 and run.train_seconds > 0
    assert result.timing["cpu_seconds"] == pytest.approx(sum(r.cpu_seconds for r in result.runs), abs=1e-2)
    assert result.timing["wall_seconds"] > 0 and result.timing["process_cpu_seconds"] >= result.timing["cpu_seconds"]
    from mixer_plugins.tools.compare import CompareResult

    assert CompareResult.load(tmp_path).timing == json.loads((tmp_path / "results.json").read_text())["timing"]
    # a comparison cut short: the summaries say how many of the seeds were run
    two_seeds = compare(_tiny(seeds=(0, 1)), log=_quiet)
    two_seeds.runs = [r for r in two_seeds.runs if not (r.label == "long_conv" and r.seed == 1)]
    notes = {s.label: (s.seeds, s.error) for s in two_seeds.summaries()}
    assert notes == {"attention": (2, None), "long_conv": (1, "1 of 2 seeds run")}
    attention = next(s for s in two_seeds.summaries() if s.label == "attention")
    assert attention.cpu_seconds == pytest.approx(sum(r.cpu_seconds for r in two_seeds.runs[:2]) / 2)
    assert "CPU time / seed" in two_seeds.table() and f"{attention.cpu_seconds:.1f} s" in two_seeds.table()


def test_the_token_tasks_share_one_position_sampler():
    from mixer_plugins.tools.compare.tasks import _scatter_slots

    slots = _scatter_slots(500, 9, 4, _gen(7), offset=3)
    assert slots.shape == (500, 4)
    assert torch.all(slots[:, 1:] > slots[:, :-1]) and int(slots.min()) >= 3 and int(slots.max()) <= 11
    assert set(slots.flatten().tolist()) == set(range(3, 12))  # every position in the region is used
    # both generators place their graded positions with it: the same generator state gives the same positions
    mqar = make_task("mqar", seq_len=17, num_kv_pairs=4, vocab_size=12, num_queries=4)
    gen = _gen(8)
    gen.manual_seed(8)
    torch.rand(1, 5, generator=gen).argsort(-1)  # the keys' draw
    torch.randint(0, 6, (1, 4), generator=gen)  # the values' draw
    expected = _scatter_slots(1, 9, 4, gen, offset=8)
    assert mqar.sample(1, _gen(8)).graded[0].nonzero()[:, 0].tolist() == expected[0].tolist()
    copying = make_task("copying", seq_len=12, num_tokens=3, vocab_size=8)
    gen = _gen(9)
    torch.randint(2, 8, (1, 3), generator=gen)  # the data tokens' draw
    expected = _scatter_slots(1, 9, 3, gen)
    assert (copying.sample(1, _gen(9)).inputs[0, :9] >= 2).nonzero()[:, 0].tolist() == expected[0].tolist()


def test_cli_jobs_and_a_single_seed():
    config = config_from_args(_parse(["--preset", "hydra-classes", "--jobs", "2", "--seeds", "0,", "--no-plots"]))
    assert config.jobs == 2 and config.seeds == (0,)
    with pytest.raises(MixerError, match="jobs"):
        _tiny(jobs=0)
