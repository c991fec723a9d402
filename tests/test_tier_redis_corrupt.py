"""The Redis tier's corrupt values and breaker verdicts, against real redis-server
processes (loopback only). Each test names the fault it guards against and
fails on the code before its fix."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import KVLayout, blockfile
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.redis_server import RedisServer, find_server_binary

redis = pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
from kvtier.tiers.redis_tier import RedisTier  # noqa: E402

NS = KVLayout("leftovers-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 4096
READER_PW = "r3ader-Pw-6c1e"
READER_COMMANDS = ("get", "set", "exists", "ping", "info")
"""An ACL user that may read and write kvtier's keys but not delete them."""


def payload(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def rkey(key: bytes) -> bytes:
    return f"kvtier:{NS}:".encode() + key


def start(**kw: object) -> RedisServer:
    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary")
    return RedisServer(**kw).start()  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A server this test may stop, restart or pause."""
    srv = start()
    yield srv
    srv.resume()
    srv.close()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[object]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def corrupt_value(raw: object, key: bytes) -> bytes:
    """Flip one payload bit of ``key``'s stored value; return the new value."""
    value = raw.get(rkey(key))  # type: ignore[attr-defined]
    raw.setrange(rkey(key), len(value) - 5, bytes([value[-5] ^ 1]))  # type: ignore[attr-defined]
    return raw.get(rkey(key))  # type: ignore[attr-defined]


# ------------------------------------------------- (1) corrupt, counted truthfully
def test_a_corrupt_value_the_server_will_not_delete_is_not_counted_removed() -> None:
    # Fault: a corrupt value was counted 'corrupt' (values removed) and reported
    # by a 'corrupt' event (a vLLM 'removed' event) whatever its delete did:
    # here the ACL user may not DEL (nor EVAL), the value stays in Redis, yet
    # the tier said it was gone.
    srv = start(config={"user": " ".join(["reader", "on", f">{READER_PW}", "~kvtier:*",
                                          "-@all", *(f"+{c}" for c in READER_COMMANDS)])})
    try:
        tier = RedisTier(f"redis://reader:{READER_PW}@127.0.0.1:{srv.port}/0", NS,
                         enable_events=True, password_env=None)
        raw = redis.Redis.from_url(srv.url)
        k = block_key(1)
        assert tier.put([(k, payload(1))]) == [True]
        tier.take_events()
        bad = corrupt_value(raw, k)
        for reads in (1, 2):
            assert tier.get_into([k], [np.zeros(SIZE, np.uint8)]) == [None]
            assert raw.get(rkey(k)) == bad  # still there: DEL was refused
            s = tier.stats()
            assert s["corrupt"] == 0, "counted as removed"
            assert (s["corrupt_kept"], s["misses"], s["hits"]) == (reads, reads, 0)
            assert s["errors"] >= reads  # the refused deletes
        assert tier.take_events() == []  # no 'removed' for a key Redis still holds
        assert s["breaker_state"] == "closed"  # a refusal is an answer
        tier.close()
        raw.close()
    finally:
        srv.close()


def test_a_corrupt_value_the_open_breaker_kept_is_not_counted_removed(
    server: RedisServer, raw: object
) -> None:
    # The same fault when the delete never reaches the server: the server
    # stopped answering between the GET and the delete, the breaker opened,
    # and the delete was refused; the value stayed, counted and reported removed.
    tier = RedisTier(server.url, NS, enable_events=True, socket_timeout_s=0.3,
                     failure_threshold=1, reset_timeout_s=0.2)
    k = block_key(2)
    assert tier.put([(k, payload(2))]) == [True]
    tier.take_events()
    bad = corrupt_value(raw, k)
    drop = tier._drop_corrupt

    def server_fails_first(corrupt: list) -> None:
        server.pause()
        try:
            assert tier.contains([k]) == [False]  # times out: the breaker opens
        finally:
            server.resume()
        drop(corrupt)

    tier._drop_corrupt = server_fails_first  # type: ignore[method-assign]
    assert tier.get([k]) == [None]
    s = tier.stats()
    assert s["corrupt"] == 0, "counted as removed"
    assert (s["corrupt_kept"], s["rejected"]) == (1, 1)
    assert [e.kind for e in tier.take_events()] == ["breaker_open"]
    assert raw.get(rkey(k)) == bad  # type: ignore[attr-defined]
    tier._drop_corrupt = drop  # type: ignore[method-assign]
    time.sleep(0.3)  # past reset_timeout_s: the next call probes
    assert tier.get([k]) == [None]  # found again, and removed this time
    s = tier.stats()
    assert (s["corrupt"], s["corrupt_kept"]) == (1, 1)
    events = [(e.kind, e.keys) for e in tier.take_events()]
    assert events == [("breaker_closed", ()), ("corrupt", (k,))]
    assert raw.exists(rkey(k)) == 0  # type: ignore[attr-defined]
    tier.close()


def test_a_corrupt_value_replaced_by_a_fresh_copy_is_not_reported_removed(
    server: RedisServer, raw: object
) -> None:
    # Fault: when another engine stored a fresh copy between this engine's GET
    # and its delete, the script kept the copy but the tier still emitted a
    # 'corrupt' event, which reaches vLLM's KV events as 'removed' for a key
    # Redis holds.
    tier = RedisTier(server.url, NS, enable_events=True)
    other = RedisTier(server.url, NS)
    k = block_key(3)
    assert tier.put([(k, payload(3))]) == [True]
    tier.take_events()
    corrupt_value(raw, k)
    drop = tier._drop_corrupt

    def another_engine_stores_first(corrupt: list) -> None:
        assert other.put([(k, payload(3))]) == [True]
        drop(corrupt)

    tier._drop_corrupt = another_engine_stores_first  # type: ignore[method-assign]
    assert tier.get([k]) == [None]
    assert tier.stats()["corrupt"] == 1  # the bad value is gone: overwritten
    assert tier.take_events() == []
    got = other.get([k])[0]
    assert got is not None and bytes(got) == payload(3).tobytes()
    tier.close()
    other.close()


# ------------------------------------------------- (2) wrong length, never a hit
def test_a_valid_value_of_the_wrong_length_is_corrupt_not_a_hit(
    server: RedisServer, raw: object, tmp_path: Path
) -> None:
    # Fault: a value with a valid checksum but a payload shorter than the CPU
    # slot was counted a tier hit (get_into returned its length), then the
    # promotion refused it: the tier's hit metric counted a block no request
    # got, the value stayed, and every later lookup promoted and failed again.
    tier = RedisTier(server.url, NS, enable_events=True)
    k = block_key(4)
    short = payload(4, SIZE - 512)
    raw.set(rkey(k), blockfile.encode(NS.encode(), k, short))  # type: ignore[attr-defined]
    with SlotRegion.create("leftover-len", 2, SIZE, shm_dir=tmp_path) as region:
        c = TierCascade(OffloadManager(2), region, [tier])
        try:
            ctx = RequestContext("r")
            deadline = time.monotonic() + 10
            while (r := c.lookup_one(k, ctx)) in (LookupResult.RETRY,
                                                  LookupResult.HIT_PENDING):
                assert time.monotonic() < deadline
                c.on_schedule_end()
                time.sleep(0.005)
            assert r is LookupResult.MISS
            assert c.stats()["promotion_failures"] == 1
            s = c.tier_stats()["redis"]
            assert (s["hits"], s["misses"], s["corrupt"]) == (0, 1, 1)
        finally:
            c.shutdown()
    events = tier.take_events()
    assert [(e.kind, e.detail) for e in events] == [("corrupt", "wrong length")]
    assert raw.exists(rkey(k)) == 0  # type: ignore[attr-defined]


def test_get_into_takes_only_a_payload_that_fills_its_buffer(
    server: RedisServer, raw: object
) -> None:
    tier = RedisTier(server.url, NS)
    keys = [block_key(5), block_key(6)]
    assert tier.put([(keys[0], payload(5)), (keys[1], payload(6, SIZE // 2))]) == [True] * 2
    bufs = [np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)]
    assert tier.get_into(keys, bufs) == [SIZE, None]
    assert np.array_equal(bufs[0], payload(5))
    s = tier.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (1, 1, 1)
    tier.close()


# ------------------------------------------------- (3) a stale success
def test_a_call_let_through_before_the_breaker_opened_does_not_close_it(
    server: RedisServer,
) -> None:
    # Fault: a call let through while the breaker was closed, which succeeded
    # after other calls had opened it, closed it again: one slow call that got
    # through undid the breaker, and every caller went back to a server that
    # had just failed failure_threshold calls in a row.
    tier = RedisTier(server.url, NS, failure_threshold=2, reset_timeout_s=30.0,
                     socket_timeout_s=0.5, connect_timeout_s=0.5, enable_events=True)
    inside, go_on = threading.Event(), threading.Event()
    got: list[object] = []

    def slow_ping(client: object) -> object:
        inside.set()
        go_on.wait(10)
        return client.ping()  # type: ignore[attr-defined]

    slow = threading.Thread(target=lambda: got.append(tier._run(slow_ping)))
    slow.start()
    try:
        assert inside.wait(10)  # let through while closed
        server.stop()
        for i in range(2):
            assert tier.contains([block_key(i)]) == [False]
        assert tier.breaker.state == "open"
        server.restart()
        go_on.set()
        slow.join(10)
        assert got == [True]  # the slow call succeeded...
        assert tier.breaker.state == "open"  # ...and proves nothing about later calls
        assert not tier.available
        assert [e.kind for e in tier.take_events()] == ["breaker_open"]
    finally:
        go_on.set()
        slow.join(10)
        tier.close()


def test_only_a_verdict_of_the_current_epoch_moves_the_breaker() -> None:
    # The permits behind the fix above: a lost probe's late failure does not
    # fail its successor's epoch, a call from before the opening neither
    # closes nor re-opens it, and a verdict needs the permit allow() gave.
    from kvtier.tiers.breaker import CircuitBreaker

    now = [0.0]
    b = CircuitBreaker(1, 1.0, 8.0, clock=lambda: now[0])
    before = b.allow()
    assert before
    b.record_failure(b.allow())
    assert b.state == "open"
    now[0] += 1.0
    lost = b.allow()  # a probe that hangs
    now[0] += 1.0
    probe = b.allow()  # given up on: the next caller probes
    assert lost and probe and b.state == "half_open"
    b.record_failure(lost)  # stale: the current probe decides
    b.record_success(before)  # stale
    assert b.state == "half_open"
    b.record_success(probe)
    assert b.state == "closed"
    b.record_failure(lost)  # stale: no failure of the new closed epoch
    assert b.state == "closed"
    with pytest.raises(TypeError, match="Permit"):
        b.record_success(True)  # type: ignore[arg-type]
