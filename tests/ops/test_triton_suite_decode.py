"""Runs ``tests/ops/test_decode_triton.py`` (the decoding step's kernels) in a fresh interpreter
under ``TRITON_INTERPRET=1`` (CPU machines): see :func:`helpers.triton_file_runner`."""

from helpers import triton_file_runner

test_decode_kernels_under_the_interpreter = triton_file_runner("ops/test_decode_triton.py")
