"""Does a block's past predict its future on a trace? A generous ceiling for
the policies that rank blocks by how often they were used (``kvtier
foresight``; docs/policy.md, "Does a block's past say when it comes back?").

Three caches with the replay's rules (``kvtier.replay.reference``: prefix
hits, missing blocks stored unless declined, the head of a request most
recent) rank resident blocks, each for a window of ``W`` requests:

* ``past``: by how many of the last ``W`` requests, this one included,
  used them: what an online frequency policy can know, with exact counts
  and the window picked after the fact;
* ``future``: by how many of the next ``W`` requests use them: an oracle;
* ``fitted``: by the state a block is in (how many requests used it so far,
  how many requests ago the last one was), valued by how often blocks in
  that state are used again within the next ``W`` requests, counted over
  the whole trace (``reuse_table``): fitted on the trace it ranks, so the
  best any fixed map from recency and frequency to a rank could do.

The lowest-ranked evictable blocks leave first, the least recent first on
ties; a missing block is stored only if it outranks the block it would
replace (TinyLFU's admission, so the one-offs do not flush the ranking).
Where ``past`` and ``fitted`` stay near LRU while ``future`` is far above
it, a block's uses so far do not tell how soon it comes back, and no
policy that reads only per-block history can get much of what OPT gets.

``asked_streams(requests, N)`` gives what kvtier is asked about behind an
``N``-block engine prefix cache (``kvtier.replay.behind_engine``: each
request's blocks past its engine hit, the stream whose OPT ``kvtier replay
--gpu-blocks N --bounds`` reports), not the whole trace.

Cost: each request that evicts ranks every resident block, so a run takes
``O(requests x capacity)`` window counts: about a minute at 4,000 blocks
over 4,000 requests. Memory: every block's list of uses (a measurement over
the whole trace, not a design).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence

from kvtier.argtypes import require_positive_int
from kvtier.progress import make_progress
from kvtier.replay.behind_engine import check_fits, engine_miss_streams, served_requests
from kvtier.replay.reference import LRUCache, Requests, prefix_hit_ratio
from kvtier.replay.trace import TraceRequest


def use_times(requests: Requests) -> dict[int, list[int]]:
    """Block -> indices of the requests that use it, ascending (each once)."""
    out: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(requests):
        for h in dict.fromkeys(ids):
            out[h].append(i)
    return out


class RankedCache:
    """A cache that keeps the blocks ranking highest now (``score``), with the
    replay's rules.

    Owns the resident blocks and each one's last use (a clock that counts
    block uses, tail first, so a request's head is its most recent block,
    which breaks ties). Invariant: at most ``capacity`` resident blocks.
    ``uses`` is every block's use list (``use_times``); ``request`` is the
    index of the request being served.
    """

    def __init__(self, capacity: int, uses: dict[int, list[int]]) -> None:
        self.capacity = require_positive_int("capacity", capacity)
        self.uses = uses
        self.request = 0
        self.clock = 0
        self.last: dict[int, int] = {}  # resident block -> clock of its last use

    def __contains__(self, block: int) -> bool:
        return block in self.last

    def score(self, block: int) -> float:
        """How much ``block`` is worth keeping while the current request is served."""
        raise NotImplementedError

    def serve(self, ids: Sequence[int]) -> None:
        """Store what the ranking admits of the request's missing blocks, then use them."""
        last = self.last
        # each block once: a hash id repeated in a request is one block to store
        # (as LRUCache), not one more eviction
        missing = list(dict.fromkeys(h for h in ids if h not in last))
        room = self.capacity - len(last)
        if len(missing) > room:
            missing = missing[:room + self._replace(missing[room:], set(ids))]
        for h in missing[:self.capacity]:
            last[h] = 0
        for h in reversed(ids):
            self.clock += 1
            if h in last:
                last[h] = self.clock
        self.request += 1

    def _replace(self, extra: list[int], protected: set[int]) -> int:
        """Evict one resident block for each leading block of ``extra`` that
        outranks it; return how many were replaced."""
        score, last = self.score, self.last
        victims = heapq.nsmallest(len(extra), ((score(h), last[h], h) for h in last
                                               if h not in protected))
        n = 0
        for h, (worth, _, victim) in zip(extra, victims, strict=False):
            if score(h) <= worth:
                break
            del last[victim]
            n += 1
        return n


class WindowLFU(RankedCache):
    """Ranks blocks by their uses in a window of ``window`` requests: the last
    ones, this one included, or with ``future`` the next ones (an oracle)."""

    def __init__(self, capacity: int, window: int, uses: dict[int, list[int]],
                 future: bool) -> None:
        super().__init__(capacity, uses)
        self.window = require_positive_int("window", window)
        self.future = future

    def score(self, block: int) -> float:
        u, i = self.uses[block], self.request
        if self.future:
            return bisect_right(u, i + self.window) - bisect_right(u, i)
        return bisect_right(u, i) - bisect_right(u, i - self.window)


USES_CAP = 16
"""Use counts above this share one class (classes: 1, 2-3, 4-7, 8-15, 16+)."""
AGE_CAP = 1 << 14
"""Ages (requests since the last use) above this share one class (log2 classes)."""


def state(uses: int, age: int) -> tuple[int, int]:
    """The class of a block used ``uses`` times, the last ``age`` requests ago."""
    return min(uses, USES_CAP).bit_length(), min(age, AGE_CAP).bit_length()


