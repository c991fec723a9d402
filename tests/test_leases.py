"""Lookup leases and their bounds, DESIGN.md §6."""

from __future__ import annotations

import pytest
from conftest import FakeClock, fill, keys, request, store

from kvtier import LookupResult, OffloadManager


def full_cache(n: int, **kwargs: object) -> tuple[OffloadManager, list[bytes]]:
    """A cache of ``n`` ready blocks stored by separate finished requests."""
    mgr = OffloadManager(n, **kwargs)  # type: ignore[arg-type]
    ks = keys(range(n))
    for k in ks:
        fill(mgr, [k])
    return mgr, ks


def try_store(mgr: OffloadManager, n: int, tag: str) -> list[bytes] | None:
    """Offer ``n`` new keys from another request; return the victims or None."""
    base = 1_000 + 100 * sum(map(ord, tag))
    new = keys(range(base, base + n))
    out = mgr.prepare_store(new, request(tag, new))
    return None if out is None else out.evicted_keys


# -- what a lease protects, and until when -------------------------------------------


def test_lookup_leases_hits_against_other_requests_stores() -> None:
    mgr, ks = full_cache(4)
    r1 = request("r1", ks[:2])
    assert mgr.lookup(ks[:2], r1) == 2
    assert mgr.stats()["leased"] == 2
    assert try_store(mgr, 3, "other") is None
    victims = try_store(mgr, 2, "other2")
    assert victims is not None and sorted(victims) == sorted(ks[2:])
    spec = mgr.prepare_load(ks[:2], r1)
    assert len(spec.block_ids) == 2


def test_lease_becomes_pin_at_prepare_load_then_ends_at_complete_load() -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    r1 = request("r1", ks[:1])
    assert mgr.lookup(ks[:1], r1) == 1
    mgr.prepare_load(ks[:1], r1)
    s = mgr.stats()
    assert (s["leased"], s["pinned"]) == (0, 1)
    assert mgr.debug_state()["leases_held"] == 0
    assert try_store(mgr, 2, "a") is None  # still pinned
    mgr.complete_load(ks[:1], r1)
    assert try_store(mgr, 2, "b") is not None


@pytest.mark.parametrize("end", ["release", "finish"])
def test_release_and_finish_drop_leases(end: str) -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    r1 = request("r1", ks)
    assert mgr.lookup(ks, r1) == 2
    assert try_store(mgr, 1, "a") is None
    if end == "release":
        mgr.release(r1)
    else:
        mgr.on_request_finished(r1)
    assert mgr.stats()["leased"] == 0
    assert mgr.debug_state()["leases_held"] == 0
    assert try_store(mgr, 2, "b") is not None


def test_key_leased_by_two_requests_is_protected_until_both_let_go() -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    r1, r2 = request("r1", ks[:1]), request("r2", ks[:1])
    assert mgr.lookup(ks[:1], r1) == 1
    assert mgr.lookup(ks[:1], r2) == 1
    assert mgr.stats()["leased"] == 1
    mgr.release(r1)
    assert try_store(mgr, 2, "a") is None
    mgr.release(r2)
    assert try_store(mgr, 2, "b") is not None


def test_lookup_one_leases_hit_only() -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    r1 = request("r1")
    assert mgr.lookup_one(ks[0], r1) is LookupResult.HIT
    assert mgr.stats()["leased"] == 1
    assert mgr.lookup_one(keys([99])[0], r1) is LookupResult.MISS
    assert mgr.stats()["leased"] == 1
    victims = try_store(mgr, 1, "a")
    assert victims == [ks[1]]
    mgr.prepare_load(ks[:1], r1)


def test_lookup_one_of_write_pending_key_is_pending_and_not_leased() -> None:
    mgr = OffloadManager(4)
    k = keys([5])[0]
    writer = request("w", [k])
    mgr.prepare_store([k], writer)
    r = request("r")
    assert mgr.lookup_one(k, r) is LookupResult.HIT_PENDING
    assert mgr.stats()["leased"] == 0
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (0, 0)
    assert mgr.lookup([k], r) == 0


