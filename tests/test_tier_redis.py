"""RedisTier against real redis-server processes started here (loopback only, no mocks)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import block_key
from kvtier.tiers import (
    CircuitBreaker,
    KVLayout,
    TierConfigError,
    TierUnavailableError,
)
from kvtier.tiers.blockfile import MAGIC
from kvtier.tiers.redis_server import RedisServer, TLSFiles, find_server_binary, free_port

redis = pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
from kvtier.tiers.redis_tier import RedisTier, redact_url  # noqa: E402

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
OTHER_NS = KVLayout("test-model", "bfloat16", 32, 2, 2, 64).namespace()
SIZE = 64 * 1024
PASSWORD = "s3cret-Pw-7f1d"
WORKER = str(Path(__file__).parent / "helpers" / "tier_worker.py")
REPO = str(Path(__file__).parent.parent)
NO_SERVER = (
    "no redis-server or valkey-server binary: `make venv` installs Debian's redis-server "
    "(apt-get, as root), or point KVTIER_REDIS_SERVER at one"
)


def payload(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def start(**kw: object) -> RedisServer:
    if find_server_binary() is None:
        pytest.skip(NO_SERVER)
    return RedisServer(**kw).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    srv = start(password=PASSWORD)
    yield srv
    srv.close()


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server this test may kill, restart or pause."""
    srv = start()
    yield srv
    srv.close()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[object]:
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    yield client
    client.close()


def make(url: str, **kw: object) -> RedisTier:
    kw.setdefault("enable_events", True)
    return RedisTier(url, NS, **kw)  # type: ignore[arg-type]


def rkey(key: bytes, ns: str = NS) -> bytes:
    return f"kvtier:{ns}:".encode() + key


# ---------------------------------------------------------------- data path
def test_round_trip(server: RedisServer, raw: object) -> None:
    tier = make(server.url)
    keys = [block_key(i) for i in range(5)]
    assert tier.put([(k, payload(i)) for i, k in enumerate(keys)]) == [True] * 5
    assert tier.contains([*keys, block_key(99)]) == [True] * 5 + [False]
    bufs = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert tier.get_into(keys, bufs) == [SIZE] * 5
    assert all(np.array_equal(b, payload(i)) for i, b in enumerate(bufs))
    assert bytes(tier.get([keys[0]])[0]) == payload(0).tobytes()  # type: ignore[arg-type]
    assert tier.get([block_key(99)]) == [None]
    value = raw.get(rkey(keys[0]))  # type: ignore[attr-defined]
    assert value.startswith(MAGIC) and value.endswith(payload(0).tobytes())
    assert raw.ttl(rkey(keys[0])) == -1  # type: ignore[attr-defined]
    s = tier.stats()
    assert (s["hits"], s["misses"], s["stores"], s["dropped_stores"]) == (6, 1, 5, 0)
    assert s["breaker_state"] == "closed"
    assert tier.delete(keys[:2]) == 2 and tier.contains(keys[:2]) == [False, False]
    kinds = [(e.kind, len(e.keys)) for e in tier.take_events()]
    assert kinds == [("stored", 5), ("removed", 2)]
    tier.close()


def test_batches_are_split(server: RedisServer, raw: object) -> None:
    tier = make(server.url, max_batch_keys=3, max_batch_bytes=2 * SIZE)
    keys = [block_key(i) for i in range(10)]
    assert tier.put([(k, payload(i)) for i, k in enumerate(keys)]) == [True] * 10
    assert tier.contains(keys) == [True] * 10
    got = tier.get(keys)
    assert all(bytes(g) == payload(i).tobytes() for i, g in enumerate(got))  # type: ignore[arg-type]


def test_reads_hold_one_batch_of_values_at_a_time(server: RedisServer, raw: object) -> None:
    # max_batch_bytes bounds what a read holds too: 16 blocks of 1 MiB come
    # back in pipelines of one block each, not all at once
    import tracemalloc

    size = 1 << 20
    tier = make(server.url, max_batch_bytes=size)
    keys = [block_key(500 + i) for i in range(16)]
    assert tier.put([(k, payload(i, size)) for i, k in enumerate(keys)]) == [True] * 16
    bufs = [np.zeros(size, np.uint8) for _ in keys]
    tracemalloc.start()
    try:
        assert tier.get_into(keys, bufs) == [size] * 16
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * size, f"one read held {peak >> 20} MiB"
    assert all(np.array_equal(b, payload(i, size)) for i, b in enumerate(bufs))
    tier.close()


