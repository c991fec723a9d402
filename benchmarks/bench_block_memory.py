"""Metadata bytes per resident block of an OffloadManager at a million blocks.

Fills ``OffloadManager(num_blocks=N, policy=P)`` with N resident ready blocks
the way vLLM drives it: requests of ``--request-blocks`` blocks, keys as vLLM
makes them (a 32-byte block hash and a 4-byte KV group, ``kvtier.block_key``),
each block's end-token position recorded in the request's context, one
lookup / store / complete / finish per request. It reports the memory the
manager holds per block, everything it keeps alive included (the key objects,
the slot ids, the block table, the policy's lists and counts):

* ``filled``: right after the N-th block was stored;
* ``full``: after one more request, which evicts (the state a full cache
  stays in: the policy has built the lists its evictions scan);
* ``churned`` (``--churn M``): after M more blocks passed through the full
  cache (ghost lists and frequency history filled, dict tables resized).

``tracemalloc`` measures the bytes Python allocated (the figure the target is
about); each policy also runs once more without it and reports the growth of
the resident set (``/proc/self/statm``), which adds the allocator's rounding
(a 69-byte key takes an 80-byte block) and its free lists. Every run is a
fresh interpreter.

    python benchmarks/bench_block_memory.py [--blocks 1000000] [--policies lru,arc,default]
        [--request-blocks 32] [--churn 0] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator

from bench_manager import kvtier_request

import kvtier

TARGET = 200
"""Bytes per resident block the manager should stay within (issue 10)."""
BLOCK_TOKENS = 16
"""vLLM's default block size: block j of a request ends at token (j + 1) * 16."""


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def block_keys(first: int, n: int) -> list[bytes]:
    """``n`` distinct keys: a 32-byte hash (of the block's serial) + group 0."""
    return [kvtier.block_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0)
            for i in range(first, first + n)]


def requests(first: int, blocks: int, per_request: int) -> Iterator[list[bytes]]:
    """Keys of consecutive requests covering ``blocks`` new blocks."""
    for start in range(first, first + blocks, per_request):
        yield block_keys(start, min(per_request, first + blocks - start))


def serve(mgr: kvtier.OffloadManager, keys: list[bytes], serial: int) -> None:
    """One request as vLLM makes it: positions, lookup, store, complete, finish."""
    ctx = kvtier.RequestContext(f"req-{serial}")
    ctx.set_positions(keys, BLOCK_TOKENS, BLOCK_TOKENS)
    kvtier_request(mgr, ctx, keys)


def measure(policy: str, blocks: int, per_request: int, churn: int,
            traced: bool) -> dict[str, object]:
    """One run in this process: bytes per block at each stage."""
    gc.collect()
    if traced:
        tracemalloc.start()
    base_rss = rss_bytes()
    base = tracemalloc.get_traced_memory()[0] if traced else 0

    def held() -> int:
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - base if traced
                else rss_bytes() - base_rss)

    mgr = kvtier.OffloadManager(blocks, policy=policy, max_leases_per_request=blocks,
                                max_leased_blocks=blocks)
    out: dict[str, object] = {"policy": policy, "blocks": blocks,
                              "measure": "tracemalloc" if traced else "rss"}
    start = time.perf_counter()
    serial = 0
    for keys in requests(0, blocks, per_request):
        serve(mgr, keys, serial)
        serial += 1
    out["fill_s"] = round(time.perf_counter() - start, 1)
    resident = mgr.stats()["resident"]
    out["filled"] = round(held() / resident, 1)
    serve(mgr, block_keys(blocks, 1), serial)  # one more block: one eviction
    serial += 1
    out["full"] = round(held() / mgr.stats()["resident"], 1)
    if churn:
        for keys in requests(blocks + 1, churn, per_request):
            serve(mgr, keys, serial)
            serial += 1
        out["churn"] = churn
        out["churned"] = round(held() / mgr.stats()["resident"], 1)
    out["resident"] = mgr.stats()["resident"]
    sizes = getattr(mgr.policy, "sizes", None)  # (older kvtier: PLFU only)
    out["policy_sizes"] = dict(sizes()) if callable(sizes) else {"resident": len(mgr.policy)}
    if traced:
        tracemalloc.stop()
    return out


def _child(args: argparse.Namespace, policy: str, traced: bool) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--one", policy, "--blocks", str(args.blocks),
           "--request-blocks", str(args.request_blocks), "--churn", str(args.churn)]
    if traced:
        cmd.append("--traced")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000,
                        help="cache size: resident blocks to fill it with (default: %(default)s)")
    parser.add_argument("--policies", default="lru,arc,default",
                        help="eviction policies to measure, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--request-blocks", type=int, default=32,
                        help="blocks per request as the cache is filled and churned "
                        "(default: %(default)s)")
    parser.add_argument("--churn", type=int, default=0,
                        help="blocks to pass through the full cache before the last figure")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.blocks, args.request_blocks, args.churn,
                                 args.traced)))
        return 0
    if not args.json:
        extra = f" {'churned':>8}" if args.churn else ""
        print(f"bytes per resident block, {args.blocks:,} blocks (target <= {TARGET})")
        print(f"{'policy':8} {'measure':12} {'filled':>7} {'full':>7}{extra}")
    over = False
    for policy in args.policies.split(","):
        for traced in (True, False):
            r = _child(args, policy, traced)
            if traced and float(r["full"]) > TARGET:  # type: ignore[arg-type]
                over = True
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                extra = f" {r['churned']:>8}" if args.churn else ""
                print(f"{policy:8} {r['measure']:12} {r['filled']:>7} {r['full']:>7}{extra}",
                      flush=True)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
