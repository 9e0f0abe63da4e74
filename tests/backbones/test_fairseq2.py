"""The fairseq2 adapter: entry point, families and archs, config-level mixer swap, padding, packing, the NLLB
wrapper, clear errors, and the MLM recipe (train, checkpoint, reload through fairseq2's ``load_model``).

fairseq2 is initialised once per process (lazily, by the first fixture that needs it, *without* ``extras``:
our families must come from the installed package's ``fairseq2.extension`` entry point). Every test is in
one xdist group so a single worker pays the ~5-10 s initialisation.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

# fairseq2 reads these at import/init time: fail loudly on a broken extension, no progress bars, CPU only.
os.environ.setdefault("FAIRSEQ2_EXTENSION_TRACE", "1")
os.environ.setdefault("FAIRSEQ2_NO_PROGRESS", "1")
os.environ.setdefault("FAIRSEQ2_DEVICE", "cpu")

pytest.importorskip("fairseq2")

import torch  # noqa: E402
from fairseq2.device import CPU  # noqa: E402
from fairseq2.nn import BatchLayout  # noqa: E402
from forked import python_m  # noqa: E402

import mixer_plugins as mp  # noqa: E402
from mixer_plugins import InvalidMixerOptions, MixerConfig, MixerContext, MixerSpec, UnknownMixerError  # noqa: E402
from mixer_plugins.mixers.base import MatrixMixer  # noqa: E402

pytestmark = [pytest.mark.fairseq2, pytest.mark.xdist_group("fairseq2")]

# Collected now, so a mixer registered later (ours or a plugin's) is covered without editing this file.
REGISTERED_MIXERS = mp.list_mixers()

REPO = Path(__file__).resolve().parents[2]


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hub(fs2):
    return fs2.get_mixer_encoder_hub()


def _tiny(fs2, **changes):
    """The ``tiny`` arch (through fairseq2's arch registry) with changes."""
    return replace(fs2.get_mixer_encoder_hub().get_arch_config("tiny"), **{"dropout_p": 0.0, **changes})


def _padded_tokens(lengths: list[int], *, seed: int, vocab: int = 200) -> torch.Tensor:
    """Random non-special byte ids (>= 4), right-padded with pad_idx 0."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=gen)
    for row, n in enumerate(lengths):
        tokens[row, n:] = 0
    return tokens


def _example_mixer() -> str:
    """A registered, loadable mixer other than attention, for the tests that need one swap (not a special case:
    the recipe and NLLB tests must run *some* non-default mixer). Prefers ``quasi``."""
    candidates = ["quasi"] + [n for n in REGISTERED_MIXERS if n != "attention"]
    for name in candidates:
        try:
            spec = mp.get_spec(name)
        except mp.MixerError:
            continue
        if spec.name != "attention":
            return name
    return "attention"


# -- 1. entry point, families, archs ----------------------------------------------------------------

def test_extension_is_declared_by_the_installed_package():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="fairseq2.extension") if ep.value.startswith("mixer_plugins.")]
    assert len(eps) == 1, f"expected one mixer-plugins fairseq2.extension entry point, got {eps}"
    assert eps[0].value == "mixer_plugins.backbones.fairseq2:setup_fairseq2_extension"
    assert eps[0].dist is not None and eps[0].dist.metadata["Name"] == "mixer-plugins"



def test_the_package_loads_its_names_on_first_use(fs2):
    """Importing the package imports neither fairseq2 nor torch (so the python -m commands answer --help at once);
    the entry point fairseq2 loads still finds setup_fairseq2_extension, and every name of __all__ resolves to its
    module's object."""
    import importlib

    code = ("import sys\nimport mixer_plugins.backbones.fairseq2 as fs2\n"
            "print(sorted(m for m in ('fairseq2', 'torch') if m in sys.modules))\n"
            "from importlib.metadata import entry_points\n"
            "ep = next(e for e in entry_points(group='fairseq2.extension') if e.value.startswith('mixer_plugins.'))\n"
            "print(ep.load() is fs2.setup_fairseq2_extension)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
    for name in fs2.__all__:
        value = getattr(fs2, name)
        if name != "setup_fairseq2_extension":
            assert value is getattr(importlib.import_module(f"{fs2.__name__}.{fs2._LAZY[name]}"), name), name
    assert set(fs2.__all__) <= set(dir(fs2))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        fs2.nonexistent  # noqa: B018
    from mixer_plugins.backbones.fairseq2 import generate, lm  # submodules are still found

    assert generate.main and lm.MixerLmRecipe.__module__ == f"{fs2.__name__}.recipe"

def test_families_and_archs_come_from_the_entry_point(resolver):
    from fairseq2.models import ModelFamily
    from fairseq2.models.nllb import get_nllb_model_hub

    # init ran without extras: these families exist only because fairseq2 ran our entry point.
    families = set(resolver.iter_keys(ModelFamily))
    assert {"mixer_encoder", "nllb_mixer"} <= families
    encoder_family = resolver.resolve(ModelFamily, key="mixer_encoder")
    assert {"tiny", "small", "base", "base_hydra"} <= encoder_family.get_archs()
    nllb_mixer_family = resolver.resolve(ModelFamily, key="nllb_mixer")
    assert nllb_mixer_family.get_archs() == get_nllb_model_hub().get_archs()


def test_paper_and_generic_presets(hub):
    base = hub.get_arch_config("base")
    assert (base.model_dim, base.num_layers, base.num_heads, base.ffn_inner_dim) == (768, 12, 12, 3072)
    assert base.mixer == "attention" and base.mixer_options == {}
    hydra = hub.get_arch_config("base_hydra")
    # Hydra BERT: 23 mixer-only (no FFN) post-norm layers of the quasiseparable mixer, no position embeddings.
    assert (hydra.model_dim, hydra.num_layers, hydra.ffn_inner_dim, hydra.pos_encoder) == (768, 23, 0, "none")
    assert hydra.norm_order.name == "POST"
    assert mp.get_spec(hydra.mixer).name == "quasiseparable"
    assert hydra.validate().has_error() is False
    # Presets are fresh objects: editing one does not leak into the next lookup.
    hub.get_arch_config("tiny").mixer_options["x"] = {}
    assert hub.get_arch_config("tiny").mixer_options == {}


def test_setup_is_idempotent(fs2):
    from fairseq2.models import ModelFamily
    from fairseq2.models.nllb import NllbConfig
    from fairseq2.runtime.dependency import DependencyContainer

    container = DependencyContainer()
    fs2.setup_fairseq2_extension(container)
    fs2.setup_fairseq2_extension(container)  # e.g. entry point + init_fairseq2(extras=setup): no duplicate error
    assert sorted(container.iter_keys(ModelFamily)) == ["mixer_decoder", "mixer_encoder", "nllb_mixer"]
    assert sorted(container.iter_keys(fs2.MixerEncoderConfig)) == ["base", "base_hydra", "small", "tiny"]
    assert sorted(container.iter_keys(fs2.MixerDecoderConfig)) == ["base", "small", "tiny"]
    assert list(container.iter_keys(NllbConfig)) == []  # nothing of upstream is touched


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Modules imported by statements that run at import time (not inside functions)."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append("." * node.level + (node.module or ""))
                found.extend("." * node.level + alias.name for alias in node.names if node.level)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [])
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def test_import_mixer_plugins_does_not_import_fairseq2():
    """fairseq2 is an optional extra: no module outside this adapter imports it (or the adapter) at import."""
    package = REPO / "mixer_plugins"
    adapter = package / "backbones" / "fairseq2"
    offenders = []
    for path in package.rglob("*.py"):
        if adapter in path.parents:
            continue
        for name in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if "fairseq2" in name.split("."):
                offenders.append(f"{path.relative_to(REPO)}: {name}")
    assert not offenders, offenders


# -- 2. the config-level swap, for every registered mixer ----------------------------------------------

@pytest.mark.parametrize("name", REGISTERED_MIXERS)
def test_config_swap_every_registered_mixer(fs2, hub, name):
    """One config field swaps the mixer; forward/backward on a padded batch; real positions equal the
    unpadded rows, ignore pad contents, and equal a packed batch of the same sequences."""
    spec = mp.get_spec(name)  # a broken plugin fails here, with its distribution and error
    # The spec's small test options, namespaced under the mixer's name, exactly as a user would write them.
    config = _tiny(fs2, mixer=name, mixer_options={name: dict(spec.test_options)})
    assert config.validate().has_error() is False, config.validate()
    torch.manual_seed(0)
    model = hub.create_new_model(config, device=CPU, dtype=torch.float64)

    attns = [layer.self_attn for layer in model.encoder.layers]
    assert all(isinstance(a, fs2.MixerAttention) and a.mixer_name == spec.name for a in attns)
    assert attns[0].mixer is not attns[1].mixer  # one mixer per layer
    mixer = attns[0].mixer
    # Sizes the mixer cannot know come from the model unless the spec's options set them.
    assert mixer.dim == config.model_dim
    if "max_seq_len" in spec.config.model_fields and "max_seq_len" not in spec.test_options:
        assert mixer.config.max_seq_len == config.max_seq_len

    length = min(12, mixer.max_seq_len or 12)
    lengths = [length, max(1, length - 5), 1]
    tokens = _padded_tokens(lengths, seed=1)
    layout = BatchLayout.of(tokens, lengths)
    real = layout.position_indices >= 0

    # forward + backward
    model.train()
    loss = model(tokens, layout, targets=tokens, reduction="mean")
    assert torch.isfinite(loss)
    loss.backward()
    mixer_params = [p for a in attns for p in a.parameters() if p.requires_grad]
    assert mixer_params, "the mixer has no trainable parameters"
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixer_params)
    assert sum(p.grad.abs().sum() for p in mixer_params) > 0

    model.eval()
    with torch.no_grad():
        hidden = model.encode(tokens, layout)
        # Pad contents do not reach real positions.
        noisy = torch.where(real, tokens, _padded_tokens([max(lengths)] * 3, seed=2))
        hidden_noisy = model.encode(noisy, layout)
        torch.testing.assert_close(hidden_noisy[real], hidden[real], rtol=0, atol=1e-10)
        # Each real row equals the same sequence run alone.
        for row, n in enumerate(lengths):
            alone = model.encode(tokens[row:row + 1, :n], BatchLayout.of(tokens[row:row + 1, :n]))
            torch.testing.assert_close(hidden[row, :n], alone[0], rtol=1e-9, atol=1e-9)
        # A packed batch of the same sequences (plus two trailing pad tokens) gives the same outputs.
        packed = torch.cat([tokens[row, :n] for row, n in enumerate(lengths)] + [torch.zeros(2, dtype=torch.long)])
        packed_layout = BatchLayout.of(packed, lengths, packed=True)
        hidden_packed = model.encode(packed, packed_layout)
        torch.testing.assert_close(hidden_packed[: sum(lengths)], hidden[real], rtol=1e-9, atol=1e-9)


