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