def test_a_server_answering_garbage_opens_the_breaker() -> None:
    # another service on the port (or a proxy answering junk): its replies
    # are no Redis protocol, a transport failure like a dropped connection
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_junk() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    while conn.recv(65536):
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    threading.Thread(target=answer_junk, daemon=True).start()
    tier = make(f"redis://127.0.0.1:{port}/0", socket_timeout_s=1.0)
    try:
        for i in range(10):
            assert tier.get([block_key(i)]) == [None]
        assert not tier.available and tier.stats()["breaker_opens"] == 1
    finally:
        tier.close()
        listener.close()


def test_ttl_and_namespaces(server: RedisServer, raw: object) -> None:
    tier = make(server.url, ttl_s=30)
    tier.put([(block_key(1), payload(1))])
    assert 0 < raw.pttl(rkey(block_key(1))) <= 30_000  # type: ignore[attr-defined]
    other = RedisTier(server.url, OTHER_NS)
    assert other.contains([block_key(1)]) == [False] and other.get([block_key(1)]) == [None]
    # A value copied under the other namespace's key is refused by its header.
    raw.set(rkey(block_key(1), OTHER_NS), raw.get(rkey(block_key(1))))  # type: ignore[attr-defined]
    assert other.get([block_key(1)]) == [None]
    assert other.stats()["corrupt"] == 1


