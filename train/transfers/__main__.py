"""`python -m train.transfers`: cli.py."""

import sys

from train.transfers.cli import main

if __name__ == "__main__":
  sys.exit(main())
