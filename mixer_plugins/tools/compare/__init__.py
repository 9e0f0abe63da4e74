"""``mixer-plugins compare``: the field's synthetic tasks over every registered mixer, with the papers' orderings.

Python API::

    from mixer_plugins.tools.compare import CompareConfig, compare, preset_config
    result = compare(CompareConfig(task="mqar", task_options={"num_kv_pairs": 4},
                                   mixers="attention,long_conv=toeplitz(data_dependent=False)", seeds=(0, 1)))
    result.table(); result.check_orderings(); result.write("outputs/compare/mine")
    compare(preset_config("hydra-classes", quick=True))

Modules: :mod:`.tasks` (task generators), :mod:`.models` (backbone, ``--mixers`` parsing), :mod:`.runner`
(training and summaries), :mod:`.presets` (the papers' comparisons), :mod:`.report` (plots), :mod:`.cli` (the
arguments, parsed without importing torch). See ``docs/compare.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that defines it; imported on first use, so that the command line's
#: argument parsing (``cli``) imports no torch
_WHERE = {
    "MixerEntry": "models", "SequenceModel": "models", "parse_mixers": "models",
    "PRESETS": "presets", "Preset": "presets", "preset_config": "presets",
    "CompareConfig": "runner", "CompareResult": "runner", "Ordering": "runner", "RunResult": "runner",
    "compare": "runner", "train_run": "runner",
    "TASKS": "tasks", "Batch": "tasks", "Task": "tasks", "make_task": "tasks",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = sorted(_WHERE)
