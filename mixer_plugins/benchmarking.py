from .tools.benchmarking import build_mixer  # noqa: F401  # TRANSITIONAL re-export (lead removes at merge)
