"""The conformance kit: checks any registered mixer against the mixer contract.

Use it on your own plugin::

    from mixer_plugins.testing import check_mixer
    check_mixer("my_mixer")                      # raises ConformanceError listing every failed check

or, in a pytest module, get one test per (mixer, check)::

    from mixer_plugins.testing import conformance_test
    test_my_mixer = conformance_test(["my_mixer"])

Checks (each one a function in :data:`CHECKS`):

* ``output``: shape and dtype preserved (float32 and float64), outputs finite, eval forward deterministic;
* ``materialize``: ``materialize`` is (batch, heads, L, L) and ``forward == forward_via_matrix`` in float64;
  non-linear mixers must raise ``NotMaterializableError`` instead;
* ``padding``: with a right-padded mask, real positions equal the unpadded run row by row, pad contents do not leak,
  pad outputs are zero;
* ``lengths``: length 1, an odd length and one past the chunk size run and agree with the matrix;
* ``gradients``: every parameter receives a finite, non-zero gradient;
* ``state_dict``: a second instance loaded from the first's ``state_dict`` gives identical outputs;
* ``reset_parameters``: under a seed, ``reset_parameters()`` re-draws the parameters exactly as a fresh build under
  that seed, and does so again;
* ``sequence_length``: data-independent mixers raise ``SequenceLengthError`` past ``max_seq_len``;
* ``bad_input``: wrong rank, width, dtype or mask raise ``MixerInputError``;
* ``bad_config``: a bad ``dim`` or a misspelt option raise ``InvalidMixerOptions`` (with a suggestion);
* ``causality``: causal mixers ignore the future and have a lower-triangular matrix;
* ``low_precision``: bfloat16 parameters and inputs give a finite bfloat16 output;
* ``nonfinite_pads``: NaN, Inf or 1e30 at the pads change nothing at real positions (pads are excluded by selection,
  never by multiplying with the mask) and pad outputs stay zero, in float32 and float64;
* ``nonfinite_future``: with the (opt-in) non-finite guard on, a NaN or Inf at a later token leaves every earlier
  output of a causal mixer unchanged;
* ``empty_batch``: a batch of 0 rows gives an empty output of the right shape (and an empty matrix);
* ``export``: ``torch.export`` succeeds, the program agrees with eager, and eager forwards after the export are
  unchanged (no tensor made while tracing survives in a cache);
* ``step``: a mixer whose spec says ``stepping=True`` decodes in its causal form: ``prefill`` of right-padded prompts
  then ``step`` of one or a few tokens at a time equal ``forward``; a cache allocated by a copy of the module works,
  and one of the same mixer at another width is refused with ``MixerInputError`` (the cache left as it was); a
  bfloat16 cache under a float32 mixer steps within bfloat16's accuracy (or is refused with ``MixerInputError``);
  under grad, prefill and steps give forward's gradients or refuse with a ``MixerInputError`` that says to use
  ``torch.no_grad()`` or ``torch.inference_mode()``, leaving the cache as it was. A mixer whose spec says
  ``stepping=False`` (or a bidirectional form) refuses to step with ``StepNotSupportedError``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ..layers.masks import set_nonfinite_guard
from ..mixers.cache import StepNotSupportedError
from ..registry import (
    InvalidMixerOptions,
    MixerInputError,
    MixerSpec,
    NotMaterializableError,
    SequenceLengthError,
    default_registry,
)

__all__ = ["CHECKS", "ConformanceError", "CheckResult", "MixerHarness", "check_mixer", "run_check", "conformance_test"]


class ConformanceError(AssertionError):
    """One or more conformance checks failed; the message lists each failure."""


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check on one mixer: the check's name, whether it passed, and why not (``message``)."""

    check: str
    passed: bool
    message: str = ""


