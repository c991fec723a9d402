"""How much of a policy's figure against LRU is the draw of its key sample.

The default policy's shadow caches follow the keys whose CRC-32 falls in a
slice of the hash space, so under other block hashes they see other blocks
(``kvtier.replay.rekey``; in a server, vLLM's block hashes make the draw). This
replays the trace under key seeds 0..N-1 (seed 0: the trace's own ids; each
one is ``kvtier replay --key-seed S``) and reports, for each policy and
capacity, its hit ratio over LRU's in the same seed: the median, the lowest
and the highest over seeds, and the figure under seed 0. Alone, or behind a
model of the engine's prefix cache (``--gpu-blocks``, the CPU-tier hit ratio
of ``kvtier replay --gpu-blocks``).

    python benchmarks/key_seed_spread.py [TRACE] [--capacity 1000,4000,16000]
        [--policies plfu,default] [--seeds 8] [--gpu-blocks N] [--limit-requests M] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.argtypes import int_list, positive_int
from kvtier.progress import make_progress
from kvtier.replay.behind_engine import replay_behind_engine, served_requests
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.rekey import rekeyed
from kvtier.replay.trace import BUNDLED_TRACE, TraceFormatError, TraceRequest, load_trace

BASELINE = "lru"


def replayer(trace: Sequence[TraceRequest],
             gpu_blocks: int | None) -> Callable[[int, str], float]:
    """``(capacity, policy) -> hit ratio`` of replays of ``trace`` (the CPU tier's
    behind an engine of ``gpu_blocks``); the trace's keys are built once."""
    if gpu_blocks is None:
        keys = trace_keys(trace)
        return lambda capacity, policy: replay(keys, capacity, policy).hit_ratio
    served = served_requests(trace)
    return lambda capacity, policy: replay_behind_engine(
        served, capacity, policy, gpu_blocks=gpu_blocks).hit_ratio


def hit_ratio(trace: Sequence[TraceRequest], capacity: int, policy: str,
              gpu_blocks: int | None) -> float:
    """One replay's hit ratio (``replayer``)."""
    return replayer(trace, gpu_blocks)(capacity, policy)


def measure(trace: Sequence[TraceRequest], policies: list[str], capacities: list[int],
            seeds: int, gpu_blocks: int | None) -> dict[tuple[str, int], list[float]]:
    """Hit ratio of every (policy, capacity), one per key seed."""
    runs: dict[tuple[str, int], list[float]] = {(p, c): [] for p in policies for c in capacities}
    bar = make_progress(seeds * len(runs), True, unit="run")
    try:
        for seed in range(seeds):
            run = replayer(rekeyed(trace, seed), gpu_blocks)
            for policy, capacity in runs:
                bar.describe(f"seed {seed}: {policy} @ {capacity}")
                runs[policy, capacity].append(run(capacity, policy))
                bar.update(1)
    finally:
        bar.close()
    return runs


def summarize(policy: str, capacity: int, ratios: list[float],
              lru: list[float]) -> dict[str, object]:
    """One row: the policy's hit ratio over LRU's, seed by seed, and their spread."""
    vs = [r / b if b else float("inf") for r, b in zip(ratios, lru, strict=True)]
    return {"policy": policy, "capacity": capacity, "seed0": vs[0],
            "median": statistics.median(vs), "min": min(vs), "max": max(vs),
            "hit_ratios": ratios, "lru_hit_ratios": lru}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE)
    ap.add_argument("--policies", default="plfu,default")
    ap.add_argument("--capacity", type=int_list, default=[1000, 4000, 16000])
    ap.add_argument("--seeds", type=positive_int, default=8)
    ap.add_argument("--gpu-blocks", type=positive_int, default=None)
    ap.add_argument("--limit-requests", type=positive_int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policies = list(dict.fromkeys([BASELINE, *args.policies.split(",")]))
    try:
        trace = load_trace(args.trace)[: args.limit_requests]
    except (OSError, TraceFormatError) as exc:
        ap.error(str(exc))
    runs = measure(trace, policies, args.capacity, args.seeds, args.gpu_blocks)
    rows = [summarize(p, c, runs[p, c], runs[BASELINE, c])
            for c in args.capacity for p in policies if p != BASELINE]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'policy':10s} {'capacity':>8s} {'seed 0':>7s} {'median':>7s} {'min':>7s} "
          f"{'max':>7s}   (x LRU over {args.seeds} key seeds)")
    for row in rows:
        print(f"{row['policy']:10s} {row['capacity']:8d} {row['seed0']:7.3f} "
              f"{row['median']:7.3f} {row['min']:7.3f} {row['max']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
