"""The serving benchmark: ``kvtier bench serve`` (see ``kvtier.bench.serving``).

    python benchmarks/bench_serve.py [--repeats 3] [--traffic bundled,generated] ...
"""

from __future__ import annotations

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