@dataclasses.dataclass
class MixerHarness:
    """Builds instances of one mixer for the checks, with small, fast defaults."""

    spec: MixerSpec
    dim: int = 32
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    batch: int = 2

    def build(self, *, seed: int | None = None, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
        """The mixer (a module following the mixer contract) in ``dtype`` and eval mode, built under ``seed``."""
        torch.manual_seed(self.seed if seed is None else seed)
        opts = {**self.spec.test_options, **self.options, **overrides}
        mixer = self.spec.build(self.spec.make_config(self.dim, **opts))
        return mixer.to(dtype).eval()

    def inputs(self, length: int, *, batch: int | None = None, dtype: torch.dtype = torch.float64,
               seed: int = 1) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch or self.batch, length, self.dim, generator=gen, dtype=dtype)

    def lengths(self, mixer: Any) -> dict[str, int]:
        """Length 1, an odd length, and one longer than the chunk size (capped by max_seq_len)."""
        chunk = getattr(mixer.config, "chunk_size", None) or 16
        cap = mixer.max_seq_len or 10**9
        return {"one": 1, "odd": min(7, cap), "past_chunk": min(2 * chunk + 3, cap)}

    def default_length(self, mixer: Any) -> int:
        return min(12, mixer.max_seq_len or 12)

    def padded(self, length: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, list[int]]:
        """Inputs of three rows right-padded to real lengths ``length``, ``length - 5`` and 1: (x, mask, lengths)."""
        real = [length, max(1, length - 5), 1]
        mask = torch.arange(length)[None, :] < torch.tensor(real)[:, None]
        return self.inputs(length, batch=len(real), dtype=dtype), mask, real


def _assert_close(a: Tensor, b: Tensor, what: str, *, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    """Assert ``a`` is close to ``b`` (``atol`` plus ``rtol`` of ``b``'s largest magnitude); else say ``what``."""
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol + rtol * scale), f"{what} (max abs err {err:.3e})"


def _expect_raises(exc_type: type[BaseException], fn: Callable[[], Any], what: str) -> None:
    try:
        fn()
    except exc_type as err:
        if not str(err):
            raise AssertionError(f"{what}: raised {type(err).__name__} with an empty message") from None
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"{what}: expected {exc_type.__name__}, got {type(err).__name__}: {err}") from None
    raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing was raised")


