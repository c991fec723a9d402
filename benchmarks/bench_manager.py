"""Manager cost per offered key: kvtier's OffloadManager against vLLM's CPUOffloadingManager.

Each kvtier policy is paired with vLLM's policy of the same name, or, for a
policy vLLM has not (``plfu``, ``default``), with vLLM's own default, LRU:
the manager a deployment would run instead (the ``vs`` column). Both
managers replay the bundled Mooncake trace the same way (per request:
lookup of the leading hits, load, store offer of all blocks, completion,
finish), interleaved in one process so machine noise hits both alike. Request
contexts, with every block's end-token position recorded as vLLM's scheduler
does (``--no-positions`` leaves them out), are built before the clock starts,
so the figure is manager seconds per offered key: median of ``--repeats``
runs, and the ratio kvtier / vLLM. With ``--lockstep`` the two managers
replay side by side instead, each request going to both in turn (the order
alternating), each manager's calls timed alone: a change in the machine's
speed between whole runs then falls on both alike
(``bench_policy_cost.py --lockstep``).

    python benchmarks/bench_manager.py [--policy lru,arc,default] [--repeats 3]
        [--lockstep] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.argtypes import int_list, policy_list, positive_int
from kvtier.replay.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "mooncake" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512


def kvtier_setup(
    traces: list[list[bytes]], capacity: int, policy: str, threshold: int, positions: bool
) -> tuple[kvtier.OffloadManager, list[kvtier.RequestContext]]:
    """A kvtier manager and one request context per trace line (positions recorded)."""
    mgr = kvtier.OffloadManager(capacity, policy=policy, store_threshold=threshold)
    contexts = [kvtier.RequestContext(str(i)) for i in range(len(traces))]
    if positions:
        for ctx, keys in zip(contexts, traces, strict=True):
            ctx.set_positions(keys, BLOCK_TOKENS, BLOCK_TOKENS)
    return mgr, contexts


def load_store_finish(mgr: Any, ctx: Any, keys: list[Any], hits: int) -> int:
    """The rest of a request once its ``hits`` leading hits are known, the
    same calls on either manager: load them, offer every block, finish."""
    if hits:
        mgr.prepare_load(keys[:hits], ctx)
        mgr.complete_load(keys[:hits], ctx)
    out = mgr.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    return hits


def kvtier_request(mgr: kvtier.OffloadManager, ctx: kvtier.RequestContext,
                   keys: list[bytes]) -> int:
    """One request through kvtier's manager; the leading hits."""
    return load_store_finish(mgr, ctx, keys, mgr.lookup(keys, ctx))


def run_kvtier(
    traces: list[list[bytes]], capacity: int, policy: str, threshold: int, positions: bool
) -> tuple[float, float]:
    """Replay through kvtier; return (microseconds per offered key, hit ratio)."""
    mgr, contexts = kvtier_setup(traces, capacity, policy, threshold, positions)
    hits = offered = 0
    start = time.perf_counter()
    for ctx, keys in zip(contexts, traces, strict=True):
        hits += kvtier_request(mgr, ctx, keys)
        offered += len(keys)
    return (time.perf_counter() - start) / offered * 1e6, hits / offered


def vllm_setup(
    traces: list[list[bytes]], capacity: int, policy: str, threshold: int, positions: bool
) -> tuple[Any, list[Any], list[list[Any]]]:
    """vLLM's ``CPUOffloadingManager``, one ``ReqContext`` per trace line and
    the keys as vLLM's key type (positions recorded as its scheduler does)."""
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    vtraces = [[OffloadKey(k) for k in keys] for keys in traces]
    mgr = CPUOffloadingManager(capacity, cache_policy=policy, store_threshold=threshold)
    contexts = [ReqContext(str(i)) for i in range(len(traces))]
    if positions:
        for ctx, keys in zip(contexts, vtraces, strict=True):
            for j, key in enumerate(keys):
                ctx.set_offload_key_position(key, (j + 1) * BLOCK_TOKENS)
    return mgr, contexts, vtraces


def vllm_request(mgr: Any, ctx: Any, keys: list[Any], hit: Any) -> int:
    """One request through vLLM's manager (per-key lookup, its API); the
    leading hits. ``hit``: ``LookupResult.HIT``, looked up once by the caller."""
    mgr.on_new_request(ctx)
    n = 0
    for key in keys:
        if mgr.lookup(key, ctx) is not hit:
            break
        n += 1
    return load_store_finish(mgr, ctx, keys, n)


def run_vllm(
    traces: list[list[bytes]], capacity: int, policy: str, threshold: int, positions: bool
) -> tuple[float, float]:
    """Replay through vLLM's manager; same return as :func:`run_kvtier`."""
    from vllm.v1.kv_offload.base import LookupResult

    mgr, contexts, vtraces = vllm_setup(traces, capacity, policy, threshold, positions)
    hit = LookupResult.HIT
    hits = offered = 0
    start = time.perf_counter()
    for ctx, keys in zip(contexts, vtraces, strict=True):
        hits += vllm_request(mgr, ctx, keys, hit)
        offered += len(keys)
    return (time.perf_counter() - start) / offered * 1e6, hits / offered


