"""The mixer contract: :class:`MatrixMixer`.

A matrix mixer maps ``x: (batch, length, dim) -> (batch, length, dim)`` and, per head, applies an
L x L matrix to its (projected) values. Every mixer is written as four small steps::

    ctx = self.prepare(x, mask)   # projections etc.: ctx.values is (batch, length, heads, head_dim)
    y   = self.mix(ctx)           # the fast path: y_i = sum_j M_ij v_j, never building M if avoidable
    M   = self.matrix(ctx)        # the same M, materialized: (batch, heads, length, length)
    out = self.finish(ctx, y)     # gates, norms, output projection

and the base class assembles the public API from them:

* ``forward(x, *, mask=None)``: ``finish(prepare(x), mix(...))``;
* ``materialize(x, *, mask=None)``: ``matrix(prepare(x))``, the framework's defining object;
* ``forward_via_matrix(x, *, mask=None)``: ``finish(M @ values)``, the oracle every fast path is tested
  against (the conformance kit checks ``forward == forward_via_matrix``);
* ``flops(batch, length)``: analytic FLOPs (2 per multiply-add) of the mixer's own work;
* ``reset_parameters()``: re-draw every parameter as a fresh build would;
* ``state_dict()`` records the mixer's name and options (see *Checkpoint records* below), and ``load_state_dict``
  refuses a checkpoint of another mixer or of other options;
* ``allocate_cache`` / ``prefill`` / ``step``: decoding, for causal mixers that can step (see *Decoding* below).

The constructor builds everything from the config and calls no overridable method; the context passed between the
steps is a typed dataclass (:class:`MixerContext` or a subclass), so a whole mixer compiles with
``torch.compile(fullgraph=True)``.

``mask`` is an optional bool ``(batch, length)`` tensor, True on real tokens, right-padded. Outputs at
real positions equal what the mixer gives on the unpadded row; outputs at pads are zero. Pads never leak: the base
class replaces pad inputs with zeros by selection before ``prepare`` (so a NaN, an Inf or a 1e30 at a pad is never
multiplied into anything) and sets pad outputs to zero by selection after ``finish``. A causal mixer's outputs at
positions before a non-finite input token are those of the clean input (see :func:`causal_nonfinite_guard`).

Decoding
--------
A causal mixer whose class implements the step hooks (``steppable = True``; its spec says ``stepping=True``)
generates token by token::

    cache = mixer.allocate_cache(batch, max_len)        # a MixerCache: lengths, the mixer's state tensors
    y = mixer.prefill(prompt, cache, mask=mask)         # the prompt's outputs (one parallel pass); fills the cache
    y_t = mixer.step(x_t, cache)                        # (batch, t, dim) new tokens -> their outputs

``prefill`` + ``step`` equal ``forward`` over the whole sequence (the conformance kit checks it, float64 and float32,
rows of different lengths included). Right-padded prompt rows each continue from their own length. They run no
value-dependent control flow and update the cache in place, so a CUDA graph can capture ``step``. Subclasses
implement :meth:`~MatrixMixer.init_cache`, :meth:`~MatrixMixer.fill_cache` and :meth:`~MatrixMixer.mix_step` (and
:meth:`~MatrixMixer.prepare_step` where their ``prepare`` is not per token).

What ``prefill`` and ``step`` refuse, with a :class:`MixerInputError`, before touching the cache:

* **A cache of another mixer.** A cache records its owner, the :meth:`~MatrixMixer.cache_key` of the mixer that
  allocated it: the mixer's class and its options, those that never change its state (``chunk_size``, dropout,
  initialisation; :data:`CHECKPOINT_FREE_OPTIONS`) excepted. Another mixer's state has other shapes or another
  meaning (a window of 3 read as a window of 5 gives wrong outputs, silently), so a cache whose owner differs is
  refused, naming both. Identically configured mixers share caches (a copy of the module, beam search). The check is
  one string comparison per call.
* **Recording autograd.** Steps are for inference: the cache keeps no autograd history and is updated in place, so
  gradients through ``step`` would be wrong (or fail with an in-place version error). With grad enabled and an input
  or a parameter that requires grad, both refuse: call them under ``torch.no_grad()`` or ``torch.inference_mode()``
  (to train, run ``forward`` over whole sequences). Under ``no_grad`` the check is one ``torch.is_grad_enabled()``
  call; a mixer with nothing that requires grad steps with grad enabled.

``allocate_cache(dtype=...)`` takes any of :data:`~mixer_plugins.mixers.cache.CACHE_DTYPES` whatever the mixer's
dtype (a bfloat16 KV cache under a float32 model halves its memory): prefill and steps round what they write to the
cache's dtype and read it back in the dtype they compute in, so outputs are those of a float32 cache within the
cache dtype's accuracy. Another dtype (integer, complex, float8) is refused.

Checkpoint records
------------------
A mixer's ``state_dict`` holds one extra entry, ``<prefix>_extra_state`` (PyTorch's extra-state mechanism): a uint8
tensor of UTF-8 JSON naming the mixer (its registry name, or its class when it was built without the registry) and
its options. A tensor, so every checkpoint path that expects tensors only (fairseq2's,
``torch.load(weights_only=True)``, ``torch.distributed.checkpoint``) carries it unchanged. ``load_state_dict``
compares it with the mixer being loaded and raises :class:`MixerCheckpointMismatchError`, naming both, when the
checkpoint holds another mixer or other options (``chunk_size``, dropout rates and initialisation-only options
excepted, see :data:`CHECKPOINT_FREE_OPTIONS`: they do not change what trained weights compute, and neither does
``max_seq_len`` for a mixer that runs at any length).

A checkpoint without the entry (converted from other code, or written without mixer records) loads without the
check. To load weights into another mixer on purpose, drop the records first:
``model.load_state_dict(strip_mixer_records(state_dict))``. The check runs when the loader reaches the mixer, so
modules loaded before it keep their new weights when it raises (as with PyTorch's own size-mismatch errors).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from ..errors import MixerCheckpointMismatchError, MixerInputError, SequenceLengthError
from ..layers.masks import causal_nonfinite_guard, padding_mask_to_bool, poison_after, zero_pads
from ..registry.spec import MixerConfig
from .cache import CACHE_DTYPES, MixerCache, StepNotSupportedError

__all__ = [
    "CHECKPOINT_FREE_OPTIONS",
    "RECORD_KEY",
    "MatrixMixer",
    "MixerCheckpointMismatchError",
    "MixerCache",
    "MixerContext",
    "QKContext",
    "StepNotSupportedError",
    "check_mixer_input",
    "mixer_record",
    "read_mixer_record",
    "record_differences",
    "strip_mixer_records",
]

#: The state_dict key (after the module's prefix) of a mixer's record: PyTorch's extra-state entry.
RECORD_KEY = "_extra_state"
_RECORD_FORMAT = "mixer-plugins/1"
#: Options that never change what trained weights compute, so checkpoints may differ in them: how the result is
#: computed (``chunk_size``), training-time noise (dropout rates) and initialisation only (the loaded weights replace
#: what they drew).
CHECKPOINT_FREE_OPTIONS = frozenset({"chunk_size", "dropout", "attn_dropout", "dt_min", "dt_max", "dt_init_floor",
                                     "A_init_range", "conv_init"})


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists, inf stays inf); unknown objects by their repr."""
    return json.loads(json.dumps(value, default=repr))


