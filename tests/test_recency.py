"""Per-request recency and atomic eviction, DESIGN.md §5."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar

import pytest
from conftest import evict_order, fill, key, keys, load, request, resident, store

from kvtier import OffloadManager, RequestContext
from kvtier.policies import ARCPolicy, LRUPolicy

POLICIES = ["lru", "arc"]


def one_by_one(mgr: OffloadManager, ks: list[bytes]) -> None:
    """Store ``ks`` as separate finished requests, so ``ks[0]`` is the least recent."""
    for k in ks:
        fill(mgr, [k])


# -- one access per request, no touch needed -----------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_loaded_keys_become_recent_without_touch(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    a, b, c, d = keys(range(4))
    one_by_one(mgr, [a, b, c, d])
    r = request("r", [a])
    load(mgr, [a], r)
    mgr.on_request_finished(r)
    assert evict_order(mgr, [a, b, c, d], 1) == [b]


@pytest.mark.parametrize("policy", POLICIES)
def test_offered_resident_keys_become_recent_without_touch(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    a, b, c, d = keys(range(4))
    one_by_one(mgr, [a, b, c, d])
    r = request("r", [a])
    assert mgr.prepare_store([a], r) == ([], [], [])
    mgr.on_request_finished(r)
    assert evict_order(mgr, [a, b, c, d], 1) == [b]


def test_access_applied_at_finish_not_before() -> None:
    mgr = OffloadManager(4)
    a, b, c, d = keys(range(4))
    one_by_one(mgr, [a, b, c, d])
    r = request("r", [a])
    load(mgr, [a], r)
    mgr.release(r)
    assert evict_order(mgr, [a, b, c, d], 1) == [a]  # r has not finished yet


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_counts_in_the_request_access(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    a, b, c, d = keys(range(4))
    one_by_one(mgr, [a, b, c, d])
    r = request("r", [a, b])
    mgr.touch([a, b], r)  # e.g. GPU prefix-cache hits of the request
    mgr.on_request_finished(r)
    assert evict_order(mgr, [a, b, c, d], 2) == [c, d]


# -- head to tail --------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_head_most_recent_tail_evicted_first(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    ks = keys(range(4))
    fill(mgr, ks)  # one request, positions 16..64 in key order
    assert evict_order(mgr, ks, 4) == ks[::-1]


@pytest.mark.parametrize("policy", POLICIES)
def test_order_follows_positions_not_call_order(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    ks = keys(range(4))
    r = RequestContext("r")
    for i, k in enumerate(ks):
        r.set_position(k, 64 - 16 * i)  # ks[3] is the head of the request
    out = mgr.prepare_store(ks, r)
    assert out is not None
    mgr.complete_store(ks, r)
    mgr.on_request_finished(r)
    assert evict_order(mgr, ks, 4) == ks


@pytest.mark.parametrize("policy", POLICIES)
def test_loads_and_offers_of_a_request_form_one_access(policy: str) -> None:
    mgr = OffloadManager(5, policy=policy)
    a, b, c, d, x = keys(range(5))
    fill(mgr, [a, b])
    fill(mgr, [x])  # x more recent than a and b
    r = request("r", [a, b, c, d])
    load(mgr, [a, b], r)
    out = mgr.prepare_store([a, b, c, d], r)
    assert out is not None and out.keys_to_store == [c, d]
    mgr.complete_store([c, d], r)
    mgr.on_request_finished(r)
    assert evict_order(mgr, [a, b, c, d, x], 5) == [x, d, c, b, a]


@pytest.mark.parametrize("policy", POLICIES)
def test_kv_groups_merged_by_position(policy: str) -> None:
    mgr = OffloadManager(6, policy=policy)
    g0 = [key(i, 0) for i in range(3)]
    g1 = [key(i, 1) for i in range(3)]
    r = RequestContext("hybrid")
    r.set_positions(g0, 16, 16)
    r.set_positions(g1, 16, 16)
    out = mgr.prepare_store(g0 + g1, r)  # group-major call order
    assert out is not None
    mgr.complete_store(out.keys_to_store, r)
    mgr.on_request_finished(r)
    victims = evict_order(mgr, g0 + g1, 6)
    assert set(victims[:2]) == {g0[2], g1[2]}
    assert set(victims[2:4]) == {g0[1], g1[1]}
    assert set(victims[4:]) == {g0[0], g1[0]}


# -- logical rank of pinned blocks -----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_store_completion_order_does_not_change_eviction_order(policy: str) -> None:
    mgr = OffloadManager(3, policy=policy)
    a, b, c = keys(range(3))
    r = request("r", [a, b, c])
    out = mgr.prepare_store([a, b, c], r)
    assert out is not None
    mgr.on_request_finished(r)  # transfers still in flight
    for k in (a, b, c):  # completions arrive head first: c completes last
        mgr.complete_store([k], r)
    assert evict_order(mgr, [a, b, c], 3) == [c, b, a]


@pytest.mark.parametrize("policy", POLICIES)
def test_load_completion_does_not_make_block_most_recent(policy: str) -> None:
    mgr = OffloadManager(3, policy=policy)
    a, b, c = keys(range(3))
    fill(mgr, [a, b, c])  # order, least recent first: c, b, a
    r2 = request("r2", [b])
    assert mgr.lookup([b], r2) == 1
    mgr.prepare_load([b], r2)  # b pinned
    mgr.on_request_finished(r2)  # b most recent: c, a, b
    r3 = request("r3", [a])
    load(mgr, [a], r3)
    mgr.on_request_finished(r3)  # a most recent: c, b, a
    mgr.complete_load([b], r2)  # the long transfer of b ends last
    assert evict_order(mgr, [a, b, c], 3) == [c, b, a]


# -- eviction is atomic and respects blocked keys ---------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_eviction_changes_nothing(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy, enable_events=True)
    ks = keys(range(4))
    one_by_one(mgr, ks)
    assert mgr.lookup(ks[:2], request("holder")) == 2  # the two least recent are leased
    mgr.take_events()
    before = mgr.stats()
    new = keys(range(10, 13))
    assert mgr.prepare_store(new, request("r", new)) is None  # needs 3, only 2 evictable
    after = mgr.stats()
    assert resident(mgr, ks) == set(ks)
    assert not resident(mgr, new)
    assert after["evictions"] == before["evictions"] == 0
    assert after["allocation_failures"] == 1
    assert mgr.debug_state()["history_size"] == 0
    assert mgr.take_events() == []
    out = mgr.prepare_store(new[:2], request("r2", new[:2]))
    assert out is not None and sorted(out.evicted_keys) == sorted(ks[2:])


@pytest.mark.parametrize("policy", POLICIES)
def test_evicts_exactly_the_missing_room(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy)
    ks = keys(range(3))
    one_by_one(mgr, ks)
    new = keys(range(10, 13))
    out = mgr.prepare_store(new, request("r", new))
    assert out is not None
    assert out.evicted_keys == ks[:2]
    assert mgr.stats()["evictions"] == 2
    assert mgr.stats()["free"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_skips_key_of_current_offer(policy: str) -> None:
    mgr = OffloadManager(2, policy=policy)
    a, b, c = keys(range(3))
    one_by_one(mgr, [a, b])  # a is least recent
    out = mgr.prepare_store([a, c], request("r", [a, c]))
    assert out is not None
    assert out.evicted_keys == [b]
    assert out.keys_to_store == [c]
    assert mgr.contains(a)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_skips_pinned_key(policy: str) -> None:
    mgr = OffloadManager(2, policy=policy)
    a, b, c, d = keys(range(4))
    one_by_one(mgr, [a, b])
    loader = request("loader", [a])
    assert mgr.lookup([a], loader) == 1
    mgr.prepare_load([a], loader)
    mgr.release(loader)
    out = mgr.prepare_store([c], request("r", [c]))
    assert out is not None and out.evicted_keys == [b]
    assert mgr.prepare_store([d], request("r2", [d])) is None  # a pinned, c writing
    mgr.complete_load([a], loader)
    out = mgr.prepare_store([d], request("r3", [d]))
    assert out is not None and out.evicted_keys == [a]


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_skips_leased_key(policy: str) -> None:
    mgr = OffloadManager(2, policy=policy, max_leased_blocks=2)
    a, b, c = keys(range(3))
    one_by_one(mgr, [a, b])
    holder = request("holder", [a])
    assert mgr.lookup([a], holder) == 1
    out = mgr.prepare_store([c], request("r", [c]))
    assert out is not None and out.evicted_keys == [b]
    assert mgr.contains(a)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_skips_write_pending_key(policy: str) -> None:
    mgr = OffloadManager(2, policy=policy)
    a, b, c, d = keys(range(4))
    writer = request("writer", [a])
    out = mgr.prepare_store([a], writer)  # a: WRITING, inserted first
    assert out is not None and out.keys_to_store == [a]
    fill(mgr, [b])
    out = mgr.prepare_store([c], request("r", [c]))
    assert out is not None and out.evicted_keys == [b]
    assert mgr.prepare_store([d], request("r2", [d])) is None
    assert mgr.contains(a)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_policy_evict_is_atomic(cls: type) -> None:
    policy = cls(8)
    ks = keys(range(6))
    policy.insert(ks)
    policy.on_access(ks, set())
    policy.blocked.update(ks[:2])
    before = len(policy)
    assert policy.evict(4, protected={ks[2]}) is None  # 3 evictable, 4 wanted
    assert len(policy) == before
    victims = policy.evict(4, protected=set())
    assert victims is not None and sorted(victims) == sorted(ks[2:])
    assert len(policy) == before - 4
    assert policy.evict(1, protected=set()) is None  # only blocked keys remain
    assert len(policy) == 2
    assert policy.evict(0, protected=set()) == []


# -- requests that run while others store (many in flight, chunked prompts) ------------


@pytest.mark.parametrize("policy", ["lru", "arc", "plfu"])
def test_a_running_request_keeps_its_head_ahead_of_its_later_chunks(policy: str) -> None:
    # vLLM offers a long prompt chunk by chunk as it computes it; meanwhile other
    # requests store and finish. The request's tail must still leave before its head.
    mgr = OffloadManager(5, policy=policy)
    a0, a1, a2, c0, c1 = keys(range(5))
    r = request("r", [a0, a1, a2])
    store(mgr, [a0, a1], r)  # first chunk
    fill(mgr, [c0, c1])  # another request, finished: more recent than a0, a1
    store(mgr, [a2], r)  # second chunk, r still running
    victims = evict_order(mgr, [a0, a1, a2, c0, c1], 3)
    assert set(victims) == {c0, c1, a2}  # r's tail goes, its head stays
    assert resident(mgr, [a0, a1]) == {a0, a1}


class NoRunningOrder(LRUPolicy):
    """LRU that is never asked to keep a running request's head ahead."""

    wants_running_order = False


