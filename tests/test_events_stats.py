"""Events, stats() and reset(), DESIGN.md §3 and the issue's point 6."""

from __future__ import annotations

import pytest
from conftest import fill, keys, load, request, store

from kvtier import Event, LookupResult, OffloadManager, ProtocolError

GAUGES = ("resident", "ready", "pinned", "leased", "write_pending", "free")
COUNTERS = ("hits", "misses", "stores", "evictions", "stores_skipped", "allocation_failures")
STATS_FIELDS = {*GAUGES, *COUNTERS}


# -- events ------------------------------------------------------------------------------


def test_no_events_when_disabled() -> None:
    mgr = OffloadManager(1)
    fill(mgr, keys([1]))
    fill(mgr, keys([2]))
    assert mgr.stats()["evictions"] == 1
    assert mgr.take_events() == []


def test_stored_and_removed_events_with_medium() -> None:
    mgr = OffloadManager(2, enable_events=True)
    a, b, c = keys(range(3))
    r = request("r", [a, b])
    out = mgr.prepare_store([a, b], r)
    assert out is not None
    assert mgr.take_events() == []  # granted, not stored yet
    mgr.complete_store([a, b], r)
    mgr.on_request_finished(r)
    out = store(mgr, [c], request("r2", [c]))
    assert out.evicted_keys == [b]
    assert mgr.take_events() == [
        Event((a, b), "stored", "CPU"),
        Event((b,), "removed", "CPU"),
        Event((c,), "stored", "CPU"),
    ]
    assert mgr.take_events() == []  # taken once


def test_failed_store_emits_nothing() -> None:
    mgr = OffloadManager(2, enable_events=True)
    a = keys([1])[0]
    r = request("r", [a])
    mgr.prepare_store([a], r)
    mgr.complete_store([a], r, success=False)
    assert mgr.take_events() == []
    assert not mgr.contains(a)
    assert mgr.stats()["stores"] == 0


def test_event_log_is_bounded_and_counts_drops() -> None:
    mgr = OffloadManager(4, enable_events=True, max_events=3)
    for i in range(5):
        fill(mgr, keys([i]))
    events = mgr.take_events()
    assert len(events) == 3
    assert mgr.stats()["events_dropped"] > 0
    assert events[-1] == Event((keys([4])[0],), "stored", "CPU")


def test_reset_tells_subscribers_the_blocks_left() -> None:
    mgr = OffloadManager(4, enable_events=True)
    ks = keys(range(3))
    fill(mgr, ks)
    mgr.take_events()
    mgr.reset()
    removed = [k for e in mgr.take_events() if e.kind == "removed" for k in e.keys]
    assert sorted(removed) == sorted(ks)


# -- stats ---------------------------------------------------------------------------------


def test_stats_fields_and_gauges() -> None:
    mgr = OffloadManager(8, max_leased_blocks=8)
    a, b, c, d, e = keys(range(5))
    fill(mgr, [a, b, c])
    s = mgr.stats()
    assert set(s) >= STATS_FIELDS
    assert (s["resident"], s["ready"], s["free"], s["stores"]) == (3, 3, 5, 3)

    r1, r2 = request("r1"), request("r2")
    assert mgr.lookup([a, b], r1) == 2
    assert mgr.lookup([a], r2) == 1
    mgr.prepare_load([c], r2)
    mgr.prepare_load([c], request("r3"))
    w = request("w", [d, e])
    mgr.prepare_store([d, e], w)
    s = mgr.stats()
    assert s["leased"] == 2  # distinct keys
    assert s["pinned"] == 1
    assert s["write_pending"] == 2
    assert (s["resident"], s["ready"], s["free"]) == (5, 3, 3)
    mgr.complete_store([d], w)
    mgr.complete_store([e], w, success=False)
    s = mgr.stats()
    gauges = ("resident", "ready", "write_pending", "free", "stores")
    assert [s[g] for g in gauges] == [4, 4, 0, 4, 4]


