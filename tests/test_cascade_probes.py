"""Asynchronous, batched existence checks of a remote tier (ExistenceProbes and
TierCascade's RETRY answers), against a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import KVLayout, Tier
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.delegating import DelegatingTier
from kvtier.tiers.probes import ExistenceProbes
from kvtier.tiers.redis_server import RedisServer, find_server_binary

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 4096
SLOTS = 8
HIT, MISS = LookupResult.HIT, LookupResult.MISS
PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


# ---------------------------------------------------------------- ExistenceProbes
def test_unknown_keys_are_batched_once_and_answered() -> None:
    p = ExistenceProbes(ttl_s=10, timeout_s=10)
    assert p.ask(b"a", 0.0) is None and p.ask(b"b", 0.0) is None
    assert p.ask(b"a", 0.1) is None  # asked again: still one question
    assert p.take_batch() == [b"a", b"b"]
    assert p.take_batch() == []  # in flight: not handed out twice
    p.answer([b"a", b"b"], [True, False], 0.2)
    assert p.ask(b"a", 0.3) is True and p.ask(b"b", 0.3) is False


def test_answers_expire_and_unanswered_questions_time_out() -> None:
    p = ExistenceProbes(ttl_s=1.0, timeout_s=2.0)
    p.ask(b"a", 0.0)
    p.answer(p.take_batch(), [False], 0.5)
    assert p.ask(b"a", 1.4) is False
    assert p.ask(b"a", 1.6) is None  # expired: asked again
    assert p.take_batch() == [b"a"]
    assert p.ask(b"a", 3.0) is None
    assert p.ask(b"a", 3.7) is False  # no answer for 2 s: not found, no endless RETRY


def test_probe_memory_is_bounded() -> None:
    p = ExistenceProbes(max_keys=4)
    for i in range(10):
        p.ask(bytes([i]), 0.0)
    assert len(p) == 4
    assert p.take_batch() == [bytes([i]) for i in range(6, 10)]
    p.answer([b"zz"], [True], 1.0)  # unknown key: ignored
    assert len(p) == 4


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"timeout_s": -1}, {"max_keys": 0}])
def test_bad_probe_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ExistenceProbes(**kwargs)


# ---------------------------------------------------------------- with Redis
class Spy(DelegatingTier):
    """A real tier, with its calls counted (each ``contains``/``get_into`` batch)."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.contains_calls: list[int] = []
        self.get_calls: list[int] = []

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self.contains_calls.append(len(keys))
        return self.inner.contains(keys)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self.get_calls.append(len(keys))
        return self.inner.get_into(keys, buffers)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    pytest.importorskip("redis")
    srv = RedisServer().start()
    yield srv
    srv.close()


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("probe-test", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def redis_spy(server: RedisServer) -> Spy:
    from kvtier.tiers.redis_tier import RedisTier

    return Spy(RedisTier(server.url, NS, socket_timeout_s=2.0, connect_timeout_s=1.0))


def seed(tier: Tier, ids: Sequence[int]) -> None:
    assert all(tier.put([(block_key(i), payload(i)) for i in ids]))


def wait_idle(c: TierCascade) -> None:
    deadline = time.monotonic() + 10
    while c.busy() or c._probes_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.002)
        c.poll()


def test_remote_lookups_cost_one_round_trip_per_step(
    region: SlotRegion, server: RedisServer
) -> None:
    spy = redis_spy(server)
    seed(spy.inner, [0, 1, 2])
    c = TierCascade(OffloadManager(SLOTS), region, [spy])
    try:
        ctx = RequestContext("r")
        keys = [block_key(i) for i in range(4)]  # 3 in Redis, then one nowhere
        assert [c.lookup_one(k, ctx) for k in keys] == [RETRY] * 4
        assert spy.contains_calls == []  # nothing asked on the scheduler thread
        c.on_schedule_end()
        wait_idle(c)
        assert spy.contains_calls == [4]  # one batch for the step
        assert [c.lookup_one(k, ctx) for k in keys] == [PENDING] * 3 + [MISS]
        c.on_schedule_end()
        wait_idle(c)
        assert spy.get_calls == [3]  # the step's promotions: one batch
        assert [c.lookup_one(k, ctx) for k in keys[:3]] == [HIT] * 3
        spec = c.manager.prepare_load(keys[:3], ctx)
        for i, slot in enumerate(spec.block_ids):
            assert np.array_equal(region.slot_array(slot), payload(i))
        c.manager.complete_load(keys[:3], ctx)
        assert c.stats()["probes"] == 4 and c.stats()["promotions"] == 3
    finally:
        c.shutdown()


def test_a_paused_server_gives_misses_not_endless_retries(
    region: SlotRegion, server: RedisServer
) -> None:
    spy = redis_spy(server)
    seed(spy.inner, [0])
    c = TierCascade(OffloadManager(SLOTS), region, [spy], probe_timeout_s=0.2)
    server.pause()
    try:
        ctx, k = RequestContext("r"), block_key(0)
        assert c.lookup_one(k, ctx) is RETRY
        c.on_schedule_end()
        started = time.monotonic()
        while (r := c.lookup_one(k, ctx)) is RETRY:
            assert time.monotonic() - started < 1.5, "RETRY past the probe timeout"
            c.on_schedule_end()
            time.sleep(0.01)
        assert r is MISS
        assert time.monotonic() - started < 1.5  # well before the 2 s socket timeout
    finally:
        server.resume()
        c.shutdown()


def test_sync_lookups_ask_on_the_callers_thread(region: SlotRegion, server: RedisServer) -> None:
    spy = redis_spy(server)
    seed(spy.inner, [0])
    c = TierCascade(OffloadManager(SLOTS), region, [spy], async_lookups=False)
    try:
        ctx = RequestContext("r")
        assert c.lookup_one(block_key(0), ctx) is PENDING
        assert c.lookup_one(block_key(9), ctx) is MISS
        assert spy.contains_calls == [1, 1]
        assert c.drain()
        assert c.lookup_one(block_key(0), ctx) is HIT
    finally:
        c.shutdown()