def _length_limited_mixers() -> list[str]:
    """Registered mixers that can be data-independent (free L-sized parameters, a ``max_seq_len`` option)."""
    names = []
    for name in REGISTERED_MIXERS:
        try:
            spec = mp.get_spec(name)
        except mp.MixerError:
            continue  # a broken plugin is reported by test_config_swap_every_registered_mixer
        if spec.data_dependent in ("no", "option") and "max_seq_len" in spec.config.model_fields:
            names.append(name)
    return names


@pytest.mark.parametrize("name", _length_limited_mixers())
def test_model_max_seq_len_reaches_data_independent_mixers(fs2, hub, name):
    """The model's max_seq_len sizes a data-independent mixer; longer inputs fail with SequenceLengthError."""
    spec = mp.get_spec(name)
    options = {k: v for k, v in spec.test_options.items() if k != "max_seq_len"}
    if spec.data_dependent == "option" and "data_dependent" in spec.config.model_fields:
        options["data_dependent"] = False
    # No position table, so the mixer itself is what limits the length.
    config = _tiny(fs2, mixer=name, mixer_options={name: options}, max_seq_len=24, pos_encoder="none")
    torch.manual_seed(0)
    model = hub.create_new_model(config, device=CPU).eval()
    mixer = model.encoder.layers[0].self_attn.mixer
    if mixer.max_seq_len is None:
        pytest.skip(f"{name}: no data-independent mode selectable through a 'data_dependent' option")
    assert mixer.max_seq_len == 24
    with torch.no_grad():
        tokens = _padded_tokens([24, 9], seed=9)
        assert torch.isfinite(model.encode(tokens, BatchLayout.of(tokens, [24, 9]))).all()
        longer = _padded_tokens([25], seed=9)
        with pytest.raises(mp.SequenceLengthError, match="max_seq_len=24"):
            model.encode(longer, BatchLayout.of(longer))


# -- 3. the adapter contract -------------------------------------------------------------------------

def test_adapter_maps_layout_to_mask_and_refuses_what_it_cannot_do(fs2):
    from fairseq2.error import NotSupportedError
    from fairseq2.models.transformer import AttentionBiasCache
    from fairseq2.nn import IncrementalStateBag

    torch.manual_seed(0)
    attn = fs2.MixerAttention.create("attention", 16, num_heads=2).double()
    assert attn.mixer.config.num_heads == 2 and attn.mixer.causal is False
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    layout = BatchLayout.of(x, [5, 3])
    cache = AttentionBiasCache()
    out = attn(x, layout, keys=x, keys_layout=layout, values=x, bias_cache=cache)
    # The same as our mixer called directly with mask = position_indices >= 0.
    expected = attn.mixer(x, mask=torch.tensor([[True] * 5, [True] * 3 + [False] * 2]))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert fs2.padding_mask(BatchLayout.of(x)) is None  # unpadded: the mixer's unmasked path

    with pytest.raises(NotSupportedError, match="incremental decoding"):
        attn(x, layout, keys=x, keys_layout=layout, values=x, bias_cache=cache, state_bag=IncrementalStateBag(8))
    other = x.clone()
    with pytest.raises(NotSupportedError, match="cross-attention"):
        attn(x, layout, keys=other, keys_layout=layout, values=other, bias_cache=cache)


def test_attention_weight_hooks_receive_the_mixer_matrix(fs2):
    from fairseq2.models.transformer import AttentionBiasCache, AttentionWeightStoreHook

    torch.manual_seed(0)
    attn = fs2.MixerAttention(fs2.resolve_mixer("attention", {}, dim=16, host_options={"num_heads": 4})).double()
    store: list = []
    attn.register_attn_weight_hook(AttentionWeightStoreHook(store))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    layout = BatchLayout.of(x, [6, 4])
    out = attn(x, layout, keys=x, keys_layout=layout, values=x, bias_cache=AttentionBiasCache())
    (attns, weights), = store
    assert attns is out and weights.shape == (2, 4, 6, 6)
    mask = layout.position_indices >= 0
    torch.testing.assert_close(weights, attn.mixer.materialize(x, mask=mask))
    torch.testing.assert_close(weights[1, :, :4, :4].sum(-1), torch.ones(4, 4, dtype=torch.float64))


def test_classification_head_and_mlm_loss(fs2, hub):
    torch.manual_seed(0)
    model = hub.create_new_model(_tiny(fs2, num_classes=3, pooling="mean"), device=CPU, dtype=torch.float64)
    model.eval()
    tokens = _padded_tokens([7, 4], seed=3)
    layout = BatchLayout.of(tokens, [7, 4])
    with torch.no_grad():
        logits = model.classify(tokens, layout)
        alone = model.classify(tokens[1:, :4], BatchLayout.of(tokens[1:, :4]))
        hidden = model.encode(tokens, layout)
        # MLM loss over a target mask = mean negative log-likelihood from the full logits, written out.
        target_mask = torch.zeros_like(tokens, dtype=torch.bool)
        target_mask[0, [1, 5]] = True
        target_mask[1, 2] = True
        loss = model(tokens, layout, tokens, target_mask=target_mask, reduction="mean")
        full_logits = model(tokens, layout)
    assert logits.shape == (2, 3)
    torch.testing.assert_close(logits[1], alone[0], rtol=1e-9, atol=1e-9)  # mean pooling ignores pads
    log_probs = full_logits.log_softmax(-1)
    expected = -log_probs[target_mask].gather(-1, tokens[target_mask][:, None]).mean()
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=1e-6, atol=1e-6)
    assert hidden.shape == (2, 7, 32)
    with pytest.raises(Exception, match="no classification head"):
        hub.create_new_model(_tiny(fs2), device=CPU).classify(tokens, layout)


# -- 4. NLLB wrapper ---------------------------------------------------------------------------------