def test_a_fresh_copy_stored_after_the_corrupt_read_is_kept(
        server: RedisServer, raw: object, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, other = make(server.url), make(server.url)
    key = block_key(1)
    tier.put([(key, payload(1))])
    value = raw.get(rkey(key))  # type: ignore[attr-defined]
    raw.setrange(rkey(key), len(value) - 5, bytes([value[-5] ^ 1]))  # type: ignore[attr-defined]
    drop = tier._drop_corrupt

    def another_engine_stores_first(corrupt: list) -> None:
        other.put([(key, payload(1))])  # lands between this engine's GET and DEL
        drop(corrupt)

    monkeypatch.setattr(tier, "_drop_corrupt", another_engine_stores_first)
    assert tier.get([key]) == [None] and tier.stats()["corrupt"] == 1
    assert raw.get(rkey(key)) == value  # type: ignore[attr-defined]
    assert bytes(other.get([key])[0]) == payload(1).tobytes()  # type: ignore[arg-type]


def test_corrupted_value_is_a_miss_and_deleted(server: RedisServer, raw: object) -> None:
    tier = make(server.url)
    keys = [block_key(i) for i in range(3)]
    tier.put([(k, payload(i)) for i, k in enumerate(keys)])
    tier.take_events()
    value = raw.get(rkey(keys[0]))  # type: ignore[attr-defined]
    raw.setrange(rkey(keys[0]), len(value) - 5, bytes([value[-5] ^ 1]))  # type: ignore[attr-defined]
    raw.set(rkey(keys[1]), b"not a kvtier value, long enough for a header" * 2)  # type: ignore[attr-defined]
    bufs = [np.zeros(SIZE, np.uint8) for _ in keys]
    assert tier.get_into(keys, bufs) == [None, None, SIZE]
    assert raw.exists(rkey(keys[0]), rkey(keys[1])) == 0  # type: ignore[attr-defined]
    s = tier.stats()
    assert (s["corrupt"], s["misses"], s["hits"]) == (2, 2, 1)
    events = tier.take_events()
    assert [(e.kind, e.keys) for e in events] == [("corrupt", (keys[0],)), ("corrupt", (keys[1],))]
    assert events[0].detail == "checksum mismatch" and events[1].detail == "bad magic"


def test_two_processes_share_blocks(server: RedisServer, raw: object) -> None:
    cfg = {"url": server.url, "namespace": NS, "size": SIZE}
    out = subprocess.run(
        [sys.executable, WORKER, "redis-write", json.dumps({**cfg, "ids": list(range(10))})],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    tier = make(server.url)
    got = tier.get([block_key(i) for i in range(10)])
    assert all(bytes(g) == payload(i).tobytes() for i, g in enumerate(got))  # type: ignore[arg-type]
    tier.put([(block_key(i), payload(i)) for i in range(10, 20)])
    out = subprocess.run(
        [sys.executable, WORKER, "redis-read", json.dumps({**cfg, "ids": list(range(10, 20))})],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["hits"] == 10 and res["bad"] == 0


def test_threads_share_one_tier(server: RedisServer, raw: object) -> None:
    tier = make(server.url)
    bad: list[int] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(60):
            i = int(rng.integers(0, 16))
            if rng.random() < 0.5:
                tier.put([(block_key(i), payload(i))])
            else:
                got = tier.get([block_key(i)])[0]
                if got is not None and bytes(got) != payload(i).tobytes():
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and tier.stats()["errors"] == 0 and tier.stats()["corrupt"] == 0


# ---------------------------------------------------------------- failures
def test_server_killed_then_restarted(own_server: RedisServer) -> None:
    tier = make(own_server.url, failure_threshold=2, reset_timeout_s=0.3,
                socket_timeout_s=0.5, connect_timeout_s=0.5)
    assert tier.put([(block_key(1), payload(1))]) == [True]
    assert tier.get([block_key(1)])[0] is not None
    own_server.stop(kill=True)
    started = time.monotonic()
    for _ in range(5):
        assert tier.get([block_key(1)]) == [None]
        assert tier.contains([block_key(1)]) == [False]
    assert tier.put([(block_key(2), payload(2))]) == [False]
    assert time.monotonic() - started < 3.0  # refused fast, no retry storms
    s = tier.stats()
    assert s["breaker_state"] == "open" and s["breaker_opens"] == 1
    assert s["rejected"] > 0 and s["errors"] >= 2 and s["dropped_stores"] == 1
    assert not tier.available
    own_server.start()  # same port, empty (no persistence)
    time.sleep(0.35)
    assert tier.available
    assert tier.put([(block_key(3), payload(3))]) == [True]  # the probe succeeds
    assert tier.stats()["breaker_state"] == "closed"
    assert bytes(tier.get([block_key(3)])[0]) == payload(3).tobytes()  # type: ignore[arg-type]
    assert tier.get([block_key(1)]) == [None]  # lost with the server's memory
    kinds = [e.kind for e in tier.take_events()]
    assert "breaker_open" in kinds and "breaker_closed" in kinds
    assert kinds.index("breaker_open") < kinds.index("breaker_closed")


def test_the_availability_gauge_stays_at_0_until_a_probe_succeeds(
        own_server: RedisServer, tmp_path: Path) -> None:
    # Fault: ``vllm:kvtier_tier_available`` read ``tier.available``, which is
    # True once the breaker has been open for reset_timeout_s (a call may go
    # as the probe). While the engine only decoded (no new prompt, no tier
    # call to probe with) each step's stats said 1 a second into the outage,
    # with the server still down, and the alert on the gauge cleared.
    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers.cascade import TierCascade

    tier = make(own_server.url, failure_threshold=1, reset_timeout_s=0.05,
                socket_timeout_s=0.5, connect_timeout_s=0.5)
    with SlotRegion.create("gauge-breaker", 4, 4096, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(4), region, [tier], own_tiers=False)
        try:
            assert cascade.tier_stats()["redis"]["available"] is True
            own_server.stop(kill=True)
            assert tier.contains([block_key(1)]) == [False]  # fails: the breaker opens
            assert cascade.tier_stats()["redis"]["available"] is False
            time.sleep(0.1)  # past reset_timeout_s, and no call since
            assert tier.available  # the next call may probe...
            assert not tier.serving  # ...but nothing says the server is back
            assert cascade.tier_stats()["redis"]["available"] is False
            own_server.start()
            assert tier.contains([block_key(1)]) == [False]  # the probe succeeds
            assert tier.serving and cascade.tier_stats()["redis"]["available"] is True
        finally:
            cascade.shutdown()
            tier.close()


def test_slow_server_times_out_and_recovers(own_server: RedisServer) -> None:
    tier = make(own_server.url, failure_threshold=2, reset_timeout_s=0.3,
                socket_timeout_s=0.3)
    tier.put([(block_key(1), payload(1))])
    own_server.pause()  # accepts connections, answers nothing
    try:
        started = time.monotonic()
        for _ in range(6):
            assert tier.get([block_key(1)]) == [None]
        elapsed = time.monotonic() - started
        assert elapsed < 2.0, f"6 calls took {elapsed:.2f} s while the server hung"
        assert tier.stats()["breaker_state"] == "open"
    finally:
        own_server.resume()
    time.sleep(0.35)
    assert tier.get([block_key(1)])[0] is not None
    assert tier.stats()["breaker_state"] == "closed"


def test_full_server_drops_stores_and_keeps_serving(own_server: RedisServer) -> None:
    own_server.stop()
    own_server.config.update({"maxmemory": "3mb", "maxmemory-policy": "noeviction"})
    own_server.start()
    tier = make(own_server.url)
    ok = tier.put([(block_key(i), payload(i, 512 * 1024)) for i in range(12)])
    assert True in ok and False in ok
    s = tier.stats()
    assert s["dropped_stores"] == ok.count(False) and s["breaker_state"] == "closed"
    stored = [block_key(i) for i, good in enumerate(ok) if good]
    assert None not in tier.get(stored)
    info = tier.check()
    assert info["maxmemory_policy"] == "noeviction" and info["maxmemory"] == 3 << 20


# ---------------------------------------------------------------- auth and TLS
def test_auth_by_url_and_env(auth_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    host = f"127.0.0.1:{auth_server.port}/0"
    by_url = make(f"redis://:{PASSWORD}@{host}")
    assert by_url.put([(block_key(1), payload(1))]) == [True]
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", PASSWORD)
    by_env = make(f"redis://{host}")
    assert by_env.get([block_key(1)])[0] is not None
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD")
    monkeypatch.setenv("MY_REDIS_PW", PASSWORD)
    named = make(f"redis://{host}", password_env="MY_REDIS_PW")
    assert named.contains([block_key(1)]) == [True]


def test_a_full_connection_pool_is_a_miss_not_a_server_failure(
        server: RedisServer, raw: object) -> None:
    # max_connections is this client's own limit: more concurrent callers than
    # connections must not open the breaker on a healthy server
    tier = make(server.url, client_options={"max_connections": 1})
    keys = [block_key(i) for i in range(8)]
    assert all(tier.put([(k, payload(i)) for i, k in enumerate(keys)]))
    barrier = threading.Barrier(4)

    def read() -> None:
        barrier.wait()
        for _ in range(20):
            tier.get(keys)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = tier.stats()
    assert s["breaker_opens"] == 0 and s["errors"] == 0 and tier.available
    assert all(v is not None for v in tier.get(keys))
    tier.close()


def test_bad_password_fails_closed_and_is_never_shown(
    auth_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wr0ng-Pw-secret"
    url = f"redis://default:{wrong}@127.0.0.1:{auth_server.port}/0"
    tier = make(url, failure_threshold=2, password_env=None)
    for _ in range(3):
        assert tier.get([block_key(1)]) == [None]
        assert tier.put([(block_key(1), payload(1))]) == [False]
    assert tier.stats()["breaker_state"] == "open"
    with pytest.raises(TierUnavailableError) as info:
        tier.check()
    no_auth = make(f"redis://127.0.0.1:{auth_server.port}/0", password_env=None)
    assert no_auth.get([block_key(1)]) == [None]
    shown = " ".join([caplog.text, repr(tier), str(info.value), str(tier.stats()),
                      str(tier.take_events()), tier.safe_url])
    assert wrong not in shown and PASSWORD not in shown
    assert "***" in repr(tier)


def _make_tls_files(directory: Path) -> TLSFiles:
    if shutil.which("openssl") is None:
        pytest.skip("openssl (to make test certificates) is not installed")
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["openssl", "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=kvtier-test-ca"],
        ["openssl", "req", *ec, "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", str(ext)],
    ):
        subprocess.run(cmd, cwd=directory, check=True, capture_output=True, timeout=60)
    return TLSFiles(directory / "server.crt", directory / "server.key", directory / "ca.crt")


def test_tls_with_auth(tmp_path: Path) -> None:
    tls = _make_tls_files(tmp_path)
    try:
        srv = start(tls=tls, password=PASSWORD)
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    try:
        url = f"rediss://:{PASSWORD}@127.0.0.1:{srv.port}/0"
        tier = make(url, client_options={"ssl_ca_certs": str(tls.ca)})
        assert tier.put([(block_key(1), payload(1))]) == [True]
        assert bytes(tier.get([block_key(1)])[0]) == payload(1).tobytes()  # type: ignore[arg-type]
        in_query = make(f"{url}?ssl_ca_certs={tls.ca}")
        assert in_query.contains([block_key(1)]) == [True]
        # A client that does not trust the server's CA never talks to it.
        untrusted = make(url, failure_threshold=1)
        assert untrusted.get([block_key(1)]) == [None]
        assert untrusted.stats()["breaker_state"] == "open"
        plain = make(f"redis://:{PASSWORD}@127.0.0.1:{srv.port}/0", failure_threshold=1,
                     socket_timeout_s=0.5)
        assert plain.get([block_key(1)]) == [None]
    finally:
        srv.close()


# ---------------------------------------------------------------- cluster
def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    pytest.skip("no free port pair for a cluster node")


def start_cluster() -> list[RedisServer]:
    """Three real servers joined into a cluster (slots spread, no replicas)."""
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        pytest.skip("redis-cli (to create a cluster) is not installed")
    nodes = [start(port=_cluster_port(), config={"cluster-enabled": "yes",
                                                 "cluster-node-timeout": "2000"})
             for _ in range(3)]
    try:
        subprocess.run(
            [cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        probes = [redis.Redis(port=n.port) for n in nodes]
        deadline = time.monotonic() + 30
        while any(p.cluster("info").get("cluster_state") != "ok" for p in probes):
            assert time.monotonic() < deadline, "cluster did not become ok"
            time.sleep(0.1)
        for p in probes:
            p.close()
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return nodes


def test_cluster_client(tmp_path: Path) -> None:
    nodes = start_cluster()
    try:
        tier = make(f"redis+cluster://127.0.0.1:{nodes[0].port}")
        assert tier.cluster
        keys = [block_key(i) for i in range(30)]
        assert tier.put([(k, payload(i, 4096)) for i, k in enumerate(keys)]) == [True] * 30
        assert tier.contains(keys) == [True] * 30
        got = tier.get(keys)
        assert all(bytes(g) == payload(i, 4096).tobytes() for i, g in enumerate(got))  # type: ignore[arg-type]
        spread = [redis.Redis(port=n.port).dbsize() for n in nodes]
        assert sum(spread) == 30 and min(spread) > 0  # keys spread over every shard
        assert tier.delete(keys[:3]) == 3 and tier.contains(keys[:4]) == [False] * 3 + [True]
        for n in nodes:  # a corrupt value, on whichever node holds it, is deleted
            node = redis.Redis(port=n.port)
            for name in node.scan_iter(match=rkey(keys[3])):
                node.setrange(name, 200, b"\xff\xfe")
        assert tier.get(keys[3:5])[0] is None and tier.contains(keys[3:5]) == [False, True]
        tier.close()
    finally:
        for n in nodes:
            n.close()


def test_a_hung_cluster_node_fails_a_call_once_and_opens_the_breaker() -> None:
    # redis-py's cluster pipeline retried each key of a stopped node with its
    # own socket timeout (22 s for one get) and reported no failure
    nodes = start_cluster()
    try:
        tier = make(f"redis+cluster://127.0.0.1:{nodes[0].port}", socket_timeout_s=0.3,
                    failure_threshold=2)
        keys = [block_key(i) for i in range(30)]
        assert all(tier.put([(k, payload(i, 4096)) for i, k in enumerate(keys)]))
        nodes[1].pause()
        try:
            for _ in range(2):
                start_s = time.monotonic()
                assert tier.get(keys) == [None] * 30
                assert time.monotonic() - start_s < 10 * 0.3  # one timeout, not one per key
            assert not tier.available and tier.stats()["breaker_opens"] == 1
        finally:
            nodes[1].resume()
        tier.close()
    finally:
        for n in nodes:
            n.close()


# ---------------------------------------------------------------- config and breaker
def test_bad_config_is_explained() -> None:
    with pytest.raises(TierConfigError, match="scheme"):
        RedisTier("http://:pw-hidden@127.0.0.1:1", NS)
    try:
        RedisTier("http://:pw-hidden@127.0.0.1:1", NS)
    except TierConfigError as exc:
        assert "pw-hidden" not in str(exc)
    with pytest.raises(TierConfigError, match="namespace"):
        RedisTier("redis://127.0.0.1:1", "bad/ns")
    for url, why in [("redis://[::1:6379/0", "cannot be parsed: Invalid IPv6"),
                     ("redis://:pw-hidden@h:99999/0", "Port out of range"),
                     ("redis://:pw-hidden@h:6379/O", "database after the host must be a number")]:
        with pytest.raises(TierConfigError, match=why) as err:
            RedisTier(url, NS)
        assert "pw-hidden" not in str(err.value)
    RedisTier("unix:///run/redis.sock?db=2", NS).close()  # a socket's path is no database
    with pytest.raises(TierConfigError, match="max_batch_keys"):
        RedisTier("redis://127.0.0.1:1", NS, max_batch_keys=0)
    with pytest.raises(TierConfigError, match="socket_timeout_s"):
        RedisTier("redis://127.0.0.1:1", NS, socket_timeout_s=0)
    with pytest.raises(TierConfigError, match="failure_threshold"):
        RedisTier("redis://127.0.0.1:1", NS, failure_threshold=0)
    # replies decoded to str: stores would succeed and every read raise
    for url, options in [("redis://127.0.0.1:1", {"decode_responses": True}),
                         ("redis://127.0.0.1:1/0?decode_responses=yes", {}),
                         ("redis+cluster://127.0.0.1:1?decode_responses=1", {})]:
        with pytest.raises(TierConfigError, match="decode_responses"):
            RedisTier(url, NS, client_options=options)
    RedisTier("redis://127.0.0.1:1/0?decode_responses=false", NS).close()
    # the cluster client drops options it does not know: refused here instead
    for url, options in [("redis+cluster://127.0.0.1:1", {"ssl_ca_cert": "/ca.pem"}),
                         ("redis+cluster://127.0.0.1:1?socket_timeot=1", {}),
                         ("redis+cluster://127.0.0.1:1?read_from_replicas=true", {})]:
        with pytest.raises(TierConfigError,
                           match=r"ssl_ca_cert'|socket_timeot|read_from_replicas"):
            RedisTier(url, NS, client_options=options)
    RedisTier("redis+cluster://127.0.0.1:1?socket_keepalive=true", NS,
              client_options={"read_from_replicas": True, "ssl_ca_certs": "/ca.pem"}).close()
    upper = RedisTier("REDIS+CLUSTER://127.0.0.1:1", NS)  # a scheme is case-insensitive
    assert upper.cluster and upper._url == "REDIS://127.0.0.1:1"
    tier = RedisTier("redis://127.0.0.1:1", NS, max_block_bytes=10)
    with pytest.raises(ValueError, match="max_block_bytes"):
        tier.put([(block_key(1), b"x" * 11)])


def test_nothing_listening_is_a_miss_not_an_error() -> None:
    tier = make(f"redis://127.0.0.1:{free_port()}/0", failure_threshold=1,
                connect_timeout_s=0.2)
    assert tier.get([block_key(1)]) == [None]
    assert tier.put([(block_key(1), b"x")]) == [False]
    with pytest.raises(TierUnavailableError, match=r"127\.0\.0\.1"):
        tier.check()


def test_redact_url() -> None:
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("rediss://:pw@h:1/0?password=x&db=2") == "rediss://:***@h:1/0?password=***&db=2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    # the TLS client key's password, which redis-py also reads from the query
    assert redact_url("rediss://h:1/0?ssl_password=k3y&ssl_keyfile=/k.pem") == \
        "rediss://h:1/0?ssl_password=***&ssl_keyfile=/k.pem"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_backs_off_and_closes() -> None:
    clock = Clock()
    changes: list[str] = []
    b = CircuitBreaker(3, 1.0, 4.0, clock=clock, on_change=changes.append)

    def fail() -> None:
        permit = b.allow()
        assert permit
        b.record_failure(permit)

    for _ in range(2):
        fail()
    assert b.state == "closed"
    b.record_success(b.allow())  # successes reset the count
    for _ in range(3):
        fail()
    assert b.state == "open" and changes == ["open"]
    assert not b.allow() and not b.ready()
    clock.now += 1.0
    assert b.ready()
    probe = b.allow()  # the probe
    assert probe
    assert b.state == "half_open" and not b.allow()  # only one probe at a time
    b.record_failure(probe)  # failed probe: open twice as long
    clock.now += 1.5
    assert not b.allow()
    clock.now += 0.5
    fail()
    clock.now += 4.0  # capped at max_reset_timeout_s
    probe = b.allow()
    assert probe
    b.record_success(probe)
    assert b.state == "closed" and changes == ["open", "closed"] and b.opens == 1
    clock.now += 0.1
    for _ in range(3):
        fail()
    clock.now += 1.0  # back to the initial timeout after closing
    assert b.allow()


def test_breaker_gives_up_on_a_lost_probe() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 1.0, clock=clock)
    b.record_failure(b.allow())
    clock.now += 1.0
    assert b.allow()  # probe never reports
    clock.now += 1.0
    assert b.allow()  # another caller probes


def test_a_probe_that_proves_nothing_lets_the_next_caller_probe_at_once() -> None:
    # Fault: a probe that ended without a verdict (the pool's own
    # max_connections limit, a caller's mistake) recorded neither success nor
    # failure, so the breaker stayed half-open and refused every call for
    # another open_s (up to max_reset_timeout_s) while the server was back.
    clock = Clock()
    b = CircuitBreaker(1, 8.0, clock=clock)
    b.record_failure(b.allow())
    clock.now += 8.0
    probe = b.allow()  # the probe
    assert probe
    b.record_no_verdict(probe)
    probe = b.allow()
    assert probe, "the next caller must probe at once"
    b.record_success(probe)
    assert b.state == "closed"
    b.record_no_verdict(b.allow())  # outside a probe: nothing changes
    assert b.state == "closed" and b.allow()


def test_redis_probe_hitting_the_connection_limit_does_not_delay_recovery() -> None:
    from redis.exceptions import MaxConnectionsError

    clock = Clock()
    tier = make(f"redis://127.0.0.1:{free_port()}")  # nothing listens: calls fail
    tier._breaker = CircuitBreaker(1, 8.0, clock=clock)
    try:
        assert tier.contains([b"k"]) == [False]
        assert tier._breaker.state == "open"
        clock.now += 8.0

        def limited(client: object) -> None:
            raise MaxConnectionsError("Too many connections")

        tier._run(limited)  # the probe, ended by the client's own limit
        assert tier._breaker.allow(), "recovery waited another open_s"
    finally:
        tier.close()


def test_a_probe_batch_is_one_round_trip(
        server: RedisServer, raw: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks about every key of a waiting prompt in one pass, and the
    cascade sends a step's unknown keys as one probe batch (kvtier/tiers/
    probes.py): a request waits for its answer, so the batch must be one
    round trip, not one per ``max_batch_keys`` (32 by default)."""
    sent: list[int] = []
    execute = redis.client.Pipeline.execute

    def counting(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(len(pipe.command_stack))
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
    tier = make(server.url)
    keys = [block_key(i) for i in range(300)]
    assert tier.put([(k, payload(i)) for i, k in enumerate(keys[:100])]) == [True] * 100
    sent.clear()
    assert tier.contains(keys) == [True] * 100 + [False] * 200
    assert sent == [300]
    tier.close()
