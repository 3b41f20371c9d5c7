"""``python -m memopt``: the memopt command line."""

import sys

from memopt.cli import main

sys.exit(main())
