"""Shared helpers for the core manager tests (import them with ``from conftest import ...``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

import kvtier
from kvtier import OffloadManager, PrepareStoreOutput, RequestContext

BLOCK_TOKENS = 16
"""End-token step between consecutive blocks of one request in these tests."""


@pytest.fixture(autouse=True, scope="session")
def _file_digest_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Remembered weights digests (kvtier.file_digests) go to a temporary directory,
    for this process and the engines it starts."""
    os.environ["KVTIER_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvtier-cache"))


def key(i: int, group: int = 0) -> bytes:
    """The block key of trace hash id ``i`` in KV group ``group``."""
    return kvtier.block_key(i, group)


def keys(ids: Iterable[int], group: int = 0) -> list[bytes]:
    """Keys of hash ids ``ids`` in ``group``, in order."""
    return [key(i, group) for i in ids]


def request(req_id: str, ks: Iterable[bytes] = (), first_end: int = BLOCK_TOKENS) -> RequestContext:
    """A context whose keys ``ks`` end at tokens ``first_end, first_end + 16, ...``."""
    ctx = RequestContext(req_id)
    ks = list(ks)
    if ks:
        ctx.set_positions(ks, first_end, BLOCK_TOKENS)
    return ctx


def store(
    mgr: OffloadManager, ks: list[bytes], ctx: RequestContext, success: bool = True
) -> PrepareStoreOutput:
    """Offer ``ks`` for ``ctx`` and complete whatever was granted; the offer must fit."""
    out = mgr.prepare_store(ks, ctx)
    assert out is not None, "prepare_store found no room"
    if out.keys_to_store:
        mgr.complete_store(out.keys_to_store, ctx, success=success)
    return out


_serial = [0]


def fill(mgr: OffloadManager, ks: list[bytes], req_id: str | None = None) -> RequestContext:
    """Store ``ks`` (READY) as one finished request with positions in key order."""
    if req_id is None:
        _serial[0] += 1
        req_id = f"fill-{_serial[0]}"
    ctx = request(req_id, ks)
    store(mgr, ks, ctx)
    mgr.on_request_finished(ctx)
    return ctx


def load(mgr: OffloadManager, ks: list[bytes], ctx: RequestContext) -> list[int]:
    """Look up, load and complete ``ks`` for ``ctx`` (all must hit)."""
    assert mgr.lookup(ks, ctx) == len(ks)
    spec = mgr.prepare_load(ks, ctx)
    mgr.complete_load(ks, ctx)
    return spec.block_ids


def resident(mgr: OffloadManager, ks: Iterable[bytes]) -> set[bytes]:
    """Which of ``ks`` are resident."""
    return {k for k in ks if mgr.contains(k)}


def evict_order(mgr: OffloadManager, candidates: list[bytes], n: int) -> list[bytes]:
    """Force ``n`` evictions with a throw-away store; return the victims in order.

    Uses hash ids far from the ones tests use, so the probe keys are new.
    """
    _serial[0] += 1
    base = 10_000_000 + 1_000 * _serial[0]
    probe = keys(range(base, base + n))
    ctx = request(f"probe-{_serial[0]}", probe)
    out = mgr.prepare_store(probe, ctx)
    assert out is not None
    assert set(out.evicted_keys) <= set(candidates)
    return out.evicted_keys


class FakeClock:
    """A stand-in for ``time.monotonic`` that only moves when told to."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Replace the clock the manager reads (``kvtier.manager``'s ``time.monotonic``)."""
    import kvtier.manager

    clock = FakeClock()

    class _Time:
        monotonic = staticmethod(clock.monotonic)

    monkeypatch.setattr(kvtier.manager, "time", _Time)
    return clock


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A fresh local redis-server or valkey-server, stopped after the test
    (skipped where none is installed or redis-py is missing: ``make test``
    installs both)."""
    pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary (see tests/test_tier_redis.py)")
    with RedisServer() as server:
        yield server