@contextlib.contextmanager
def _fails_check(what: str, advice: str = "") -> Iterator[None]:
    """Report an unexpected exception of the block as a failed check: ``what`` raised it (then ``advice``)."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001 - a raw error is a failure of the check
        raise AssertionError(f"{what} raised {type(err).__name__}: {err}{advice}") from err


# -- the checks ------------------------------------------------------------------------------------

def check_output(h: MixerHarness) -> None:
    for dtype in (torch.float32, torch.float64):
        mixer = h.build(dtype=dtype)
        x = h.inputs(h.default_length(mixer), dtype=dtype)
        with torch.no_grad():
            y = mixer(x)
            y2 = mixer(x)
        assert isinstance(y, Tensor), f"forward returned {type(y).__name__}, not a Tensor"
        assert y.shape == x.shape, f"output shape {tuple(y.shape)} != input shape {tuple(x.shape)}"
        assert y.dtype == dtype, f"output dtype {y.dtype} != input dtype {dtype}"
        assert torch.isfinite(y).all(), f"non-finite output in {dtype}"
        assert torch.equal(y, y2), "two eval-mode forwards of the same input differ"


def check_materialize(h: MixerHarness) -> None:
    mixer = h.build()
    length = h.default_length(mixer)
    x = h.inputs(length)
    if not mixer.materializable:
        _expect_raises(NotMaterializableError, lambda: mixer.materialize(x), "materialize of a non-linear mixer")
        return
    with torch.no_grad():
        matrix = mixer.materialize(x)
        y, y_ref = mixer(x), mixer.forward_via_matrix(x)
    expected = (h.batch, mixer.num_heads, length, length)
    assert tuple(matrix.shape) == expected, f"materialize shape {tuple(matrix.shape)} != {expected}"
    assert torch.isfinite(matrix).all(), "materialized matrix has non-finite entries"
    _assert_close(y, y_ref, f"forward and forward_via_matrix disagree at length {length}")


def check_padding(h: MixerHarness) -> None:
    mixer = h.build()
    x, mask, real = h.padded(h.default_length(mixer))
    noisy = torch.where(mask[..., None], x, 100.0 * torch.randn_like(x))
    with torch.no_grad():
        y = mixer(x, mask=mask)
        y_noisy = mixer(noisy, mask=mask)
        for row, n in enumerate(real):
            alone = mixer(x[row:row + 1, :n])
            _assert_close(y[row, :n], alone[0], f"row {row} (real length {n}): padded and unpadded outputs differ")
    _assert_close(y, y_noisy, "pad contents leak into real positions")
    assert (y[~mask] == 0).all(), "outputs at pad positions must be zero"
    if mixer.materializable:
        with torch.no_grad():
            matrix = mixer.materialize(x, mask=mask)
            y_ref = mixer.forward_via_matrix(x, mask=mask)
        keep = mask[:, None, :, None] & mask[:, None, None, :]
        assert (matrix[~keep.expand_as(matrix)] == 0).all(), "materialize must be zero on pad rows/columns"
        _assert_close(y, y_ref, "masked forward and forward_via_matrix disagree")


def check_lengths(h: MixerHarness) -> None:
    mixer = h.build()
    for label, length in h.lengths(mixer).items():
        x = h.inputs(length)
        with torch.no_grad():
            y = mixer(x)
            assert y.shape == x.shape and torch.isfinite(y).all(), f"bad output at length {length} ({label})"
            if mixer.materializable:
                _assert_close(y, mixer.forward_via_matrix(x), f"forward disagrees with its matrix at length "
                              f"{length} ({label})")


def check_gradients(h: MixerHarness) -> None:
    mixer = h.build().train()
    x = h.inputs(h.default_length(mixer)).requires_grad_(True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    (mixer(x) * probe).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all(), "no finite gradient w.r.t. the input"
    missing, dead = [], []
    for name, p in mixer.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None or not torch.isfinite(p.grad).all():
            missing.append(name)
        elif p.grad.abs().max() == 0:
            dead.append(name)
    assert not missing, f"parameters without a finite gradient: {missing}"
    assert not dead, f"parameters whose gradient is exactly zero (dead at init?): {dead}"


def check_state_dict(h: MixerHarness) -> None:
    first = h.build(seed=11)
    second = h.build(seed=12)
    x = h.inputs(h.default_length(first))
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    with torch.no_grad():
        assert torch.equal(first(x), second(x)), "outputs differ after a state_dict round-trip"


def check_reset_parameters(h: MixerHarness) -> None:
    seed = 21
    fresh = h.build(seed=seed, dtype=torch.float32).state_dict()
    mixer = h.build(seed=seed + 1, dtype=torch.float32)
    reset = getattr(mixer, "reset_parameters", None)
    assert callable(reset), f"{type(mixer).__name__} has no reset_parameters() (MatrixMixer provides one)"
    for attempt in ("first", "second"):
        torch.manual_seed(seed)
        with torch.no_grad():
            reset()
        state = mixer.state_dict()
        assert state.keys() == fresh.keys(), "reset_parameters() changed the state_dict's keys"
        differ = [name for name, value in state.items() if not torch.equal(value, fresh[name])]
        assert not differ, (
            f"after reset_parameters() under seed {seed} ({attempt} time), these differ from a fresh build under the "
            f"same seed (not re-initialised, or drawn in another order): {differ}"
        )


def check_sequence_length(h: MixerHarness) -> None:
    mixer = h.build()
    if mixer.max_seq_len is None:
        # Data-dependent: must run past any length it was configured with.
        x = h.inputs(h.lengths(mixer)["past_chunk"] + 1)
        with torch.no_grad():
            assert torch.isfinite(mixer(x)).all()
        return
    x = h.inputs(mixer.max_seq_len + 1)
    _expect_raises(SequenceLengthError, lambda: mixer(x), f"length {mixer.max_seq_len + 1} > max_seq_len")
    with torch.no_grad():
        assert mixer(h.inputs(mixer.max_seq_len)).shape[1] == mixer.max_seq_len


def check_bad_input(h: MixerHarness) -> None:
    mixer = h.build()
    n = h.default_length(mixer)
    x = h.inputs(n)
    cases = {
        "2-D input": lambda: mixer(x[0]),
        "4-D input": lambda: mixer(x[None]),
        "wrong width": lambda: mixer(torch.randn(2, n, h.dim + 1, dtype=x.dtype)),
        "integer input": lambda: mixer(torch.ones(2, n, h.dim, dtype=torch.long)),
        "float mask": lambda: mixer(x, mask=torch.ones(2, n)),
        "mask of the wrong shape": lambda: mixer(x, mask=torch.ones(2, n + 1, dtype=torch.bool)),
        "left-padded mask": lambda: mixer(x, mask=torch.arange(n).expand(2, n) >= 1),
    }
    if any(p.is_floating_point() for p in mixer.parameters()):
        # A mixer without parameters computes in its input's dtype; one with parameters must not mix dtypes.
        cases["float32 input to a float64 mixer"] = lambda: mixer(x.float())
    for what, fn in cases.items():
        _expect_raises(MixerInputError, fn, what)


def check_bad_config(h: MixerHarness) -> None:
    spec = h.spec
    opts = {**spec.test_options, **h.options}
    for bad_dim in (0, -4):
        _expect_raises(InvalidMixerOptions, functools.partial(spec.make_config, bad_dim, **opts), f"dim={bad_dim}")
    option = next((o for o in spec.option_names() if o != "dim"), None)
    if option is not None and len(option) > 3:
        typo = option[:-1]
        try:
            spec.make_config(h.dim, **{**opts, typo: 1})
        except InvalidMixerOptions as err:
            assert repr(option) in str(err), f"misspelt option {typo!r}: no 'did you mean {option!r}' in: {err}"
        else:
            raise AssertionError(f"misspelt option {typo!r} was accepted")


def check_causality(h: MixerHarness) -> None:
    mixer = h.build()
    if not mixer.causal:
        return
    length = h.default_length(mixer)
    x = h.inputs(length)
    t = length // 2
    x2 = x.clone()
    x2[:, t + 1:] += torch.randn_like(x2[:, t + 1:])
    with torch.no_grad():
        y, y2 = mixer(x), mixer(x2)
    _assert_close(y[:, : t + 1], y2[:, : t + 1], f"causal mixer: output at t <= {t} changed when only the future "
                  "changed", rtol=1e-9, atol=1e-11)
    if mixer.materializable:
        with torch.no_grad():
            upper = torch.triu(mixer.materialize(x), diagonal=1)
        assert (upper == 0).all(), "causal mixer: materialized matrix is not lower-triangular"


def check_low_precision(h: MixerHarness) -> None:
    mixer = h.build(dtype=torch.bfloat16)
    x = h.inputs(h.default_length(mixer), dtype=torch.bfloat16)
    with torch.no_grad():
        y = mixer(x)
    assert y.dtype == torch.bfloat16, f"bfloat16 input gave a {y.dtype} output"
    assert torch.isfinite(y).all(), "bfloat16 forward gave non-finite values"


_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def check_nonfinite_pads(h: MixerHarness) -> None:
    for dtype in (torch.float32, torch.float64):
        mixer = h.build(dtype=dtype)
        x, mask, _ = h.padded(h.default_length(mixer), dtype=dtype)
        with torch.no_grad():
            y = mixer(x, mask=mask)
            for label, value in {**_NONFINITE, "1e30": 1e30}.items():
                bad = x.masked_fill(~mask[..., None], value)
                y_bad = mixer(bad, mask=mask)
                assert torch.isfinite(y_bad).all(), (
                    f"{label} at the pads made outputs non-finite ({dtype}): pads must be excluded by selection "
                    "(torch.where / masked_fill), not by multiplying with the mask (NaN * 0 = NaN)"
                )
                _assert_close(y_bad, y, f"{label} at the pads changed real outputs ({dtype})",
                              rtol=1e-6 if dtype == torch.float32 else 1e-9, atol=1e-6)
                assert (y_bad[~mask] == 0).all(), f"{label} at the pads: pad outputs are not zero ({dtype})"
                if mixer.materializable and dtype == torch.float64:
                    matrix = mixer.materialize(bad, mask=mask)
                    assert torch.isfinite(matrix).all(), f"{label} at the pads made the materialized matrix non-finite"


def check_nonfinite_future(h: MixerHarness) -> None:
    mixer = set_nonfinite_guard(h.build())   # the guard is opt-in: this checks what it promises
    if not mixer.causal:
        return
    length = h.default_length(mixer)
    x = h.inputs(length)
    t = length // 2
    with torch.no_grad():
        y = mixer(x)
        for label, value in _NONFINITE.items():
            for first in (t + 1, length - 1):
                if first >= length:
                    continue
                bad = x.clone()
                bad[:, first:] = value
                past = mixer(bad)[:, :first]
                assert torch.isfinite(past).all(), (
                    f"causal mixer: {label} from token {first} on made earlier outputs non-finite (a causal mask "
                    "applied by multiplying: 0 * NaN = NaN)"
                )
                _assert_close(past, y[:, :first], f"causal mixer: {label} from token {first} on changed earlier "
                              "outputs", rtol=1e-9, atol=1e-11)


def check_empty_batch(h: MixerHarness) -> None:
    mixer = h.build()
    length = h.default_length(mixer)
    x = h.inputs(length)[:0]
    with _fails_check("batch 0"), torch.no_grad():
        y = mixer(x)
        assert tuple(y.shape) == tuple(x.shape), f"batch 0: output shape {tuple(y.shape)} != {tuple(x.shape)}"
        y_masked = mixer(x, mask=torch.ones(0, length, dtype=torch.bool))
        assert tuple(y_masked.shape) == tuple(x.shape), "batch 0 with a mask: wrong output shape"
        if mixer.materializable:
            matrix = mixer.materialize(x)
            expected = (0, mixer.num_heads, length, length)
            assert tuple(matrix.shape) == expected, f"batch 0: materialize shape {tuple(matrix.shape)} != {expected}"


def check_export(h: MixerHarness) -> None:
    mixer = h.build(dtype=torch.float32)
    # A length the other checks do not use, so nothing this mixer caches per length was made before the export.
    length = min(19, mixer.max_seq_len or 19)
    x = h.inputs(length, dtype=torch.float32, seed=5)
    reference = h.build(dtype=torch.float32)
    with _fails_check("torch.export of the mixer"):
        exported = torch.export.export(mixer, (x,))
    # e.g. a FakeTensor kept from tracing, used in an eager call
    with _fails_check("eager forward after torch.export"), torch.no_grad():
        y_after = mixer(x)
        y_program = exported.module()(x)
        y_again = mixer(x)
    assert torch.isfinite(y_after).all(), "eager forward after torch.export gave non-finite outputs"
    _assert_close(y_program, y_after, "the exported program and eager disagree", rtol=1e-4, atol=1e-5)
    assert torch.equal(y_after, y_again), "eager forwards after torch.export differ from one another"
    if mixer.materializable:
        with torch.no_grad():
            y_ref = reference.forward_via_matrix(x)
        _assert_close(y_after, y_ref, "eager forward after torch.export drifted from the mixer's matrix: a tensor "
                      "made while tracing (a FakeTensor) survived in a cache", rtol=1e-4, atol=1e-5)


#: Token counts of the successive steps of the ``step`` check (one or a few tokens at a time).
_STEP_SIZES = (1, 2, 1, 3, 1, 1, 4)


def check_step(h: MixerHarness) -> None:
    spec = h.spec
    causal: dict[str, Any] = {"causal": True} if "causal" in spec.config.model_fields else {}
    mixer = h.build(**causal)
    if not spec.stepping or not mixer.causal:
        assert not mixer.can_step, (
            f"the spec says stepping={spec.stepping} (direction {spec.direction!r}) but the mixer can step: set "
            "stepping=True in its spec"
        )
        _expect_raises(StepNotSupportedError, lambda: mixer.allocate_cache(1, 4),
                       "allocate_cache on a mixer that cannot step")
        return
    assert mixer.can_step, f"the spec says stepping=True but the mixer cannot step: {mixer.step_problem()}"
    chunk = getattr(mixer.config, "chunk_size", None) or 8
    length = min(2 * chunk + 7, mixer.max_seq_len or 10**9)
    prompt = max(2, length // 2)
    prompts = torch.tensor([prompt, max(1, prompt - 4), 1])
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        mixer = h.build(dtype=dtype, **causal)
        x = h.inputs(length, batch=len(prompts), dtype=dtype, seed=3)
        mask = torch.arange(prompt)[None, :] < prompts[:, None]
        with torch.no_grad():
            full = mixer(x)
            cache = mixer.allocate_cache(len(prompts), length)
            y = mixer.prefill(x[:, :prompt], cache, mask=mask)
            _assert_close(y[mask], full[:, :prompt][mask], f"prefill of right-padded prompts differs from forward "
                          f"({dtype})", rtol=tol, atol=tol)
            assert (y[~mask] == 0).all(), f"prefill: pad outputs are not zero ({dtype})"
            assert torch.equal(cache.lengths, prompts), f"prefill: cache lengths {cache.lengths.tolist()} != prompts"
            position, given = prompts.clone(), prompt
            for t in _STEP_SIZES:
                if given + t > length:
                    break
                index = (position[:, None] + torch.arange(t))[..., None].expand(-1, -1, h.dim)
                y_t = mixer.step(x.gather(1, index), cache)
                assert y_t.shape == (len(prompts), t, h.dim), f"step of {t} tokens gave shape {tuple(y_t.shape)}"
                _assert_close(y_t, full.gather(1, index), f"prefill + steps differ from forward ({dtype}) at the step "
                              f"of {t} token(s) from positions {position.tolist()}", rtol=tol, atol=tol)
                position += t
                given += t
    prompt = max(1, length // 2)
    _check_step_owner(h, causal, length, prompt)
    _check_step_cache_dtype(h, causal, length, prompt)
    _check_step_under_grad(h, causal, length, prompt)


#: Relative accuracy of steps with a bfloat16 cache under a float32 mixer (bfloat16's machine epsilon, 2^-7, with a
#: margin): the state is rounded to bfloat16 once per token, the arithmetic stays in float32.
_BF16_CACHE_TOL = 1e-2


def _decode(mixer: Any, x: Tensor, prompt: int, cache: Any) -> Tensor:
    """Prefill ``x[:, :prompt]`` into ``cache``, then step the rest in pieces of :data:`_STEP_SIZES` tokens (as long
    as they fit): every output, concatenated. Runs in the caller's grad mode."""
    outputs = [mixer.prefill(x[:, :prompt], cache)]
    given = prompt
    for t in _STEP_SIZES:
        if given + t > x.shape[1]:
            break
        outputs.append(mixer.step(x[:, given:given + t], cache))
        given += t
    return torch.cat(outputs, dim=1)