def run_lockstep(
    traces: list[list[bytes]], capacity: int, policy: str, theirs_policy: str,
    threshold: int, positions: bool
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Replay through both managers side by side, request by request; return
    kvtier's and vLLM's (microseconds per offered key, hit ratio)."""
    from vllm.v1.kv_offload.base import LookupResult

    kmgr, kcontexts = kvtier_setup(traces, capacity, policy, threshold, positions)
    vmgr, vcontexts, vtraces = vllm_setup(traces, capacity, theirs_policy, threshold, positions)
    hit, clock = LookupResult.HIT, time.perf_counter
    seconds, hits = [0.0, 0.0], [0, 0]
    for i, keys in enumerate(traces):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            start = clock()
            if side == 0:
                hits[0] += kvtier_request(kmgr, kcontexts[i], keys)
            else:
                hits[1] += vllm_request(vmgr, vcontexts[i], vtraces[i], hit)
            seconds[side] += clock() - start
    offered = sum(map(len, traces))
    ours, theirs = ((t / offered * 1e6, h / offered) for t, h in zip(seconds, hits, strict=True))
    return ours, theirs


VLLM_DEFAULT_POLICY = "lru"
"""vLLM's ``CPUOffloadingManager`` cache policy when none is configured."""


def vllm_counterpart(policy: str) -> str:
    """vLLM's cache policy to pair with kvtier's ``policy``: the same name
    when vLLM has it, else vLLM's default."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    try:
        CachePolicyFactory.get_cache_policy_cls(policy)
    except ValueError:
        return VLLM_DEFAULT_POLICY
    return policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help="Mooncake trace to replay (default: the bundled "
                        "conversation trace)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each row, the median reported (default: %(default)s)")
    parser.add_argument("--capacity", type=int_list, default="1000,4000,16000",
                        help="cache sizes in blocks, comma-separated (default: %(default)s)")
    parser.add_argument("--policy", type=policy_list, default="lru,arc",
                        help="kvtier eviction policies, comma-separated, each paired with "
                        "vLLM's of that name or its default LRU (default: %(default)s)")
    parser.add_argument("--store-threshold", type=int_list, default="1,2",
                        help="offers a block needs before either manager stores it, "
                        "comma-separated (default: %(default)s)")
    parser.add_argument("--lockstep", action="store_true",
                        help="replay both managers side by side, request by request")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per row instead of a table")
    parser.add_argument("--no-positions", dest="positions", action="store_false",
                        help="leave the blocks' end-token positions out of the "
                        "request contexts")
    args = parser.parse_args(argv)
    policies: list[str] = args.policy
    pairs = {policy: vllm_counterpart(policy) for policy in policies}
    try:
        requests = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        parser.error(f"--trace: {exc}")
    traces = [[kvtier.block_key(h) for h in req.hash_ids] for req in requests]
    if not args.json:
        print(f"{'policy':7} {'vs':4} {'blocks':>7} {'thr':>3} {'kvtier us/key':>14} "
              f"{'vLLM us/key':>12} {'ratio':>6}  hit kvtier/vLLM")
    for policy, theirs_policy in pairs.items():
        for capacity in args.capacity:
            for threshold in args.store_threshold:
                ours, theirs = [], []
                for _ in range(args.repeats):  # interleaved: noise hits both
                    if args.lockstep:
                        k_run, v_run = run_lockstep(traces, capacity, policy, theirs_policy,
                                                    threshold, args.positions)
                    else:
                        k_run = run_kvtier(traces, capacity, policy, threshold, args.positions)
                        v_run = run_vllm(traces, capacity, theirs_policy, threshold,
                                         args.positions)
                    ours.append(k_run)
                    theirs.append(v_run)
                k_us = statistics.median(r[0] for r in ours)
                v_us = statistics.median(r[0] for r in theirs)
                row = {
                    "policy": policy, "vllm_policy": theirs_policy,
                    "capacity": capacity, "store_threshold": threshold,
                    "kvtier_us_per_key": round(k_us, 3), "vllm_us_per_key": round(v_us, 3),
                    "ratio": round(k_us / v_us, 3),
                    "kvtier_hit_ratio": round(ours[0][1], 4),
                    "vllm_hit_ratio": round(theirs[0][1], 4),
                }
                if args.json:
                    print(json.dumps(row))
                else:
                    print(f"{policy:7} {theirs_policy:4} {capacity:>7} {threshold:>3} "
                          f"{k_us:>14.3f} {v_us:>12.3f} "
                          f"{k_us / v_us:>6.2f}  {ours[0][1]:.4f}/{theirs[0][1]:.4f}")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