def _tiny_nllb_fields() -> dict:
    return dict(model_dim=32, max_seq_len=64, vocab_size=100, num_encoder_layers=2, num_decoder_layers=1,
                num_encoder_attn_heads=4, num_decoder_attn_heads=4, ffn_inner_dim=64, dropout_p=0.0)


def _seq2seq(model, src, src_lens):
    tgt = torch.randint(4, 100, (src.shape[0], 6), generator=torch.Generator().manual_seed(5))
    return model(src, BatchLayout.of(src, src_lens), tgt[:, :-1], BatchLayout.of(tgt[:, :-1]), tgt[:, 1:],
                 reduction="mean")


@pytest.mark.parametrize("mixer", ["attention", "mha"])
def test_nllb_wrapper_with_attention_is_upstream_nllb(fs2, mixer):
    from fairseq2.models.nllb import NllbConfig, get_nllb_model_hub
    from fairseq2.models.transformer import StandardMultiheadAttention

    torch.manual_seed(0)
    upstream = get_nllb_model_hub().create_new_model(NllbConfig(**_tiny_nllb_fields()), device=CPU)
    torch.manual_seed(0)
    wrapped = fs2.get_nllb_mixer_hub().create_new_model(
        fs2.NllbMixerConfig(**_tiny_nllb_fields(), mixer=mixer), device=CPU)
    assert type(wrapped.encoder.layers[0].self_attn) is StandardMultiheadAttention
    up_state, our_state = upstream.state_dict(), wrapped.state_dict()
    assert list(up_state) == list(our_state)  # same parameter names: NLLB checkpoints load unchanged
    assert all(torch.equal(up_state[k], our_state[k]) for k in up_state)
    src = _padded_tokens([9, 5], seed=4, vocab=100)
    torch.testing.assert_close(_seq2seq(wrapped, src, [9, 5]), _seq2seq(upstream, src, [9, 5]), rtol=0, atol=0)


def test_nllb_wrapper_swaps_only_the_encoder_self_attention(fs2):
    from fairseq2.models.transformer import StandardMultiheadAttention

    name = _example_mixer()
    spec = mp.get_spec(name)
    config = fs2.NllbMixerConfig(**_tiny_nllb_fields(), mixer=name, mixer_options={name: dict(spec.test_options)})
    assert not config.validate().has_error()
    torch.manual_seed(0)
    model = fs2.get_nllb_mixer_hub().create_new_model(config, device=CPU, dtype=torch.float64)
    assert all(isinstance(layer.self_attn, fs2.MixerAttention) for layer in model.encoder.layers)
    decoder_layer = model.decoder.layers[0]
    assert type(decoder_layer.self_attn) is StandardMultiheadAttention
    assert type(decoder_layer.encoder_decoder_attn) is StandardMultiheadAttention
    src = _padded_tokens([9, 5], seed=4, vocab=100)
    loss = _seq2seq(model, src, [9, 5])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.encoder.layers[0].self_attn.parameters())
    # Encoder outputs at real positions ignore pad contents.
    model.eval()
    with torch.no_grad():
        layout = BatchLayout.of(src, [9, 5])
        real = layout.position_indices >= 0
        encode = lambda s: model.encoder(*model.encoder_frontend(s, layout))  # noqa: E731
        noisy = torch.where(real, src, torch.randint(4, 100, src.shape, generator=torch.Generator().manual_seed(6)))
        torch.testing.assert_close(encode(noisy)[real], encode(src)[real], rtol=0, atol=1e-10)


def test_nllb_wrapper_reexposes_the_nllb_archs(fs2):
    from fairseq2.models.nllb import NllbConfig, get_nllb_model_hub

    ours = fs2.get_nllb_mixer_hub().get_arch_config("dense_600m")
    upstream = get_nllb_model_hub().get_arch_config("dense_600m")
    assert isinstance(ours, fs2.NllbMixerConfig) and ours.mixer == "attention" and ours.mixer_options == {}
    assert all(getattr(ours, f.name) == getattr(upstream, f.name) for f in fields(NllbConfig))


# -- 5. clear errors ---------------------------------------------------------------------------------

