"""Studies of megaflex, run from a checkout (``python -m studies.<name>``), never installed: the
kernel study, its pilot, the kernel transfer and distillation studies and the normaliser
diagnosis. ``studies.runner`` trains and scores one run for all of them. Results and reports go to
docs/results/<study>/ (index: docs/results/README.md)."""