def test_hits_and_misses_count_keys() -> None:
    mgr = OffloadManager(8)
    a, b, c, d = keys(range(4))
    fill(mgr, [a, b])
    r = request("r")
    assert mgr.lookup([a, b, c, a], r) == 2
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (2, 2)
    mgr.prepare_store([d], request("w", [d]))
    assert mgr.lookup_one(d, r) is LookupResult.HIT_PENDING
    assert mgr.lookup_one(c, r) is LookupResult.MISS
    assert mgr.lookup_one(a, r) is LookupResult.HIT
    # asked again by the same request: already counted
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (2, 2)
    other = request("o")
    assert mgr.lookup_one(c, other) is LookupResult.MISS
    assert mgr.lookup_one(a, other) is LookupResult.HIT
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (3, 3)


@pytest.mark.parametrize("per_key", [False, True], ids=["lookup", "lookup_one"])
def test_a_waiting_request_asking_every_step_is_counted_once(per_key: bool) -> None:
    # vLLM asks again for a waiting request's blocks at every scheduler step
    mgr = OffloadManager(8)
    ks = keys(range(4))
    fill(mgr, ks[:2])
    r = request("r", ks)

    def ask() -> None:
        if per_key:  # as vLLM 0.32 does: key by key up to the first miss
            for k in ks:
                if mgr.lookup_one(k, r) is not LookupResult.HIT:
                    break
        else:
            mgr.lookup(ks, r)

    for _ in range(5):
        ask()
    misses = 1 if per_key else 2
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (2, misses)
    fill(mgr, ks[2:3])  # a block found later counts as a hit too
    ask()
    ask()
    assert (mgr.stats()["hits"], mgr.stats()["misses"]) == (3, misses + 1)


def test_store_eviction_and_failure_counters() -> None:
    mgr = OffloadManager(2, store_threshold=2, max_leased_blocks=2)
    a, b, c, d = keys(range(4))
    for i in range(2):
        fill(mgr, [a, b], f"warm{i}")
    s = mgr.stats()
    assert (s["stores"], s["stores_skipped"], s["evictions"]) == (2, 2, 0)
    mgr.prepare_store([c], request("c1"))
    assert mgr.stats()["stores_skipped"] == 3
    holder = request("holder")
    assert mgr.lookup([a, b], holder) == 2
    assert mgr.prepare_store([c], request("c2")) is None
    assert mgr.stats()["allocation_failures"] == 1
    mgr.release(holder)
    fill(mgr, [c, d], "c3")  # c admitted (2nd offer); d skipped
    s = mgr.stats()
    assert (s["stores"], s["evictions"], s["stores_skipped"]) == (3, 1, 4)


# -- reset ---------------------------------------------------------------------------------


def test_reset_forgets_blocks_and_frees_every_slot() -> None:
    mgr = OffloadManager(4, store_threshold=2)
    ks = keys(range(4))
    for i in range(2):
        fill(mgr, ks, f"w{i}")
    mgr.reset()
    s = mgr.stats()
    assert (s["resident"], s["ready"], s["free"], s["pinned"], s["leased"]) == (0, 0, 4, 0, 0)
    assert not any(mgr.contains(k) for k in ks)
    assert mgr.debug_state()["policy_size"] == 0
    assert mgr.policy.blocked == set()
    fill(mgr, ks, "after1")
    assert not any(mgr.contains(k) for k in ks)  # counts restarted: first offer only counts


def test_reset_ignores_store_completions_from_before() -> None:
    mgr = OffloadManager(2, enable_events=True)
    a = keys([1])[0]
    old = request("old", [a])
    mgr.prepare_store([a], old)
    mgr.reset()
    mgr.complete_store([a], old, success=True)
    assert not mgr.contains(a)
    assert mgr.stats()["stores"] == 0
    assert mgr.take_events() == []
    assert mgr.stats()["free"] == 2


