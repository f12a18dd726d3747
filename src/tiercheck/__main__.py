"""``python -m tiercheck``: the ``tiercheck`` command line."""

import sys

from tiercheck.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
