"""Scheduler-thread cost of lookups that reach a Redis tier: synchronous vs batched.

A vLLM scheduler looks a request's blocks up one at a time, on the thread that
schedules every request of the engine. With a Redis tier below the CPU tier,
``TierCascade(async_lookups=False)`` asks Redis on that thread (one round trip
per key that misses the CPU tier); the default asks through batched probes on
an I/O thread and answers RETRY meanwhile (one round trip per step for all
requests, the request waits a step or two).

Workload: ``--requests`` requests of ``--blocks`` block keys each, scanned the
way vLLM's scheduler scans (stop at the first MISS; HIT_PENDING / RETRY defer
the request to the next step), steps repeated until every request is settled;
between steps the benchmark waits for the cascade's I/O (the engine's model
step), which is not counted. Two cases: ``hit`` (every block is in Redis) and
``miss`` (none is). Reported per case and mode, median of ``--repeats``:
scheduler-thread milliseconds (time inside ``lookup_one`` and
``on_schedule_end``), steps until settled, and the sync/async time ratio.

    python benchmarks/bench_lookup.py [--requests 16] [--blocks 64] [--url redis://...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import KVLayout
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.redis_server import RedisServer
from kvtier.tiers.redis_tier import RedisTier

SLOT_BYTES = 4096
NS = KVLayout("bench-lookup", "uint8", 16, 1, 1, 1).namespace()
_SETTLED = (LookupResult.HIT, LookupResult.MISS)


@dataclass
class Row:
    case: str
    mode: str
    scheduler_ms: float
    steps: int
    ratio_to_async: float = 0.0


def _scan(c: TierCascade, keys: list[bytes], ctx: RequestContext) -> bool:
    """One vLLM-style prefix scan; True when every answer was final."""
    final = True
    for key in keys:
        r = c.lookup_one(key, ctx)
        if r is LookupResult.MISS:
            break
        if r not in _SETTLED:
            final = False
    return final


def run_once(url: str, requests: list[list[bytes]], async_lookups: bool,
             region: SlotRegion) -> tuple[float, int]:
    """(scheduler-thread seconds, steps) to settle every request once."""
    capacity = region.num_slots
    tier = RedisTier(url, NS)
    c = TierCascade(OffloadManager(capacity, max_leases_per_request=capacity,
                                   max_leased_blocks=capacity),
                    region, [tier], async_lookups=async_lookups)
    try:
        ctxs = [RequestContext(f"r{i}") for i in range(len(requests))]
        open_reqs = list(range(len(requests)))
        spent, steps = 0.0, 0
        while open_reqs:
            steps += 1
            t0 = time.perf_counter()
            open_reqs = [i for i in open_reqs if not _scan(c, requests[i], ctxs[i])]
            c.on_schedule_end()
            spent += time.perf_counter() - t0
            while c.busy() or c._probes_in_flight:  # the model step: not counted
                time.sleep(0.0002)
                c.poll()
        return spent, steps
    finally:
        c.shutdown()


def bench(url: str, n_requests: int, blocks: int, repeats: int) -> list[Row]:
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, SlotRegion.create(
            "bench-lookup", n_requests * blocks + 8, SLOT_BYTES, shm_dir=tmp) as region:
        seeder = RedisTier(url, NS)
        for case in ("hit", "miss"):
            base = int(rng.integers(1 << 40))
            requests = [[block_key(base + r * blocks + i) for i in range(blocks)]
                        for r in range(n_requests)]
            if case == "hit":
                payload = np.zeros(SLOT_BYTES, np.uint8)
                seeder.put([(k, payload) for keys in requests for k in keys])
            times: dict[bool, list[float]] = {True: [], False: []}
            steps: dict[bool, int] = {}
            for i in range(repeats):
                for mode in ((True, False) if i % 2 == 0 else (False, True)):
                    spent, n = run_once(url, requests, mode, region)
                    times[mode].append(spent)
                    steps[mode] = n
            med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
            for mode in (False, True):
                rows.append(Row(case, "async" if mode else "sync", round(med[mode], 3),
                                steps[mode], round(med[mode] / med[True], 2)))
        seeder.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16,
                    help="requests of the workload, scanned at every step until settled "
                    "(default: %(default)s)")
    ap.add_argument("--blocks", type=int, default=64,
                    help="block keys per request (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs of each case and mode, the median reported "
                    "(default: %(default)s)")
    ap.add_argument("--url", help="an existing Redis/Valkey (default: start a local one)")
    ap.add_argument("--json", action="store_true",
                    help="print the rows as one JSON list instead of a table")
    args = ap.parse_args()
    server = None if args.url else RedisServer().start()
    url = args.url if server is None else server.url
    try:
        rows = bench(url, args.requests, args.blocks, args.repeats)
    finally:
        if server is not None:
            server.close()
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    print(f"{args.requests} requests x {args.blocks} blocks, median of {args.repeats}")
    print(f"{'case':<6}{'mode':<7}{'scheduler ms':>13}{'steps':>7}{'vs async':>10}")
    for r in rows:
        print(f"{r.case:<6}{r.mode:<7}{r.scheduler_ms:>13.3f}{r.steps:>7}{r.ratio_to_async:>10.2f}")


if __name__ == "__main__":
    main()