@pytest.mark.parametrize("success", [True, False])
def test_old_store_completion_does_not_touch_new_block_of_same_key(success: bool) -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    old = request("old", [a])
    mgr.prepare_store([a], old)
    mgr.reset()
    new = request("new", [a])
    out = mgr.prepare_store([a], new)
    assert out is not None and out.keys_to_store == [a]
    mgr.complete_store([a], old, success=success)
    assert mgr.contains(a)
    assert mgr.stats()["write_pending"] == 1  # still the new, unfinished store
    assert mgr.lookup([a], request("reader")) == 0
    mgr.complete_store([a], new)
    assert mgr.stats()["ready"] == 1


def test_reset_ignores_load_completions_from_before() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    fill(mgr, [a])
    old = request("old", [a])
    load_ids = mgr.prepare_load([a], old)
    assert load_ids.block_ids
    mgr.reset()
    fill(mgr, [a])
    reader = request("reader", [a])
    assert mgr.lookup([a], reader) == 1
    mgr.prepare_load([a], reader)
    mgr.complete_load([a], old)  # from before the reset: ignored
    assert mgr.stats()["pinned"] == 1
    with pytest.raises(ProtocolError):
        mgr.complete_load([a], old)  # owed nothing any more
    mgr.complete_load([a], reader)
    assert mgr.stats()["pinned"] == 0


def test_reset_ignores_every_old_load_of_a_key() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    fill(mgr, [a])
    r = request("r", [a])
    mgr.prepare_load([a], r)
    mgr.prepare_load([a], r)  # two loads of one key in flight
    mgr.reset()
    mgr.complete_load([a], r)
    mgr.complete_load([a], r)  # the second old completion is as void as the first
    assert mgr.stats()["pinned"] == 0


def test_old_load_completion_does_not_unpin_same_requests_new_load() -> None:
    mgr = OffloadManager(2)
    a, b, c = keys(range(3))
    fill(mgr, [a])
    r = request("r", [a])
    mgr.prepare_load([a], r)  # load 1 (before the reset)
    mgr.reset()
    fill(mgr, [a])
    assert mgr.lookup([a], r) == 1
    mgr.prepare_load([a], r)  # load 2: same request, same key, new block
    mgr.complete_load([a], r)  # load 1's completion arrives first
    assert mgr.stats()["pinned"] == 1  # load 2 still reads the slot
    out = mgr.prepare_store([b, c], request("w", [b, c]))
    assert out is None or a not in out.evicted_keys


def test_old_store_completion_does_not_complete_same_requests_new_grant() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    r = request("r", [a])
    mgr.prepare_store([a], r)  # store 1 (before the reset)
    mgr.reset()
    out = mgr.prepare_store([a], r)  # re-offered after the reset: store 2
    assert out is not None and out.keys_to_store == [a]
    mgr.complete_store([a], r, success=True)  # store 1's completion arrives first
    assert mgr.stats()["write_pending"] == 1  # store 2's bytes are not written yet
    assert mgr.lookup([a], request("reader")) == 0


def test_reset_without_owed_completions_lets_the_next_grant_complete() -> None:
    # vLLM drops the completions of jobs from before a reset and re-offers a
    # running request's blocks through the same context: its next completion
    # of a key is that of its next grant (absorbing it as the old one would
    # leave the block WRITING, and the load's pin held, for good)
    mgr = OffloadManager(2)
    a, b = keys(range(2))
    fill(mgr, [b])
    r = request("r", [a, b])
    assert mgr.lookup([b], r) == 1
    mgr.prepare_load([b], r)
    mgr.prepare_store([a], r)
    mgr.reset(owed_completions=False)
    out = mgr.prepare_store([a], r)
    assert out is not None and out.keys_to_store == [a]
    mgr.complete_store([a], r)
    fill(mgr, [b])
    assert mgr.lookup([b], r) == 1
    mgr.prepare_load([b], r)
    mgr.complete_load([b], r)
    mgr.on_request_finished(r)
    s = mgr.stats()
    assert (s["ready"], s["write_pending"], s["pinned"]) == (2, 0, 0)
    with pytest.raises(ProtocolError):
        mgr.complete_store([a], r)  # nothing is owed any more


