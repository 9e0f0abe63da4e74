"""Data parallelism: DDP and FSDP2 (``fully_shard``) on 2 gloo ranks equal one process at the same global batch.

For a small timm ViT and a small fairseq2 ``mixer_encoder`` with each mixer in :data:`MIXERS`, in float64:

* the gradients after one backward equal the single-process gradients of the global batch, and the parameters
  after one optimizer step (SGD with momentum and weight decay) equal the single-process ones (tolerance
  ``rtol=1e-9, atol=1e-12``: only the order of the summation differs);
* a ``torch.distributed.checkpoint`` save of model and optimizer, loaded into a freshly built (differently
  initialised) wrapped model, gives bit-identical outputs and parameters.

One spawn of 2 ranks runs both engines on every model (each rank also computes the single-process reference).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_spawned

import mixer_plugins  # noqa: F401  (registers our timm names)
from mixer_plugins.registry import default_registry

timm = pytest.importorskip("timm")

MIXERS = ("attention", "quasiseparable", "semiseparable", "toeplitz", "mlr_attention", "btt_attention")
HOSTS = ("timm", "fairseq2")
AVAILABLE_HOSTS = tuple(h for h in HOSTS if importlib.util.find_spec(h) is not None)
WORLD = 2
GLOBAL_BATCH = 4
RTOL, ATOL = 1e-9, 1e-12

VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
SEQ_LENS = [12, 9, 12, 5]          # the fairseq2 batch is right-padded


def _options(name: str) -> dict:
    return dict(default_registry.get_spec(name).test_options)


def _build(host: str, mixer: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if host == "timm":
            model = timm.create_model("vit_tiny", mixer=mixer, mixer_options=_options(mixer), **VIT)
        else:
            from mixer_plugins.backbones.fairseq2 import BYTE_VOCAB_SIZE, MixerEncoderConfig, create_mixer_encoder_model

            config = MixerEncoderConfig(model_dim=32, num_layers=2, num_heads=2, ffn_inner_dim=32,
                                        vocab_size=BYTE_VOCAB_SIZE, max_seq_len=16, dropout_p=0.0, mixer=mixer,
                                        mixer_options={mixer: _options(mixer)})
            model = create_mixer_encoder_model(config)
    return model.double()


def _batch(host: str) -> dict:
    gen = torch.Generator().manual_seed(1234)
    if host == "timm":
        return {"x": torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=gen, dtype=torch.float64),
                "y": torch.randint(0, VIT["num_classes"], (GLOBAL_BATCH,), generator=gen)}
    tokens = torch.randint(4, 200, (GLOBAL_BATCH, max(SEQ_LENS)), generator=gen)
    real = torch.arange(max(SEQ_LENS))[None] < torch.tensor(SEQ_LENS)[:, None]
    tokens = tokens.masked_fill(~real, 0)
    target_mask = real & (torch.rand(tokens.shape, generator=gen) < 0.5)
    target_mask[:, 1] = True
    return {"tokens": tokens, "seq_lens": list(SEQ_LENS), "target_mask": target_mask}


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _loss(host: str, model, batch: dict, scale: float) -> torch.Tensor:
    """timm: mean cross-entropy over the batch; fairseq2: the MLM loss summed over the targets; times ``scale``."""
    if host == "timm":
        return F.cross_entropy(model(batch["x"]), batch["y"]) * scale
    from fairseq2.nn import BatchLayout

    layout = BatchLayout.of(batch["tokens"], batch["seq_lens"])
    return model(batch["tokens"], layout, batch["tokens"], target_mask=batch["target_mask"], reduction="sum") * scale


def _output(host: str, model, batch: dict) -> torch.Tensor:
    if host == "timm":
        return model(batch["x"])
    from fairseq2.nn import BatchLayout

    return model(batch["tokens"], BatchLayout.of(batch["tokens"], batch["seq_lens"]))


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wrap(engine: str, host: str, model):
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    blocks = model.blocks if host == "timm" else model.encoder.layers
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _compare(got: dict, want: dict) -> float:
    """Largest |got - want| / (atol + rtol |want|) over all tensors (<= 1 passes)."""
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        worst = max(worst, ((g - w).abs() / (ATOL + RTOL * w.abs())).max().item())
    return worst


def _case(engine: str, host: str, mixer: str, rank: int, ckpt_root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    seed = 100 + MIXERS.index(mixer)
    batch = _batch(host)
    # one process, the global batch
    ref = _build(host, mixer, seed)
    opt_ref = _optimizer(ref)
    n_targets = batch["target_mask"].sum().item() if host == "fairseq2" else 1
    _loss(host, ref, batch, 1.0 / n_targets).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt_ref.step()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # WORLD ranks, an equal share of the global batch each
    model = _build(host, mixer, seed)
    names = [n for n, _ in model.named_parameters()]
    wrapped = _wrap(engine, host, model)
    opt = _optimizer(wrapped)
    share = GLOBAL_BATCH // WORLD
    local = _rows(batch, slice(rank * share, (rank + 1) * share))
    if host == "fairseq2":
        local["seq_lens"] = batch["seq_lens"][rank * share:(rank + 1) * share]
    # DDP and FSDP average the ranks' gradients: a mean loss stays a mean, a sum over the global targets
    # becomes each rank's sum times the world size
    _loss(host, wrapped, local, 1.0 if host == "timm" else WORLD / n_targets).backward()
    grads = {n: _full(p.grad) for n, p in zip(names, model.parameters())}
    opt.step()
    params = {n: _full(p.detach()) for n, p in zip(names, model.parameters())}
    result = {"grad": _compare(grads, ref_grads), "param": _compare(params, ref_params)}
    # checkpoint round trip into a differently initialised model
    ckpt = os.path.join(ckpt_root, f"{engine}-{host}-{mixer}")
    model_sd, optim_sd = get_state_dict(wrapped, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    fresh = _build(host, mixer, seed + 1000)
    fresh_wrapped = _wrap(engine, host, fresh)
    fresh_opt = _optimizer(fresh_wrapped)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh_wrapped, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fresh_wrapped, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with torch.no_grad():
        same_out = torch.equal(_output(host, wrapped, local), _output(host, fresh_wrapped, local))
    same_params = all(torch.equal(_full(a.detach()), _full(b.detach()))
                      for a, b in zip(model.parameters(), fresh.parameters()))
    result["checkpoint_identical"] = bool(same_out and same_params)
    return result


def _worker(rank: int, world_size: int, engines: tuple[str, ...], ckpt_root: str) -> dict:
    results = {}
    for engine in engines:
        for host in AVAILABLE_HOSTS:
            for mixer in MIXERS:
                results[(engine, host, mixer)] = _case(engine, host, mixer, rank, ckpt_root)
                dist.barrier()
    return results


ENGINES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def engine_results() -> list[dict]:
    """One spawn of 2 ranks runs both engines on every model (process start-up dominates on 2 cores)."""
    with tempfile.TemporaryDirectory() as ckpt_root:
        return run_spawned(_worker, WORLD, ENGINES, ckpt_root)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("engine", ENGINES)
def test_data_parallel_equals_one_process(engine_results, engine, host):
    if host == "fairseq2":
        pytest.importorskip("fairseq2")
    for rank, per_rank in enumerate(engine_results):
        for mixer in MIXERS:
            r = per_rank[(engine, host, mixer)]
            where = f"{engine}, {host}, {mixer}, rank {rank}"
            assert r["grad"] <= 1.0, f"gradients differ from one process ({where}): {r['grad']:.3g} x tolerance"
            assert r["param"] <= 1.0, f"parameters after a step differ ({where}): {r['param']:.3g} x tolerance"
            assert r["checkpoint_identical"], f"checkpoint round trip is not bit-identical ({where})"


# -- fairseq2's recipe under torchrun ---------------------------------------------------------------------------

def _recipe_env() -> dict:
    import mixer_plugins as package

    root = os.path.dirname(os.path.dirname(os.path.abspath(package.__file__)))
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p), FAIRSEQ2_DEVICE="cpu",
               OMP_NUM_THREADS="1", FAIRSEQ2_NO_PROGRESS="1", GLOO_SOCKET_IFNAME="lo")
    return env


def _recipe(out_dir, nproc: int, batch_size: int, num_steps: int, data_parallelism: str = "ddp") -> None:
    import subprocess
    import sys

    from forked import python_m
    from helpers import free_port

    # the LR schedule must not depend on num_steps: the run is stopped at step 3, then resumed to step 6
    config = ["--no-rich", "--config", f"regime.num_steps={num_steps}", "regime.checkpoint_every_n_steps=3",
              "regime.publish_metrics_every_n_steps=1", "data.num_examples=64", f"data.batch_size={batch_size}",
              "model.config_overrides.mixer=quasiseparable", "lr_scheduler.config.cycle_len=6",
              f"trainer.data_parallelism={data_parallelism}"]
    recipe, args = "mixer_plugins.backbones.fairseq2", [str(out_dir), *config]
    if nproc == 1:
        done = python_m(recipe, args, env=_recipe_env(), cwd=os.getcwd(), timeout=600)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", recipe, *args]
        done = subprocess.run(cmd, env=_recipe_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _losses(out_dir) -> dict[int, float]:
    import json

    losses = {}
    with open(os.path.join(out_dir, "metrics", "train.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            losses[int(record["Step"])] = float(record["NLL Loss"])
    return losses


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory) -> dict[int, float]:
    """The recipe in one process, data.batch_size=8, 6 steps: the reference loss curve."""
    pytest.importorskip("fairseq2")
    out = tmp_path_factory.mktemp("one")
    _recipe(out, nproc=1, batch_size=8, num_steps=6)
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("data_parallelism", ["ddp", "fsdp"])
def test_fairseq2_recipe_under_torchrun_follows_one_process_and_resumes(tmp_path, one_process_losses,
                                                                         data_parallelism):
    """torchrun, 2 CPU ranks (gloo), data.batch_size=4 each, ``trainer.data_parallelism`` ddp (replicated) or
    fsdp (FSDP2, sharded parameters, optimizer state and checkpoint), stopped at step 3 and resumed from its
    checkpoint, gives the loss curve of one process with data.batch_size=8 (float32; rtol 1e-4)."""
    pytest.importorskip("fairseq2")
    out = tmp_path / data_parallelism
    _recipe(out, nproc=2, batch_size=4, num_steps=3, data_parallelism=data_parallelism)
    assert os.path.isdir(out / "checkpoints" / "step_3")
    shards = sorted(p.name for p in (out / "checkpoints" / "step_3" / "model").rglob("*.pt"))
    # FSDP saves one shard of the model per rank; DDP one replicated copy
    assert len(shards) == (2 if data_parallelism == "fsdp" else 1), shards
    _recipe(out, nproc=2, batch_size=4, num_steps=6, data_parallelism=data_parallelism)   # resumes from step 3
    one, two = one_process_losses, _losses(out)
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), f"step {step}: 2 ranks {two[step]} vs 1 {one[step]}"
    log = (out / "logs" / "rank_0.log").read_text()
    wrapped = "Wrapping model with FSDP2" if data_parallelism == "fsdp" else "Wrapping model with DDP"
    assert wrapped in log, f"the recipe did not wrap the model as asked ({data_parallelism})"
    assert "Resuming from step 3" in log


@pytest.mark.parametrize("world", [2, 3])
def test_mlm_reader_shares_make_the_single_process_batch(world):
    """Rank shares of global batch k, concatenated, are batch k of one process (tokens, inputs, masks)."""
    pytest.importorskip("fairseq2")
    from mixer_plugins.backbones.fairseq2.corpus import ByteTokenizer, encode_all, generate_corpus
    from mixer_plugins.backbones.fairseq2.data import MlmDataReader, MlmDataSection

    tok = ByteTokenizer()
    examples = encode_all(tok, generate_corpus(50, seed=0), 40)
    one = MlmDataReader(examples, MlmDataSection(batch_size=4 * world, max_seq_len=40), tok)
    ranks = [MlmDataReader(examples, MlmDataSection(batch_size=4, max_seq_len=40), tok, rank=r, world_size=world)
             for r in range(world)]
    full, rest = divmod(50, 4 * world)
    steps = full + (1 if rest >= world else 0)    # a last global batch too small for every rank is dropped
    for _ in range(steps):
        (whole,) = next(one)
        parts = [next(r)[0] for r in ranks]
        assert sum((p.seq_lens for p in parts), []) == whole.seq_lens
        for name in ("inputs", "targets", "target_mask"):
            width = getattr(whole, name).shape[1]
            glued = torch.cat([F.pad(getattr(p, name), (0, width - getattr(p, name).shape[1])) for p in parts])
            assert torch.equal(glued, getattr(whole, name)), name
    for r in ranks:                     # every rank ends the epoch at the same step
        with pytest.raises(StopIteration):
            next(r)
