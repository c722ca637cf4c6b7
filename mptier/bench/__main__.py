"""``python -m mptier.bench`` runs the same command as ``mptier bench``."""

import sys

from mptier.bench.cli import main

sys.exit(main())
