from .tools.flop_report import TOLERANCE, UNCOUNTED_SUFFIX, compare_flops, flop_report, markdown_table  # noqa: F401  # TRANSITIONAL re-export (lead removes at merge)
