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
