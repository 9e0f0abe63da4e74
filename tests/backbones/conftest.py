"""Fixtures the fairseq2 backbone tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def resolver():
    """fairseq2's resolver, initialised once per process through the entry points only (no extras)."""
    from fairseq2.runtime.dependency import get_dependency_resolver

    return get_dependency_resolver()


@pytest.fixture(scope="module")
def fs2(resolver):
    """The adapter package, imported after fairseq2 is initialised."""
    import mixer_plugins.backbones.fairseq2 as fs2

    return fs2
