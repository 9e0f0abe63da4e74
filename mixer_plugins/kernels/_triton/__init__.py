"""Our Triton kernels (GPU; CPU tensors under ``TRITON_INTERPRET=1``), imported only when a ``triton`` backend runs.

* :mod:`.scan` — the fused chunked scan behind the ``triton`` backends of ``quasiseparable``, ``ssd`` and
  ``directional_scan`` (both directions in one pass, forward and backward);
* :mod:`.mlr` — fused MLR attention (flash-style online softmax over the levels each tile pair shares).
* :mod:`.norm` — the fused gated RMSNorm behind ``gated_rmsnorm``'s ``triton`` backend (one kernel each way);
* :mod:`.conv` — the fused depthwise short convolution (+ SiLU) behind ``depthwise_conv1d``'s ``triton`` backend.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so set it before these modules are imported.
"""
