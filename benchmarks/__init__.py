"""Benchmarks of megaflex, run from a checkout (``python -m benchmarks.<name>``), never installed:
speed and memory per attention form, model, decoding, data loading, training engine and parallel
layout, the ahead-of-time Triton compiles (``triton_aot``) and the GPU acceptance (``gpu_check``).
Results go to ``--out``: by default ``$XDG_CACHE_HOME/megaflex/<name>`` (``megaflex.cli_args.scratch_results``),
outside the repository; the committed docs/results/ only when ``--out`` names it (index:
docs/results/README.md)."""
