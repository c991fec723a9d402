"""Surrogate "unseen production" traces for policy validation (issue 11).

The production trace the issue quotes is not available. What is known of it:
59 % of its distinct blocks are used once, reuse distances spread from 1,000
to 32,000 distinct blocks, and accesses to blocks used five or more times are
55 % of all accesses. This script writes traces of that shape from a family
of generators whose parameters vary per variant, so a policy can be tuned on
some variants and reported on others it never saw:

* a corpus of shared documents (system prompts, RAG documents, tool
  manuals) of Zipf popularity, each behind one of a few tenant prompts;
* multi-turn sessions whose next turn comes after a log-uniform delay (so
  reuse distances spread over decades);
* one-off prompts and one-off question tails (most distinct blocks).

``python benchmarks/surrogate_traces.py OUTDIR`` writes ``OUTDIR/<name>.jsonl``
for every variant in ``VARIANTS`` and prints each trace's shape (``--stats``).
The variants are split: ``TUNE`` were looked at while building the policy,
``HELD_OUT`` were generated once, after the policy was frozen.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvtier.replay.generate import MEAN_GAP_MS, write_trace
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace


@dataclass(frozen=True)
class Variant:
    seed: int
    requests: int = 12_000
    docs: int = 3_000  # shared documents
    doc_blocks: tuple[int, int] = (2, 14)
    zipf: float = 0.9  # document popularity skew
    tenants: int = 6
    p_doc: float = 0.55  # request reads a shared document
    p_session: float = 0.30  # request is the next turn of a session
    p_oneoff_long: float = 0.05  # long one-off prompt (scan)
    delay: tuple[int, int] = (60, 3_000)  # requests between two turns (log-uniform)
    turns_mean: float = 3.0
    docs_per_request: tuple[int, int] = (1, 2)
    drift: float = 0.0  # share of popularity ranks reshuffled every 1,000 requests


VARIANTS: dict[str, Variant] = {
    # looked at while building the policy
    "tune-a": Variant(seed=101, tenants=40, docs=2_500, zipf=0.6, p_oneoff_long=0.02,
                      p_doc=0.6),
    "tune-b": Variant(seed=102, tenants=60, docs=2_000, zipf=0.4, p_oneoff_long=0.03,
                      p_doc=0.6, docs_per_request=(1, 3)),
    # held out: other seeds and other shapes inside the same family
    "held-c": Variant(seed=203, tenants=40, docs=3_000, zipf=0.5, p_oneoff_long=0.02,
                      p_doc=0.65, p_session=0.25, delay=(200, 6_000)),
    "held-d": Variant(seed=204, tenants=30, docs=5_000, zipf=0.7, doc_blocks=(3, 20),
                      delay=(150, 5_000), p_doc=0.65, p_session=0.2, p_oneoff_long=0.05,
                      drift=0.1),
    "held-e": Variant(seed=205, tenants=80, docs=4_000, zipf=0.3, doc_blocks=(1, 10),
                      delay=(80, 3_500), turns_mean=5.0, docs_per_request=(1, 3),
                      p_oneoff_long=0.02, drift=0.05),
    "held-f": Variant(seed=206, requests=16_000, tenants=20, docs=1_500, zipf=0.8,
                      delay=(50, 8_000), p_doc=0.5, p_session=0.35, p_oneoff_long=0.03),
}
TUNE = ("tune-a", "tune-b")
HELD_OUT = ("held-c", "held-d", "held-e", "held-f")


class _Ids:
    """Prefix-hash ids: block j's id depends on the contents of blocks 0..j."""

    def __init__(self) -> None:
        self._table: dict[tuple[int, int], int] = {}
        self._content = 0

    def fresh(self, n: int) -> list[int]:
        start = self._content
        self._content += n
        return list(range(start, start + n))

    def ids(self, contents: list[int]) -> list[int]:
        out, parent = [], -1
        for c in contents:
            node = (parent, c)
            hid = self._table.get(node)
            if hid is None:
                hid = self._table[node] = len(self._table)
            out.append(hid)
            parent = hid
        return out


