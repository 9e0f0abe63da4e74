"""Kernels of MLR attention: ``triton.py`` holds the fused Triton forward."""
