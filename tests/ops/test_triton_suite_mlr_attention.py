"""Runs ``tests/ops/test_mlr_attention_triton_kernels.py`` (the MLR attention kernels) in a fresh interpreter
under ``TRITON_INTERPRET=1`` (CPU machines): see :func:`helpers.triton_file_runner`."""

from helpers import triton_file_runner

test_mlr_attention_kernels_under_the_interpreter = triton_file_runner("ops/test_mlr_attention_triton_kernels.py")
