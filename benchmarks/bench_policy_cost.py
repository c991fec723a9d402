"""Manager cost per offered key of each eviction policy, against LRU, side by side.

Each round replays the trace once per policy and capacity through a fresh
manager (``kvtier.replay.driver.replay``: only manager calls are timed), in
an order that rotates every round, with a GC pass before each run, so that
machine noise falls on every policy alike. Reported per cell: the best of
``--rounds`` runs in microseconds per offered key, and the median over
rounds of its ratio to LRU's run at the same capacity in the same round
(issue 11 asks for <= 1.5x), with the quartiles of those ratios, which show
how far one round moves; on a shared machine the paired ratio is the
steadier figure, and pinning the process to one core (``taskset -c 1``)
steadier still.

    python benchmarks/bench_policy_cost.py [--policies lru,plfu,adaptive]
        [--capacity 1000,4000,16000] [--rounds 5] [--json] [TRACE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

from kvtier.progress import make_progress
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.trace import BUNDLED_TRACE, load_trace

BASELINE = "lru"


def measure(trace: Path, policies: list[str], capacities: list[int],
            rounds: int) -> dict[tuple[str, int], list[float]]:
    """Microseconds per key of every (policy, capacity), one per round."""
    requests = trace_keys(load_trace(trace))
    cells = [(p, c) for c in capacities for p in policies]
    runs: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    bar = make_progress(rounds * len(cells), True, unit="run")
    try:
        for r in range(rounds):
            shift = r % len(cells)
            for policy, capacity in cells[shift:] + cells[:shift]:
                bar.describe(f"round {r + 1}/{rounds}: {policy} @ {capacity}")
                gc.collect()
                runs[policy, capacity].append(replay(requests, capacity, policy).us_per_key)
                bar.update(1)
    finally:
        bar.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE)
    ap.add_argument("--policies", default="lru,plfu,adaptive")
    ap.add_argument("--capacity", default="1000,4000,16000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policies = list(dict.fromkeys([BASELINE, *args.policies.split(",")]))
    capacities = [int(c) for c in args.capacity.split(",")]
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    runs = measure(args.trace, policies, capacities, args.rounds)
    rows = [summarize(p, c, runs[p, c], runs[BASELINE, c]) for c in capacities for p in policies]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'policy':10s} {'capacity':>8s} {'us/key':>8s} {'x LRU':>6s} {'q1':>5s} {'q3':>5s}")
    for row in rows:
        print(f"{row['policy']:10s} {row['capacity']:8d} {row['us_per_key']:8.3f} "
              f"{row['vs_lru']:6.2f} {row['vs_lru_q1']:5.2f} {row['vs_lru_q3']:5.2f}")
    return 0


def summarize(policy: str, capacity: int, times: list[float],
              lru_times: list[float]) -> dict[str, object]:
    """One table row: best time, and the median and quartiles of the paired ratios."""
    ratios = [a / b for a, b in zip(times, lru_times, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"policy": policy, "capacity": capacity, "us_per_key": round(min(times), 3),
            "vs_lru": round(statistics.median(ratios), 2),
            "vs_lru_q1": round(q1, 2), "vs_lru_q3": round(q3, 2)}


if __name__ == "__main__":
    sys.exit(main())
