"""The deadline of one step of the GPU check, checked inside the table scripts' loops as well as between their rows.

``benchmarks/gpu/run.sh`` runs each step under a hard limit (``timeout``, SIGINT first) and hands the step's script
an earlier, cooperative deadline (``MIXER_PLUGINS_GPU_DEADLINE_AT``, seconds since the epoch, or the script's
``--deadline-at`` / ``--budget-s``): once it has passed, a timing loop (``mixer_plugins.tools.benchmarking``'s
``time_calls`` with ``deadline=Deadline.at``) stops after the calls it has made (at least one timed call once a
candidate has run, so a compile that took the time still yields a value) and the rows not started are reported as
not measured. A slow row thus never takes the later steps' time, and a cut step keeps what it measured (the scripts
write their results after every row).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV = "MIXER_PLUGINS_GPU_DEADLINE_AT"
#: the note of a row that was not started because the step's deadline had passed
NOT_STARTED = "not measured: the step's deadline had passed"
#: a table script's exit status when its deadline left rows not measured (and nothing failed)
EXIT_CUT = 4


class Deadline:
    """A point in time (``time.time()``), or none."""

    def __init__(self, at: float | None = None) -> None:
        self.at = at

    @classmethod
    def from_args(cls, deadline_at: float | None = None, budget_s: float | None = None) -> Deadline:
        """The earlier of ``deadline_at``, now + ``budget_s`` and :data:`ENV` (where set)."""
        candidates = [t for t in (deadline_at, None if budget_s is None else time.time() + budget_s) if t is not None]
        if os.environ.get(ENV):
            candidates.append(float(os.environ[ENV]))
        return cls(min(candidates) if candidates else None)

    def passed(self) -> bool:
        return self.at is not None and time.time() > self.at

    def left(self) -> float:
        return float("inf") if self.at is None else self.at - time.time()


def interrupt_on_term() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt here, even where the process started with SIGINT ignored (a
    background job's children inherit that), so a step cut by ``timeout`` still writes its results and exits."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)`` that a cut never leaves half written (a temporary file, then renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
