"""The two ways to swap a fairseq2 encoder's mixer: in Python, and on a recipe command line.

    OMP_NUM_THREADS=1 python examples/fairseq2_mlm.py [MIXER]      # default: quasi; about a minute on a CPU

1. Python: build the ``tiny`` arch of the ``mixer_encoder`` family with ``mixer=MIXER`` and run an MLM
   forward/backward on a padded batch.
2. Command line: train the same model for a few steps with the recipe
   (``python -m mixer_plugins.backbones.fairseq2 OUT --config model.config_overrides.mixer=MIXER``), then
   reload the checkpoint through fairseq2's ``load_model``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("FAIRSEQ2_DEVICE", "cpu")
os.environ.setdefault("FAIRSEQ2_NO_PROGRESS", "1")

import torch  # noqa: E402
from fairseq2 import init_fairseq2  # noqa: E402
from fairseq2.device import CPU  # noqa: E402
from fairseq2.nn import BatchLayout  # noqa: E402

from mixer_plugins.backbones.fairseq2 import get_mixer_encoder_hub, load_mixer_checkpoint  # noqa: E402


def main(mixer: str) -> None:
    # -- 1. Python: one config field -------------------------------------------------------------
    init_fairseq2()  # fairseq2 runs our entry point: the mixer_encoder family is registered
    hub = get_mixer_encoder_hub()
    config = replace(hub.get_arch_config("tiny"), mixer=mixer)
    model = hub.create_new_model(config, device=CPU)
    tokens = torch.randint(4, 260, (3, 24))
    seq_lens = [24, 17, 5]
    for row, n in enumerate(seq_lens):
        tokens[row, n:] = 0  # right padding
    layout = BatchLayout.of(tokens, seq_lens)
    loss = model(tokens, layout, targets=tokens, reduction="mean")
    loss.backward()
    print(f"[python] mixer={mixer}: {type(model.encoder.layers[0].self_attn.mixer).__name__}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, MLM loss {loss.item():.3f}")

    # -- 2. Recipe command line: the same field as a config override --------------------------------
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "mixer_plugins.backbones.fairseq2", out, "--no-rich", "--config",
               f"model.config_overrides.mixer={mixer}", "regime.num_steps=20", "regime.publish_metrics_every_n_steps=5",
               "common.metric_recorders.tensorboard.enabled=false"]
        print("[recipe]", " ".join(cmd[1:]))
        subprocess.run(cmd, check=True)
        trained = load_mixer_checkpoint(Path(out) / "checkpoints")
        print(f"[recipe] reloaded with load_model: mixer={trained.mixer_name}, "
              f"{type(trained.encoder.layers[0].self_attn.mixer).__name__}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "quasi")
