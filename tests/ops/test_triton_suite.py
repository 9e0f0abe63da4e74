"""Runs ``tests/ops/test_scan_triton.py`` (the Triton scan's kernels) in a fresh interpreter
under ``TRITON_INTERPRET=1`` (CPU machines): see :func:`helpers.triton_file_runner`."""

from helpers import triton_file_runner

test_scan_kernels_under_the_interpreter = triton_file_runner("ops/test_scan_triton.py")