def test_leased_hits_stay_loadable_under_store_pressure() -> None:
    mgr, ks = full_cache(8)
    r1 = request("r1", ks[:4])
    assert mgr.lookup(ks[:4], r1) == 4
    for i in range(30):
        new = keys(range(500 + 3 * i, 503 + 3 * i))
        ctx = request(f"w{i}", new)
        out = mgr.prepare_store(new, ctx)
        assert out is not None
        assert not set(out.evicted_keys) & set(ks[:4])
        mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
    spec = mgr.prepare_load(ks[:4], r1)
    assert len(set(spec.block_ids)) == 4


# -- bounds ----------------------------------------------------------------------------


def test_per_request_bound_shortens_the_hit() -> None:
    mgr, ks = full_cache(8, max_leases_per_request=3, max_leased_blocks=8)
    r1 = request("r1")
    assert mgr.lookup(ks[:5], r1) == 3
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (3, 2)
    assert mgr.lookup(ks[:3], r1) == 3  # already leased to r1: no new budget needed
    assert mgr.lookup_one(ks[4], r1) is LookupResult.MISS
    assert mgr.stats()["leased"] == 3
    assert mgr.lookup(ks[:5], request("r2")) == 3  # another request has its own budget


def test_total_bound_defaults_to_half_the_cache() -> None:
    mgr, ks = full_cache(8)
    r1, r2, r3 = request("r1"), request("r2"), request("r3")
    assert mgr.lookup(ks[:3], r1) == 3
    assert mgr.lookup(ks[3:6], r2) == 1
    assert mgr.debug_state()["leases_held"] == 4
    assert mgr.lookup_one(ks[7], r3) is LookupResult.MISS
    mgr.release(r1)
    assert mgr.lookup_one(ks[7], r3) is LookupResult.HIT
    assert mgr.debug_state()["leases_held"] == 2


def test_abandoned_request_cannot_hold_more_than_half_the_cache() -> None:
    mgr, ks = full_cache(6)
    assert mgr.lookup(ks, request("abandoned")) == 3
    victims = try_store(mgr, 3, "busy")
    assert victims is not None and len(victims) == 3


def test_per_request_default_bound() -> None:
    n = 16_384 + 16
    mgr = OffloadManager(n, max_leased_blocks=n)
    ks = keys(range(n))
    fill(mgr, ks)
    assert mgr.lookup(ks, request("long-prompt")) == 16_384


def test_total_bound_counts_blocks_so_a_shared_prefix_keeps_hitting() -> None:
    # max_leased_blocks bounds the cache space leases can hold. Many concurrent
    # requests sharing one prefix lease the same few blocks: that holds no more
    # space than one of them does, so every one of them must still get its hit.
    mgr, ks = full_cache(8)  # max_leased_blocks defaults to 4
    prefix = ks[:2]
    hits = [mgr.lookup(prefix, request(f"r{i}")) for i in range(6)]
    assert hits == [2] * 6
    assert mgr.stats()["leased"] == 2
    assert mgr.lookup(ks[2:6], request("other")) == 2  # 2 + 2 distinct blocks: the bound


def test_leases_lapse_after_timeout(fake_clock: FakeClock) -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2, lease_timeout_s=10.0)
    assert mgr.lookup(ks, request("abandoned")) == 2
    fake_clock.advance(9.5)
    assert try_store(mgr, 1, "early") is None
    fake_clock.advance(1.0)
    victims = try_store(mgr, 1, "late")  # the store that finds no room expires them
    assert victims is not None and len(victims) == 1
    assert mgr.stats()["leased"] == 0
    assert mgr.debug_state()["leases_held"] == 0


def test_expired_leases_dropped_on_next_lookup(fake_clock: FakeClock) -> None:
    mgr, ks = full_cache(4, max_leased_blocks=2, lease_timeout_s=10.0)
    assert mgr.lookup(ks[:2], request("abandoned")) == 2
    r2 = request("r2")
    assert mgr.lookup(ks[2:], r2) == 0  # total budget held by the abandoned request
    fake_clock.advance(10.0)
    assert mgr.lookup(ks[2:], r2) == 2
    assert mgr.debug_state()["leases_held"] == 2
    mgr.prepare_load(ks[2:], r2)


