"""Manager time for one long prompt offered chunk by chunk (chunked prefill).

vLLM offers a long prompt's blocks as it computes them, one chunk per
scheduler step. Each offer after the first keeps the request's earlier blocks
ranked above the new ones (``keep_ahead``), which touches all of them: the
time per chunk grows with the blocks offered so far. This offers one request
of ``--blocks`` keys in chunks of ``--chunk`` through a fresh manager per
policy (capacity 4 x the request) and reports, per policy, the total
milliseconds, the first and last chunk's, and microseconds per key; the best
of ``--repeats`` runs.

    python benchmarks/bench_long_prompt.py [--blocks 8192] [--chunk 128]
        [--policies lru,default] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtier import OffloadManager, RequestContext, block_key


def offer_in_chunks(policy: str, blocks: int, chunk: int) -> list[float]:
    """Seconds of each chunk's prepare/complete store, then of the finish."""
    mgr = OffloadManager(4 * blocks, policy=policy)
    keys = [block_key(i) for i in range(blocks)]
    ctx = RequestContext("long")
    ctx.set_positions(keys, 16, 16)
    times = []
    for start in range(0, blocks, chunk):
        t0 = time.perf_counter()
        out = mgr.prepare_store(keys[start:start + chunk], ctx)
        if out is not None:
            mgr.complete_store(out.keys_to_store, ctx)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mgr.on_request_finished(ctx)
    times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--policies", default="lru,default")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.chunk < 1 or args.repeats < 1:
        ap.error("--blocks, --chunk and --repeats must be >= 1")
    print(f"{'policy':8s} {'total ms':>9s} {'first ms':>9s} {'last ms':>8s} {'us/key':>7s}")
    for policy in args.policies.split(","):
        runs = [offer_in_chunks(policy, args.blocks, args.chunk) for _ in range(args.repeats)]
        best = min(runs, key=sum)
        total = sum(best)
        print(f"{policy:8s} {total * 1e3:9.1f} {best[0] * 1e3:9.2f} {best[-2] * 1e3:8.2f} "
              f"{total / args.blocks * 1e6:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
