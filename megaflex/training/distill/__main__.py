"""``python -m megaflex.training.distill`` runs megaflex-distill (as does ``python -m megaflex.distill``)."""

import sys

from megaflex.training.distill.cli import main

if __name__ == "__main__":
    sys.exit(main())
