"""Studies of megaflex, run from a checkout (``python -m studies.<name>``), never installed: the
kernel study, its pilot, the kernel transfer and distillation studies and the normaliser
diagnosis. ``studies.runner`` trains and scores one run for all of them. Results and reports go to
``--out``: by default ``$XDG_CACHE_HOME/megaflex/<study>`` (``megaflex.cli_args.scratch_results``), the
committed docs/results/<study>/ only when ``--out`` names it (index: docs/results/README.md)."""
