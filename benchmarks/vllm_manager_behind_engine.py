"""vLLM's own CPU offloading manager behind the lab's engine, beside kvtier's
manager with the same policy: the CPU-tier hit ratio of each.

The lab's engine model (``kvtier replay --gpu-blocks``: vLLM's prefix cache,
its scheduler with ``--gpu-batch-tokens``) drives vLLM's
``CPUOffloadingManager`` through a small shim with the calls it makes to
kvtier's manager (vLLM asks key by key; the shim stops at the first miss, as
vLLM's connector does), then kvtier's ``OffloadManager`` with the policy of
the same name. Same requests, same engine; a difference is the managers'.

    python benchmarks/vllm_manager_behind_engine.py TRACE [--gpu-blocks 500]
        [--gpu-batch-tokens 2048] [--capacity 1000,4000] [--policy lru,arc]
        [--limit-requests N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.replay.behind_engine import (
    KvtierConnector,
    replay_behind_engine,
    run_engine,
    served_requests,
)
from kvtier.replay.serving_trace import ENGINE_BLOCK_TOKENS
from kvtier.replay.trace import iter_trace
from kvtier.request import RequestContext
from kvtier.results import PrepareStoreOutput

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class VllmManagerShim:
    """The ``OffloadManager`` calls the lab's connector makes, answered by
    vLLM's ``CPUOffloadingManager``. Owns one vLLM ``ReqContext`` per request
    from its first call to its finish."""

    def __init__(self, capacity: int, policy: str) -> None:
        from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.manager = CPUOffloadingManager(capacity, cache_policy=policy, store_threshold=1)
        self._key, self._context, self._hit = OffloadKey, ReqContext, LookupResult.HIT
        self._contexts: dict[str, Any] = {}

    def _ctx(self, ctx: RequestContext) -> Any:
        theirs = self._contexts.get(ctx.req_id)
        if theirs is None:
            theirs = self._contexts[ctx.req_id] = self._context(ctx.req_id)
            self.manager.on_new_request(theirs)
        return theirs

    def _keys(self, keys: Sequence[bytes]) -> list[Any]:
        return [self._key(k) for k in keys]

    def lookup(self, keys: Sequence[bytes], ctx: RequestContext) -> int:
        theirs = self._ctx(ctx)
        return sum(1 for _ in itertools.takewhile(
            lambda k: self.manager.lookup(self._key(k), theirs) is self._hit, keys))

    def prepare_load(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        self.manager.prepare_load(self._keys(keys), self._ctx(ctx))

    def complete_load(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        self.manager.complete_load(self._keys(keys), self._ctx(ctx))

    def prepare_store(self, keys: Sequence[bytes],
                      ctx: RequestContext) -> PrepareStoreOutput | None:
        out = self.manager.prepare_store(self._keys(keys), self._ctx(ctx))
        if out is None:
            return None
        return PrepareStoreOutput([bytes(k) for k in out.keys_to_store], [], [])

    def complete_store(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        self.manager.complete_store(self._keys(keys), self._ctx(ctx))

    def on_request_finished(self, ctx: RequestContext) -> None:
        theirs = self._contexts.pop(ctx.req_id, None)
        if theirs is not None:
            self.manager.on_request_finished(theirs)


def vllm_hit_ratio(requests: Sequence[Any], capacity: int, policy: str, gpu_blocks: int,
                   batch_tokens: int | None) -> float:
    """CPU-tier hit ratio (tokens) of vLLM's manager behind the lab's engine."""
    connector = KvtierConnector(VllmManagerShim(capacity, policy),  # type: ignore[arg-type]
                                requests, ENGINE_BLOCK_TOKENS)
    run_engine(requests, connector, gpu_blocks=gpu_blocks, batch_tokens=batch_tokens)
    counts = connector.counts
    return counts.hit_tokens / counts.query_tokens if counts.query_tokens else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="Mooncake trace to replay (JSON lines)")
    ap.add_argument("--gpu-blocks", type=int, default=500,
                    help="blocks of the engine's prefix cache in front of the managers "
                    "(default: %(default)s)")
    ap.add_argument("--gpu-batch-tokens", type=int, default=None,
                    help="vLLM's scheduler over a queue that never runs dry (default: "
                    "one request at a time)")
    ap.add_argument("--capacity", default="1000,4000",
                    help="CPU tier sizes in blocks, comma-separated (default: %(default)s)")
    ap.add_argument("--policy", default="lru,arc",
                    help="cache policies, comma-separated, each a name both vLLM and "
                    "kvtier know (default: %(default)s)")
    ap.add_argument("--limit-requests", type=int, default=None,
                    help="replay only this many of the trace's first requests "
                    "(default: all)")
    args = ap.parse_args(argv)
    trace = list(itertools.islice(iter_trace(args.trace), args.limit_requests))
    requests = served_requests(trace)
    print(f"{'policy':6} {'blocks':>7} {'vLLM':>7} {'kvtier':>7} {'kvtier/vLLM':>11}")
    for policy in args.policy.split(","):
        for capacity in (int(c) for c in args.capacity.split(",")):
            theirs = vllm_hit_ratio(requests, capacity, policy, args.gpu_blocks,
                                    args.gpu_batch_tokens)
            ours = replay_behind_engine(requests, capacity, policy, gpu_blocks=args.gpu_blocks,
                                        batch_tokens=args.gpu_batch_tokens).hit_ratio
            ratio = f"{ours / theirs:11.3f}" if theirs else f"{'-':>11}"
            print(f"{policy:6} {capacity:>7} {theirs:7.4f} {ours:7.4f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