def test_new_grant_extends_the_requests_leases(fake_clock: FakeClock) -> None:
    mgr, ks = full_cache(4, max_leased_blocks=4, lease_timeout_s=10.0)
    r1 = request("r1")
    assert mgr.lookup(ks[:1], r1) == 1
    fake_clock.advance(8.0)
    assert mgr.lookup(ks[:2], r1) == 2  # a new grant at t=8
    fake_clock.advance(8.0)  # t=16: 16 s after the first grant, 8 s after the last
    assert try_store(mgr, 3, "a") is None
    mgr.prepare_load(ks[:2], r1)


@pytest.mark.parametrize("one", [False, True], ids=["lookup", "lookup_one"])
def test_asking_again_for_held_keys_extends_the_leases(fake_clock: FakeClock, one: bool) -> None:
    # a request waiting in the engine's queue asks every step: what it was
    # told is a hit must stay loadable, however long it waits
    mgr, ks = full_cache(2, max_leased_blocks=2, lease_timeout_s=10.0)
    r1 = request("r1")
    for _ in range(20):  # asked for 10 s, the lease timeout, nothing new leased
        if one:
            assert mgr.lookup_one(ks[0], r1) is LookupResult.HIT
        else:
            assert mgr.lookup(ks[:1], r1) == 1
        fake_clock.advance(0.5)
    assert try_store(mgr, 2, "a") is None  # 0.5 s after the last lookup
    mgr.prepare_load(ks[:1], r1)


def test_asking_again_at_the_lease_budget_extends_the_leases(fake_clock: FakeClock) -> None:
    # r1 may hold 1 lease and asks every step for [k0, k1]: k0 it holds, k1 its
    # budget refuses; it is still asking again for what it holds
    mgr, ks = full_cache(3, max_leases_per_request=1, max_leased_blocks=3,
                         lease_timeout_s=10.0)
    r1 = request("r1")
    for _ in range(20):
        assert mgr.lookup(ks[:2], r1) == 1
        fake_clock.advance(0.5)
    victims = try_store(mgr, 3, "a")  # 0.5 s after r1's last lookup
    assert victims is None or ks[0] not in victims


def test_default_lease_timeout_is_sixty_seconds(fake_clock: FakeClock) -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    assert mgr.lookup(ks, request("abandoned")) == 2
    fake_clock.advance(59.0)
    assert try_store(mgr, 1, "early") is None
    fake_clock.advance(1.5)
    assert try_store(mgr, 1, "late") is not None


def test_reset_drops_every_lease() -> None:
    mgr, ks = full_cache(4)
    r1 = request("r1")
    assert mgr.lookup(ks[:2], r1) == 2
    mgr.reset()
    assert mgr.stats()["leased"] == 0
    assert mgr.debug_state()["leases_held"] == 0
    fill(mgr, ks)
    assert mgr.lookup(ks[:2], r1) == 2  # leased anew, not taken as still leased
    assert mgr.stats()["leased"] == 2
    assert mgr.debug_state()["leases_held"] == 2
    assert try_store(mgr, 3, "a") is None


def test_lookup_hits_stop_at_first_not_ready_key() -> None:
    mgr = OffloadManager(8, max_leased_blocks=8)
    a, b, c, d = keys(range(4))
    fill(mgr, [a, b])
    store(mgr, [d], request("w", [d]))
    mgr.prepare_store([c], request("w2", [c]))  # c write-pending
    r = request("r")
    assert mgr.lookup([a, b, c, d], r) == 2
    assert mgr.stats()["leased"] == 2
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (2, 2)


def test_lease_outlives_another_requests_load_of_the_key() -> None:
    mgr, ks = full_cache(2, max_leased_blocks=2)
    r1, r2 = request("r1", ks[:1]), request("r2", ks[:1])
    assert mgr.lookup(ks[:1], r1) == 1
    assert mgr.lookup(ks[:1], r2) == 1
    mgr.prepare_load(ks[:1], r2)
    mgr.complete_load(ks[:1], r2)  # r2's pin ends; r1's lease remains
    assert mgr.stats()["leased"] == 1
    assert ks[0] in mgr.policy.blocked
    assert try_store(mgr, 2, "a") is None
    mgr.prepare_load(ks[:1], r1)