def _cache_snapshot(cache: Any) -> dict[str, Any]:
    return {"offset": cache.offset, "lengths": cache.lengths.clone(), "poisoned": cache.poisoned.clone(),
            **{f"state[{name!r}]": t.clone() for name, t in cache.state.items()}}


def _assert_cache_kept(cache: Any, before: Mapping[str, Any], what: str) -> None:
    after = _cache_snapshot(cache)
    changed = [k for k, v in before.items()
               if k not in after or (not torch.equal(after[k], v) if isinstance(v, Tensor) else after[k] != v)]
    assert not changed, f"{what} was refused but changed the cache's {', '.join(changed)}: refuse before touching it"


def _check_step_owner(h: MixerHarness, causal: Mapping[str, Any], length: int, prompt: int) -> None:
    """A cache belongs to its mixer: shared by a copy of the module, refused by the same mixer at another width."""
    mixer = h.build(**causal)
    x = h.inputs(length, seed=4)
    with torch.no_grad():
        expected = _decode(mixer, x, prompt, mixer.allocate_cache(h.batch, length))
        got = _decode(mixer, x, prompt, copy.deepcopy(mixer).allocate_cache(h.batch, length))
    _assert_close(got, expected, "decoding with a cache allocated by a copy of the module differs", rtol=1e-12,
                  atol=1e-12)
    wide = dataclasses.replace(h, dim=2 * h.dim)
    try:
        wider = wide.build(**causal)
    except InvalidMixerOptions:
        return  # the options do not fit twice the width: nothing to compare with
    foreign = wider.allocate_cache(h.batch, length)
    with torch.no_grad():
        _expect_raises(MixerInputError, lambda: mixer.prefill(x[:, :prompt], foreign),
                       "prefill with the cache of this mixer at another width")
        wider.prefill(wide.inputs(prompt), foreign)
        before = _cache_snapshot(foreign)
        _expect_raises(MixerInputError, lambda: mixer.step(x[:, prompt:prompt + 1], foreign),
                       "step with the cache of this mixer at another width")
    _assert_cache_kept(foreign, before, "a step with the cache of this mixer at another width")


