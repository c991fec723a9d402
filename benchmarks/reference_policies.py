"""How far simple, well-known policy families get on a trace, outside the manager
(docs/policy.md, "The issue's production trace").

Caches over hash ids with the replay's rules (``kvtier.replay.reference``,
whose ``LRUCache`` each family extends; its ``lru`` row equals ``kvtier
replay --policy lru`` block for block).

Families, each at several parameters:

* ``doorkeeper-H``: LRU that stores a missing block only if one of the last
  ``H x capacity`` distinct blocks used was it (TinyLFU's doorkeeper; the
  default policy's admission is this rule over PLFU);
* ``threshold-K``: LRU that stores a missing block only once it was used ``K``
  times before (exact counts, memory unbounded: a reference, not a design);
* ``lfu-aged-P``: LFU over exact counts halved every ``P x capacity`` offered
  blocks, recency breaking ties; a missing block is stored only if its count
  beats that of the block it would evict (TinyLFU's admission);
* ``lru-2``: evicts the block whose second most recent use is the oldest
  (LRU-K with K = 2; blocks used once go first, least recent first), with the
  use times of up to ``8 x capacity`` blocks.

The best parameter of a family is picked after the fact, so a family's best
row is a ceiling for that family, not what it would do online.

    python benchmarks/reference_policies.py TRACE [--capacity 1000,4000,16000]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from kvtier.argtypes import int_list
from kvtier.progress import make_progress
from kvtier.replay.reference import Cache, LRUCache, Requests, prefix_hit_ratio
from kvtier.replay.trace import BUNDLED_TRACE, load_trace


class Doorkeeper(LRUCache):
    """LRU storing a missing block only if the last ``factor x capacity``
    distinct blocks used include it (bounded: that many history entries)."""

    def __init__(self, capacity: int, factor: int) -> None:
        super().__init__(capacity)
        self.limit = factor * capacity
        self.seen: OrderedDict[int, None] = OrderedDict()

    def admitted(self, missing: list[int], room: int) -> int:
        if len(missing) <= room:
            return len(missing)
        known = 0
        for h in missing:
            if h not in self.seen:
                break
            known += 1
        return max(known, room)

    def used(self, ids: Sequence[int]) -> None:
        seen = self.seen
        for h in reversed(ids):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.limit:
            seen.popitem(last=False)


class Threshold(LRUCache):
    """LRU storing a missing block only once it was used ``uses`` times before
    (exact counts of every block ever used: unbounded)."""

    def __init__(self, capacity: int, uses: int) -> None:
        super().__init__(capacity)
        self.uses = uses
        self.counts: Counter[int] = Counter()

    def admitted(self, missing: list[int], room: int) -> int:
        if len(missing) <= room:
            return len(missing)
        known = 0
        for h in missing:
            if self.counts[h] < self.uses:
                break
            known += 1
        return max(known, room)

    def used(self, ids: Sequence[int]) -> None:
        self.counts.update(ids)


class _HeapCache:
    """Resident blocks ranked by a key in a lazy min-heap (stale entries are
    skipped when popped, and the heap is rebuilt from the resident blocks when
    it holds more than ``4 x capacity`` entries); ``rank(block)`` is the
    block's current key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: set[int] = set()
        self.heap: list[tuple[tuple[int, int], int]] = []

    def __contains__(self, block: int) -> bool:
        return block in self.resident

    def rank(self, block: int) -> tuple[int, int]:
        raise NotImplementedError

    def push(self, block: int) -> None:
        heapq.heappush(self.heap, (self.rank(block), block))
        if len(self.heap) > 4 * self.capacity:
            self.rebuild()

    def rebuild(self) -> None:
        """The heap with one current entry per resident block."""
        self.heap = [(self.rank(h), h) for h in self.resident]
        heapq.heapify(self.heap)

    def lowest(self, n: int, protected: set[int]) -> list[tuple[tuple[int, int], int]]:
        """Up to ``n`` evictable blocks of lowest rank, lowest first (left in the heap)."""
        out: list[tuple[tuple[int, int], int]] = []
        kept: list[tuple[tuple[int, int], int]] = []
        heap = self.heap
        while len(out) < n and heap:
            entry = heapq.heappop(heap)
            rank, block = entry
            if block not in self.resident or rank != self.rank(block):
                continue  # stale
            (kept if block in protected else out).append(entry)
        for entry in out + kept:
            heapq.heappush(heap, entry)
        return out

    def evict(self, blocks: list[int]) -> None:
        self.resident.difference_update(blocks)  # their heap entries go stale

    def store(self, blocks: list[int]) -> None:
        for h in blocks[:self.capacity - len(self.resident)]:
            self.resident.add(h)
            self.push(h)


