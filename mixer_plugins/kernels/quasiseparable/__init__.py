"""Kernels of the quasiseparable scan: ``triton.py`` holds the fused Triton forward and backward."""
