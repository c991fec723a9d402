"""The cost of the manager's calls on vLLM's scheduler thread (the hot path):
work per call must follow the keys of the call, not the size of the cache."""

from __future__ import annotations

from collections.abc import Container

import pytest

import kvtier
from kvtier.manager import OffloadManager
from kvtier.request import RequestContext


def _counting_evict(mgr: OffloadManager) -> list[int]:
    """Count the calls of ``mgr``'s policy's ``evict`` (one-element list)."""
    calls = [0]
    evict = mgr.policy.evict

    def counted(n: int, protected: Container[bytes]) -> list[bytes] | None:
        calls[0] += 1
        return evict(n, protected)

    mgr.policy.evict = counted  # type: ignore[method-assign]
    return calls


def _keys(first: int, n: int) -> list[bytes]:
    return [kvtier.block_key(i) for i in range(first, first + n)]


@pytest.mark.parametrize("policy", sorted(kvtier.POLICIES))
@pytest.mark.parametrize("capacity", [64, 4096])
def test_a_refused_offer_does_not_ask_the_policy(policy: str, capacity: int) -> None:
    """A full cache of held blocks (stores in flight, leases of a waiting
    request): an offer is refused without the policy's ``evict``, which
    scanned every resident block to fail, twice (again after looking for
    lapsed leases): 9 ms per refused offer at 64k blocks, repeated by vLLM at
    every step."""
    mgr = OffloadManager(capacity, policy=policy, max_leases_per_request=capacity,
                         max_leased_blocks=capacity)
    writer = RequestContext("writer")
    held = _keys(0, capacity)
    assert mgr.prepare_store(held, writer) is not None  # every slot being written
    ready = held[: capacity // 2]
    mgr.complete_store(ready, writer)
    assert mgr.lookup(ready, RequestContext("waiting")) == len(ready)  # leased
    calls = _counting_evict(mgr)
    for i in range(3):
        assert mgr.prepare_store(_keys(capacity, 4), RequestContext(f"new-{i}")) is None
    assert calls[0] == 0
    assert mgr.stats()["allocation_failures"] == 3


@pytest.mark.parametrize("policy", sorted(kvtier.POLICIES))
def test_the_last_evictable_block_is_still_evicted(policy: str) -> None:
    """The count of evictable blocks leaves out the offer's own resident
    blocks, and only those: with exactly one other ready block the policy is
    asked and evicts it; with none the offer is refused."""
    mgr = OffloadManager(4, policy=policy)
    first = RequestContext("first")
    a, b, c, d, e = _keys(0, 5)
    mgr.prepare_store([a, b, c, d], first)
    mgr.complete_store([a, b, c, d], first)
    mgr.on_request_finished(first)
    calls = _counting_evict(mgr)
    assert mgr.prepare_store([a, b, c, d, e], RequestContext("all")) is None
    assert calls[0] == 0
    out = mgr.prepare_store([a, b, c, e], RequestContext("three"))
    assert out is not None and out.keys_to_store == [e] and out.evicted_keys == [d]
    assert calls[0] == 1


def test_an_offer_waits_for_a_lapsed_lease() -> None:
    """Blocks held only by a lease that lapsed are evicted for an offer (the
    manager looks for lapsed leases once the count says no block is free)."""
    mgr = OffloadManager(2, lease_timeout_s=1e-9, max_leased_blocks=2)
    writer = RequestContext("writer")
    old = _keys(0, 2)
    mgr.prepare_store(old, writer)
    mgr.complete_store(old, writer)
    mgr.on_request_finished(writer)
    assert mgr.lookup(old, RequestContext("waiting")) == 2
    out = mgr.prepare_store(_keys(2, 1), RequestContext("new"))
    assert out is not None and len(out.evicted_keys) == 1
    assert mgr.stats()["leased"] == 0
