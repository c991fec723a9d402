"""The longest requests on the scheduler's path: each request's manager time, its tail.

``bench_manager.py`` gives the mean per key; a serving engineer also asks how
long the slowest call holds the scheduler. This replays a generated workload
(``kvtier generate``'s kinds; large enough that a history of several times
the cache fills and is aged) through kvtier's manager with each policy, and
through vLLM's ``CPUOffloadingManager`` with LRU, timing every request's
manager calls (lookup, load, store offer, completion, finish; the same
sequence as ``bench_manager.py``). A policy that can age its history in
steps (PLFU and the default, ``PLFUPolicy.AGE_STEP``) is also run with the
whole history aged in one call (``, at once``: ``age_in_steps`` off, as
every aging was before it existed). Rows are interleaved, their order rotating,
``--repeats`` times; each figure is the median over the repeats. The process
should have a core to itself (``taskset -c 1``): a preempted request looks
like a slow one.

    taskset -c 1 python benchmarks/bench_call_stalls.py [--capacity 16384,65536] \\
        [--policy lru,default] [--kind rag] [--requests 120000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench_manager import (
    VLLM_DEFAULT_POLICY,
    kvtier_request,
    kvtier_setup,
    vllm_request,
    vllm_setup,
)

import kvtier
from kvtier.argtypes import int_list, policy_list, positive_int
from kvtier.policies import policy_class
from kvtier.replay.generate import KINDS, generate

AT_ONCE = ", at once"
"""Suffix of the row of a policy whose history is aged in one call."""


def request_times(run: Callable[[int], int], n: int) -> list[float]:
    """Seconds of each of ``n`` requests ``run(i)``; the collector is off while
    they run (a collection would land on whichever request triggers it)."""
    times = []
    clock = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        for i in range(n):
            start = clock()
            run(i)
            times.append(clock() - start)
    finally:
        gc.enable()
    return times


def kvtier_times(traces: list[list[bytes]], capacity: int, row: str) -> list[float]:
    """Request times of kvtier's manager; ``row`` is a policy name, or one with
    ``AT_ONCE`` (its history aged in one call)."""
    policy = row.removesuffix(AT_ONCE)
    mgr, contexts = kvtier_setup(traces, capacity, policy, 1, True)
    if row.endswith(AT_ONCE):
        mgr.policy.age_in_steps = False  # type: ignore[attr-defined]
    return request_times(lambda i: kvtier_request(mgr, contexts[i], traces[i]), len(traces))


def vllm_times(traces: list[list[bytes]], capacity: int) -> list[float]:
    """Request times of vLLM's manager with its default policy."""
    from vllm.v1.kv_offload.base import LookupResult

    mgr, contexts, vtraces = vllm_setup(traces, capacity, VLLM_DEFAULT_POLICY, 1, True)
    hit = LookupResult.HIT
    return request_times(lambda i: vllm_request(mgr, contexts[i], vtraces[i], hit),
                         len(traces))


def tail(times: list[float]) -> dict[str, float]:
    """p50, p99.9 and the longest request, in microseconds."""
    ordered = sorted(times)
    last = len(ordered) - 1
    return {"p50_us": ordered[last // 2] * 1e6,
            "p999_us": ordered[min(last, round(0.999 * last))] * 1e6,
            "max_us": ordered[last] * 1e6}


def rows_for(policies: list[str]) -> list[str]:
    """Each policy, and after it its ``AT_ONCE`` row when it ages in steps."""
    rows = []
    for policy in policies:
        rows.append(policy)
        if hasattr(policy_class(policy), "AGE_STEP"):
            rows.append(policy + AT_ONCE)
    return rows


def measure(traces: list[list[bytes]], capacity: int, rows: list[str],
            repeats: int) -> dict[str, dict[str, float]]:
    """Median over ``repeats`` of each row's tail (rows rotate between repeats)."""
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    for r in range(repeats):
        for row in rows[r % len(rows):] + rows[:r % len(rows)]:
            if row == "vllm":
                times = vllm_times(traces, capacity)
            else:
                times = kvtier_times(traces, capacity, row)
            runs[row].append(tail(times))
    return {row: {name: statistics.median(t[name] for t in got) for name in got[0]}
            for row, got in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int_list, default="16384,65536",
                        help="cache sizes in blocks, comma-separated (default: %(default)s)")
    parser.add_argument("--policy", type=policy_list, default="lru,default",
                        help="kvtier eviction policies, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--kind", default="rag", choices=sorted(KINDS),
                        help="generated workload, one of kvtier generate's kinds "
                        "(default: %(default)s)")
    parser.add_argument("--requests", type=positive_int, default=120_000,
                        help="requests of the generated workload (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the generated workload (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each row, the median kept (default: %(default)s)")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false",
                        help="leave out vLLM's manager")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per row instead of a table")
    args = parser.parse_args(argv)
    traces = [[kvtier.block_key(h) for h in req.hash_ids]
              for req in generate(args.kind, args.seed, args.requests)]
    rows = rows_for(args.policy) + (["vllm"] if args.vllm else [])
    if not args.json:
        keys = sum(map(len, traces))
        print(f"{args.kind} seed {args.seed}: {len(traces)} requests, {keys} keys; "
              f"median of {args.repeats}")
        print(f"{'manager':22} {'blocks':>7} {'p50 us':>8} {'p99.9 us':>9} {'max ms':>7}")
    for capacity in args.capacity:
        for row, t in measure(traces, capacity, rows, args.repeats).items():
            label = f"vLLM {VLLM_DEFAULT_POLICY}" if row == "vllm" else f"kvtier {row}"
            result: dict[str, Any] = {"manager": label, "capacity": capacity,
                                      **{k: round(v, 1) for k, v in t.items()}}
            if args.json:
                print(json.dumps(result))
            else:
                print(f"{label:22} {capacity:>7} {t['p50_us']:>8.0f} "
                      f"{t['p999_us']:>9.0f} {t['max_us'] / 1e3:>7.1f}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
