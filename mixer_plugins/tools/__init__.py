"""Tools built on the library: the ``mixer-plugins`` command line and what its commands use.

* :mod:`.cli` — the command line, one module per subcommand (``mixer_plugins.tools.cli:main`` is the console
  script);
* :mod:`.demo` — small timm ViTs that differ only in the mixer, trained on scikit-learn's digits;
* :mod:`.benchmarking` — time (the one timing loop), counted FLOPs and peak memory of mixers;
* :mod:`.training` — the training loop of ``demo`` and ``compare``;
* :mod:`.tables` — the comparison table of benchmark results (``bench`` and pytest-benchmark's JSON);
* :mod:`.flop_report` — analytic FLOPs against PyTorch's ``FlopCounterMode``;
* :mod:`.plotting` — heat maps, learning curves and scaling plots (matplotlib, the ``demo`` extra);
* :mod:`.compare` — the field's synthetic tasks (associative recall, selective copying, in-context regression,
  digits) trained over any registered mixers, with the papers' orderings checked.

The tools import the library; nothing in the library imports the tools. Importing this package imports none of
its modules.
"""

# Choices shared by the torch-free argument parsers and the modules that run them (defined here, where parsing
# can read them without importing torch).
#: the mixers ``demo`` and ``bench`` run by default
DEFAULT_MIXERS = ("attention", "quasiseparable", "mlr_attention", "toeplitz")
#: ``mode`` of a measurement: a forward without gradients, or a forward+backward
MODES = ("forward", "forward_backward")
#: ``direction`` of a run: "default" keeps each mixer's own default direction
DIRECTIONS = ("default", "causal", "bidirectional")
#: colour scales of the matrix heat maps
SCALES = ("linear", "log")
