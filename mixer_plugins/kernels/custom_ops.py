from ._scan.custom_op import chunked_scan, chunked_scan_flops  # noqa: F401  # TRANSITIONAL re-export (lead removes at merge)
