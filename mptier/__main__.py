import sys

from mptier.cli import main

sys.exit(main())