def _check_step_cache_dtype(h: MixerHarness, causal: Mapping[str, Any], length: int, prompt: int) -> None:
    """A bfloat16 cache under a float32 mixer steps within bfloat16's accuracy, or allocate_cache refuses it."""
    mixer = h.build(dtype=torch.float32, **causal)
    x = h.inputs(length, dtype=torch.float32, seed=4)
    with torch.no_grad():
        expected = _decode(mixer, x, prompt, mixer.allocate_cache(h.batch, length))
    try:
        cache = mixer.allocate_cache(h.batch, length, dtype=torch.bfloat16)
    except MixerInputError:
        return  # refused clearly
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"allocate_cache(dtype=torch.bfloat16) of a float32 mixer raised {type(err).__name__}: "
                             f"{err}; step with it, or refuse the dtype with MixerInputError") from err
    with _fails_check("decoding with a bfloat16 cache under a float32 mixer", "; read the state in the compute "
                      "dtype (cache.read(name, dtype)), or refuse the dtype in allocate_cache with MixerInputError"), \
            torch.no_grad():
        got = _decode(mixer, x, prompt, cache)
    assert got.dtype == torch.float32, f"a bfloat16 cache under a float32 mixer gave {got.dtype} outputs"
    _assert_close(got, expected, "decoding with a bfloat16 cache under a float32 mixer differs from a float32 "
                  "cache's, more than bfloat16's accuracy", rtol=_BF16_CACHE_TOL, atol=0.0)


