"""What the scheduler's thread pays per disk lookup of a block it does not
know, ``disk_lookups=inline`` against ``thread``, side by side.

A request's lookup walks its blocks until the first miss; a block neither in
the CPU tier nor in the disk tier's index costs one ``stat`` (blocks other
engines wrote to a shared directory), which ``thread`` hands to a thread of
its own and waits for. This times ``DiskTier.contains`` of one unknown key,
``--lookups`` times per round, the two modes alternating over ``--rounds``
rounds in one directory; reported: the median microseconds per lookup of
each, and their ratio.

    python benchmarks/bench_disk_lookups.py [--lookups 2000] [--rounds 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from kvtier import block_key
from kvtier.tiers import DiskTier, KVLayout

MODES = ("inline", "thread")


def lookup_us(tier: DiskTier, n: int, first_id: int) -> float:
    """Microseconds per ``contains`` of one key the directory does not hold."""
    keys = [block_key(first_id + i) for i in range(n)]
    start = time.perf_counter()
    for key in keys:
        tier.contains([key])
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lookups", type=int, default=2000,
                    help="lookups of unknown blocks per mode and round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="rounds, the two modes alternating, the median reported "
                    "(default: %(default)s)")
    ap.add_argument("--dir", default=None, help="directory (default: a temp dir)")
    args = ap.parse_args(argv)
    ns = KVLayout("bench", "bfloat16", 16, 2, 2, 64).namespace()
    with tempfile.TemporaryDirectory(dir=args.dir) as path:
        tiers = {m: DiskTier(path, ns, 1 << 30, free_reserve_bytes=0, lookups=m) for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else reversed(MODES):
                times[m].append(lookup_us(tiers[m], args.lookups, (r + 1) << 32))
    med = {m: statistics.median(t) for m, t in times.items()}
    for m in MODES:
        print(f"{m:7s} {med[m]:8.1f} us per lookup of an unknown block")
    print(f"thread / inline: {med['thread'] / med['inline']:.1f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
