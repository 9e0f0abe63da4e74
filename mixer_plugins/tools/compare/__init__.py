"""``mixer-plugins compare``: the field's synthetic tasks over every registered mixer, with the papers' orderings.

Python API::

    from mixer_plugins.tools.compare import CompareConfig, compare, preset_config
    result = compare(CompareConfig(task="mqar", task_options={"num_kv_pairs": 4},
                                   mixers="attention,long_conv=toeplitz(data_dependent=False)", seeds=(0, 1)))
    result.table(); result.check_orderings(); result.write("outputs/compare/mine")
    compare(preset_config("hydra-classes", quick=True))

Modules: :mod:`.tasks` (task generators), :mod:`.models` (backbone, ``--mixers`` parsing), :mod:`.runner`
(training and summaries), :mod:`.presets` (the papers' comparisons), :mod:`.report` (plots), :mod:`.cli`.
See ``docs/compare.md``.
"""

from .models import MixerEntry, SequenceModel, parse_mixers
from .presets import PRESETS, Preset, preset_config
from .runner import CompareConfig, CompareResult, Ordering, RunResult, compare, train_run
from .tasks import TASKS, Batch, Task, make_task

__all__ = [
    "PRESETS",
    "TASKS",
    "Batch",
    "CompareConfig",
    "CompareResult",
    "MixerEntry",
    "Ordering",
    "Preset",
    "RunResult",
    "SequenceModel",
    "Task",
    "compare",
    "make_task",
    "parse_mixers",
    "preset_config",
    "train_run",
]
