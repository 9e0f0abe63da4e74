"""fairseq2 decoders: the ``mixer_decoder`` family, incremental decoding through ``IncrementalStateBag`` on the
mixers' caches, fairseq2's own generators (sampling and beam search) against a recomputing oracle, the NLLB decoder
swap, config errors, and the language-model recipe end to end (train, checkpoint, ``generate``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("FAIRSEQ2_EXTENSION_TRACE", "1")
os.environ.setdefault("FAIRSEQ2_NO_PROGRESS", "1")
os.environ.setdefault("FAIRSEQ2_DEVICE", "cpu")

pytest.importorskip("fairseq2")

import torch  # noqa: E402
from fairseq2.device import CPU  # noqa: E402
from fairseq2.models.clm import CausalLM  # noqa: E402
from fairseq2.nn import BatchLayout, IncrementalState, IncrementalStateBag  # noqa: E402
from forked import python_m  # noqa: E402

import mixer_plugins as mp  # noqa: E402
from mixer_plugins.registry import default_registry  # noqa: E402

pytestmark = [pytest.mark.fairseq2, pytest.mark.xdist_group("fairseq2")]

REPO = Path(__file__).resolve().parents[2]
F64 = torch.float64
STEPPING = [n for n in default_registry.names() if default_registry.get_spec(n).stepping]


@pytest.fixture(scope="module")
def hub(fs2):
    return fs2.get_mixer_decoder_hub()


def tiny(hub, mixer="attention", **changes):
    spec = mp.get_spec(mixer)
    options = {k: v for k, v in spec.test_options.items() if k != "max_seq_len"}
    return replace(hub.get_arch_config("tiny"), mixer=mixer, mixer_options={spec.name: options} if options else {},
                   **changes)


def build(hub, config, seed=0):
    torch.manual_seed(seed)
    return hub.create_new_model(config, device=CPU).to(F64).eval()


def tokens(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 200, (rows, length), generator=torch.Generator().manual_seed(seed))


# -- the family ---------------------------------------------------------------------------------------------------

def test_family_archs_and_the_125m_shape(fs2, hub):
    assert {"tiny", "small", "base"} <= set(hub.get_archs())
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = fs2.create_mixer_decoder_model(hub.get_arch_config("base"))
    params = sum(p.numel() for p in model.parameters())
    assert 120e6 < params < 130e6, params
    assert all(type(layer.self_attn).__name__ == "MixerAttention" for layer in model.decoder.layers)
    assert model.decoder.layers[0].self_attn.mixer.causal


@pytest.mark.parametrize("mixer", STEPPING)
def test_incremental_decoding_equals_the_full_forward(hub, mixer):
    """A padded prompt, then steps of one and two tokens (each row from its own length), through the state bag;
    no position table, so each row's positions are its own (what the mixers' caches track)."""
    model = build(hub, tiny(hub, mixer, pos_encoder="none"))
    seqs = tokens(2, 11, seed=1)
    lengths = [6, 3]
    with torch.no_grad():
        full = model(seqs, BatchLayout.of(seqs))
        bag = IncrementalStateBag(11)
        prompt = seqs[:, :6].clone()
        prompt[1, 3:] = 0
        out = model(prompt, BatchLayout.of(prompt, lengths), state_bag=bag)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(out[row, :n], full[row, :n], rtol=0, atol=1e-10)
        position = torch.tensor(lengths)
        for t in (1, 2, 1):
            index = position[:, None] + torch.arange(t)
            step = seqs.gather(1, index)
            got = model(step, BatchLayout.of(step), state_bag=bag)
            expected = full.gather(1, index[..., None].expand(-1, -1, full.shape[-1]))
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
            position += t


# -- fairseq2's generators against a recomputing oracle ------------------------------------------------------------

class _History(IncrementalState):
    def __init__(self, seqs):
        self.seqs = seqs

    def reorder(self, new_order):
        self.seqs = self.seqs.index_select(0, new_order)

    def size_bytes(self):
        return 0

    def capacity_bytes(self):
        return 0


class RecomputingLM(CausalLM):
    """The oracle: the same model run without any cache, on the whole prefix at every call (the history is kept
    in the bag, so the generators' reordering applies to it)."""

    def __init__(self, model):
        super().__init__(model.max_seq_len)
        self.model = model

    def forward(self, seqs, seqs_layout, targets=None, *, state_bag=None, **kwargs):
        state = state_bag.maybe_get_state(self, _History)
        if state is None:
            state = _History(seqs)
            state_bag.set_state(self, state)
        else:
            state.seqs = torch.cat([state.seqs, seqs], dim=1)
        return self.model(state.seqs, BatchLayout.of(state.seqs))[:, -seqs.shape[1]:]


def _generators(model, mode):
    from fairseq2.data.tokenizers import VocabularyInfo
    from fairseq2.generation.beam_search import BeamSearchSequenceGenerator, StandardBeamSearchAlgorithm
    from fairseq2.generation.sampling import SamplingSequenceGenerator, TopPSampler

    vocab = VocabularyInfo(size=264, unk_idx=None, bos_idx=2, eos_idx=3, pad_idx=0)
    if mode == "beam":
        return BeamSearchSequenceGenerator(model, vocab, StandardBeamSearchAlgorithm(), beam_size=3, max_gen_len=12,
                                           prefill_chunk_size=3)
    return SamplingSequenceGenerator(model, vocab, TopPSampler(0.95), num_gens=2, max_gen_len=12, temperature=1.0,
                                     prefill_chunk_size=3)


@pytest.mark.parametrize("mixer", ["semiseparable", "sliding_window_attention", "attention"])
@pytest.mark.parametrize("mode", ["sampling", "beam"])
def test_generators_with_caches_equal_recomputation(hub, mixer, mode):
    """fairseq2's sampling and beam search (prompts of different lengths, the prefill in chunks, beams reordered
    and dropped as they finish) give the same hypotheses with the mixers' caches as with no cache at all."""
    model = build(hub, tiny(hub, mixer), seed=2)
    prompts = tokens(2, 8, seed=3)
    prompts[1, 5:] = 0
    layout = BatchLayout.of(prompts, [8, 5])
    results = []
    for lm in (model, RecomputingLM(model)):
        torch.manual_seed(7)
        results.append(_generators(lm, mode)(prompts, layout).hypotheses)
    cached, oracle = results
    assert [len(h) for h in cached] == [len(h) for h in oracle] == ([3, 3] if mode == "beam" else [2, 2])
    for ours, theirs in zip(cached, oracle):
        for a, b in zip(ours, theirs):
            assert torch.equal(a.seq, b.seq)
            if a.score is not None:
                torch.testing.assert_close(a.score, b.score, rtol=1e-5, atol=1e-6)


def test_a_causal_mixer_without_a_step_decodes_by_recomputing(fs2):
    """A plugin mixer whose spec says stepping=False still decodes (the adapter reruns the prefix)."""
    from mixer_plugins.backbones.fairseq2 import MixerAttention, RecomputeState, ResolvedMixer
    from mixer_plugins.mixers.attention import SoftmaxAttention

    class NoStep(SoftmaxAttention):
        steppable = False

    spec = mp.MixerSpec(name="no_step", config=mp.get_spec("attention").config, builder=NoStep, direction="either")
    attn = MixerAttention(ResolvedMixer(spec=spec, config=spec.make_config(16, num_heads=2, causal=True),
                                        from_host={})).double().eval()
    x = torch.randn(2, 7, 16, dtype=F64)
    bag = IncrementalStateBag(7)
    call = lambda s, layout: attn(s, layout, keys=s, keys_layout=layout, values=s, bias_cache=None,  # noqa: E731
                                  state_bag=bag)
    with torch.no_grad():
        first = call(x[:, :4], BatchLayout.of(x[:, :4]))
        assert isinstance(bag.maybe_get_state(attn, RecomputeState), RecomputeState)
        rest = call(x[:, 4:7], BatchLayout.of(x[:, 4:7]))
        expected = attn.mixer(x)
    torch.testing.assert_close(torch.cat([first, rest], 1), expected, rtol=0, atol=1e-12)


# -- NLLB ------------------------------------------------------------------------------------------------------------

def test_nllb_decoder_self_attention_swaps_and_decodes_incrementally(fs2):
    from fairseq2.models.nllb import NllbConfig

    base = NllbConfig(model_dim=32, max_seq_len=64, vocab_size=100, num_encoder_layers=1, num_decoder_layers=2,
                      num_encoder_attn_heads=2, num_decoder_attn_heads=2, ffn_inner_dim=64, dropout_p=0.0)
    config = fs2.NllbMixerConfig(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                                 decoder_mixer="semiseparable",
                                 decoder_mixer_options={"semiseparable": {"head_dim": 8, "d_state": 8}})
    assert not config.validate().has_error()
    torch.manual_seed(0)
    model = fs2.create_nllb_mixer_model(config).to(F64).eval()
    assert type(model.encoder.layers[0].self_attn).__name__ == "StandardMultiheadAttention"
    decoder_attn = model.decoder.layers[0].self_attn
    assert decoder_attn.mixer_name == "semiseparable" and decoder_attn.mixer.causal
    assert type(model.decoder.layers[0].encoder_decoder_attn).__name__ == "StandardMultiheadAttention"
    source, target = tokens(2, 6, seed=4) % 100, tokens(2, 7, seed=5) % 100
    src_layout = BatchLayout.of(source)
    with torch.no_grad():
        full = model(source, src_layout, target, BatchLayout.of(target))
        bag = IncrementalStateBag(8)
        parts = []
        for lo, hi in ((0, 3), (3, 4), (4, 7)):
            chunk = target[:, lo:hi]
            parts.append(model(source, src_layout, chunk, BatchLayout.of(chunk), state_bag=bag))
            bag.increment_step_nr(hi - lo)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-10)
    upstream = fs2.NllbMixerConfig(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    assert fs2.NllbMixerFactory(upstream)._resolved_decoder is None  # attention: upstream NLLB decoder


# -- config errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mixer,options,message", [
    ("quasiseparable", {}, "bidirectional only; it has no causal form"),
    ("sliding_window_attention", {"swa": {"causal": False}}, "decoder needs a causal mixer"),
    ("attentoin", {}, "did you mean"),
])
def test_bad_decoder_mixers_fail_with_our_message(fs2, hub, mixer, options, message):
    config = replace(hub.get_arch_config("tiny"), mixer=mixer, mixer_options=options)
    errors = str(config.validate())
    assert message in errors, errors
    with pytest.raises(mp.MixerError, match=message.split(";")[0]):
        fs2.create_mixer_decoder_model(config)
    nllb = fs2.NllbMixerConfig(decoder_mixer=mixer, decoder_mixer_options=options)
    assert message in str(nllb.validate())


