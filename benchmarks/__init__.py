"""Benchmarks of megaflex, run from a checkout (``python -m benchmarks.<name>``), never installed:
speed and memory per attention form, model, decoding, data loading, training engine and parallel
layout, the ahead-of-time Triton compiles (``triton_aot``) and the GPU acceptance (``gpu_check``).
Results go to docs/results/ (index: docs/results/README.md)."""
