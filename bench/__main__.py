"""`python -m bench`: the memopt benchmark harness (see bench/compare.py and bench/README.md)."""

import sys

from bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
