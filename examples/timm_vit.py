"""Build a Hydra-ViT with timm, train it a few steps on random data, and print its parameters and FLOPs.

    python examples/timm_vit.py                          # hydra_vit_tiny with the quasiseparable mixer, 32 px
    python examples/timm_vit.py --mixer toeplitz         # any registered mixer (mixer-plugins list)
    python examples/timm_vit.py --model vit_small --mixer quasi --img-size 96
    python examples/timm_vit.py --mixer-options '{"d_state": 16}'

``import mixer_plugins`` is what makes ``timm.create_model('hydra_vit_tiny')`` and ``mixer=`` work. The defaults
(32 x 32 images in 8 x 8 patches, batch 8, 5 steps) run in seconds on a CPU; the paper's setup is
``hydra_vit_base`` at 224 px (see docs/timm.md).
"""

from __future__ import annotations

import argparse
import json
import time

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins  # noqa: F401  (registers the timm names and mixers)
from mixer_plugins.backbones.timm import TimmMixerAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hydra_vit_tiny", help="hydra_vit_tiny|small|base or vit_tiny|...|large")
    parser.add_argument("--mixer", default="quasi", help="a registered mixer name or alias (default: quasi)")
    parser.add_argument("--mixer-options", default="{}", help="the mixer's options as JSON")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = timm.create_model(
        args.model, mixer=args.mixer, mixer_options=json.loads(args.mixer_options), img_size=args.img_size,
        patch_size=args.patch_size, num_classes=args.num_classes,
    )
    mixers = [m for m in model.modules() if isinstance(m, TimmMixerAttention)]
    tokens = mixers[0].seq_len
    params = sum(p.numel() for p in model.parameters())
    mixer_params = sum(p.numel() for m in mixers for p in m.parameters())
    print(f"{args.model} with mixer {mixers[0].mixer_name!r}: {len(model.blocks)} blocks, width {model.embed_dim}, "
          f"{tokens} tokens per {args.img_size}px image")
    print(f"parameters: {params / 1e6:.2f}M (mixers {mixer_params / 1e6:.2f}M)")

    # FLOPs of one forward at batch 1: counted from the aten ops, and the mixers' own analytic count
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, args.img_size, args.img_size))
    analytic = sum(m.flops(1, tokens) for m in mixers)
    print(f"FLOPs per image: {counter.get_total_flops() / 1e9:.3f} GFLOP (torch FlopCounterMode); "
          f"mixers alone {analytic / 1e9:.3f} GFLOP (analytic)")

    # a few AdamW steps on random images and labels
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    labels = torch.randint(0, args.num_classes, (args.batch_size,))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s (batch {args.batch_size})")


if __name__ == "__main__":
    main()