class RecordingRunningOrder(LRUPolicy):
    """LRU that records each ``keep_ahead`` call."""

    calls: ClassVar[list[list[bytes]]] = []

    def keep_ahead(self, run: object, ks: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        self.calls.append([k for k in ks[start:] if k not in new and k in self._order])
        super().keep_ahead(run, ks, start, new)


def test_without_keep_ahead_the_head_of_a_running_request_leaves_first() -> None:
    # the negative control: a policy that ignores keep_ahead loses r's head
    mgr = OffloadManager(5, policy="test_recency:NoRunningOrder")
    a0, a1, a2, c0, c1 = keys(range(5))
    r = request("r", [a0, a1, a2])
    store(mgr, [a0, a1], r)
    fill(mgr, [c0, c1])
    store(mgr, [a2], r)
    assert set(evict_order(mgr, [a0, a1, a2, c0, c1], 3)) == {a0, a1, c1}


def test_a_single_offer_asks_the_policy_for_no_reordering() -> None:
    calls = RecordingRunningOrder.calls
    calls.clear()
    mgr = OffloadManager(4, policy="test_recency:RecordingRunningOrder")
    a, b, c = keys(range(3))
    fill(mgr, [a])
    r = request("r", [a, b, c])
    load(mgr, [a], r)
    store(mgr, [a, b, c], r)  # the request's only offer: nothing to keep ahead of
    assert calls == []
    store(mgr, [key(3)], r)  # a later offer: its held blocks, head first
    assert calls == [[a, b, c]]


def test_a_block_evicted_while_its_request_ran_still_counts_as_used() -> None:
    mgr = OffloadManager(4, policy="plfu")
    a0, a1 = keys(range(2))
    r = request("r", [a0, a1])
    store(mgr, [a0, a1], r)
    fill(mgr, keys(range(10, 14)))  # another request evicts r's blocks before r finishes
    assert resident(mgr, [a0, a1]) == set()
    mgr.on_request_finished(r)
    history = mgr.policy.history  # type: ignore[attr-defined]
    assert history.get(a0) == history.get(a1) == 1  # the use is remembered
