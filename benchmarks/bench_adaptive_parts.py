"""What the adaptive policy adds to PLFU per offered key, part by part.

``bench_policy_cost.py`` compares whole replays, whose run-to-run noise on a
shared machine (several percent) hides a part that costs a few percent. This
times the two parts alone, on the keys a replay would give them: the CRC-32
filter that picks the sampled keys (it runs over every key of every
request), and the five shadow caches fed the sampled keys of each request.
For scale it also times LRU's whole replay; a part's ``x LRU`` is its time
per key over LRU's manager time per key. Best of ``--repeats`` for each.

    python benchmarks/bench_adaptive_parts.py [--capacity 1000,4000,16000]
        [--repeats 5] [TRACE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.trace import BUNDLED_TRACE, load_trace


def filter_seconds(policy: AdaptivePolicy, requests: list[list[bytes]]) -> float:
    """One pass of adaptive's sampling filter over every request."""
    sampled = policy.sampled
    start = time.perf_counter()
    for keys in requests:
        sampled(keys)
    return time.perf_counter() - start


def shadow_seconds(capacity: int, sampled: list[list[bytes]]) -> float:
    """Feed a fresh policy's shadows every sampled request, one shadow after
    another (as the policy feeds them an epoch's requests)."""
    shadows = AdaptivePolicy(capacity).shadows
    requests = [(keys, 0) for keys in sampled]
    start = time.perf_counter()
    for s in shadows:
        s.access_all(requests)
    return time.perf_counter() - start


def measure(requests: list[list[bytes]], capacity: int, repeats: int) -> dict[str, float]:
    """Microseconds per offered key of LRU's replay and of each part."""
    n_keys = sum(map(len, requests))
    policy = AdaptivePolicy(capacity)
    sampled = [s for s in map(policy.sampled, requests) if s]
    lru = min(replay(requests, capacity, "lru").us_per_key for _ in range(repeats))
    filt = min(filter_seconds(policy, requests) for _ in range(repeats))
    shad = min(shadow_seconds(capacity, sampled) for _ in range(repeats))
    return {"lru": lru, "filter": filt / n_keys * 1e6, "shadows": shad / n_keys * 1e6,
            "sampled_requests": len(sampled) / len(requests)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE,
                    help="Mooncake trace (default: the bundled conversation trace)")
    ap.add_argument("--capacity", default="1000,4000,16000",
                    help="cache sizes in blocks, comma-separated (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timings of each figure, the best kept (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    requests = trace_keys(load_trace(args.trace))
    print(f"{'capacity':>8s} {'sampled req':>11s} {'LRU us/key':>10s} "
          f"{'filter us/key':>13s} {'x LRU':>6s} {'shadows us/key':>14s} {'x LRU':>6s}")
    for capacity in (int(c) for c in args.capacity.split(",")):
        m = measure(requests, capacity, args.repeats)
        print(f"{capacity:8d} {m['sampled_requests']:11.1%} {m['lru']:10.3f} "
              f"{m['filter']:13.3f} {m['filter'] / m['lru']:6.3f} "
              f"{m['shadows']:14.3f} {m['shadows'] / m['lru']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
