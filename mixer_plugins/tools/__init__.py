"""Tools built on the library: the command line, the demo, benchmarks, FLOP reports, plots and comparisons."""
