"""kvtier's metrics and events as vLLM 0.32 reads them: the
adapter's stats objects (``OffloadingConnectorStats``) step after step, the
way vLLM's scheduler asks for blocks, real redis-server and disk tiers; no
engine is started."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")

SLOTS = 16
SIZE = 4096


def _key(i: int, group: int = 0) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), group)


class Reported:
    """What Prometheus would show: every step's stats summed (counters), as
    vLLM's ``OffloadPromMetrics.observe`` applies them."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def step(self, adapter: Any) -> None:
        data = adapter.get_stats().data
        for name, by_labels in data["data"].items():
            value = by_labels.get(())
            if data["types"][name] == "counter" and isinstance(value, int | float):
                self.totals[name] = self.totals.get(name, 0) + value

    def __getitem__(self, name: str) -> float:
        return self.totals.get("vllm:kvtier_" + name, 0)


def _prefix_scan(adapter: Any, keys: list[Any], req: Any) -> None:
    """How vLLM 0.32's scheduler asks for a full-attention group's blocks
    (``OffloadingConnectorScheduler._maximal_prefix_lookup``): key by key,
    on through HIT, HIT_PENDING and RETRY, stopping at the first MISS."""
    from vllm.v1.kv_offload.base import LookupResult

    for key in keys:
        if adapter.lookup(key, req) is LookupResult.MISS:
            break


def _window_scan(adapter: Any, keys: list[Any], req: Any) -> None:
    """How it asks for a sliding-window group's blocks
    (``_sliding_window_lookup``): from the last key back, not stopping at a
    MISS until it has a window of hits."""
    for key in reversed(keys):
        adapter.lookup(key, req)


def _stored(adapter: Any, keys: list[Any]) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    req = ReqContext(req_id="writer")
    out = adapter.prepare_store(keys, req)
    assert out is not None and list(out.keys_to_store) == keys
    adapter.complete_store(keys, req)
    adapter.on_request_finished(req)


# ------------------------------------------------------------ hits and misses
def test_a_hybrid_models_waiting_request_is_counted_once() -> None:
    """README: "hits and misses count blocks once per request: vLLM asks
    again for a waiting request's blocks at every scheduler step, and those
    repeats are not counted". A model with two KV groups is asked group by
    group; the count kept only the last key that missed, which alternated
    between the groups' first misses, so every step counted both again."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier import OffloadManager
    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(SLOTS, policy="lru"))
    groups = [[_key(i, g) for i in range(4)] for g in range(2)]
    _stored(adapter, groups[0][:2] + groups[1][:2])
    reported = Reported()
    reported.step(adapter)
    req = ReqContext(req_id="waiting")
    for _ in range(5):  # a request waiting for GPU room, asked every step
        for keys in groups:
            _prefix_scan(adapter, keys, req)
        reported.step(adapter)
    assert reported["hits"] == 4  # two blocks of each group
    assert reported["misses"] == 2  # each group's first missing block, once


def test_a_sliding_window_groups_misses_are_counted_once() -> None:
    """A sliding-window group is asked from its last block back, every key
    of a missing run: each step counted every block again."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier import OffloadManager
    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(SLOTS, policy="lru"))
    keys = [_key(i, 1) for i in range(4)]
    reported = Reported()
    req = ReqContext(req_id="waiting")
    for _ in range(3):
        _window_scan(adapter, keys, req)
        reported.step(adapter)
    assert reported["misses"] == 4
    assert reported["hits"] == 0




def test_blocks_waiting_on_a_slow_redis_are_counted_once(
    tmp_path: Path, redis_server: Any
) -> None:
    """With Redis (asynchronous lookups, the default) a block not in CPU
    answers RETRY until Redis answers, and vLLM goes on to the request's next
    block: each step asked every block again, and each was counted again as
    a CPU miss while Redis was slow."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.redis_tier import RedisTier
    from kvtier.vllm.adapter import KVTierOffloadingManager

    ns = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
    redis = RedisTier(redis_server.url, ns, socket_timeout_s=2.0, connect_timeout_s=1.0)
    with SlotRegion.create("metrics-review", SLOTS, SIZE, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(SLOTS), region, [redis], probe_timeout_s=0.3)
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        redis_server.pause()
        try:
            keys = [_key(i) for i in range(4)]
            req = ReqContext(req_id="waiting")
            reported = Reported()
            steps = 0
            started = time.monotonic()
            while time.monotonic() - started < 0.6:  # past the probe timeout: misses
                _prefix_scan(adapter, keys, req)
                adapter.on_schedule_end(None)
                reported.step(adapter)
                steps += 1
                time.sleep(0.02)
            assert steps > 3
            assert reported["misses"] == len(keys)
        finally:
            redis_server.resume()
            adapter.shutdown()


# ------------------------------------------------------------ events
def test_taking_events_does_not_wait_for_a_slow_tensor_parallel_put(
    redis_server: Any
) -> None:
    """vLLM's scheduler takes the tiers' events at every step, on its own
    thread. A tensor-parallel engine's tier (``RankedTier``, with KV events
    enabled) held its events lock for the whole of an I/O thread's put, so
    while Redis hung the scheduler waited for that put to time out on every
    rank: the engine stalled in the event path the cascade keeps off the
    scheduler elsewhere. The events settled so far come at once; the put's
    own come with a later step."""
    import threading

    import numpy as np

    from kvtier import block_key
    from kvtier.tiers import KVLayout
    from kvtier.tiers.ranks import RankedTier, ShardedSlot
    from kvtier.tiers.redis_tier import RedisTier

    layouts = [KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r, tp_size=2) for r in range(2)]
    ranks = [RedisTier(redis_server.url, layout.namespace(), socket_timeout_s=1.0,
                       connect_timeout_s=1.0, enable_events=True) for layout in layouts]
    tier = RankedTier(ranks, enable_events=True)
    block = ShardedSlot([np.full(SIZE, r, np.uint8) for r in range(2)])
    try:
        assert tier.put([(block_key(0), block)]) == [True]
        assert [e.kind for e in tier.take_events()] == ["stored"]
        redis_server.pause()
        put = threading.Thread(target=tier.put, args=([(block_key(1), block)],))
        put.start()
        time.sleep(0.2)  # the put is waiting on the paused server
        started = time.monotonic()
        tier.take_events()
        waited = time.monotonic() - started
        redis_server.resume()
        put.join(10)
        assert waited < 0.2, f"take_events waited {waited:.2f} s for an I/O thread's put"
    finally:
        redis_server.resume()
        tier.close()