def test_reset_holds_back_busy_slots_until_released() -> None:
    mgr = OffloadManager(3)
    mgr.reset(busy_slots=[1])
    out = mgr.prepare_store(keys(range(3)), request("w", keys(range(3))))
    assert out is None  # two slots for three blocks
    out = mgr.prepare_store(keys(range(2)), request("w2", keys(range(2))))
    assert out is not None and sorted(out.block_ids) == [0, 2]
    mgr.reset()  # a slot stays held back across resets until released
    assert mgr.stats()["free"] == 2 and mgr.debug_state()["held_back"] == 1
    mgr.release_slots([1, 1, 0])  # once each; a slot not held back is ignored
    assert mgr.stats()["free"] == 3 and mgr.debug_state()["held_back"] == 0
    with pytest.raises(ValueError, match="busy_slots"):
        mgr.reset(busy_slots=[3])


def test_a_slot_two_jobs_use_is_held_back_until_both_release_it() -> None:
    mgr = OffloadManager(4)
    ks = keys(range(4))
    fill(mgr, ks)
    job1 = mgr.pin_internal(ks[:1])
    job2 = mgr.pin_internal(ks[:1])  # a second write job reading the same slot
    mgr.reset(owed_completions=False, busy_slots=job1 + job2)
    mgr.release_slots(job1)
    assert mgr.debug_state()["held_back"] == 1 and mgr.stats()["free"] == 3
    out = mgr.prepare_store(keys(range(10, 14)), request("r", keys(range(10, 14))))
    assert out is None  # job 2 still reads that slot
    mgr.release_slots(job2)
    assert mgr.debug_state()["held_back"] == 0 and mgr.stats()["free"] == 4


def test_load_and_store_after_reset_work_normally() -> None:
    mgr = OffloadManager(4)
    ks = keys(range(2))
    fill(mgr, ks)
    r = request("r", ks)
    assert mgr.lookup(ks, r) == 2
    mgr.reset()
    assert mgr.lookup(ks, r) == 0
    fill(mgr, ks)
    ids = load(mgr, ks, r)
    assert len(set(ids)) == 2
    assert mgr.stats()["pinned"] == 0


def test_old_and_new_load_completed_in_one_call() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    fill(mgr, [a])
    r = request("r", [a])
    mgr.prepare_load([a], r)  # before the reset
    mgr.reset()
    fill(mgr, [a])
    mgr.prepare_load([a], r)  # after it
    mgr.complete_load([a, a], r)  # both completions in one call
    assert mgr.stats()["pinned"] == 0


def test_reset_twice_ignores_every_old_store_completion() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    r = request("r", [a])
    mgr.prepare_store([a], r)  # grant 1
    mgr.reset()
    out = mgr.prepare_store([a], r)  # grant 2 (the request re-offers after the reset)
    assert out is not None and out.keys_to_store == [a]
    mgr.reset()
    mgr.complete_store([a], r, success=False)  # grant 1's completion: void
    mgr.complete_store([a], r, success=False)  # grant 2's completion: just as void
    assert mgr.stats()["resident"] == 0


def test_old_store_is_not_a_load_to_complete() -> None:
    mgr = OffloadManager(2)
    a = keys([1])[0]
    r = request("r", [a])
    mgr.prepare_store([a], r)
    mgr.reset()
    with pytest.raises(ProtocolError):
        mgr.complete_load([a], r)  # r never loaded a
    mgr.complete_store([a], r)  # the store's own (void) completion is still accepted