BAD_CONFIGS = {
    "misspelt mixer": (dict(mixer="attentoin"), UnknownMixerError, r"did you mean 'attention'"),
    "misspelt option": (dict(mixer="attention", mixer_options={"attention": {"num_head": 2}}),
                        InvalidMixerOptions, r"unknown option 'num_head'; did you mean 'num_heads'"),
    "bad option value": (dict(mixer="attention", mixer_options={"attention": {"num_heads": 5}}),
                         InvalidMixerOptions, r"not divisible by num_heads \(5\)"),
    "bad value from the model": (dict(mixer="attention", num_heads=3), InvalidMixerOptions,
                                 r"num_heads=3(, causal=False)? came from the model config"),
    "misspelt namespace": (dict(mixer="attention", mixer_options={"attentoin": {"num_heads": 2}}),
                           UnknownMixerError, r"unknown mixer 'attentoin'; did you mean 'attention'"),
    "namespace not a mapping": (dict(mixer="attention", mixer_options={"attention": 4}), InvalidMixerOptions,
                                r"must be a mapping of option names to values"),
    "same mixer twice": (dict(mixer="attention", mixer_options={"attention": {}, "mha": {}}),
                         InvalidMixerOptions, r"given under several names"),
    "dim in options": (dict(mixer="attention", mixer_options={"attention": {"dim": 8}}), InvalidMixerOptions,
                       r"'dim' is set by the model"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_mixer_config_fails_with_our_message(fs2, hub, case):
    from fairseq2.utils.validation import StandardObjectValidator, ValidationError

    changes, error, pattern = BAD_CONFIGS[case]
    config = _tiny(fs2, **changes)
    # fairseq2's own validation (what recipes and asset cards run) reports our message...
    with pytest.raises(ValidationError, match=pattern):
        StandardObjectValidator().validate(config)
    # ...and building without validation (hub.create_new_model) raises our error, before anything is built.
    with pytest.raises(error, match=pattern):
        hub.create_new_model(config, device=CPU)


NLLB_BAD_CONFIGS = {
    "misspelt mixer": (dict(mixer="attentoin"), r"did you mean 'attention'"),
    "misspelt namespace": (dict(mixer="attention", mixer_options={"attentoin": {}}), r"did you mean 'attention'"),
    # With mixer=attention the wrapper keeps fairseq2's attention, which our options cannot configure.
    "options for upstream attention": (dict(mixer="attention", mixer_options={"attention": {"num_heads": 2}}),
                                       r"keeps fairseq2's own attention"),
}


@pytest.mark.parametrize("case", list(NLLB_BAD_CONFIGS))
def test_bad_nllb_mixer_config_fails_with_our_message(fs2, case):
    changes, pattern = NLLB_BAD_CONFIGS[case]
    config = fs2.NllbMixerConfig(**_tiny_nllb_fields(), **changes)
    assert re.search(pattern, str(config.validate()))
    with pytest.raises(mp.MixerError, match=pattern):
        fs2.get_nllb_mixer_hub().create_new_model(config, device=CPU)


def test_structural_config_errors_are_reported(fs2):
    config = _tiny(fs2, model_dim=0, dropout_p=1.5, pad_idx=999)
    result = str(config.validate())
    assert "`model_dim` must be >= 1" in result and "`dropout_p` must be in [0, 1)" in result
    assert "`pad_idx` must be in [0, vocab_size=264)" in result


# -- 6. meta-device loading of plugin mixers -----------------------------------------------------------

class _MetaHostileConfig(MixerConfig):
    pass


class _MetaHostileMixer(MatrixMixer):
    """Its constructor needs real values (``.item()`` fails on meta) and it has a non-persistent buffer."""

    def __init__(self, config):
        super().__init__(config)
        self.value = torch.nn.Linear(config.dim, config.dim)
        self.decay = float(torch.linspace(0.5, 0.9, 3)[1].item())  # fails on the meta device
        self.register_buffer("lags", torch.arange(64, dtype=torch.get_default_dtype()), persistent=False)

    def prepare(self, x, mask):
        return MixerContext(values=self.value(x)[:, :, None, :], mask=mask)

    def matrix(self, ctx):
        n = ctx.values.shape[1]
        lag = self.lags[:n, None] - self.lags[None, :n]
        weights = (self.decay ** lag.abs()).to(ctx.values.dtype)
        return weights.expand(ctx.values.shape[0], 1, n, n)

    def finish(self, ctx, y):
        return y.flatten(2)

    def flops_breakdown(self, batch, length):
        return {"mix": 2 * batch * length * length * self.dim}


def test_plugin_mixer_survives_fairseq2_meta_device_loading(fs2, hub, tmp_path):
    spec = MixerSpec(name="meta_hostile_test_mixer", config=_MetaHostileConfig, builder=_MetaHostileMixer)
    mp.register_mixer(spec)
    try:
        config = _tiny(fs2, mixer=spec.name)
        torch.manual_seed(0)
        model = hub.create_new_model(config, device=CPU).eval()
        path = tmp_path / "model.pt"
        torch.save(model.state_dict(), path)
        # fairseq2 builds on meta, moves to empty CPU storage, loads, then resets non-persistent buffers.
        loaded = hub.load_custom_model(path, config, device=CPU).eval()
        tokens = _padded_tokens([9, 6], seed=7)
        layout = BatchLayout.of(tokens, [9, 6])
        with torch.no_grad():
            torch.testing.assert_close(loaded.encode(tokens, layout), model.encode(tokens, layout), rtol=0, atol=0)
    finally:
        mp.unregister_mixer(spec.name)


def test_example_plugin_mixer_is_initialised_after_meta_to_empty_and_reset(fs2, hub):
    """fairseq2 (and FSDP) build on the meta device, allocate with ``to_empty`` and call ``reset_parameters``: the
    example plugin's own parameter, ``decay_logit``, comes out as a fresh build has it, not as uninitialised memory."""
    pytest.importorskip("mixer_plugins_example", reason="the example plugin (examples/third_party_plugin) is not "
                                                        "installed")
    torch.manual_seed(0)
    fresh = mp.create_mixer("ema", 32, num_heads=4)
    with torch.device("meta"):
        mixer = mp.create_mixer("ema", 32, num_heads=4)
    mixer.to_empty(device="cpu")
    with torch.no_grad():
        mixer.decay_logit.fill_(float("nan"))  # what to_empty may leave there
    torch.manual_seed(0)
    mixer.reset_parameters()
    state = mixer.state_dict()
    assert [k for k, v in fresh.state_dict().items() if v.is_floating_point() and not torch.equal(state[k], v)] == []
    # and in a fairseq2 model built on meta and materialised the same way
    config = _tiny(fs2, mixer="ema")
    model = hub.create_new_model(config, device=CPU, meta=True)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, MatrixMixer):
            with torch.no_grad():
                module.decay_logit.fill_(float("nan"))
            module.reset_parameters()
            assert torch.equal(module.decay_logit, fresh.decay_logit)


# -- 7a. the recipe's data: corpus, tokenizer, masking, reader ------------------------------------------

def test_byte_tokenizer_and_generated_corpus(fs2):
    from mixer_plugins.backbones.fairseq2.corpus import ByteTokenizer, generate_corpus

    tok = ByteTokenizer()
    ids = tok.encode("héllo", max_len=32)
    assert ids == [2] + [b + 4 for b in "héllo".encode()] + [3]
    assert tok.decode(ids) == "<s>héllo</s>"
    assert len(tok.encode("x" * 100, max_len=10)) == 10 and tok.encode("x" * 100, max_len=10)[-1] == 3
    assert tok.vocab_size <= fs2.BYTE_VOCAB_SIZE  # the byte-level archs fit the tokenizer
    corpus = generate_corpus(200, seed=0)
    assert corpus == generate_corpus(200, seed=0) and corpus != generate_corpus(200, seed=1)
    # The arithmetic facts are right (the corpus has something to learn on both sides of a mask).
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
             "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
    facts = re.findall(r"(\w+) plus (\w+) makes (\w+)\.", " ".join(corpus).lower())
    assert facts and all(words.index(a) + words.index(b) == words.index(c) for a, b, c in facts)


def test_bert_masking_statistics():
    from mixer_plugins.backbones.fairseq2.corpus import ByteTokenizer
    from mixer_plugins.backbones.fairseq2.data import mask_tokens

    tok = ByteTokenizer()
    tokens = torch.randint(4, 260, (64, 200), generator=torch.Generator().manual_seed(0))
    tokens[:, 0], tokens[:, -1] = tok.bos_idx, tok.eos_idx
    tokens[1:, 150:] = tok.pad_idx
    tokens[1:, 149] = tok.eos_idx
    inputs, target = mask_tokens(tokens, tok, 0.15, torch.Generator().manual_seed(1))
    is_byte = tokens >= tok.byte_offset
    assert not (target & ~is_byte).any()  # never <s>, </s> or pads
    assert torch.equal(inputs[~target], tokens[~target])  # non-targets are untouched
    rate = target.sum() / is_byte.sum()
    assert abs(rate.item() - 0.15) < 0.01
    masked = (inputs[target] == tok.mask_idx).float().mean().item()
    kept = (inputs[target] == tokens[target]).float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.03  # the rest: random bytes
    assert (inputs[target & (inputs != tok.mask_idx)] >= tok.byte_offset).all()
    # Every example gets at least one target, even at a tiny rate.
    _, sparse = mask_tokens(tokens, tok, 1e-6, torch.Generator().manual_seed(2))
    assert (sparse.sum(dim=1) == 1).all()


def test_data_reader_is_deterministic_and_resumes():
    from mixer_plugins.backbones.fairseq2.corpus import ByteTokenizer, encode_all, generate_corpus
    from mixer_plugins.backbones.fairseq2.data import MlmDataReader, MlmDataSection

    tok = ByteTokenizer()
    section = MlmDataSection(batch_size=8, max_seq_len=40)
    examples = encode_all(tok, generate_corpus(30, seed=0), section.max_seq_len)
    reader = MlmDataReader(examples, section, tok)
    epoch = [next(reader)[0] for _ in range(4)]  # 30 examples / 8 = 4 batches, then the epoch ends
    with pytest.raises(StopIteration):
        next(reader)
    assert sorted(len(e) for e in examples) == sorted(n for b in epoch for n in b.seq_lens)
    for batch in epoch:
        assert batch.inputs.shape == batch.targets.shape == batch.target_mask.shape
        real = batch.layout().position_indices >= 0
        assert torch.equal(real, batch.targets != tok.pad_idx)
    reader.reset()  # next epoch: a new order
    first_of_epoch_2 = next(reader)[0]
    state = reader.state_dict()
    second_of_epoch_2 = next(reader)[0]
    resumed = MlmDataReader(examples, section, tok)
    resumed.load_state_dict(state)
    again = next(resumed)[0]
    assert torch.equal(again.inputs, second_of_epoch_2.inputs) and again.seq_lens == second_of_epoch_2.seq_lens
    assert first_of_epoch_2.seq_lens != epoch[0].seq_lens or not torch.equal(first_of_epoch_2.targets,
                                                                            epoch[0].targets)


# -- 7. the MLM recipe: command line, checkpoint, reload through load_model ---------------------------

def _run_recipe(out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIRSEQ2_DEVICE": "cpu", "FAIRSEQ2_NO_PROGRESS": "1",
           "FAIRSEQ2_EXTENSION_TRACE": "1"}
    args = [str(out_dir), "--no-rich", "--config", "common.torch.num_threads=1",
            "common.metric_recorders.tensorboard.enabled=false", *overrides]
    return python_m("mixer_plugins.backbones.fairseq2", args, env=env, cwd=REPO, timeout=300)


def test_forked_commands_behave_as_fresh_interpreters(tmp_path):
    """The recipe tests' runner (tests/forked.py) gives what ``subprocess.run([python, "-m", ...])`` gives: the
    exit status and both streams; the child sees exactly the environment and the folder it is given, its own
    ``sys.argv`` and ``__main__``; an uncaught exception is status 1 with its traceback, ``sys.exit("text")``
    status 1 with the text."""
    (tmp_path / "probe_cmd.py").write_text(
        "import os, sys\n"
        "print(os.getcwd(), sys.argv[1:], os.environ.get('PROBE'), 'OMP_NUM_THREADS' in os.environ, __name__)\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'raise':\n    raise ValueError('boom')\n"
        "if sys.argv[1] == 'text':\n    sys.exit('stopped: text')\n"
        "sys.exit(int(sys.argv[1]))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PROBE"] = "yes"
    for arg, status, last_line in (("0", 0, "to stderr"), ("3", 3, "to stderr"), ("raise", 1, "ValueError: boom"),
                                   ("text", 1, "stopped: text")):
        got = python_m("probe_cmd", [arg], env=env, cwd=tmp_path, timeout=60)
        want = subprocess.run([sys.executable, "-m", "probe_cmd", arg], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (
            status, f"{tmp_path} {[arg]} yes False __main__\n"), (arg, got, want)
        # a traceback names the runner's frames (runpy) above the command's own: compare the last lines
        assert got.stderr.splitlines()[-1] == want.stderr.splitlines()[-1] == last_line, (got.stderr, want.stderr)


@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_trains_checkpoints_and_reloads_through_load_model(fs2, hub, tmp_path):
    name = _example_mixer()
    spec = mp.get_spec(name)
    # Options go on the command line exactly as a user writes them: mixer_options.<name>.<option>=<yaml>.
    option_args = [f"model.config_overrides.mixer_options.{name}.{k}={json.dumps(v)}"
                   for k, v in spec.test_options.items()]
    steps = 8
    proc = _run_recipe(
        tmp_path, f"model.config_overrides.mixer={name}", *option_args,
        f"regime.num_steps={steps}", "regime.publish_metrics_every_n_steps=1", "data.num_examples=256",
        "data.batch_size=16", "data.max_seq_len=48", "optimizer.config.lr=0.003",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # It trained: every step logged a finite loss, and the loss fell.
    records = [json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    losses = [r["NLL Loss"] for r in records if "NLL Loss" in r]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses

    # It checkpointed the model with its config (the mixer included) ...
    ckpt = tmp_path / "checkpoints"
    metadata = yaml.safe_load((ckpt / "model.yaml").read_text())
    assert metadata["model_family"] == "mixer_encoder"
    assert metadata["model_config"]["mixer"] == name
    given = json.loads(json.dumps(dict(spec.test_options)))  # as YAML gives them back (lists, not tuples)
    assert metadata["model_config"]["mixer_options"] == ({name: given} if given else {})

    # ... and fairseq2's load_model brings it back with that mixer and those exact weights.
    loaded = fs2.load_mixer_checkpoint(ckpt).eval()
    assert all(layer.self_attn.mixer_name == spec.name for layer in loaded.encoder.layers)
    raw = torch.load(next((ckpt / f"step_{steps}" / "model").rglob("*.pt")), weights_only=True)
    raw = raw.get("model", raw)
    state = loaded.state_dict()
    assert set(raw) <= set(state)
    assert all(torch.equal(state[k], raw[k]) for k in raw)

    # Identical outputs: the reloaded model vs one built from the saved config (structured by fairseq2 as a
    # card would be) with the raw checkpoint tensors loaded by plain torch.
    from fairseq2.runtime.dependency import get_dependency_resolver
    from fairseq2.utils.structured import ValueConverter

    converter = get_dependency_resolver().resolve(ValueConverter)
    config = converter.structure(metadata["model_config"], fs2.MixerEncoderConfig)
    rebuilt = hub.create_new_model(config, device=CPU).eval()
    rebuilt.load_state_dict(raw)
    tokens = _padded_tokens([20, 11, 3], seed=8, vocab=120)
    layout = BatchLayout.of(tokens, [20, 11, 3])
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, layout), rebuilt(tokens, layout), rtol=0, atol=0)


@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_command_line_rejects_a_bad_mixer_with_our_message(tmp_path):
    proc = _run_recipe(tmp_path, "model.config_overrides.mixer=attentoin", "regime.num_steps=1")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "unknown mixer 'attentoin'; did you mean 'attention'" in output
    assert "Traceback" not in output


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


_SMALL_RUN = ("regime.num_steps=2", "data.num_examples=32", "data.batch_size=8", "data.max_seq_len=32")


@pytest.fixture(scope="module")
def small_attention_run(tmp_path_factory) -> Path:
    """The output folder of one recipe run (``mixer=attention``, ``_SMALL_RUN``): the tests that run the recipe
    again into such a folder start from a copy of it (:func:`_copy_of`), so the first run is paid once."""
    folder = tmp_path_factory.mktemp("small_attention_run")
    first = _run_recipe(folder, "model.config_overrides.mixer=attention", *_SMALL_RUN)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return folder


def _copy_of(run: Path, folder: Path) -> Path:
    """``folder`` (a test's own, maybe existing and empty) holding a copy of the output folder ``run``."""
    shutil.copytree(run, folder, dirs_exist_ok=True)
    return folder


@pytest.mark.slow  # two recipe runs (and the shared first run)
def test_recipe_refuses_a_folder_holding_another_models_checkpoints(fs2, small_attention_run, tmp_path):
    _copy_of(small_attention_run, tmp_path)  # a first run: mixer=attention, _SMALL_RUN
    ckpt = tmp_path / "checkpoints"
    tokens = _padded_tokens([20, 11, 3], seed=8, vocab=120)
    layout = BatchLayout.of(tokens, [20, 11, 3])
    with torch.no_grad():
        before = fs2.load_mixer_checkpoint(ckpt).eval()(tokens, layout)
    tree = _tree(tmp_path)

    other = _example_mixer()
    proc = _run_recipe(tmp_path, f"model.config_overrides.mixer={other}", *_SMALL_RUN)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "holds checkpoints of another model config" in output and "Use another output folder" in output
    assert "overwrite_checkpoints" not in output  # never suggest deleting intact checkpoints
    assert "stay loadable with load_mixer_checkpoint" in output  # true: checked just below
    assert f"'attention' -> '{other}'" in output
    assert "Traceback" not in output
    assert _tree(tmp_path) == tree  # nothing written: not model.yaml, not config.yaml, not the logs

    # The first run still loads and gives the same outputs.
    with torch.no_grad():
        after = fs2.load_mixer_checkpoint(ckpt).eval()(tokens, layout)
    torch.testing.assert_close(after, before, rtol=0, atol=0)

    # Asked to, the recipe deletes the old checkpoints and trains the new model there.
    proc = _run_recipe(tmp_path, f"model.config_overrides.mixer={other}", "overwrite_checkpoints=true", *_SMALL_RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert yaml.safe_load((ckpt / "model.yaml").read_text())["model_config"]["mixer"] == other
    reloaded = fs2.load_mixer_checkpoint(ckpt)
    assert all(layer.self_attn.mixer_name == mp.get_spec(other).name for layer in reloaded.encoder.layers)


@pytest.mark.slow  # three recipe runs (and the shared first run)
def test_recipe_resume_reads_the_config_of_the_step_it_resumes(fs2, small_attention_run, tmp_path):
    """fairseq2 rewrites checkpoints/model.yaml at every start, not atomically: a start killed while writing it leaves
    it empty or cut. The steps keep their own copy, so resume, refusal and reload do not depend on that file.

    A rerun with the same config resumes whatever the folder's model.yaml holds: the check compares with the last
    step's own copy first, which is intact here whether model.yaml is intact or empty."""
    _copy_of(small_attention_run, tmp_path)  # a first run: mixer=attention, _SMALL_RUN
    ckpt = tmp_path / "checkpoints"
    intact = (ckpt / "model.yaml").read_bytes()
    assert (ckpt / "step_2" / "model.yaml").read_bytes() == intact  # the step's own copy of its config
    tokens = _padded_tokens([20, 11, 3], seed=8, vocab=120)
    layout = BatchLayout.of(tokens, [20, 11, 3])
    with torch.no_grad():
        before = fs2.load_mixer_checkpoint(ckpt).eval()(tokens, layout)

    # an empty model.yaml: the step still loads, and a rerun with the same config resumes
    (ckpt / "model.yaml").write_bytes(b"")
    with torch.no_grad():
        torch.testing.assert_close(fs2.load_mixer_checkpoint(ckpt).eval()(tokens, layout), before, rtol=0, atol=0)
    again = _run_recipe(tmp_path, "model.config_overrides.mixer=attention", *_SMALL_RUN[1:], "regime.num_steps=3")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step_3").is_dir()  # the rerun with the same config resumed
    assert (ckpt / "step_3" / "model.yaml").read_bytes() == intact

    # a cut model.yaml and another mixer: refused from the step's own config, without suggesting to delete anything
    (ckpt / "model.yaml").write_bytes(intact[: len(intact) // 2])
    tree = _tree(tmp_path)
    other = _example_mixer()
    proc = _run_recipe(tmp_path, f"model.config_overrides.mixer={other}", *_SMALL_RUN)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert f"'attention' -> '{other}'" in output and "step_3" in output and "Traceback" not in output
    assert "overwrite_checkpoints" not in output and "stay loadable" in output
    assert _tree(tmp_path) == tree
    assert all(layer.self_attn.mixer_name == "attention" for layer in fs2.load_mixer_checkpoint(ckpt).encoder.layers)

    # a run saved before steps kept a copy, its model.yaml cut: nothing to compare with, so it resumes (fairseq2's
    # strict load guards the weights) instead of refusing
    for step in (2, 3):
        (ckpt / f"step_{step}" / "model.yaml").unlink()
    proc = _run_recipe(tmp_path, "model.config_overrides.mixer=attention", *_SMALL_RUN[1:], "regime.num_steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cannot be read" in proc.stdout + proc.stderr and (ckpt / "step_4").is_dir()


@pytest.mark.slow  # four recipe runs
@pytest.mark.parametrize("override, message", [
    ("data.text_file=/no/such/file.txt", "`text_file` '/no/such/file.txt' does not exist"),
    ("data.mask_prob=abc", "`mask_prob` field cannot be structured"),
    ("bogus_key=3", "extra key(s) bogus_key"),
    ("optimizer.config.lr=-1", "`optimizer.config.lr` must be a finite number >= 0, but is -1"),
])
def test_recipe_bad_config_values_are_one_line_and_exit_2(tmp_path, override, message):
    proc = _run_recipe(tmp_path, "model.config_overrides.mixer=attention", *_SMALL_RUN, override)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and message in errors[0], output[-3000:]
    assert "Traceback" not in output and len(proc.stderr.splitlines()) < 10


@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_model_too_large_to_allocate_is_one_line_and_exit_2(tmp_path):
    """Found when fairseq2 builds the model (after its log has started): one error line naming the sizes."""
    proc = _run_recipe(tmp_path, "model.config_overrides.mixer=attention", *_SMALL_RUN,
                       "model.config_overrides.model_dim=100000000")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "model_dim=100000000) cannot be allocated" in errors[0], output[-3000:]
    assert "lower model.config_overrides.model_dim" in errors[0] and "Traceback" not in output


@pytest.mark.parametrize("values, problems", [
    ({"lr": -1.0}, ["`optimizer.config.lr` must be a finite number >= 0, but is -1.0."]),
    ({"lr": float("nan"), "eps": -1e-8}, ["`optimizer.config.lr` must be a finite number >= 0, but is nan.",
                                          "`optimizer.config.eps` must be a finite number >= 0, but is -1e-08."]),
    ({"betas": [0.9, 1.0], "weight_decay": -0.1}, ["`optimizer.config.weight_decay` must be a finite number >= 0",
                                                   "`optimizer.config.betas[1]` must be in [0, 1), but is 1.0."]),
    ({"groups": [{"params": "encoder.*", "lr": -2.0}]}, ["`optimizer.config.groups[0].lr` must be a finite number"]),
])
def test_recipe_refuses_optimizer_values_torch_would_refuse(fs2, resolver, values, problems):
    """Checked with the config, before anything is written (torch.optim would raise with a stack trace once the
    trainer builds the optimizer); the values torch accepts pass."""
    from fairseq2.utils.validation import ValidationError

    with pytest.raises(ValidationError) as info:
        _recipe_config(resolver, {"optimizer": {"config": values}})
    for problem in problems:
        assert problem in str(info.value), str(info.value)
    _recipe_config(resolver, {"optimizer": {"config": {"lr": 0.0, "betas": [0.0, 0.5], "eps": 0.0}}})


def test_a_model_too_large_to_allocate_is_a_config_error(fs2, resolver):
    """The recipes build the model through ``create_model``: torch's allocation failure becomes one line (a
    ``RecipeError``: exit status 2, no stack trace) naming the sizes; other errors pass through unchanged."""
    from fairseq2.recipe.error import RecipeError

    from mixer_plugins.backbones.fairseq2.recipe import create_model

    config = _recipe_config(resolver, {"model": {"config_overrides": {"model_dim": 10**8}}})

    class Context:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def get_model_as(self, kls):
            raise self.error

        def get_config_as(self, kls):
            assert isinstance(config, kls)
            return config

    allocation = RuntimeError("[enforce fail at alloc_cpu.cpp:124] err == 0. DefaultCPUAllocator: can't allocate "
                              "memory: you tried to allocate 105600000000 bytes. Error code 12 (Cannot allocate "
                              "memory)")
    with pytest.raises(RecipeError) as info:
        create_model(Context(allocation), torch.nn.Module)
    message = str(info.value)
    assert info.value.__cause__ is None and "\n" not in message
    assert "model.arch=tiny, model_dim=100000000" in message and "105600000000 bytes" in message
    assert "enforce fail" not in message and "lower model.config_overrides.model_dim" in message
    with pytest.raises(RuntimeError, match="something else"):
        create_model(Context(RuntimeError("something else")), torch.nn.Module)


def _write_recipe_checkpoint(folder: Path, model, config, state: dict, *, step: int = 1) -> None:
    """A recipe checkpoint folder by hand: model.yaml, step_N/model.yaml and the model file, as the recipe writes."""
    from fairseq2.runtime.dependency import get_dependency_resolver
    from fairseq2.utils.structured import ValueConverter

    metadata = {"name": "checkpoint", "model_family": "mixer_encoder",
                "model_config": get_dependency_resolver().resolve(ValueConverter).unstructure(config)}
    text = yaml.safe_dump(metadata)
    (folder / f"step_{step}" / "model" / "pp_00" / "tp_00").mkdir(parents=True)
    (folder / "model.yaml").write_text(text)
    (folder / f"step_{step}" / "model.yaml").write_text(text)
    torch.save(state, folder / f"step_{step}" / "model" / "pp_00" / "tp_00" / "sdp_00.pt")


def test_load_model_checks_the_mixer_records_and_loads_checkpoints_without_them(fs2, hub, tmp_path):
    """fairseq2's load_model copies tensors into the model's state (not through load_state_dict): the family's
    state-dict converter checks the mixers' records against the config and supplies them for older checkpoints."""
    from mixer_plugins.mixers.base import MixerCheckpointMismatchError

    config = _tiny(fs2, mixer="quasi", mixer_options={"quasi": {"head_dim": 16, "d_state": 8}})
    torch.manual_seed(0)
    model = hub.create_new_model(config, device=CPU).eval()
    state = model.state_dict()
    records = [k for k in state if k.endswith("_extra_state")]
    assert records == [f"encoder.layers.{i}.self_attn.mixer._extra_state" for i in range(config.num_layers)]
    tokens = _padded_tokens([12, 5], seed=3)
    layout = BatchLayout.of(tokens, [12, 5])
    old = tmp_path / "old"
    _write_recipe_checkpoint(old, model, config, {k: v for k, v in state.items() if k not in records})
    with torch.no_grad():
        torch.testing.assert_close(fs2.load_mixer_checkpoint(old).eval()(tokens, layout), model(tokens, layout))
    # weights of quasi under a config that says quasiseparable_no_shift: the same tensor names, another function
    other = replace(config, mixer="quasiseparable_no_shift",
                    mixer_options={"quasiseparable_no_shift": {"head_dim": 16, "d_state": 8}})
    wrong = tmp_path / "wrong"
    _write_recipe_checkpoint(wrong, model, other, state)
    with pytest.raises(Exception) as info:
        fs2.load_mixer_checkpoint(wrong)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    mismatch = [e for e in chain if isinstance(e, MixerCheckpointMismatchError)]
    assert mismatch and "'quasiseparable'" in str(mismatch[0]) and "'quasiseparable_no_shift'" in str(mismatch[0])


def test_load_mixer_checkpoint_with_a_cut_step_model_yaml(fs2, hub, tmp_path):
    """A step's copy of model.yaml cut before its ``mixer`` field (YAML cut between two lines still parses): the
    folder's intact model.yaml stands in, with a warning, instead of a default ``attention`` config refused by the
    mixer records; with both files cut, the error names both."""
    from fairseq2.runtime.dependency import get_dependency_resolver
    from fairseq2.utils.structured import ValueConverter

    config = _tiny(fs2, mixer="quasi", mixer_options={"quasi": {"head_dim": 16, "d_state": 8}})
    torch.manual_seed(0)
    model = hub.create_new_model(config, device=CPU).eval()
    _write_recipe_checkpoint(tmp_path, model, config, model.state_dict())
    metadata = {"name": "checkpoint", "model_family": "mixer_encoder",
                "model_config": get_dependency_resolver().resolve(ValueConverter).unstructure(config)}
    text = yaml.safe_dump(metadata, sort_keys=False)  # fairseq2 writes the fields in the config's order
    (tmp_path / "model.yaml").write_text(text)
    cut = text[: text.index("\n  mixer:") + 1]
    (tmp_path / "step_1" / "model.yaml").write_text(cut)
    tokens = _padded_tokens([12, 5], seed=3)
    layout = BatchLayout.of(tokens, [12, 5])
    with pytest.warns(UserWarning, match=r"step_1/model\.yaml is cut \(its model_config lacks mixer, mixer_options"):
        loaded = fs2.load_mixer_checkpoint(tmp_path).eval()
    assert all(layer.self_attn.mixer_name == "quasiseparable" for layer in loaded.encoder.layers)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, layout), model(tokens, layout), rtol=0, atol=0)

    (tmp_path / "model.yaml").write_text(cut)
    with pytest.raises(ValueError, match=r"step_1/model\.yaml is cut .* and .*model\.yaml is missing or cut too"):
        fs2.load_mixer_checkpoint(tmp_path)
    other = yaml.safe_dump({**metadata, "model_config": {**metadata["model_config"], "num_layers": 3}},
                           sort_keys=False)
    (tmp_path / "model.yaml").write_text(other)
    with pytest.raises(ValueError, match="holds another model config"):
        fs2.load_mixer_checkpoint(tmp_path)


def test_load_mixer_checkpoint_from_a_folder_whose_path_needs_percent_encoding(fs2, hub, tmp_path):
    """fairseq2 turns a checkpoint path into a percent-encoded URI and reads it back undecoded; a folder whose path
    holds a space (or '%', '#') loads all the same, through the step's own model.yaml and through the folder's."""
    config = _tiny(fs2, mixer="quasi", mixer_options={"quasi": {"head_dim": 16, "d_state": 8}})
    torch.manual_seed(0)
    model = hub.create_new_model(config, device=CPU).eval()
    folder = tmp_path / "my runs #1 (50% done)" / "checkpoints"
    folder.parent.mkdir()
    _write_recipe_checkpoint(folder, model, config, model.state_dict(), step=3)
    tokens = _padded_tokens([12, 5], seed=3)
    layout = BatchLayout.of(tokens, [12, 5])
    with torch.no_grad():
        expected = model(tokens, layout)
        torch.testing.assert_close(fs2.load_mixer_checkpoint(folder).eval()(tokens, layout), expected,
                                   rtol=0, atol=0)
        (folder / "step_3" / "model.yaml").unlink()  # a run saved before steps kept their own copy
        for step in (None, 3):
            loaded = fs2.load_mixer_checkpoint(folder, step=step).eval()
            torch.testing.assert_close(loaded(tokens, layout), expected, rtol=0, atol=0)


@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_fails_clearly_on_a_non_finite_loss(tmp_path):
    proc = _run_recipe(tmp_path, "model.config_overrides.mixer=attention", "optimizer.config.lr=1e30",
                       "regime.num_steps=4", *_SMALL_RUN[1:])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "NonFiniteLossError" in output and "not finite" in output
    assert "Traceback" not in output
    assert not (tmp_path / "checkpoints" / "step_4").exists()


# -- 7b. the recipe's --help and --dump-config -------------------------------------------------------------------------

def _recipe_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIRSEQ2_DEVICE": "cpu", "FAIRSEQ2_NO_PROGRESS": "1"}
    return python_m("mixer_plugins.backbones.fairseq2", args, env=env, cwd=REPO, timeout=300)


def test_recipe_help_describes_the_recipe(fs2, monkeypatch, capsys):
    """``python -m mixer_plugins.backbones.fairseq2 --help``, in this process: the recipe's command line is read
    before anything else (before fairseq2 is imported), and ``--help`` prints and exits there."""
    import importlib

    entry = importlib.import_module("mixer_plugins.backbones.fairseq2.__main__")
    monkeypatch.setattr(sys, "argv", ["__main__.py", "--help"])
    with pytest.raises(SystemExit) as info:
        entry.main()
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m mixer_plugins.backbones.fairseq2")
    for fragment in ("masked", "OUT_DIR", "checkpoints", "--config mixer.name=NAME", "mixer.options.OPTION=VALUE",
                     "model.config_overrides.mixer", "mixer-plugins list", "base_hydra", "examples:",
                     "--dump-config", "--config-file"):  # ours, and fairseq2's own options still listed
        assert fragment in out, fragment
    from fairseq2.recipe import cli

    assert cli.ArgumentParser is __import__("argparse").ArgumentParser  # restored afterwards


def _as_subcommands(text: str) -> str:
    for module, command in (("python -m mixer_plugins.backbones.fairseq2.generate", "mixer-plugins generate"),
                            ("python -m mixer_plugins.backbones.fairseq2.lm", "mixer-plugins lm"),
                            ("python -m mixer_plugins.backbones.fairseq2", "mixer-plugins mlm")):
        text = text.replace(module, command)
    return text


def _options(parser) -> dict:
    """Each argument of ``parser`` but --help: its option strings (or name), nargs, default and choices."""
    return {a.dest: (tuple(a.option_strings), a.nargs if a.option_strings else "positional", a.default,
                     tuple(a.choices or ())) for a in parser._actions if a.dest != "help"}


def test_mixer_plugins_recipe_commands_have_the_recipes_arguments_and_help(fs2, monkeypatch):
    """``mixer-plugins mlm``, ``lm`` and ``generate`` read their arguments without fairseq2: the same arguments as
    fairseq2's recipe command line and as ``generate``'s, and the recipes' own descriptions, naming these commands."""
    import argparse
    import importlib

    from fairseq2.recipe import cli as recipe_cli

    from mixer_plugins.backbones.fairseq2 import generate as generate_module
    from mixer_plugins.backbones.fairseq2 import lm as lm_recipe
    from mixer_plugins.tools.cli import build_parser
    from mixer_plugins.tools.cli import generate as generate_cli
    from mixer_plugins.tools.cli import lm as lm_cli
    from mixer_plugins.tools.cli import mlm as mlm_cli

    mlm_recipe = importlib.import_module("mixer_plugins.backbones.fairseq2.__main__")
    assert (mlm_cli.DESCRIPTION, mlm_cli.EPILOG) == (_as_subcommands(mlm_recipe.DESCRIPTION),
                                                     _as_subcommands(mlm_recipe.EPILOG))
    assert (lm_cli.DESCRIPTION, lm_cli.EPILOG) == (_as_subcommands(lm_recipe.DESCRIPTION),
                                                   _as_subcommands(lm_recipe.EPILOG))

    class Captured(Exception):
        pass

    class Recording(argparse.ArgumentParser):
        def parse_args(self, *args, **kwargs):
            raise Captured(self)

    monkeypatch.setattr(recipe_cli, "ArgumentParser", Recording)
    with pytest.raises(Captured) as info:
        recipe_cli._parse_args()
    fairseq2_options = _options(info.value.args[0])
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("mlm", "lm"):
        assert _options(subcommands[name]) == fairseq2_options, name
    assert _options(subcommands["generate"]) == _options(generate_module._parser())
    assert generate_cli.MODULE == generate_module.__name__


@pytest.mark.parametrize("option, value", [
    ("--temperature", "0"), ("--temperature", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
    ("--top-p", "-0.1"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-p", "0"), ("--top-k", "-1"), ("--top-k", "0"),
    ("--beam-size", "0"), ("--num-gens", "0"), ("--max-gen-len", "0"), ("--temperature", "2.5"), ("--top-p", "1"),
    ("--top-k", "5"), ("--beam-size", "1"),
])
def test_mixer_plugins_generate_refuses_what_generate_refuses(fs2, tmp_path, capsys, option, value):
    """The values ``mixer-plugins generate`` refuses while parsing (before importing fairseq2) are exactly those
    ``generate``'s own option checks refuse."""
    from mixer_plugins.backbones.fairseq2.generate import main as generate_main
    from mixer_plugins.tools.cli import main as cli_main

    argv = [str(tmp_path / "missing"), "--prompt", "x", option, value]
    assert generate_main(argv) == 2
    refused = "missing" not in capsys.readouterr().err  # the option, not the folder (which does not exist)
    assert cli_main(["generate", *argv]) == 2
    assert ("mixer-plugins: error: argument " + option in capsys.readouterr().err) == refused


@pytest.mark.slow  # three fresh fairseq2 processes: ~45 s
def test_mixer_plugins_recipe_commands_run_the_recipes(tmp_path):
    """``mixer-plugins lm`` trains, ``mixer-plugins generate`` continues a prompt from its checkpoint, and
    ``mixer-plugins mlm --dump-config`` passes the options through, as the ``python -m`` forms do."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIRSEQ2_DEVICE": "cpu", "FAIRSEQ2_NO_PROGRESS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mixer_plugins", *args], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)

    out = tmp_path / "lm_run"
    proc = cli("lm", str(out), "--no-rich", "--config", "common.torch.num_threads=1",
               "common.metric_recorders.tensorboard.enabled=false", "mixer.name=semiseparable",
               "mixer.options.head_dim=8", "mixer.options.d_state=8", "regime.num_steps=2", "data.num_examples=16",
               "data.batch_size=8", "data.max_seq_len=24")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_2").is_dir()
    proc = cli("generate", str(out / "checkpoints"), "--prompt", "-The cat", "--max-gen-len", "4", "--mode", "beam",
               "--beam-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.startswith("-The cat") for line in proc.stdout.splitlines()] == [True, True]
    proc = cli("mlm", "--dump-config", "--no-rich", "--config", "mixer.name=quasi", "mixer.options.d_state=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load(proc.stdout)["mixer"] == {"name": "quasi", "options": {"d_state": 32}}


@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_dump_config_shows_the_mixer_fields():
    proc = _recipe_cli("--dump-config", "--no-rich", "--config", "mixer.name=quasi", "mixer.options.d_state=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumped = yaml.safe_load(proc.stdout)
    assert dumped["mixer"] == {"name": "quasi", "options": {"d_state": 32}}
    assert dumped["model"]["config_overrides"] == {"mixer": "quasi", "mixer_options": {"quasi": {"d_state": 32}}}


def _recipe_config(resolver, unstructured: dict):
    from fairseq2.utils.structured import ValueConverter
    from fairseq2.utils.validation import ObjectValidator

    from mixer_plugins.backbones.fairseq2.recipe import MixerMlmConfig

    unstructured = {**unstructured, "model": {"family": "mixer_encoder", "arch": "tiny",
                                              **unstructured.get("model", {})}}
    config = resolver.resolve(ValueConverter).structure(unstructured, MixerMlmConfig)
    resolver.resolve(ObjectValidator).validate(config)
    return config


def test_recipe_mixer_section_reaches_the_model(fs2, hub, resolver):
    from mixer_plugins.backbones.fairseq2.recipe import MixerMlmConfig, MixerSection

    assert MixerMlmConfig().mixer == MixerSection()  # shown by --dump-config: name null = the arch's mixer
    assert MixerMlmConfig().model.config_overrides is None
    config = _recipe_config(resolver, {"mixer": {"name": "quasi", "options": {"d_state": 8}}})
    # fairseq2 merges the overrides' top-level keys over the arch's config
    model_config = replace(hub.get_arch_config("tiny"), **config.model.config_overrides)
    assert model_config.mixer == "quasi" and model_config.mixer_options == {"quasi": {"d_state": 8}}
    model = hub.create_new_model(model_config, device=CPU)
    assert model.encoder.layers[0].self_attn.mixer.config.d_state == 8
    # the arch's own mixer stays when the section names none
    config = _recipe_config(resolver, {"model": {"arch": "base_hydra"}})
    assert config.model.config_overrides is None


@pytest.mark.parametrize("section, overrides, problem", [
    ({"name": "quasi"}, {"mixer": "toeplitz"}, "name two different mixers"),
    ({"options": {"d_state": 8}}, None, "needs `mixer.name`"),
])
def test_recipe_mixer_section_conflicts_are_config_errors(fs2, resolver, section, overrides, problem):
    from fairseq2.utils.validation import ValidationError

    with pytest.raises(ValidationError, match=re.escape(problem)):
        _recipe_config(resolver, {"mixer": section, "model": {"config_overrides": overrides}})


def test_recipe_mixer_section_agrees_with_the_model_overrides(fs2):
    from mixer_plugins.backbones.fairseq2.recipe import MixerSection

    section = MixerSection(name="Quasi", options={"d_state": 8})
    merged = section.apply_to({"mixer": "quasi", "mixer_options": {"Quasi": {"chunk_size": 8}}, "num_layers": 1})
    assert merged == {"mixer": "Quasi", "mixer_options": {"Quasi": {"chunk_size": 8, "d_state": 8}}, "num_layers": 1}
    assert not section.validate().has_error()
    assert MixerSection().apply_to(None) is None


# -- 7c. torch.compile with inductor -----------------------------------------------------------------------------------

@pytest.mark.slow  # inductor compiles a forward, a backward and an inference graph: ~1 min on a small CPU
def test_mixer_encoder_compiles_with_inductor(fs2, hub):
    """A training step (loss, every gradient) and eval of ``torch.compile(model)`` equal eager, with padding. The
    mixer is ``toeplitz``: the FFT Toeplitz custom op and its backward (the timm tests compile quasi and attention)."""
    from helpers import assert_train_and_eval_match, inductor_settings

    torch.manual_seed(0)
    config = _tiny(fs2, mixer="toeplitz", mixer_options={"toeplitz": {"head_dim": 16}}, num_layers=1,
                   max_seq_len=16, dropout_p=0.1)
    model = hub.create_new_model(config, device=CPU)
    lengths = [12, 7]
    tokens = _padded_tokens(lengths, seed=4)
    layout = BatchLayout.of(tokens, lengths)
    real = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]
    targets = _padded_tokens(lengths, seed=5)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits[real].float(), targets[real])

    with inductor_settings():
        assert_train_and_eval_match(model, (tokens, layout), loss_fn)  # fullgraph: one graph, no breaks


# -- 8. the documentation's example runs ------------------------------------------------------------------

def _doc_snippet(first_line: str) -> str:
    """A python block of the fairseq2 section, from the README once merged there, else from docs/."""
    for doc in (REPO / "README.md", REPO / "docs" / "fairseq2.md"):
        if doc.exists():
            match = re.search(r"```python\n" + re.escape(first_line) + r"\n(.*?)```", doc.read_text(), re.S)
            if match and "get_mixer_encoder_hub" in match.group(1):
                return first_line + "\n" + match.group(1)
    pytest.fail(f"no python block starting with {first_line!r} in README.md or docs/fairseq2.md")


def test_documented_python_example_runs(fs2, resolver, monkeypatch):
    import fairseq2

    # fairseq2 is already initialised in this process; the snippet's init_fairseq2() must not re-run it.
    monkeypatch.setattr(fairseq2, "init_fairseq2", lambda **kwargs: resolver)
    namespace: dict = {}
    exec(_doc_snippet("from dataclasses import replace"), namespace)
    model, hidden, logits = namespace["model"], namespace["hidden"], namespace["logits"]
    assert model.encoder.layers[0].self_attn.mixer_name == mp.get_spec("quasi").name
    assert model.encoder.layers[0].self_attn.mixer.config.d_state == 16
    assert hidden.shape == (2, 16, 32) and logits.shape == (2, 16, model.vocab_size)


def test_both_recipes_report_every_mixer_error_in_one_line():
    """fairseq2 picks a command-line error handler by the exception's exact type: each recipe registers ours for
    every error class of ``mixer_plugins.errors`` (otherwise that error prints fairseq2's "unexpected error" trace)."""
    from unittest.mock import MagicMock

    import mixer_plugins.errors as errors
    from mixer_plugins.backbones.fairseq2.lm import MixerLmRecipe
    from mixer_plugins.backbones.fairseq2.recipe import (
        CheckpointConfigMismatchError,
        MixerMlmRecipe,
        NonFiniteLossError,
        _log_mixer_error,
    )

    expected = {getattr(errors, name) for name in errors.__all__
                if issubclass(getattr(errors, name), errors.MixerError)} | {CheckpointConfigMismatchError}
    assert errors.StepNotSupportedError in expected and errors.MixerCheckpointMismatchError in expected
    for recipe in (MixerMlmRecipe(), MixerLmRecipe()):
        container = MagicMock()   # records the registrations (register_cli_error calls register_instance)
        recipe.register(container)
        handlers = {c.kwargs["key"]: c.args[1] for c in container.register_instance.call_args_list
                    if "key" in c.kwargs}
        assert {k for k, h in handlers.items() if h is _log_mixer_error} == expected, type(recipe)
        assert NonFiniteLossError in handlers