# -- the recipe end to end --------------------------------------------------------------------------------------------

@pytest.mark.slow  # a recipe run (tests/forked.py)
def test_recipe_trains_checkpoints_and_generates(fs2, tmp_path, capsys, monkeypatch):
    """A tiny semiseparable decoder trains a few steps (a recipe run), checkpoints, and ``generate``
    continues prompts from the checkpoint with sampling and with beam search."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIRSEQ2_DEVICE": "cpu", "FAIRSEQ2_NO_PROGRESS": "1",
           "FAIRSEQ2_EXTENSION_TRACE": "1"}
    steps = 6
    args = [str(tmp_path), "--no-rich", "--config", "common.torch.num_threads=1",
            "common.metric_recorders.tensorboard.enabled=false", "mixer.name=semiseparable",
            "mixer.options.head_dim=8", "mixer.options.d_state=8", f"regime.num_steps={steps}",
            "regime.publish_metrics_every_n_steps=1", "data.num_examples=64", "data.batch_size=8",
            "data.max_seq_len=40", "optimizer.config.lr=0.003"]
    proc = python_m("mixer_plugins.backbones.fairseq2.lm", args, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    losses = [r["NLL Loss"] for r in records if "NLL Loss" in r]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses

    from mixer_plugins.backbones.fairseq2.generate import main

    ckpt = str(tmp_path / "checkpoints")
    assert main([ckpt, "--prompt", "The cat", "--prompt", "two", "--max-gen-len", "8", "--num-gens", "2"]) == 0
    sampled = capsys.readouterr().out.splitlines()
    assert len(sampled) == 4 and sampled[0].startswith("The cat") and sampled[2].startswith("two")
    assert main([ckpt, "--prompt", "The cat", "--mode", "beam", "--beam-size", "3", "--max-gen-len", "8"]) == 0
    beams = capsys.readouterr().out.splitlines()
    assert len(beams) == 3 and all(line.startswith("The cat") for line in beams)
    assert main([str(tmp_path), "--prompt", "x"]) == 2  # not a checkpoints folder: one line on stderr
    assert "error:" in capsys.readouterr().err

    # as the docs write the commands: a folder relative to the working directory
    from mixer_plugins.backbones.fairseq2 import load_mixer_checkpoint

    monkeypatch.chdir(tmp_path.parent)
    relative = f"{tmp_path.name}/checkpoints"
    assert main([relative, "--prompt", "The cat", "--max-gen-len", "4"]) == 0
    assert capsys.readouterr().out.startswith("The cat")
    assert type(load_mixer_checkpoint(relative)).__name__ == type(load_mixer_checkpoint(ckpt)).__name__


@pytest.mark.parametrize("option, value", [
    ("--temperature", "0"), ("--temperature", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
    ("--top-p", "-0.1"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-p", "0"), ("--top-k", "-1"), ("--top-k", "0"),
    ("--beam-size", "0"), ("--num-gens", "0"), ("--max-gen-len", "0"),
])
def test_generate_refuses_a_bad_option_in_one_line_before_loading_anything(option, value, tmp_path, capsys):
    # the folder does not even exist: the option is checked first, with exit status 2 and no traceback
    from mixer_plugins.backbones.fairseq2.generate import main

    assert main([str(tmp_path / "missing"), "--prompt", "x", option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and option.lstrip("-").replace("-", "_") in err[0]
