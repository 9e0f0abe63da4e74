"""Every registered mixer runs on the ``meta`` device (shapes only): ``mixer.to("meta")`` then forward, with and
without a padding mask, gives an output of the input's shape, dtype and device.

Meta tensors have no contents, so any value read (``.item()``, ``bool(tensor)``, ``if tensor.any()``) fails there;
this is how a value-dependent probe in a forward is found. The cases that still read values inside
:mod:`mixer_plugins.kernels` are marked below (strict: they must start passing once the kernels stop reading values).
"""

from __future__ import annotations

import pytest
import torch

import mixer_plugins as mp


def _cases():
    for name in mp.list_mixers():
        for masked in (False, True):
            yield pytest.param(name, masked, id=f"{name}-{'mask' if masked else 'nomask'}")


@pytest.mark.parametrize("name, masked", _cases())
def test_meta_forward_gives_shapes(name, masked):
    spec = mp.get_spec(name)
    mixer = spec.build(spec.make_config(32, **spec.test_options)).to("meta")
    assert all(p.device.type == "meta" for p in mixer.parameters())
    length = min(12, mixer.max_seq_len or 12)
    x = torch.empty(3, length, 32, device="meta")
    mask = torch.ones(3, length, dtype=torch.bool, device="meta") if masked else None
    y = mixer(x, mask=mask)
    assert (y.shape, y.dtype, y.device.type) == (x.shape, x.dtype, "meta")


def test_meta_forward_still_checks_shapes():
    """On meta only the value checks are skipped: a mask of the wrong shape is still refused."""
    mixer = mp.create_mixer("attention", 32, num_heads=4).to("meta")
    x = torch.empty(2, 5, 32, device="meta")
    with pytest.raises(mp.MixerInputError, match="mask must have shape"):
        mixer(x, mask=torch.ones(2, 6, dtype=torch.bool, device="meta"))