def reuse_table(uses: dict[int, list[int]], horizon: int) -> dict[tuple[int, int], float]:
    """``state`` -> the share of the trace's blocks in that state that are used
    again within the next ``horizon`` requests, counted over the whole trace
    (``uses``: ``use_times`` of it).

    In-sample: fitted on the trace it then ranks, so a cache that reads it
    gets the best any fixed map from (uses, age) to a rank could.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    gaps: dict[int, list[int]] = defaultdict(list)  # uses class -> gaps to the next use
    never = AGE_CAP + horizon + 1  # past every age and horizon the table asks about
    for u in uses.values():
        for k, t in enumerate(u):
            gaps[state(k + 1, 0)[0]].append(u[k + 1] - t if k + 1 < len(u) else never)
    table: dict[tuple[int, int], float] = {}
    for uses_class, g in gaps.items():
        g.sort()
        for age_class in range(AGE_CAP.bit_length() + 1):
            age = (1 << age_class) >> 1  # the least age of the class
            alive = len(g) - bisect_right(g, age)  # not used again by that age
            again = bisect_right(g, age + horizon) - bisect_right(g, age)
            table[uses_class, age_class] = again / alive if alive else 0.0
    return table


class FittedRanking(RankedCache):
    """Ranks blocks by ``table`` (``reuse_table``) at their current state: uses
    so far, this request included, and requests since the last one."""

    def __init__(self, capacity: int, uses: dict[int, list[int]],
                 table: dict[tuple[int, int], float]) -> None:
        super().__init__(capacity, uses)
        self.table = table

    def score(self, block: int) -> float:
        u, i = self.uses[block], self.request
        k = bisect_right(u, i)
        return self.table.get(state(k, i - u[k - 1]), 0.0)


Row = tuple[float, float, float, float]
"""Hit ratios of LRU, ``past``, ``future`` and ``fitted``."""


def run(requests: Requests, capacities: list[int], windows: list[int],
        progress: bool = True) -> dict[tuple[int, int], Row]:
    """(capacity, window) -> the hit ratio of each ranking (``Row``)."""
    uses = use_times(requests)
    tables = {window: reuse_table(uses, window) for window in windows}
    runs = len(capacities) * (1 + 3 * len(windows))
    bar = make_progress(runs * len(requests), progress, unit="req")
    out: dict[tuple[int, int], Row] = {}
    try:
        for capacity in capacities:
            bar.describe(f"lru @ {capacity}")
            lru = prefix_hit_ratio(requests, LRUCache(capacity), bar.update)
            for window in windows:
                caches: dict[str, RankedCache] = {
                    "past": WindowLFU(capacity, window, uses, future=False),
                    "future": WindowLFU(capacity, window, uses, future=True),
                    "fitted": FittedRanking(capacity, uses, tables[window])}
                ratios = []
                for name, cache in caches.items():
                    bar.describe(f"{name} {window} @ {capacity}")
                    ratios.append(prefix_hit_ratio(requests, cache, bar.update))
                out[capacity, window] = (lru, ratios[0], ratios[1], ratios[2])
    finally:
        bar.close()
    return out


def asked_streams(loaded: Sequence[TraceRequest], gpu_blocks: int) -> Requests:
    """The requests as hash ids, or with ``gpu_blocks`` what kvtier is asked
    about behind an engine cache of that many blocks (each key numbered in
    order of first appearance); ``ValueError`` when the engine cannot hold the
    longest request."""
    if not gpu_blocks:
        return [r.hash_ids for r in loaded]
    served = served_requests(loaded)
    check_fits(served, gpu_blocks)
    number: dict[bytes, int] = {}
    return [[number.setdefault(key, len(number)) for key in keys]
            for keys in engine_miss_streams(served, gpu_blocks)[0]]


def rows(results: dict[tuple[int, int], Row]) -> list[dict[str, float | int]]:
    """The results as one dict per (capacity, window), for ``--json``."""
    return [{"capacity": capacity, "window": window, "lru": lru, "past": past,
             "future": future, "fitted": fitted}
            for (capacity, window), (lru, past, future, fitted) in results.items()]


def table(results: dict[tuple[int, int], Row]) -> str:
    """One row per (capacity, window): hit ratios and x LRU."""
    names = ("past", "future", "fitted")
    lines = [f"{'blocks':>7s} {'window':>7s} {'LRU':>7s} "
             + " ".join(f"{n:>7s} {'x LRU':>6s}" for n in names)]
    for (capacity, window), (lru, *ratios) in results.items():
        cells = " ".join(f"{r:7.4f} {_x(r, lru)}" for r in ratios)
        lines.append(f"{capacity:7d} {window:7d} {lru:7.4f} {cells}")
    return "\n".join(lines)


GAIN = 1.2
"""A ranking this many times LRU's hit ratio counts as a gain worth a policy
(the bar issue 11 sets for unseen traces)."""


def readings(results: dict[tuple[int, int], Row]) -> list[str]:
    """One line per capacity saying what the table means there, from the best
    window of each ranking (picked after the fact)."""
    out = []
    for capacity in dict.fromkeys(c for c, _ in results):
        cells = [row for (c, _), row in results.items() if c == capacity]
        lru = cells[0][0]
        history = max(max(row[1], row[3]) for row in cells)
        future = max(row[2] for row in cells)
        if _gains(history, lru):
            verdict = "a block's past predicts its reuse: a frequency policy can gain"
        elif _gains(future, lru):
            verdict = ("a block's past does not say when it comes back: expect any "
                       "recency or frequency policy near LRU")
        else:
            verdict = "no ranking gains much over LRU at this size"
        out.append(f"{capacity} blocks: LRU {lru:.4f}, best history {history:.4f} "
                   f"({_x(history, lru).strip()} x), future {future:.4f} "
                   f"({_x(future, lru).strip()} x): {verdict}")
    return out


def _gains(ratio: float, lru: float) -> bool:
    return ratio >= GAIN * lru and ratio > 0


def _x(ratio: float, lru: float) -> str:
    return f"{ratio / lru:6.2f}" if lru else f"{'-':>6s}"
