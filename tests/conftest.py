"""Shared test configuration: small thread counts (CI has 2 cores) and deterministic seeds."""

from __future__ import annotations

import os

import pytest
import torch

# One intra-op thread per test process: the suite runs under pytest-xdist on 2 cores.
torch.set_num_threads(int(os.environ.get("MIXER_PLUGINS_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules holding a ``slow`` test first (in collection order), every other module after them (in its
    order). The suite runs on two pytest-xdist workers that take whole modules (``--dist loadfile``); a long module
    handed out last would leave the other worker idle while it runs. ``make test`` also turns off xdist's own
    reordering (``--no-loadscope-reorder``), which hands modules out by their number of tests, largest first, and so
    puts the long few-test modules (a compile check, a dry run, an interpreter suite) last."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
