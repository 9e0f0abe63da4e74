"""Spawn a small gloo process group on 127.0.0.1 for a test, run one function on every rank, collect results.

Workers are started with ``torch.multiprocessing`` (start method ``spawn``) on a free local port; each rank's
return value is saved with ``torch.save`` and handed back to the test in rank order.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_spawned"]

#: A rank stuck in a collective (another rank failed) gives up after this long instead of hanging the test.
TIMEOUT_S = 240


def free_port() -> int:
    """A TCP port nobody listens on at the moment, on 127.0.0.1 only."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"       # loopback only
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; their results in rank order.

    ``fn`` must be a module-level function (it is pickled by reference). A failing rank raises here.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
