"""The Redis tier's close, TLS errors and existence probes, against real redis-server processes
(loopback only). Each test names the fault it guards against."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import KVLayout, TierUnavailableError
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.redis_server import RedisServer, find_server_binary

redis = pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
from test_tier_redis import _make_tls_files  # noqa: E402

from kvtier.tiers.redis_tier import RedisTier  # noqa: E402

NS = KVLayout("review-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 16 * 1024


def payload(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A server this test may pause or restart."""
    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary")
    srv = RedisServer().start()
    yield srv
    srv.resume()
    srv.close()


def clients_of(srv: RedisServer) -> int:
    """Connections the server holds, the asking one excluded."""
    with redis.Redis.from_url(srv.url) as raw:
        return len(raw.client_list()) - 1


# ---------------------------------------------------------------- close() races
def test_close_ends_a_call_hung_in_a_stopped_server_quietly(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # An I/O thread left in a hung server when the cascade shuts down: close()
    # shuts its socket. The call used to count that as the server failing (an
    # error, a breaker failure: with failure_threshold=1 the breaker opened and
    # warned "circuit breaker open ... Bad file descriptor" on a closed tier).
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.redis_tier")
    tier = RedisTier(server.url, NS, failure_threshold=1, socket_timeout_s=5.0,
                     enable_events=True)
    k = block_key(1)
    assert tier.put([(k, payload(1))]) == [True]
    server.pause()
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(tier.get([k])))
    thread.start()
    time.sleep(0.3)  # the GET is in the stopped server now
    started = time.monotonic()
    tier.close()
    thread.join(5)
    assert time.monotonic() - started < 1.0  # not the 5 s socket timeout
    assert got == [[None]]
    s = tier.stats()
    assert (s["errors"], s["breaker_state"], s["breaker_opens"]) == (0, "closed", 0)
    assert "breaker open" not in caplog.text
    assert [e.kind for e in tier.take_events()] == ["stored"]


def test_a_call_that_close_overtakes_builds_no_new_client(server: RedisServer) -> None:
    # A call past its closed-check when close() ran built a fresh client
    # (close() had set it to None): a closed tier served the call, and the new
    # client's pooled connection stayed open for the tier's life.
    tier = RedisTier(server.url, NS, failure_threshold=1, reset_timeout_s=1.0)
    k = block_key(2)
    assert tier.put([(k, payload(2))]) == [True]
    tier.breaker.record_failure(tier.breaker.allow())  # open: the next call is the probe
    assert tier.breaker.state == "open"
    inside, go_on = threading.Event(), threading.Event()

    def gated_clock() -> float:  # holds the probe inside breaker.allow()
        inside.set()
        go_on.wait(5)
        return time.monotonic() + 60.0

    tier.breaker._clock = gated_clock
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(tier.contains([k])))
    thread.start()
    assert inside.wait(5)
    tier.close()
    go_on.set()
    thread.join(5)
    assert got == [[False]]  # a closed tier answers nothing
    assert tier._client_obj is None
    assert clients_of(server) == 0
    with pytest.raises(ValueError, match="closed"):
        tier.check()  # did build a client again, and PINGed the server


def test_calls_racing_close_raise_nothing_but_the_closed_error(server: RedisServer) -> None:
    # redis-py, its socket shut from another thread, can fail with
    # AttributeError ('NoneType' object has no attribute 'readline'): that
    # escaped get/contains/put as a bare AttributeError.
    unexpected: list[str] = []
    for trial in range(25):
        tier = RedisTier(server.url, NS, failure_threshold=1000)
        keys = [block_key(trial * 10 + i) for i in range(4)]
        tier.put([(k, payload(i)) for i, k in enumerate(keys)])

        def work(tier: RedisTier = tier, keys: list[bytes] = keys) -> None:
            while True:
                try:
                    tier.contains(keys)
                    tier.get(keys)
                except ValueError as exc:
                    if "closed" not in str(exc):
                        unexpected.append(repr(exc))
                    return
                except Exception as exc:
                    unexpected.append(repr(exc))
                    return

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.01)
        tier.close()
        for t in threads:
            t.join(5)
        assert tier.stats()["breaker_opens"] == 0
    assert unexpected == []