_NO_GRAD_ADVICE = "call prefill/step under torch.no_grad() or torch.inference_mode()"


def _check_step_under_grad(h: MixerHarness, causal: Mapping[str, Any], length: int, prompt: int) -> None:
    """Under grad, prefill + steps give forward's gradients, or refuse (saying to use no_grad) and keep the cache."""
    mixer = h.build(**causal)
    x = h.inputs(length, seed=4)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    params = [p for p in mixer.parameters() if p.requires_grad]
    xg = x.clone().requires_grad_(True)
    advice = f"; give correct gradients, or refuse with MixerInputError ({_NO_GRAD_ADVICE})"
    try:
        with torch.enable_grad():
            y = _decode(mixer, xg, prompt, mixer.allocate_cache(h.batch, length))
    except MixerInputError as err:
        assert "torch.no_grad()" in str(err) and "torch.inference_mode()" in str(err), (
            f"prefill/step under grad: the MixerInputError must say how to fix it ({_NO_GRAD_ADVICE}): {err}"
        )
        _check_step_refusal_keeps_the_cache(mixer, x, prompt, length, h.batch)
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"prefill/step under grad raised {type(err).__name__}: {err}{advice}") from err
    n = y.shape[1]
    with _fails_check("backward through prefill/step under grad", advice), torch.enable_grad():
        got = torch.autograd.grad((y * probe[:, :n]).sum(), [xg, *params], allow_unused=True)
    xr = x.clone().requires_grad_(True)
    with torch.enable_grad():
        ref = mixer(xr)[:, :n]
        expected = torch.autograd.grad((ref * probe[:, :n]).sum(), [xr, *params], allow_unused=True)
    names = ["the input", *(name for name, p in mixer.named_parameters() if p.requires_grad)]
    for name, a, b in zip(names, got, expected):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b
        _assert_close(a.to(x.dtype), b.to(x.dtype), f"gradients through prefill + steps under grad differ from "
                      f"forward's (w.r.t. {name}){advice}", rtol=1e-8, atol=1e-10)


