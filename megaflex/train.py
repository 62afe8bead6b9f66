"""Alias so that ``python -m megaflex.train`` (and ``deepspeed -m megaflex.train``) runs the trainer."""

import sys

from megaflex.training.train import main

if __name__ == "__main__":
    sys.exit(main())
