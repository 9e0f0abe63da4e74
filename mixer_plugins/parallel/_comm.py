"""Small collective helpers for context parallelism (autograd-aware where gradients must flow)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["group_rank", "group_size", "all_gather_autograd", "all_gather_ints"]


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group=group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group=group)


def all_gather_autograd(t: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """Every rank's ``t`` (same shape everywhere), with gradients flowing back to the rank that sent it.

    ``torch.distributed.nn.functional.all_gather``: its backward sums, on each sender, the gradients every
    rank computed for that sender's slot (an all-to-all on gloo, a reduce-scatter on NCCL).
    """
    from torch.distributed.nn.functional import all_gather

    if group_size(group) == 1:
        return [t]
    return list(all_gather(t.contiguous(), group=group))


def all_gather_ints(values: list[int], group: ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's list of small integers (same count everywhere); no gradients."""
    mine = torch.tensor(values, dtype=torch.long, device=device)
    if group_size(group) == 1:
        return [values]
    out = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(out, mine, group=group)
    return [o.tolist() for o in out]
