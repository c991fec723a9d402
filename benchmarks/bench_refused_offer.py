"""Manager time for a store offer refused for want of room (the hot path's worst case).

A CPU tier whose blocks are all held (half of them being written, half
leased by a waiting request) cannot make room, and vLLM repeats a refused
offer at every scheduler step. This fills a fresh manager per policy and
capacity that way, offers 16 new keys ``--offers`` times, and reports the
microseconds per refused offer and how often the policy's ``evict`` was
asked. The cost must not grow with the cache.

    python benchmarks/bench_refused_offer.py [--capacity 1000,16000,64000]
        [--policies default,lru] [--offers 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from kvtier import OffloadManager, RequestContext, block_key

OFFER = 16


def full_of_held_blocks(capacity: int, policy: str) -> tuple[OffloadManager, list[int]]:
    """A manager whose every slot is held, and a counter of ``evict`` calls."""
    mgr = OffloadManager(capacity, policy=policy, max_leases_per_request=capacity,
                         max_leased_blocks=capacity)
    calls = [0]
    evict: Callable[..., list[bytes] | None] = mgr.policy.evict

    def counted(n: int, protected: object) -> list[bytes] | None:
        calls[0] += 1
        return evict(n, protected)

    mgr.policy.evict = counted  # type: ignore[method-assign]
    writer = RequestContext("writer")
    keys = [block_key(i) for i in range(capacity)]
    mgr.prepare_store(keys, writer)  # every slot being written
    ready = keys[: capacity // 2]
    mgr.complete_store(ready, writer)  # half of them ready, and leased:
    mgr.lookup(ready, RequestContext("waiting"))
    return mgr, calls


def refused_offer_us(capacity: int, policy: str, offers: int) -> tuple[float, float]:
    """(microseconds per refused offer, evict calls per offer)."""
    mgr, calls = full_of_held_blocks(capacity, policy)
    new = [block_key(capacity + i) for i in range(OFFER)]
    start = time.perf_counter()
    for i in range(offers):
        if mgr.prepare_store(new, RequestContext(f"offer{i}")) is not None:
            raise RuntimeError("the offer was granted: the cache was not full of held blocks")
    return (time.perf_counter() - start) / offers * 1e6, calls[0] / offers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", default="1000,16000,64000",
                    help="cache sizes in blocks, comma-separated, each >= 16 "
                    "(default: %(default)s)")
    ap.add_argument("--policies", default="default,lru",
                    help="eviction policies, comma-separated (default: %(default)s)")
    ap.add_argument("--offers", type=int, default=200,
                    help="refused offers of 16 new blocks timed per policy and capacity "
                    "(default: %(default)s)")
    args = ap.parse_args(argv)
    capacities = [int(c) for c in args.capacity.split(",")]
    if args.offers < 1 or min(capacities) < OFFER:
        ap.error(f"--offers must be >= 1 and every --capacity >= {OFFER}")
    print(f"{'policy':8s} {'capacity':>8s} {'us/offer':>9s} {'evict calls':>11s}")
    for capacity in capacities:
        for policy in args.policies.split(","):
            us, calls = refused_offer_us(capacity, policy, args.offers)
            print(f"{policy:8s} {capacity:8d} {us:9.1f} {calls:11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
