"""Option values that cannot make a working mixer are refused up front, with the option named."""

from __future__ import annotations

import math

import pytest

import mixer_plugins as mp
from mixer_plugins.registry.spec import _annotation_types


def _fields_of(name: str, kind: type) -> list[str]:
    spec = mp.get_spec(name)
    return [k for k, f in spec.config.model_fields.items()
            if kind in _annotation_types(f.annotation) and bool not in _annotation_types(f.annotation)]


FLOAT_CASES = [(n, k) for n in mp.list_mixers() for k in _fields_of(n, float)]
INT_CASES = [(n, k) for n in mp.list_mixers() for k in _fields_of(n, int)]


def test_every_mixer_has_float_and_int_options_to_check():
    assert len(FLOAT_CASES) >= 15 and len(INT_CASES) >= 20


@pytest.mark.parametrize("name, option", FLOAT_CASES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_float_options_refuse_inf_and_nan(name, option, value):
    spec = mp.get_spec(name)
    options = {**spec.test_options, option: value}
    options.setdefault("dim", 16)
    with pytest.raises(mp.InvalidMixerOptions, match=option):
        spec.make_config(**options)


@pytest.mark.parametrize("name, option", INT_CASES)
def test_int_options_refuse_bools(name, option):
    spec = mp.get_spec(name)
    options = {**spec.test_options, option: True}
    options.setdefault("dim", 16)
    with pytest.raises(mp.InvalidMixerOptions, match=f"{option}=True: expected a number, not a bool"):
        spec.make_config(**options)


def test_num_heads_true_is_not_one():
    with pytest.raises(mp.InvalidMixerOptions, match="num_heads=True"):
        mp.create_mixer("attention", 16, num_heads=True)
    assert mp.create_mixer("attention", 16, num_heads=1) is not None  # a real 1 still works


def test_inf_dropout_no_longer_builds_a_mixer_of_nans():
    with pytest.raises(mp.InvalidMixerOptions, match="dropout=inf.*finite"):
        mp.create_mixer("attention", 16, num_heads=2, dropout=math.inf)


@pytest.mark.parametrize("dim", [2**20, 2**40])  # an allocator refusal / a size overflow
def test_sizes_that_cannot_be_allocated_are_a_clear_error(dim):
    with pytest.raises(mp.InvalidMixerOptions, match=rf"cannot be allocated at these sizes \(dim={dim}") as info:
        mp.create_mixer("attention", dim, num_heads=1)
    assert isinstance(info.value, mp.MixerError)
