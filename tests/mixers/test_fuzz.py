"""Property-based fuzzing of the mixer contract over random registered mixers, options, shapes, masks and dtypes.

Brief by default (a few examples, so CI stays fast); set ``MIXER_PLUGINS_FUZZ_EXAMPLES`` for a longer run, e.g.
``MIXER_PLUGINS_FUZZ_EXAMPLES=500 pytest tests/mixers/test_fuzz.py`` (see docs/contract.md).
"""

from __future__ import annotations

import os

import pytest
import torch

import mixer_plugins as mp
from mixer_plugins.errors import InvalidMixerOptions
from mixer_plugins.layers.masks import set_nonfinite_guard

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("MIXER_PLUGINS_FUZZ_EXAMPLES", "15"))
MIXERS = sorted(mp.list_mixers())
DIM = 32


@st.composite
def cases(draw):
    name = draw(st.sampled_from(MIXERS))
    spec = mp.get_spec(name)
    options = dict(spec.test_options)
    names = set(spec.option_names())
    if "causal" in names:
        options["causal"] = draw(st.booleans())
    if "data_dependent" in names and draw(st.booleans()):
        options["data_dependent"] = False
        options["max_seq_len"] = draw(st.integers(8, 24))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    batch = draw(st.integers(1, 3))
    cap = options.get("max_seq_len") if options.get("data_dependent") is False else 24
    length = draw(st.integers(1, cap))
    real = draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**16))
    return name, options, dtype, batch, length, real, seed


def _tol(dtype):
    return (1e-3, 1e-4) if dtype == torch.float32 else (1e-7, 1e-9)


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize="MIXER_PLUGINS_FUZZ_SEED" not in os.environ,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_contract_holds_on_random_mixers_options_shapes_masks_and_dtypes(case):
    name, options, dtype, batch, length, real, seed = case
    torch.manual_seed(seed)
    try:
        mixer = mp.create_mixer(name, DIM, **options)
    except InvalidMixerOptions:
        assume(False)
    mixer = mixer.to(dtype).eval()
    rtol, atol = _tol(dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, DIM, generator=gen, dtype=dtype)
    mask = torch.arange(length)[None, :] < torch.tensor(real)[:, None]
    with torch.no_grad():
        y = mixer(x)
        # shape and finiteness
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.isfinite(y).all(), f"{name} {options}: non-finite output for a finite input"
        # padding invariance, pads zero, and pads never leak (even NaN pads)
        y_masked = mixer(x, mask=mask)
        y_nan_pads = mixer(x.masked_fill(~mask[..., None], float("nan")), mask=mask)
        assert torch.isfinite(y_nan_pads).all(), f"{name} {options}: NaN pads leaked"
        torch.testing.assert_close(y_nan_pads, y_masked, rtol=rtol, atol=atol)
        assert (y_masked[~mask] == 0).all()
        for row, n in enumerate(real):
            alone = mixer(x[row:row + 1, :n])
            torch.testing.assert_close(y_masked[row, :n], alone[0], rtol=rtol, atol=atol)
        # causality: the future (finite noise, then NaN: the opt-in non-finite guard on) never changes the past
        if mixer.causal and length > 1:
            set_nonfinite_guard(mixer)
            t = length // 2
            for value in ("noise", float("nan")):
                x2 = x.clone()
                if value == "noise":
                    x2[:, t:] += torch.randn(x2[:, t:].shape, generator=gen, dtype=dtype)
                else:
                    x2[:, t:] = value
                y2 = mixer(x2)
                torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=rtol, atol=atol)
