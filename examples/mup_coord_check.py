"""muP coordinate check: the same small model at widths 64..512, trained 10 Adam steps, under muP and under the
standard parametrization (SP). Under muP every module's activation RMS stays put as the width grows; under SP it
grows with width (the check fails), which is why an SP learning rate tuned at one width does not transfer.

Run: ``python examples/mup_coord_check.py`` (CPU, well under a minute). Pass ``--plot coord.png`` to also draw the
RMS of each block's output against width (needs matplotlib).
"""

from __future__ import annotations

import argparse

import torch

from mixer_plugins.layers import mup
from mixer_plugins.testing import MixerCoordCheckModel

WIDTHS = [64, 128, 256, 512]
BATCH, LENGTH, IN_DIM = 8, 16, 8
TARGET = torch.randn(IN_DIM, generator=torch.Generator().manual_seed(123))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh batch per step: predict a fixed projection of the running mean of the inputs."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, LENGTH, IN_DIM, generator=g)
    y = (x.cumsum(1) / torch.arange(1, LENGTH + 1)[:, None]) @ TARGET
    return x, y[..., None]


def builder(mixer_muP: bool):
    """MLR attention with a fixed head dim (16), as in the paper's language models; logits 4/r_l or 1/sqrt(r_l)."""
    def build(width: int) -> torch.nn.Module:
        options = dict(num_heads=width // 16, ranks=[8, 4, 2, 2], block_sizes=[None, 4, 2, 1],
                       logit_scaling="mup" if mixer_muP else "standard", logit_multiplier=4.0 if mixer_muP else 1.0)
        return MixerCoordCheckModel(width, "mlr_attention", depth=2, in_dim=IN_DIM, mlp_ratio=2, mixer_options=options)
    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="save a plot of block-output RMS vs width to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = {}
    for name in ("mup", "sp"):
        result = mup.coord_check(builder(name == "mup"), WIDTHS, steps=10, data=data, lr=1e-3, parametrization=name)
        results[name] = result
        verdict = "PASS" if result.passes(0.5) else "FAIL"
        print(f"{name.upper()}: largest |log2(RMS at width 512 / RMS at width 64)| = {result.max_spread():.2f} "
              f"-> {verdict} (tolerance 0.5)")
        print(result.table(rows=5), end="\n\n")

    if args.plot:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, (name, result) in zip(axes, results.items()):
            for module in ("blocks.0.mixer", "blocks.1.mixer", "blocks.1.mlp", "readout"):
                ax.loglog(result.widths, result.rms[module][:, -1], marker="o", label=module)
            ax.set_title(f"{name.upper()}: activation RMS after 10 steps")
            ax.set_xlabel("width")
        axes[0].set_ylabel("RMS")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"saved {args.plot}")


if __name__ == "__main__":
    main()
