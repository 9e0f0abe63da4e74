"""Our Triton kernels (GPU; CPU tensors under ``TRITON_INTERPRET=1``), imported only when a ``triton`` backend runs.

* :mod:`._common` — what every kernel module shares (availability, launch grids and devices, 64-bit offsets, matmul
  precision); the scan's kernels are in :mod:`mixer_plugins.kernels.scan` (``triton_kernels``, ``triton_one_chunk``);
* :mod:`.mlr` — fused MLR attention (flash-style online softmax over the levels each tile pair shares).
* :mod:`.norm` — the fused gated RMSNorm behind ``gated_rmsnorm``'s ``triton`` backend (one kernel each way);
* :mod:`.conv` — the fused depthwise short convolution (+ SiLU) behind ``depthwise_conv1d``'s ``triton`` backend.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so set it before these modules are imported.
"""
