"""A mixer's state_dict records its name and options, and loading refuses a checkpoint of another mixer or of other
options, naming both; checkpoints without the record (older ones, converted ones) load as before."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from torch import nn

import mixer_plugins as mp
from mixer_plugins.mixers.base import MixerCheckpointMismatchError, read_mixer_record, strip_mixer_records
from mixer_plugins.mixers.records import mixer_record

_ALL = mp.list_mixers()


def build(name: str, seed: int = 0, **options):
    spec = mp.get_spec(name)
    torch.manual_seed(seed)
    return spec.build(spec.make_config(32, **{**spec.test_options, **options})).double().eval()


def _layout(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items() if not k.endswith("_extra_state")}


def _same_layout_pairs():
    """Pairs of registered mixers whose tensors have the same names and shapes: a plain load_state_dict would move the
    weights of one into the other without a word."""
    layouts = {}
    for name in _ALL:
        layouts[name] = _layout(build(name).state_dict())
    return [(a, b) for a, b in itertools.permutations(_ALL, 2) if layouts[a] == layouts[b]]


_PAIRS = _same_layout_pairs()


def test_there_are_mixers_with_the_same_layout():
    assert ("quasiseparable", "quasiseparable_no_shift") in _PAIRS  # the case the check exists for


@pytest.mark.parametrize("source, target", _PAIRS)
def test_a_checkpoint_of_another_mixer_is_refused_naming_both(source, target):
    state = build(source).state_dict()
    model = build(target, seed=1)
    with pytest.raises(MixerCheckpointMismatchError) as info:
        model.load_state_dict(state)
    message = str(info.value)
    assert repr(source) in message and repr(target) in message
    assert "strip_mixer_records" in message
    # asked to, it loads the weights anyway
    model.load_state_dict(strip_mixer_records(state))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items() if not k.endswith("_extra_state"))


@pytest.mark.parametrize("name, changed", [
    ("quasiseparable", {"norm_before_gate": False}),
    ("quasiseparable", {"dt_limit": (0.05, 1.0)}),
    ("attention", {"causal": True}),
    ("toeplitz", {"scale_length": 64}),
    ("mlr_attention", {"block_divide": False}),
    ("btt_attention", {"logit_scaling": "mup"}),
    ("vandermonde", {"frequency_scale": 0.01}),
])
def test_a_checkpoint_of_other_options_is_refused_naming_the_option(name, changed):
    state = build(name).state_dict()
    other = build(name, seed=1, **changed)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with pytest.raises(MixerCheckpointMismatchError, match=f"{next(iter(changed))}: "):
        other.load_state_dict(state)
    # the option really changes what the same weights compute: loading it silently would be a wrong answer
    other.load_state_dict(strip_mixer_records(state))
    with torch.no_grad():
        assert not torch.allclose(other(x), build(name)(x))


@pytest.mark.parametrize("name", _ALL)
def test_same_mixer_and_options_load_and_old_checkpoints_without_the_record_too(name):
    first, second = build(name, seed=0), build(name, seed=1)
    state = first.state_dict()
    record = read_mixer_record(state["_extra_state"])
    assert record["mixer"] == mp.get_spec(name).name
    assert record["options"]["dim"] == 32 and record == mixer_record(first)
    x = torch.randn(2, min(9, first.max_seq_len or 9), 32, dtype=torch.float64)
    old = {k: v for k, v in state.items() if k != "_extra_state"}  # a checkpoint saved before the record existed
    result = second.load_state_dict(old)                             # strict: no missing key
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        assert torch.equal(second(x), first(x))
    second.load_state_dict(state)


def test_options_that_do_not_change_the_weights_meaning_may_differ():
    state = build("quasiseparable", chunk_size=8).state_dict()
    build("quasiseparable", chunk_size=32).load_state_dict(state)
    state = build("quasiseparable", conv_init=0.01, dt_min=0.01, A_init_range=(1.0, 4.0)).state_dict()
    build("quasiseparable").load_state_dict(state)  # initialisation only: the loaded weights replace the draws
    state = build("mlr_attention", attn_dropout=0.1).state_dict()
    build("mlr_attention").load_state_dict(state)
    # max_seq_len does not matter to a mixer that runs at any length (hosts set it from their own size) ...
    state = build("toeplitz", max_seq_len=64).state_dict()
    build("toeplitz", max_seq_len=128).load_state_dict(state)
    # ... but it does to a data-independent one whose matrix depends on it (the DFT has no weights to say so)
    state = build("vandermonde", data_dependent=False, max_seq_len=16).state_dict()
    with pytest.raises(MixerCheckpointMismatchError, match="max_seq_len: 16 -> 24"):
        build("vandermonde", data_dependent=False, max_seq_len=24).load_state_dict(state)


def test_the_record_travels_through_torch_save_weights_only_and_dtype_conversion():
    source = build("quasiseparable")
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert read_mixer_record(loaded["_extra_state"]) == mixer_record(source)
    halves = {k: v.to(torch.bfloat16) for k, v in loaded.items()}  # a checkpoint converted wholesale
    assert read_mixer_record(halves["_extra_state"]) == mixer_record(source)
    with pytest.raises(MixerCheckpointMismatchError):
        build("quasiseparable_no_shift").load_state_dict(halves)


def test_the_error_names_where_the_mixer_sits_in_a_model():
    model = nn.Sequential(nn.Linear(32, 32), build("quasiseparable_no_diag"))
    state = nn.Sequential(nn.Linear(32, 32), build("quasiseparable")).state_dict()
    assert "1._extra_state" in state
    with pytest.raises(MixerCheckpointMismatchError, match=r"^1: the checkpoint holds mixer 'quasiseparable'"):
        model.load_state_dict(state)


def test_an_entry_that_is_not_a_record_is_refused():
    state = build("attention").state_dict()
    state["_extra_state"] = torch.tensor([1.5, 2.0])
    with pytest.raises(MixerCheckpointMismatchError, match="not a mixer-plugins record"):
        build("attention").load_state_dict(state)
    assert strip_mixer_records(state).keys() == state.keys()  # only records are stripped


def test_a_mixer_built_without_the_registry_records_its_class():
    from mixer_plugins.mixers.quasiseparable import QuasiseparableConfig, QuasiseparableMixer

    bare = QuasiseparableMixer(QuasiseparableConfig(dim=32, head_dim=16, d_state=8))
    record = read_mixer_record(bare.state_dict()["_extra_state"])
    assert record["mixer"] is None and record["class"] == "QuasiseparableMixer"
    build("quasiseparable").load_state_dict(bare.state_dict())  # a registered one compares by class then
    with pytest.raises(MixerCheckpointMismatchError, match="class 'QuasiseparableMixer' -> 'NoShiftMixer'"):
        build("quasiseparable_no_shift").load_state_dict(bare.state_dict())


def test_the_hydra_drop_in_keeps_the_released_key_set():
    from mixer_plugins.compat import Hydra

    assert not any(k.endswith("_extra_state") for k in Hydra(16, d_state=4, headdim=8).state_dict())


def test_timm_models_refuse_a_checkpoint_of_another_mixer():
    timm = pytest.importorskip("timm")
    import mixer_plugins.backbones.timm  # noqa: F401  (registers the mixer ViTs)

    small = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    options = dict(head_dim=16, d_state=8)
    source = timm.create_model("vit_tiny", mixer="quasiseparable", mixer_options=options, **small)
    state = source.state_dict()
    assert "blocks.0.attn.mixer._extra_state" in state
    same = timm.create_model("vit_tiny", mixer="quasi", mixer_options=options, **small)
    same.load_state_dict(state)
    other = timm.create_model("vit_tiny", mixer="quasiseparable_no_shift", mixer_options=options, **small)
    with pytest.raises(MixerCheckpointMismatchError, match=r"^blocks\.0\.attn\.mixer: .*'quasiseparable_no_shift'"):
        other.load_state_dict(state)


def test_records_of_other_library_versions_compare_by_defaults():
    """A checkpoint saved before an option existed loads while the mixer keeps that option's default (what the
    library did then)."""
    from mixer_plugins.mixers.records import encode_record as _encode

    source = build("mlr_attention")
    state = source.state_dict()
    record = read_mixer_record(state["_extra_state"])
    older = {**record, "options": {k: v for k, v in record["options"].items() if k != "ln_bias"}}
    state["_extra_state"] = _encode(older)
    build("mlr_attention").load_state_dict(state)
    with pytest.raises(MixerCheckpointMismatchError, match=r"ln_bias: \(not in the checkpoint: its default False\)"):
        build("mlr_attention", ln_bias=True).load_state_dict(strip_mixer_records(state) | {
            "_extra_state": state["_extra_state"], "q_norm.bias": torch.zeros(16, dtype=torch.float64),
            "k_norm.bias": torch.zeros(16, dtype=torch.float64)})
    # the comparison itself, on a config model: an option the checkpoint predates is compared with its default
    from mixer_plugins.mixers.base import record_differences

    class Widths(mp.MixerConfig):
        width: int = 4

    own = {"mixer": "m", "class": "M", "options": {"dim": 8, "width": 6}}
    saved = {"mixer": "m", "class": "M", "options": {"dim": 8}}
    assert record_differences(saved, own, length_free=True, config_class=Widths) == [
        "width: (not in the checkpoint: its default 4) -> 6"]
    own["options"]["width"] = 4
    assert record_differences(saved, own, length_free=True, config_class=Widths) == []
