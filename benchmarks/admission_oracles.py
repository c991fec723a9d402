"""How far admission alone can lift an LRU cache on a trace (docs/policy.md,
"Where it falls short").

Three LRU caches of ``--capacity`` blocks, prefix hits counted as the
replay counts them (the leading resident run of each request):

* ``lru``: every missing block is stored;
* ``oracle``: a missing block is stored only if a later request uses it
  again (knows the future: what any admission rule over LRU can reach);
* ``by shape``: a new block is stored only if its class reuses often
  enough, the class being the request's shape when the block first appears
  (how many leading blocks were known, how many new blocks the request
  brings, both as powers of two); each class's reuse rate is measured on
  the whole trace, so this too is hindsight, and the best threshold is shown.

    python benchmarks/admission_oracles.py TRACE [--capacity 4000]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.replay.trace import load_trace

Admit = Callable[[int, bool, int], bool]
"""(hash id, first time seen, position in the flat access sequence) -> store it."""


def lru_hits(requests: Sequence[Sequence[int]], capacity: int, admit: Admit) -> float:
    """Prefix-hit ratio of an LRU cache that stores a missing block when ``admit`` says so."""
    cache: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    hits = total = pos = 0
    for ids in requests:
        for h in ids:
            if h not in cache:
                break
            hits += 1
        total += len(ids)
        for i, h in enumerate(ids):
            if h in cache:
                cache.move_to_end(h)
            elif admit(h, h not in seen, pos + i):
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        pos += len(ids)
        seen.update(ids)
    return hits / total


def used_again(requests: Sequence[Sequence[int]]) -> list[bool]:
    """For each access of the flat sequence: does a later access use the same block?"""
    flat = [h for ids in requests for h in ids]
    out = [False] * len(flat)
    later: set[int] = set()
    for i in range(len(flat) - 1, -1, -1):
        out[i] = flat[i] in later
        later.add(flat[i])
    return out


def shape_classes(requests: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """Each block's class: (leading known blocks, new blocks) of the request that
    first used it, as bit lengths capped at 7."""
    seen: set[int] = set()
    out: dict[int, tuple[int, int]] = {}
    for ids in requests:
        known = 0
        while known < len(ids) and ids[known] in seen:
            known += 1
        new = [h for h in ids if h not in seen]
        key = (min(7, known.bit_length()), min(7, len(new).bit_length()))
        for h in new:
            out.setdefault(h, key)
        seen.update(ids)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="Mooncake trace to replay (JSON lines)")
    ap.add_argument("--capacity", type=int, default=4000,
                    help="blocks each LRU cache holds (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.capacity < 1:
        ap.error("--capacity must be >= 1")
    requests = [r.hash_ids for r in load_trace(args.trace)]
    uses = Counter(h for ids in requests for h in ids)
    again = used_again(requests)
    base = lru_hits(requests, args.capacity, lambda h, first, pos: True)
    oracle = lru_hits(requests, args.capacity, lambda h, first, pos: again[pos])
    classes = shape_classes(requests)
    offered: Counter[tuple[int, int]] = Counter(classes.values())
    reused = Counter(c for h, c in classes.items() if uses[h] > 1)
    best = (base, 0.0)
    for tenth in range(1, 10):
        good = {c for c in offered if reused[c] >= offered[c] * tenth / 10}
        def by_shape(h: int, first: bool, pos: int,
                     good: set[tuple[int, int]] = good) -> bool:
            return not first or classes[h] in good
        ratio = lru_hits(requests, args.capacity, by_shape)
        best = max(best, (ratio, tenth / 10))
    print(f"{'cache':10s} {'hit ratio':>9s} {'x LRU':>6s}")
    for name, ratio, note in (("lru", base, ""), ("oracle", oracle, ""),
                              ("by shape", best[0], f"   (threshold {best[1]:.1f})")):
        times = f"{ratio / base:6.2f}" if base else f"{'-':>6s}"
        print(f"{name:10s} {ratio:9.4f} {times}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