def _check_step_refusal_keeps_the_cache(mixer: Any, x: Tensor, prompt: int, length: int, batch: int) -> None:
    """A step refused under grad leaves the cache as it was: decoding continues under no_grad, equal to forward."""
    cache = mixer.allocate_cache(batch, length)
    with torch.no_grad():
        mixer.prefill(x[:, :prompt], cache)
        expected = mixer(x)[:, prompt:prompt + 1]
    before = _cache_snapshot(cache)
    xg = x.clone().requires_grad_(True)
    with torch.enable_grad():
        _expect_raises(MixerInputError, lambda: mixer.step(xg[:, prompt:prompt + 1], cache),
                       "step under grad (after a prefill under no_grad)")
    _assert_cache_kept(cache, before, "a step under grad")
    with torch.no_grad():
        got = mixer.step(x[:, prompt:prompt + 1], cache)
    _assert_close(got, expected, "after a step refused under grad, the next step differs from forward", rtol=1e-10,
                  atol=1e-10)


#: Every check, by name (its function's name without ``check_``), in the order the kit runs them.
CHECKS: dict[str, Callable[[MixerHarness], None]] = {fn.__name__.removeprefix("check_"): fn for fn in (
    check_output, check_materialize, check_padding, check_lengths, check_gradients, check_state_dict,
    check_reset_parameters, check_sequence_length, check_bad_input, check_bad_config, check_causality,
    check_low_precision, check_nonfinite_pads, check_nonfinite_future, check_empty_batch, check_export, check_step,
)}


