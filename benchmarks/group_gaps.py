"""How a trace's prompt groups come back: whether a group returns, and whether
the gap before its next request can be told from the last one
(docs/policy.md, "Does a block's past say when it comes back?").

A group is the requests that share a first block (so a trace whose
requests all open with one system prompt, as the bundled one does, is one
group). Printed: the groups and
how many had one request only; for k = 1..5, the share of groups with k
requests that have another; quantiles of the reuse gap of blocks (requests
between two requests that use the block); and, over consecutive gaps of
each group, the chance that a gap is short (at most ``--short`` requests)
after a short one and after a long one. A cache that must choose which
groups to hold gains from the first only if the second says when.

    python benchmarks/group_gaps.py TRACE [--short 40]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from kvtier.argtypes import positive_int
from kvtier.replay.foresight import use_times
from kvtier.replay.reference import Requests
from kvtier.replay.trace import BUNDLED_TRACE, load_trace


def groups(requests: Requests) -> list[list[int]]:
    """Each group's request indices, ascending (groups in order of first request)."""
    out: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(requests):
        if ids:
            out[ids[0]].append(i)
    return list(out.values())


def returns(members: Sequence[Sequence[int]], k: int) -> float:
    """Share of the groups with at least ``k`` requests that have a ``k + 1``-th."""
    reached = sum(1 for m in members if len(m) >= k)
    return sum(1 for m in members if len(m) > k) / reached if reached else 0.0


def block_gaps(requests: Requests) -> list[int]:
    """Requests between two consecutive uses of a block, every reuse, sorted."""
    return sorted(b - a for uses in use_times(requests).values() for a, b in pairwise(uses))


def short_after(members: Sequence[Sequence[int]], short: int) -> tuple[float, float]:
    """P(a group's gap <= ``short`` | its previous gap <= ``short``), and the
    same after a longer one (0 when no such pair)."""
    pairs = {True: 0, False: 0}  # previous gap short -> pairs of gaps
    shorts = {True: 0, False: 0}  # ... of which the next gap is short
    for m in members:
        for before, after in pairwise(b - a for a, b in pairwise(m)):
            pairs[before <= short] += 1
            shorts[before <= short] += after <= short
    after_short, after_long = (shorts[k] / pairs[k] if pairs[k] else 0.0 for k in (True, False))
    return after_short, after_long


def report(requests: Requests, short: int) -> list[str]:
    """The printed lines."""
    members = groups(requests)
    gaps = block_gaps(requests)
    once = sum(1 for m in members if len(m) == 1)
    lines = [f"{len(requests)} requests, {len(members)} groups, {once} with one request",
             "P(another request | k so far): " + ", ".join(
                 f"k={k} {returns(members, k):.2f}" for k in range(1, 6))]
    if gaps:
        q = [gaps[min(len(gaps) - 1, int(len(gaps) * p))] for p in (0.1, 0.25, 0.5, 0.75, 0.9)]
        lines.append("block reuse gap, requests (10/25/50/75/90 %): " + " / ".join(map(str, q)))
    after_short, after_long = short_after(members, short)
    lines.append(f"P(gap <= {short} | previous gap <= {short}) {after_short:.2f}, "
                 f"P(gap <= {short} | previous gap > {short}) {after_long:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE,
                    help="Mooncake trace (default: the bundled conversation trace)")
    ap.add_argument("--short", type=positive_int, default=40,
                    help="a gap of at most this many requests is short (default 40)")
    args = ap.parse_args(argv)
    try:
        requests = [r.hash_ids for r in load_trace(args.trace)]
    except (OSError, ValueError) as exc:  # no trace, or a bad one
        ap.error(str(exc))
    print("\n".join(report(requests, args.short)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
