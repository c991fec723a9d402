"""Tier faults under load: ``kvtier bench faults`` (see ``kvtier.bench.faults``).

    python benchmarks/bench_faults.py [--faults redis-kill,disk-full,...] [--requests 800]
"""

from __future__ import annotations

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "faults", *sys.argv[1:]]))