def mixer_record(mixer: nn.Module) -> dict[str, Any]:
    """What a mixer's ``state_dict`` records: ``{"format", "mixer", "class", "options"}``.

    ``mixer`` is the registry name (None for a mixer built without the registry), ``class`` the module's class name,
    ``options`` its validated config (``dim`` included).
    """
    config = getattr(mixer, "config", None)
    options = config.model_dump() if isinstance(config, MixerConfig) else {}
    return {"format": _RECORD_FORMAT, "mixer": getattr(mixer, "mixer_name", None),
            "class": type(mixer).__qualname__, "options": _plain(options)}


def _encode(record: Mapping[str, Any]) -> Tensor:
    data = json.dumps(record, sort_keys=True).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.uint8)


def read_mixer_record(value: object) -> dict[str, Any] | None:
    """The record held by a state_dict entry, or None when it holds none (empty, on the meta device, or not ours).

    Accepts the uint8 tensor a mixer saves, and the same bytes in any numeric dtype (a checkpoint converted wholesale
    to float16 or bfloat16 keeps them exactly).
    """
    if not isinstance(value, Tensor) or value.dim() != 1 or value.numel() == 0 or value.device.type == "meta":
        return None
    codes = value.detach().to("cpu", torch.float64)
    if not bool(((codes >= 0) & (codes <= 255) & (codes == codes.round())).all()):
        return None
    try:
        record = json.loads(bytes(codes.to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT:
        return None
    return record


def strip_mixer_records(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without the mixers' records: loading it skips the mixer/option check (as for a
    checkpoint without records). Use it to load weights into another mixer on purpose."""
    return {k: v for k, v in state_dict.items()
            if not (k.rsplit(".", 1)[-1] == RECORD_KEY and read_mixer_record(v) is not None)}


def _describe(record: Mapping[str, Any]) -> str:
    return repr(record.get("mixer") or record.get("class"))


def record_differences(saved: Mapping[str, Any], own: Mapping[str, Any], *, length_free: bool,
                       config_class: type | None = None) -> list[str]:
    """What differs between a saved record and a mixer's own (empty: compatible).

    ``length_free``: the mixer runs at any length, so ``max_seq_len`` does not matter. ``config_class`` (the mixer's
    config model) lets records of other library versions compare: an option the checkpoint does not know matches
    when the mixer has its default (the behaviour of a version without the option); an option the checkpoint has
    and the mixer does not is not compared.
    """
    if saved.get("mixer") and own.get("mixer"):
        if saved["mixer"] != own["mixer"]:
            return [f"mixer {saved['mixer']!r} -> {own['mixer']!r}"]
    elif saved.get("class") != own.get("class"):
        return [f"class {saved.get('class')!r} -> {own.get('class')!r}"]
    fields = getattr(config_class, "model_fields", {})
    old = saved.get("options", {})
    new = own.get("options", {})
    free = CHECKPOINT_FREE_OPTIONS | ({"max_seq_len"} if length_free else set())
    problems = []
    for key in sorted(new):
        if key in free:
            continue
        if key in old:
            if old[key] != new[key]:
                problems.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        elif key in fields and not fields[key].is_required():
            default = _plain(fields[key].get_default(call_default_factory=True))
            if new[key] != default:
                problems.append(f"{key}: (not in the checkpoint: its default {default!r}) -> {new[key]!r}")
    return problems


@dataclasses.dataclass(eq=False)
class MixerContext:
    """Per-call intermediate tensors shared by ``mix``, ``matrix`` and ``finish``.

    Always has ``values`` (batch, length, heads, head_dim) and ``mask`` (bool (batch, length) or None). A mixer that
    needs more declares a dataclass subclass with typed fields (``@dataclasses.dataclass(eq=False, kw_only=True)``),
    e.g. :class:`QKContext`; plain dataclasses are what ``torch.compile`` traces without graph breaks.
    """

    values: Tensor
    mask: Tensor | None = None

    def __repr__(self) -> str:
        items = ", ".join(
            f"{f.name}={tuple(v.shape) if isinstance(v := getattr(self, f.name), Tensor) else v!r}"
            for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({items})"


@dataclasses.dataclass(eq=False, kw_only=True)
class QKContext(MixerContext):
    """Context of the mixers scored by per-head queries and keys, (batch|1, length, heads, qk_dim) each."""

    q: Tensor
    k: Tensor


#: The context type a mixer's hooks pass between them (:class:`MixerContext` or a subclass).
CtxT = TypeVar("CtxT", bound=MixerContext)


def check_mixer_input(module: nn.Module, x: Tensor, mask: Tensor | None, dim: int) -> tuple[Tensor, Tensor | None]:
    """Clear errors for every way an input can be wrong (rank, width, dtype, device, mask)."""
    if not isinstance(x, Tensor):
        raise MixerInputError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise MixerInputError(
            f"input must have shape (batch, length, dim={dim}); got a {x.dim()}-D tensor of shape {tuple(x.shape)}"
        )
    if x.shape[-1] != dim:
        raise MixerInputError(f"input width {x.shape[-1]} does not match the mixer's dim={dim}")
    if x.shape[1] == 0:
        raise MixerInputError("input length must be at least 1")
    if not x.dtype.is_floating_point:
        raise MixerInputError(f"input must be a floating-point tensor, got dtype {x.dtype}")
    param = next(iter(module.parameters()), None)
    if param is not None:
        if param.device != x.device and param.device.type != "meta":
            raise MixerInputError(f"input is on {x.device} but the mixer's parameters are on {param.device}")
        if (
            param.dtype != x.dtype
            and param.dtype.is_floating_point
            and not torch.is_autocast_enabled(x.device.type)
        ):
            raise MixerInputError(
                f"input dtype {x.dtype} does not match the mixer's parameters ({param.dtype}); "
                f"convert one of them (e.g. mixer.to({x.dtype})) or run under torch.autocast"
            )
    if mask is not None:
        mask = padding_mask_to_bool(mask.to(x.device), x.shape[0], x.shape[1])
    return x, mask


class MatrixMixer(nn.Module, Generic[CtxT]):
    """Base class of every mixer in the library (and a convenient one for plugins).

    Subclasses implement :meth:`prepare`, :meth:`matrix`, :meth:`finish`, :meth:`flops` and usually a
    fast :meth:`mix`. Data-independent mixers set :attr:`max_seq_len`; they then accept any length up to
    it (using the leading L x L block of their matrix, which is what makes them padding-invariant) and
    raise :class:`SequenceLengthError` beyond it.

    The class is generic in the context its hooks pass between them: a mixer whose context is a
    :class:`MixerContext` subclass derives from ``MatrixMixer[ItsContext]`` and its hooks take and return that type.
    """

    #: True when output i depends only on inputs j <= i.
    causal: bool = False
    #: Longest supported sequence for data-independent mixers; None means any length.
    max_seq_len: int | None = None
    #: Number of heads of the materialized matrix.
    num_heads: int = 1
    #: False for mixers that are not linear in their values; their ``matrix`` raises
    #: :class:`NotMaterializableError` (e.g. the ``mult`` bidirectional ablation).
    materializable: bool = True
    #: True for classes that implement the decoding hooks (their causal form steps; see :attr:`can_step`).
    steppable: bool = False

    def __init__(self, config: MixerConfig):
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.causal = bool(getattr(config, "causal", type(self).causal))
        self.register_load_state_dict_pre_hook(_check_record_on_load)

    # -- checkpoint records (see the module docstring) ----------------------------------------------
    def get_extra_state(self) -> Tensor:
        """The mixer's record (name and options) as a uint8 tensor: the ``_extra_state`` entry of its state_dict."""
        return _encode(mixer_record(self))

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore: the record was compared with this mixer before loading (an empty entry stands for a
        checkpoint without one)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every parameter as a fresh build would (same distributions, same order of random draws).

        The registry builds a mixer and then calls this, so under one seed a re-initialised mixer equals a freshly
        built one. The default resets each child module that has a ``reset_parameters`` (``nn.Linear``, norms, ...),
        recursing into those that do not (``nn.ModuleList``); mixers with parameters of their own override it,
        call ``super().reset_parameters()`` and then re-draw their own.
        """
        _reset_children(self)

    # -- hooks implemented by subclasses ---------------------------------------------------------
    def prepare(self, x: Tensor, mask: Tensor | None) -> CtxT:
        """Projections etc. of a checked input: the context holding the values and what ``mix``/``matrix`` need."""
        raise NotImplementedError

    def matrix(self, ctx: CtxT) -> Tensor:
        """The L x L matrix per head, (batch, heads, length, length), applied to ``ctx.values``."""
        raise NotImplementedError

    def mix(self, ctx: CtxT) -> Tensor:
        """Apply the matrix to the values. The default builds the matrix (O(L^2)); override when faster."""
        return torch.einsum("bhij,bjhp->bihp", self.matrix(ctx), ctx.values)

    def finish(self, ctx: CtxT, y: Tensor) -> Tensor:
        """Mixed values (batch, length, heads, head_dim) -> output (batch, length, dim): gates, norms, projection."""
        raise NotImplementedError

    def flops(self, batch: int, length: int) -> int:
        """Analytic FLOPs (2 per multiply-add) of one forward at this batch and length."""
        return int(sum(self.flops_breakdown(batch, length).values()))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        """FLOPs per part (projections, scores, scan, ...). Subclasses implement this or :meth:`flops`."""
        raise NotImplementedError(f"{type(self).__name__} does not report its FLOPs")

    # -- public API ------------------------------------------------------------------------------
    def check_length(self, length: int) -> None:
        """Raise :class:`SequenceLengthError` past ``max_seq_len`` (data-independent mixers)."""
        if self.max_seq_len is not None and length > self.max_seq_len:
            raise SequenceLengthError(
                f"{type(self).__name__} is data-independent: its parameters cover sequences of up to "
                f"max_seq_len={self.max_seq_len} tokens, got length {length}. Build it with a larger "
                "max_seq_len, or use the data-dependent variant (data_dependent=True) where there is one"
            )

    def _begin(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Checked input with pads zeroed by selection, the bool mask, and (causal mixers) the poisoned positions."""
        x, mask = check_mixer_input(self, x, mask, self.dim)
        self.check_length(x.shape[1])
        x = zero_pads(x, mask)            # by selection: NaN/Inf/huge pad contents never enter the mixer
        poisoned = None
        if self.causal:
            x, poisoned = causal_nonfinite_guard(x)
            if mask is not None:
                poisoned = poisoned & mask
        return x, mask, poisoned

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``finish(prepare(x), mix(...))`` on the checked input, pads zeroed; outputs at pads are zero."""
        x, mask, poisoned = self._begin(x, mask)
        ctx = self.prepare(x, mask)
        return zero_pads(poison_after(self.finish(ctx, self.mix(ctx)), poisoned), mask)

    def materialize(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """The mixer's matrix for this input, (batch, heads, length, length); zero on pad rows/columns.

        Rows of a causal mixer at or after a non-finite input token are NaN.
        """
        x, mask, poisoned = self._begin(x, mask)
        ctx = self.prepare(x, mask)
        matrix = self.matrix(ctx)
        if poisoned is not None:
            matrix = matrix.masked_fill(poisoned[:, None, :, None], float("nan"))
        if mask is not None:
            keep = mask[:, None, :, None] & mask[:, None, None, :]
            matrix = matrix.masked_fill(~keep, 0.0)
        return matrix

    def forward_via_matrix(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """Forward computed through the materialized matrix: the oracle for :meth:`forward`."""
        x, mask, poisoned = self._begin(x, mask)
        ctx = self.prepare(x, mask)
        matrix = self.matrix(ctx)
        y = torch.einsum("bhij,bjhp->bihp", matrix, ctx.values)
        return zero_pads(poison_after(self.finish(ctx, y), poisoned), mask)

    # -- decoding (causal mixers that can step) ----------------------------------------------------
    def step_problem(self) -> str | None:
        """Why this mixer cannot step (a message), or None when it can. Subclasses add their own reasons."""
        name = getattr(self, "mixer_name", None) or type(self).__name__
        if not self.causal:
            return (f"mixer {name!r} is bidirectional (causal=False): only a causal mixer decodes token by token; "
                    "build it with causal=True where it has that option")
        if not self.steppable:
            return (f"mixer {name!r} has no decoding step (its spec says stepping=False); run forward over the whole "
                    "prefix instead")
        return None

    @property
    def can_step(self) -> bool:
        """Whether :meth:`allocate_cache`, :meth:`prefill` and :meth:`step` work on this mixer."""
        return self.step_problem() is None

    def _require_step(self) -> None:
        problem = self.step_problem()
        if problem is not None:
            raise StepNotSupportedError(problem)

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> MixerCache:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens each (prompt and steps), owned by
        this mixer (and usable by any mixer of the same :meth:`cache_key`).

        ``dtype`` and ``device`` default to the mixer's parameters'. ``dtype`` may differ from the mixer's: any of
        :data:`~mixer_plugins.mixers.cache.CACHE_DTYPES` (the state is stored in it and read back in the compute
        dtype). Raises :class:`StepNotSupportedError` for a mixer that cannot step, :class:`MixerInputError` for
        another ``dtype`` and :class:`SequenceLengthError` past a data-independent mixer's ``max_seq_len``.
        """
        self._require_step()
        for label, value, low in (("batch", batch, 0), ("max_len", max_len, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MixerInputError(f"allocate_cache: {label} must be an integer >= {low}, got {value!r}")
        if dtype is not None and dtype not in CACHE_DTYPES:
            raise MixerInputError(
                f"allocate_cache: dtype must be one of {', '.join(map(str, CACHE_DTYPES))} (the precision the state "
                f"is stored in), got {dtype!r}"
            )
        self.check_length(max_len)
        param = next(iter(self.parameters()), None)
        if dtype is None:
            dtype = param.dtype if param is not None and param.dtype.is_floating_point else torch.get_default_dtype()
        if device is None:
            device = param.device if param is not None else torch.get_default_device()
        device = torch.device(device)
        cache = MixerCache(lengths=torch.zeros(batch, dtype=torch.long, device=device),
                           poisoned=torch.zeros(batch, dtype=torch.bool, device=device), max_len=max_len,
                           owner=self._owner_key())
        self.init_cache(cache, batch, max_len, dtype, device)
        return cache

    def cache_key(self) -> str:
        """What a decoding cache of this mixer records as its owner, and what ``prefill`` and ``step`` compare with
        the cache's: the mixer's class and its options (JSON), those that never change its state excepted
        (:data:`CHECKPOINT_FREE_OPTIONS`; ``max_seq_len`` of a mixer that runs at any length).

        Two mixers with equal keys keep states of the same shapes and meaning, so they share caches. Override it
        (calling ``super().cache_key()`` and adding to it) when the state depends on something the config does not
        hold. It is computed once per mixer (the options are fixed when it is built).
        """
        record = mixer_record(self)
        free = CHECKPOINT_FREE_OPTIONS | ({"max_seq_len"} if self.max_seq_len is None else set())
        options = {k: v for k, v in record["options"].items() if k not in free}
        return json.dumps({"class": f"{type(self).__module__}.{type(self).__qualname__}", "options": options},
                          sort_keys=True)

    def _owner_key(self) -> str:
        """:meth:`cache_key`, computed on the first call and kept (the per-call check is then a string comparison)."""
        key = self.__dict__.get("_cache_owner_key")
        if key is None:
            key = self.cache_key()
            self.__dict__["_cache_owner_key"] = key
        return key

    def _check_cache(self, cache: MixerCache, x: Tensor) -> None:
        if not isinstance(cache, MixerCache):
            raise MixerInputError(f"cache must be a MixerCache (from allocate_cache), got {type(cache).__name__}")
        if cache.owner is not None and cache.owner != self._owner_key():
            raise MixerInputError(self._owner_mismatch(cache.owner))
        if cache.batch != x.shape[0]:
            raise MixerInputError(f"the cache has {cache.batch} rows but the input has batch {x.shape[0]}")
        if cache.lengths.device != x.device:
            raise MixerInputError(f"the cache is on {cache.lengths.device} but the input is on {x.device}")
        if cache.offset + x.shape[1] > cache.max_len:
            raise SequenceLengthError(
                f"the cache holds up to max_len={cache.max_len} tokens per row; {cache.offset} were given and "
                f"{x.shape[1]} more do not fit. Allocate a longer cache"
            )

    def _owner_mismatch(self, owner: str) -> str:
        """The message refusing a cache owned by ``owner`` (another :meth:`cache_key`): both mixers, and the options
        in which they differ."""
        name = getattr(self, "mixer_name", None)
        ours = self._owner_key()
        try:
            theirs_record, ours_record = json.loads(owner), json.loads(ours)
            theirs_class, ours_class = str(theirs_record["class"]), str(ours_record["class"])
            theirs_opts, ours_opts = dict(theirs_record["options"]), dict(ours_record["options"])
        except (ValueError, KeyError, TypeError):
            theirs_desc, ours_desc = repr(owner), repr(ours)
        else:
            theirs_short, ours_short = theirs_class.rsplit(".", 1)[-1], ours_class.rsplit(".", 1)[-1]
            missing = "(unset)"
            differ = [k for k in sorted(set(theirs_opts) | set(ours_opts))
                      if theirs_opts.get(k, missing) != ours_opts.get(k, missing)]
            if theirs_class != ours_class or not differ:
                theirs_desc, ours_desc = theirs_short, ours_short
            else:
                theirs_desc = f"{theirs_short}({', '.join(f'{k}={theirs_opts.get(k, missing)!r}' for k in differ)})"
                ours_desc = f"{ours_short}({', '.join(f'{k}={ours_opts.get(k, missing)!r}' for k in differ)})"
        return (
            f"the cache belongs to another mixer: it was allocated by {theirs_desc}, and this is {ours_desc}"
            f"{f' ({name!r})' if name else ''}. A cache holds the state of the mixer that allocated it (mixers of the "
            "same class and options share caches); allocate one with this mixer's allocate_cache"
        )

    def _refuse_autograd(self, x: Tensor) -> None:
        """Raise :class:`MixerInputError` when autograd would record ``prefill``/``step`` (grad enabled, and the input
        or a parameter requires grad): the cache keeps no history and is updated in place, so gradients through
        steps would be wrong. Under ``no_grad``/``inference_mode`` this is one ``torch.is_grad_enabled()`` call."""
        if not torch.is_grad_enabled():
            return
        if not x.requires_grad and not any(p.requires_grad for p in self.parameters()):
            return  # nothing would be recorded
        culprit = "the input requires grad" if x.requires_grad else next(
            f"parameter {n!r} requires grad" for n, p in self.named_parameters() if p.requires_grad)
        raise MixerInputError(
            f"prefill and step are for inference, and autograd is recording ({culprit}): the cache keeps no autograd "
            "history and is updated in place, so gradients through the steps would be wrong. Call prefill/step under "
            "torch.no_grad() or torch.inference_mode() (to train, run forward over whole sequences)"
        )

    def prefill(self, x: Tensor, cache: MixerCache, *, mask: Tensor | None = None) -> Tensor:
        """Run a prompt ``x`` (batch, length, dim) in one parallel pass: returns its outputs (what :meth:`forward`
        gives) and fills the empty ``cache``. With a right-padded ``mask``, each row continues from its own length.

        Raises :class:`MixerInputError` for a cache of another mixer (see :meth:`cache_key`) and when autograd would
        record it (run it under ``torch.no_grad()`` or ``torch.inference_mode()``).
        """
        self._require_step()
        x, mask, poisoned = self._begin(x, mask)
        self._check_cache(cache, x)
        if cache.offset:
            raise MixerInputError(f"prefill needs an empty cache; this one holds {cache.offset} tokens (use step to "
                                  "continue it, or allocate a new one)")
        self._refuse_autograd(x)
        b, length = x.shape[:2]
        lengths = (mask.sum(dim=1) if mask is not None
                   else torch.full((b,), length, dtype=torch.long, device=x.device))
        ctx = self.prepare(x, mask)
        y = self.fill_cache(cache, ctx, x, lengths)
        out = self.finish(ctx, y)
        cache.lengths.copy_(lengths)
        if poisoned is not None:
            cache.poisoned.copy_(poisoned.any(dim=1))
        cache.offset = length
        return zero_pads(poison_after(out, poisoned), mask)

    def step(self, x: Tensor, cache: MixerCache) -> Tensor:
        """Outputs of ``t`` new tokens ``x`` (batch, t, dim) of every row, each row continuing from its own length
        in ``cache`` (updated in place). ``prefill`` + ``step`` equal :meth:`forward` over the whole sequence.

        Raises :class:`MixerInputError`, leaving the cache as it was, for a cache of another mixer and when autograd
        would record the step (run it under ``torch.no_grad()`` or ``torch.inference_mode()``)."""
        self._require_step()
        x, _ = check_mixer_input(self, x, None, self.dim)
        self._check_cache(cache, x)
        self._refuse_autograd(x)
        b, t = x.shape[:2]
        if t == 1:
            # One token: a non-finite one reaches only its own row (its state, its output), and that row's outputs
            # are NaN from here on. x - x is NaN exactly where x is not finite (0 elsewhere), so its sum flags the row.
            flag = (x - x).sum((1, 2))
            out = self.step_tokens(x, cache)
            poisoned = torch.logical_or(cache.poisoned, flag.ne(flag), out=cache.poisoned)
            out.masked_fill_(poisoned.view(b, 1, 1), math.nan)
        else:
            # Several tokens are mixed together: a non-finite one is zeroed first, so it cannot reach earlier ones.
            x, bad = causal_nonfinite_guard(x)
            out = self.step_tokens(x, cache)
            poisoned = (bad | cache.poisoned[:, None]).cummax(dim=1).values
            cache.poisoned.copy_(poisoned[:, -1])
            out = poison_after(out, poisoned)
        cache.lengths.add_(t)
        cache.offset += t
        return out

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        """Outputs (batch, t, dim) of the new tokens ``x``, updating ``cache.state`` in place (:meth:`step` has
        checked the call, and keeps ``lengths`` and ``poisoned``). The default runs :meth:`prepare_step`,
        :meth:`mix_step` and :meth:`finish`; a mixer with a fused one-token path overrides it."""
        ctx = self.prepare_step(x, cache)
        y = self.mix_step(ctx, cache).to(ctx.values.dtype)   # a state of a wider dtype may have widened it
        return self.finish(ctx, y)

    # -- decoding hooks ------------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        """Put the mixer's zero-initialised state tensors into ``cache.state``, floating ones in ``dtype`` (which may
        differ from the mixer's)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement init_cache")

    def fill_cache(self, cache: MixerCache, ctx: CtxT, x: Tensor, lengths: Tensor) -> Tensor:
        """Prefill: fill ``cache.state`` from the prompt's context (and its checked input ``x``; row ``b`` has
        ``lengths[b]`` real tokens) and return the mixed values :meth:`mix` gives."""
        raise NotImplementedError(f"{type(self).__name__} does not implement fill_cache")

    def prepare_step(self, x: Tensor, cache: MixerCache) -> CtxT:
        """The context of new tokens (batch, t, dim). The default is :meth:`prepare` (right for per-token
        projections); mixers whose ``prepare`` looks across tokens (a short convolution) override it."""
        return self.prepare(x, None)

    def mix_step(self, ctx: CtxT, cache: MixerCache) -> Tensor:
        """Mixed values of the new tokens (at positions ``cache.positions(t)``), updating ``cache.state`` in place
        (``cache.lengths`` is advanced by the caller). The state may be in another dtype than the context: read it
        in the compute dtype (``cache.read(name, dtype)``) and write through ``kv_write``/``copy_`` (which round to
        the cache's dtype)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement mix_step")

    def extra_repr(self) -> str:
        opts = ", ".join(
            f"{k}={v!r}" for k, v in self.config.model_dump().items() if k != "dim"
        )
        return f"dim={self.dim}" + (f", {opts}" if opts else "")


def _check_record_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                          strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                          error_msgs: list[str]) -> None:
    """``load_state_dict`` pre-hook of every mixer: compare the checkpoint's record with the mixer's own."""
    if type(module).get_extra_state is nn.Module.get_extra_state:
        return  # a subclass that keeps another code's key set (compat.Hydra) records nothing
    key = prefix + RECORD_KEY
    if key not in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)  # no record: load without the check
        return
    value = state_dict[key]
    if isinstance(value, Tensor) and (value.numel() == 0 or value.device.type == "meta"):
        return
    saved = read_mixer_record(value)
    if saved is None:
        raise MixerCheckpointMismatchError(
            f"{key!r} is not a mixer-plugins record ({type(value).__name__} "
            f"{tuple(value.shape) if isinstance(value, Tensor) else ''}); it belongs to another module, or the "
            "checkpoint was altered. Drop it to load the weights without the check"
        )
    own = mixer_record(module)
    problems = record_differences(saved, own, length_free=getattr(module, "max_seq_len", None) is None,
                                  config_class=type(getattr(module, "config", None)))
    if problems:
        where = prefix[:-1] or "the mixer"
        raise MixerCheckpointMismatchError(
            f"{where}: the checkpoint holds mixer {_describe(saved)} and this is mixer {_describe(own)}, with other "
            f"settings (checkpoint -> this mixer: {'; '.join(problems)}). Build the model with the checkpoint's "
            "mixer and options, or, to load these weights anyway, drop the records: "
            "load_state_dict(strip_mixer_records(state_dict)) (mixer_plugins.mixers.base)"
        )


def _reset_children(module: nn.Module) -> None:
    for child in module.children():
        reset = getattr(child, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            _reset_children(child)
