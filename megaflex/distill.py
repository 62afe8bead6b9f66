"""Alias so that ``python -m megaflex.distill`` (and ``deepspeed -m megaflex.distill``) runs megaflex-distill."""

import sys

from megaflex.training.distill.cli import main

if __name__ == "__main__":
    sys.exit(main())
