"""``python -m <module> <args>`` as a child forked from a server process that has imported fairseq2's recipe
machinery already: a recipe command spends ~7 of its ~9 s importing ``fairseq2.recipe`` (transformers, torchvision,
scikit-learn), so the recipe tests start their commands here rather than with :func:`subprocess.run`.

The child is a fresh process as far as the command can tell: its own ``os.environ`` (exactly ``env``), working
folder, ``sys.argv``, ``__main__`` and standard streams; none of the test process's state (the server is a new
interpreter that imported the modules in :data:`PRELOAD` and nothing else). What differs from a new interpreter:
those modules are imported before ``env`` applies, so environment variables they read at import time come from the
test process's environment. A command whose behaviour depends on that, or on a cold import, runs with
:func:`subprocess.run`; the ``mixer-plugins`` console commands and the torchrun test still do.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

#: what the server imports once; each child starts with these in ``sys.modules``
PRELOAD = ["fairseq2.recipe", __name__]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _run(module: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the child: what ``python -m module *argv`` does, with standard output and error sent to ``out``/``err``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise               # its code becomes the exit status, as in a new interpreter
    except BaseException:
        traceback.print_exc()   # what the interpreter prints for an uncaught exception, and its status 1
        raise SystemExit(1) from None


def python_m(module: str, args: Sequence[str], *, env: Mapping[str, str], cwd: str | Path,
             timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` in ``cwd`` with exactly ``env`` as its environment; returns what
    ``subprocess.run(..., capture_output=True, text=True)`` returns, and raises :class:`subprocess.TimeoutExpired`
    (after killing the child) past ``timeout`` seconds."""
    cmd = [sys.executable, "-m", module, *args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = _context.Process(target=_run, args=(module, list(args), dict(env), str(cwd), out, err))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        stdout, stderr = (Path(p).read_text() if os.path.exists(p) else "" for p in (out, err))
    return subprocess.CompletedProcess(cmd, child.exitcode, stdout, stderr)