def _harness(mixer: str | MixerSpec, dim: int | None, options: Mapping[str, Any] | None, seed: int) -> MixerHarness:
    """The harness of one mixer at ``dim`` (default 32), after checking once that its options (the spec's
    ``test_options`` with ``options`` over them) fit that dim, so no check fails on it."""
    spec = mixer if isinstance(mixer, MixerSpec) else default_registry.get_spec(mixer)
    harness = MixerHarness(spec=spec, dim=dim or 32, options=dict(options or {}), seed=seed)
    opts = {**spec.test_options, **harness.options}
    try:
        spec.make_config(harness.dim, **opts)
    except InvalidMixerOptions as err:
        raise ValueError(
            f"conformance kit: the options {opts} of mixer {spec.name!r} do not fit dim={harness.dim} ({err}); "
            "pass options= that do, or another dim"
        ) from None
    return harness


def run_check(mixer: str | MixerSpec, check: str, *, dim: int | None = None,
              options: Mapping[str, Any] | None = None, seed: int = 0) -> None:
    """Run one check at width ``dim`` (default 32); raises AssertionError with a clear message when it fails, and
    ValueError when the mixer's options (its spec's ``test_options`` and ``options``) do not fit ``dim``."""
    if check not in CHECKS:
        raise KeyError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")
    CHECKS[check](_harness(mixer, dim, options, seed))


def check_mixer(mixer: str | MixerSpec, *, dim: int | None = None, options: Mapping[str, Any] | None = None,
                checks: Iterable[str] | None = None, seed: int = 0, raise_on_failure: bool = True) -> list[CheckResult]:
    """Run the conformance checks on one mixer (by name, alias or spec) at width ``dim`` (default 32).

    Raises ValueError when the mixer's options (its spec's ``test_options`` and ``options``) do not fit ``dim``.
    """
    harness = _harness(mixer, dim, options, seed)
    results = []
    for name in checks or CHECKS:
        try:
            CHECKS[name](harness)
        except Exception as err:  # noqa: BLE001 - every failure is reported, not just the first
            results.append(CheckResult(name, False, f"{type(err).__name__}: {err}"))
        else:
            results.append(CheckResult(name, True))
    failed = [r for r in results if not r.passed]
    if failed and raise_on_failure:
        lines = "\n".join(f"  - {r.check}: {r.message}" for r in failed)
        raise ConformanceError(f"mixer {harness.spec.name!r} failed {len(failed)} conformance check(s):\n{lines}")
    return results


def conformance_test(mixers: Iterable[str] | None = None, *, checks: Iterable[str] | None = None,
                     options: Mapping[str, Mapping[str, Any]] | None = None) -> Callable[[str, str], None]:
    """A pytest test function parametrized over (mixer, check); assign it to a ``test_*`` name.

    ``mixers`` defaults to every registered mixer; ``options`` maps a mixer name to extra options.
    """
    import pytest

    names = list(mixers) if mixers is not None else default_registry.names()
    check_names = list(checks or CHECKS)
    per_mixer = dict(options or {})

    @pytest.mark.parametrize("check", check_names)
    @pytest.mark.parametrize("mixer", names)
    def test_conformance(mixer: str, check: str) -> None:
        run_check(mixer, check, options=per_mixer.get(mixer))

    return test_conformance