class AgedLFU(_HeapCache):
    """LFU over exact use counts, halved every ``period x capacity`` offered
    blocks; ties go to the least recent. A missing block is stored only if its
    count beats the count of the victim it would replace (a suffix of the offer
    is declined from the first block that does not)."""

    def __init__(self, capacity: int, period: int) -> None:
        super().__init__(capacity)
        self.counts: Counter[int] = Counter()
        self.last: dict[int, int] = {}
        self.clock = 0
        self.period = period * capacity
        self.next_aging = self.period

    def rank(self, block: int) -> tuple[int, int]:
        return self.counts[block], self.last[block]

    def serve(self, ids: Sequence[int]) -> None:
        counts, last = self.counts, self.last
        for h in reversed(ids):  # the request's use first: its head ends most recent
            self.clock += 1
            counts[h] += 1
            last[h] = self.clock
            if h in self.resident:
                self.push(h)
        missing = [h for h in ids if h not in self.resident]
        room = self.capacity - len(self.resident)
        if len(missing) > room:
            victims = self.lowest(len(missing) - room, set(ids))
            stored = room
            for i, h in enumerate(missing[room:]):
                if i >= len(victims) or counts[h] <= victims[i][0][0]:
                    break
                stored += 1
            self.evict([block for _, block in victims[:stored - room]])
            missing = missing[:stored]
        self.store(missing)
        if self.clock >= self.next_aging:
            self._age()

    def _age(self) -> None:
        self.next_aging = self.clock + self.period
        self.counts = Counter({h: c >> 1 for h, c in self.counts.items() if c > 1})
        self.last = {h: t for h, t in self.last.items() if h in self.counts
                     or h in self.resident}
        self.rebuild()


class LRU2(_HeapCache):
    """LRU-2: ranks a block by the request before its latest one (-1 if none),
    then by its latest (head of a request most recent). Keeps the two use
    times of at most ``history x capacity`` blocks (resident ones always)."""

    def __init__(self, capacity: int, history: int = 8) -> None:
        super().__init__(capacity)
        self.times: dict[int, tuple[int, int]] = {}
        self.requests = 0
        self.limit = history * capacity

    def rank(self, block: int) -> tuple[int, int]:
        return self.times[block]

    def serve(self, ids: Sequence[int]) -> None:
        times = self.times
        self.requests += 1
        n = len(ids)
        for j, h in enumerate(ids):
            now = self.requests * (1 << 20) + n - j  # the head is the most recent
            before = times.get(h)
            times[h] = (before[1] if before else -1, now)
            if h in self.resident:
                self.push(h)
        missing = [h for h in ids if h not in self.resident]
        over = len(self.resident) + len(missing) - self.capacity
        if over > 0:
            self.evict([block for _, block in self.lowest(over, set(ids))])
        self.store(missing)
        if len(times) > self.limit:
            gone = sorted((t[1], h) for h, t in times.items() if h not in self.resident)
            for _, h in gone[:len(gone) // 2]:
                del times[h]


FAMILIES: dict[str, list[tuple[str, Callable[[int], Cache]]]] = {
    "lru": [("lru", LRUCache)],
    "doorkeeper": [(f"doorkeeper-{f}", partial(Doorkeeper, factor=f)) for f in (2, 4, 8, 16, 32)],
    "threshold": [(f"threshold-{k}", partial(Threshold, uses=k)) for k in (1, 2, 3, 4)],
    "lfu-aged": [(f"lfu-aged-{p}", partial(AgedLFU, period=p)) for p in (4, 16, 64)],
    "lru-2": [("lru-2", LRU2)],
}
"""Family name -> (row name, cache factory) of each parameter tried."""


def run(requests: Requests, capacities: list[int], progress: bool = True
        ) -> dict[tuple[str, int], float]:
    """Hit ratio of every row of every family at every capacity."""
    rows = [row for family in FAMILIES.values() for row in family]
    bar = make_progress(len(rows) * len(capacities), progress, unit="run")
    out: dict[tuple[str, int], float] = {}
    try:
        for capacity in capacities:
            for name, make in rows:
                bar.describe(f"{name} @ {capacity}")
                out[name, capacity] = prefix_hit_ratio(requests, make(capacity))
                bar.update(1)
    finally:
        bar.close()
    return out


def table(ratios: dict[tuple[str, int], float], capacities: list[int]) -> str:
    """Every row, then each family's best, as hit ratio and x LRU per capacity."""
    head = "".join(f"{c:>10d} {'x LRU':>6s}" for c in capacities)
    lines = [f"{'policy':16s}{head}"]

    def line(name: str, cells: list[tuple[str, float]]) -> str:
        body = ""
        for (_, ratio), c in zip(cells, capacities, strict=True):
            base = ratios["lru", c]
            body += f"{ratio:10.4f} {ratio / base:6.2f}" if base else f"{ratio:10.4f} {'-':>6s}"
        return f"{name:16s}{body}"

    for family in FAMILIES.values():
        for name, _ in family:
            lines.append(line(name, [(name, ratios[name, c]) for c in capacities]))
    lines.append("best of each family (parameter picked after the fact):")
    for fam, family in FAMILIES.items():
        best = [max(((n, ratios[n, c]) for n, _ in family), key=lambda x: x[1])
                for c in capacities]
        lines.append(line(fam, best) + "   " + " / ".join(n for n, _ in best))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE,
                    help="Mooncake trace (default: the bundled conversation trace)")
    ap.add_argument("--capacity", type=int_list, default="1000,4000,16000",
                    help="cache sizes in blocks, comma-separated")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar on stderr (shown only on a terminal)")
    args = ap.parse_args(argv)
    try:
        requests = [r.hash_ids for r in load_trace(args.trace)]
    except (OSError, ValueError) as exc:  # no trace, or a bad one
        ap.error(str(exc))
    ratios = run(requests, args.capacity, not args.no_progress)
    print(table(ratios, args.capacity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
