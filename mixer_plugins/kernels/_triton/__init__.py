"""Our Triton kernels (GPU; CPU tensors under ``TRITON_INTERPRET=1``), imported only when a ``triton`` backend runs.

* :mod:`._common` — what every kernel module shares (availability, launch grids and devices, 64-bit offsets, matmul
  precision).

The kernels live in their ops' folders: the scan's in :mod:`mixer_plugins.kernels.scan` (``triton_kernels``,
``triton_one_chunk``), fused MLR attention (also the sliding-window kernels) in ``mlr_attention/triton_kernels``,
the gated RMSNorm in ``norm/triton_kernels``, the depthwise short convolution (+ SiLU) in ``conv/triton_kernels``.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so set it before these modules are imported.
"""