def generate(v: Variant) -> list[TraceRequest]:
    rng = random.Random(f"surrogate-{v.seed}")
    ids = _Ids()
    tenants = [ids.fresh(rng.randint(1, 3)) for _ in range(v.tenants)]
    docs = [(rng.randrange(v.tenants), ids.fresh(rng.randint(*v.doc_blocks)))
            for _ in range(v.docs)]
    rank = list(range(v.docs))
    cum: list[float] = []
    total = 0.0
    for i in range(v.docs):
        total += 1.0 / (i + 1) ** v.zipf
        cum.append(total)

    def pick_doc() -> int:
        return rank[bisect.bisect_left(cum, rng.random() * total)]

    due: list[tuple[int, int, list[int], int]] = []  # (due request, tie, history, turns left)
    out: list[TraceRequest] = []
    clock = 0.0
    lo, hi = math.log(v.delay[0]), math.log(v.delay[1])
    tie = 0
    while len(out) < v.requests:
        i = len(out)
        if v.drift and i and i % 1000 == 0:
            k = int(v.docs * v.drift)
            for _ in range(k):
                a, b = rng.randrange(v.docs), rng.randrange(v.docs)
                rank[a], rank[b] = rank[b], rank[a]
        r = rng.random()
        if due and due[0][0] <= i and r < v.p_session + v.p_doc:
            _, _, history, left = heapq.heappop(due)
            contents = history + ids.fresh(rng.randint(1, 3))
        elif r < v.p_doc:
            tenant = rng.randrange(v.tenants)
            contents = list(tenants[tenant])
            for _ in range(rng.randint(*v.docs_per_request)):
                contents += docs[pick_doc()][1]
            contents += ids.fresh(rng.randint(1, 4))
            left = 1 + int(rng.expovariate(1 / v.turns_mean)) if rng.random() < 0.3 else 0
            history = contents
        elif r < v.p_doc + v.p_session:
            tenant = rng.randrange(v.tenants)
            contents = list(tenants[tenant]) + ids.fresh(rng.randint(2, 8))
            left = 1 + int(rng.expovariate(1 / v.turns_mean))
        elif r < v.p_doc + v.p_session + v.p_oneoff_long:
            contents = list(tenants[rng.randrange(v.tenants)][:1]) + ids.fresh(
                rng.randint(24, 96))
            left = 0
        else:
            contents = list(tenants[rng.randrange(v.tenants)]) + ids.fresh(rng.randint(1, 6))
            left = 0
        output = int(rng.lognormvariate(math.log(300), 0.8)) + 1
        hash_ids = ids.ids(contents)
        partial = rng.randrange(MOONCAKE_BLOCK_TOKENS)
        out.append(TraceRequest(int(clock), max(1, len(hash_ids) * MOONCAKE_BLOCK_TOKENS
                                               - partial), output, tuple(hash_ids)))
        clock += rng.expovariate(1.0 / MEAN_GAP_MS)
        if left > 0 and len(contents) < 300:
            answer = ids.fresh(max(1, round(output / MOONCAKE_BLOCK_TOKENS)))
            wait = int(math.exp(rng.uniform(lo, hi)))
            tie += 1
            heapq.heappush(due, (i + wait, tie, contents + answer, left - 1))
    return out


def shape(requests: list[TraceRequest]) -> dict[str, float]:
    """Two of the issue's statistics (``stack_distances`` gives the third)."""
    seq = [h for r in requests for h in r.hash_ids]
    uses = Counter(seq)
    once = sum(1 for c in uses.values() if c == 1) / len(uses)
    hot = sum(c for c in uses.values() if c >= 5) / len(seq)
    return {"distinct": len(uses), "accesses": len(seq), "used_once": round(once, 3),
            "hot5_access_share": round(hot, 3)}


def stack_distances(requests: list[TraceRequest], sample: int = 16) -> list[int]:
    """LRU stack distances (distinct blocks in between) of reuses of sampled blocks."""
    # Fenwick tree over access times of the most recent use of each block
    seq = [h for r in requests for h in r.hash_ids]
    n = len(seq)
    tree = [0] * (n + 1)

    def add(i: int, d: int) -> None:
        i += 1
        while i <= n:
            tree[i] += d
            i += i & -i

    def prefix(i: int) -> int:
        s = 0
        i += 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    out = []
    for t, h in enumerate(seq):
        p = last.get(h)
        if p is not None:
            if h % sample == 0:
                out.append(prefix(t - 1) - prefix(p))
            add(p, -1)
        add(t, 1)
        last[h] = t
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir",
                    help="directory to write NAME.jsonl into, one per variant "
                    "(created if missing)")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--stats", action="store_true", help="print each trace's shape")
    args = ap.parse_args(argv)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(VARIANTS)
    for name in names:
        path = outdir / f"{name}.jsonl"
        reqs = generate(VARIANTS[name])
        write_trace(reqs, path)
        if args.stats:
            reqs = load_trace(path)
            st = shape(reqs)
            d = sorted(stack_distances(reqs))
            pct = {p: d[int(len(d) * p / 100)] for p in (10, 25, 50, 75, 90)} if d else {}
            print(name, st, "stack distance pct", pct, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
