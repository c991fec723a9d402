"""``python -m kvtier``: the command line (see ``kvtier.cli``)."""

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main())
