"""Triton backend of causal linear attention (the GPU training path; runs on CPU under TRITON_INTERPRET=1).

* ``triton_linear_attention``: the chunked form's contract (``chunked_linear_attention``'s signature).
* ``trig_linear_attention``: trig feature map + attention as one autograd function that keeps no
  [B, H, N, F] features alive between forward and backward.
* ``TritonWindowNumerator``: the one-normaliser window hybrid's chunked form (``window.py``), the
  contract of ``window.chunk.ChunkedWindowNumerator``.

``triton`` itself is imported only when a kernel first runs (``function.kernels_for``), so this
package imports without it.
"""

from .launch import kernel_chunk
from .linear import triton_available, triton_linear_attention
from .tuning import interpreter_enabled
from .trig import trig_linear_attention
from .window import TritonWindowNumerator

__all__ = [
    "TritonWindowNumerator", "interpreter_enabled", "kernel_chunk", "trig_linear_attention", "triton_available",
    "triton_linear_attention",
]
