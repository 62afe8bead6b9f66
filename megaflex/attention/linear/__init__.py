"""Causal linear attention on features, one module per algorithm: ``naive`` (the quadratic reference),
``recurrent`` (token by token, decoding), ``chunk`` (torch, CPU-tuned), ``chunk_trig`` (trig map fused into
``chunk`` on CPU), ``chunk_fla`` (flash-linear-attention, CUDA). ``plan.py`` picks one; the Triton
kernels are in ``attention/triton``."""