# ---------------------------------------------------------------- TLS mismatch
def test_rediss_to_a_plain_port_says_tls_not_just_timeout(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The plain server waits for a command, the TLS client for a handshake:
    # the error was "Timeout connecting to server", of a server that was up.
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.redis_tier")
    tier = RedisTier(f"rediss://127.0.0.1:{server.port}/0", NS, failure_threshold=1,
                     connect_timeout_s=0.3, password_env=None)
    assert tier.contains([block_key(1)]) == [False]
    assert "breaker open" in caplog.text and "does not speak TLS" in caplog.text
    with pytest.raises(TierUnavailableError, match="does not speak TLS"):
        tier.check()
    tier.close()


def test_redis_to_a_tls_port_names_rediss(tmp_path: Path) -> None:
    # A TLS port drops plain commands: "Connection reset by peer" alone.
    tls = _make_tls_files(tmp_path)
    try:
        srv = RedisServer(tls=tls).start()
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    try:
        tier = RedisTier(f"redis://127.0.0.1:{srv.port}/0", NS, password_env=None)
        with pytest.raises(TierUnavailableError, match="must start with rediss://"):
            tier.check()
        tier.close()
    finally:
        srv.close()


# ---------------------------------------------------------------- probes
def _settle(c: TierCascade, key: bytes, ctx: RequestContext) -> LookupResult:
    """Look ``key`` up, ending steps while it answers RETRY / HIT_PENDING."""
    deadline = time.monotonic() + 10
    while (r := c.lookup_one(key, ctx)) in (LookupResult.RETRY, LookupResult.HIT_PENDING):
        assert time.monotonic() < deadline
        c.on_schedule_end()
        time.sleep(0.005)
    return r


def _store(c: TierCascade, region: SlotRegion, ids: list[int], ctx: RequestContext) -> None:
    keys = [block_key(i) for i in ids]
    out = c.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    for i, slot in zip(ids, out.block_ids, strict=True):
        region.slot_array(slot)[:] = payload(i)
    c.complete_store(keys, ctx)


def test_a_block_the_cascade_wrote_to_redis_is_not_hidden_by_an_older_probe(
    server: RedisServer, tmp_path: Path
) -> None:
    # The probe answer "not in Redis" given before the cascade wrote the block
    # there was trusted for probe_ttl_s: a block evicted from the CPU tier soon
    # after its first lookup was recomputed, not promoted (as write-on-evict
    # does to every block of a small CPU tier).
    tier = RedisTier(server.url, NS)
    with SlotRegion.create("review-probe", 2, SIZE, shm_dir=tmp_path) as region:
        c = TierCascade(OffloadManager(2, policy="lru"), region, [tier], probe_ttl_s=60)
        try:
            k = block_key(1)
            ctx = RequestContext("first")
            assert _settle(c, k, ctx) is LookupResult.MISS  # asked: not in Redis
            _store(c, region, [1], ctx)  # computed, written through to Redis
            c.on_request_finished(ctx)
            assert c.drain() and tier.contains([k]) == [True]
            other = RequestContext("other")
            _store(c, region, [2, 3], other)  # the CPU tier evicts the block
            c.on_request_finished(other)
            assert c.drain() and not c.manager.contains(k)
            again = RequestContext("again")
            assert _settle(c, k, again) is LookupResult.HIT  # promoted from Redis
            spec = c.manager.prepare_load([k], again)
            assert np.array_equal(region.slot_array(spec.block_ids[0]), payload(1))
            c.manager.complete_load([k], again)
            assert c.source_of(k) == "redis"
        finally:
            c.shutdown()


def test_a_probe_answer_ages_from_when_redis_gave_it_not_when_it_was_applied(
    server: RedisServer, tmp_path: Path
) -> None:
    # A probe's answer was stamped when the scheduler applied it: one that sat
    # unapplied (no scheduling step: the asking request went away) was trusted
    # as fresh for probe_ttl_s more. A block gone from Redis meanwhile was then
    # promoted, failed, and was refused as "failed recently" for failure_ttl_s.
    tier = RedisTier(server.url, NS)
    k = block_key(7)
    assert tier.put([(k, payload(7))]) == [True]
    with SlotRegion.create("review-age", 2, SIZE, shm_dir=tmp_path) as region:
        c = TierCascade(OffloadManager(2), region, [tier], probe_ttl_s=0.3)
        try:
            assert c.lookup_one(k, RequestContext("gone")) is LookupResult.RETRY
            c.on_schedule_end()  # the probe goes out, answers "there", and waits
            time.sleep(0.1)
            assert tier.delete([k]) == 1  # another engine's Redis drops the block
            time.sleep(0.4)  # the answer is older than probe_ttl_s now
            assert _settle(c, k, RequestContext("later")) is LookupResult.MISS
            s = c.stats()
            assert (s["promotions"], s["promotion_failures"], s["failed_keys"]) == (0, 0, 0)
        finally:
            c.shutdown()
