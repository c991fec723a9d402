"""Admission by offer count (``store_threshold``), DESIGN.md §4."""

from __future__ import annotations

import time

import pytest
from conftest import fill, keys, request

from kvtier import OffloadManager

A, B, C, D = keys(range(4))


def tracker_size(mgr: OffloadManager) -> int:
    return mgr.debug_state()["tracker_size"]


# -- oversized offers ----------------------------------------------------------------


def test_oversized_offer_second_request_stores_first_three() -> None:
    mgr = OffloadManager(16, store_threshold=2, max_tracker_size=3)
    first = mgr.prepare_store([A, B, C, D], request("r1"))
    assert first is not None and first.keys_to_store == []
    assert tracker_size(mgr) == 3
    assert [mgr.admission_count(k) for k in (A, B, C, D)] == [1, 1, 1, 0]

    second = mgr.prepare_store([A, B, C, D], request("r2"))
    assert second is not None
    assert second.keys_to_store == [A, B, C]
    assert len(second.block_ids) == 3
    assert tracker_size(mgr) == 3


def test_oversized_offer_repeated_by_many_requests_keeps_storing_and_bounded() -> None:
    mgr = OffloadManager(64, store_threshold=2, max_tracker_size=3)
    offer = keys(range(10))
    stored: list[bytes] = []
    for i in range(12):
        ctx = request(f"r{i}", offer)
        out = mgr.prepare_store(offer, ctx)
        assert out is not None
        assert tracker_size(mgr) <= 3
        if out.keys_to_store:
            mgr.complete_store(out.keys_to_store, ctx)
            stored += out.keys_to_store
        mgr.on_request_finished(ctx)
    # Progress every second request, three keys at a time, head of the offer first.
    assert stored[:3] == offer[:3]
    assert len(stored) >= 9
    assert len(set(stored)) == len(stored)


def test_tracked_key_of_offer_not_pushed_out_by_new_keys_of_same_offer() -> None:
    mgr = OffloadManager(16, store_threshold=3, max_tracker_size=3)
    x, y, n1, n2, n3 = keys(range(10, 15))
    mgr.prepare_store([A], request("r1"))  # tracker: A (oldest)
    mgr.prepare_store([x, y], request("r2"))  # tracker: A, x, y
    assert tracker_size(mgr) == 3

    # A is tracked and the least recently offered entry; it comes last in the offer.
    mgr.prepare_store([n1, n2, n3, A], request("r3"))
    assert mgr.admission_count(A) == 2
    assert tracker_size(mgr) == 3
    assert mgr.admission_count(x) == 0 and mgr.admission_count(y) == 0
    assert [mgr.admission_count(k) for k in (n1, n2, n3)] == [1, 1, 0]


def test_offer_when_every_tracker_entry_is_protected_tracks_no_new_keys() -> None:
    mgr = OffloadManager(16, store_threshold=3, max_tracker_size=2)
    n1, n2 = keys(range(20, 22))
    mgr.prepare_store([A, B], request("r1"))
    mgr.prepare_store([n1, A, n2, B], request("r2"))
    assert mgr.admission_count(A) == 2 and mgr.admission_count(B) == 2
    assert mgr.admission_count(n1) == 0 and mgr.admission_count(n2) == 0
    assert tracker_size(mgr) == 2


def _offer_seconds(n: int) -> float:
    """Best-of-5 seconds to record one offer of ``n`` new keys into a full tracker."""
    best = float("inf")
    for rep in range(5):
        mgr = OffloadManager(8, store_threshold=2, max_tracker_size=n // 2)
        mgr.prepare_store(keys(range(10**9, 10**9 + n // 2)), request(f"fill{rep}"))
        half_tracked = keys(range(10**9 + n // 4, 10**9 + n // 4 + n))
        ctx = request(f"big{rep}")
        start = time.perf_counter()
        mgr.prepare_store(half_tracked, ctx)
        best = min(best, time.perf_counter() - start)
        assert tracker_size(mgr) == n // 2
    return best


def test_admission_work_is_linear_in_offer_length() -> None:
    small, large = _offer_seconds(2_000), _offer_seconds(32_000)
    # 16x the keys: linear work is ~16x, quadratic would be ~256x.
    assert large < 60 * max(small, 1e-3), (small, large)


# -- once per request ----------------------------------------------------------------


def _all_leased(n: int, threshold: int) -> tuple[OffloadManager, list[bytes]]:
    """A full cache of ``n`` ready blocks, all leased by an idle request (no room)."""
    mgr = OffloadManager(n, store_threshold=threshold, max_leased_blocks=n)
    ks = keys(range(100, 100 + n))
    for i in range(threshold):
        fill(mgr, ks, f"warm{i}")
    assert all(mgr.contains(k) for k in ks)
    assert mgr.lookup(ks, request("holder")) == n
    return mgr, ks


def test_retry_after_no_room_does_not_count_again() -> None:
    mgr, _ = _all_leased(2, threshold=2)
    mgr.prepare_store([A], request("r0"))
    assert mgr.admission_count(A) == 1
    r1 = request("r1", [A, B])
    assert mgr.prepare_store([A, B], r1) is None  # A reached 2: admitted, but no room
    assert (mgr.admission_count(A), mgr.admission_count(B)) == (2, 1)
    for _ in range(3):
        assert mgr.prepare_store([A, B], r1) is None
    assert (mgr.admission_count(A), mgr.admission_count(B)) == (2, 1)
    assert mgr.stats()["allocation_failures"] == 4


def test_reoffer_through_same_context_does_not_count_again() -> None:
    mgr = OffloadManager(16, store_threshold=3)
    r1 = request("r1", [A])
    for _ in range(5):  # preempted and rescheduled: the same request offers A again
        out = mgr.prepare_store([A], r1)
        assert out is not None and out.keys_to_store == []
    assert mgr.admission_count(A) == 1
    assert not mgr.contains(A)


def test_reoffer_after_granted_and_evicted_does_not_count_again() -> None:
    mgr = OffloadManager(1, store_threshold=2)
    r1, r2 = request("r1", [A]), request("r2", [A])
    mgr.prepare_store([A], r1)
    out = mgr.prepare_store([A], r2)
    assert out is not None and out.keys_to_store == [A]
    mgr.complete_store([A], r2)
    fill(mgr, [B])  # threshold: B is only counted
    fill(mgr, [B])
    assert not mgr.contains(A)  # evicted to make room for B
    mgr.prepare_store([A], r2)  # r2 re-offers after preemption
    assert mgr.admission_count(A) == 2


def test_retry_refreshes_tracker_position() -> None:
    mgr = OffloadManager(16, store_threshold=3, max_tracker_size=3)
    r1 = request("r1")
    mgr.prepare_store([A], r1)
    mgr.prepare_store([B, C], request("r2"))  # tracker: A, B, C
    mgr.prepare_store([A], r1)  # retry: A becomes the most recently offered
    assert mgr.admission_count(A) == 1
    mgr.prepare_store([D], request("r3"))  # pushes out the least recent: B
    assert mgr.admission_count(A) == 1
    assert mgr.admission_count(B) == 0
    assert mgr.admission_count(C) == 1


def test_stores_skipped_counts_each_key_once_per_request() -> None:
    mgr = OffloadManager(16, store_threshold=4)
    r1 = request("r1")
    for _ in range(3):
        mgr.prepare_store([A, B, A], r1)
    assert mgr.stats()["stores_skipped"] == 2
    mgr.prepare_store([A, B], request("r2"))
    assert mgr.stats()["stores_skipped"] == 4


def test_stores_skipped_once_per_request_for_untracked_keys() -> None:
    mgr = OffloadManager(16, store_threshold=2, max_tracker_size=1)
    r1 = request("r1")
    for _ in range(3):
        mgr.prepare_store([A, B], r1)  # B never fits in the tracker
    assert mgr.admission_count(B) == 0
    assert mgr.stats()["stores_skipped"] == 2


def test_offers_from_other_requests_count_normally() -> None:
    mgr = OffloadManager(16, store_threshold=3)
    for i in range(2):
        out = mgr.prepare_store([A], request(f"r{i}"))
        assert out is not None and out.keys_to_store == []
        assert mgr.admission_count(A) == i + 1
    out = mgr.prepare_store([A], request("r2"))
    assert out is not None and out.keys_to_store == [A]
    assert mgr.admission_count(A) == 3
    assert mgr.stats()["stores_skipped"] == 2


def test_duplicate_key_in_one_offer_counts_once() -> None:
    mgr = OffloadManager(16, store_threshold=2)
    out = mgr.prepare_store([A, A, A], request("r1"))
    assert out is not None and out.keys_to_store == []
    assert mgr.admission_count(A) == 1


def test_reset_restarts_counting_of_every_request() -> None:
    mgr = OffloadManager(16, store_threshold=3)
    r1 = request("r1")
    mgr.prepare_store([A], r1)
    assert mgr.stats()["stores_skipped"] == 1
    mgr.reset()
    assert mgr.admission_count(A) == 0
    assert mgr.debug_state()["tracker_size"] == 0
    mgr.prepare_store([A], request("r2"))
    assert mgr.admission_count(A) == 1
    mgr.prepare_store([A], r1)  # r1 counted A before the reset: it counts again now
    assert mgr.admission_count(A) == 2
    assert mgr.stats()["stores_skipped"] == 3


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_threshold_one_admits_on_first_offer_and_tracks_nothing(policy: str) -> None:
    mgr = OffloadManager(8, policy=policy, store_threshold=1, max_tracker_size=1)
    ks = keys(range(5))
    r1 = request("r1", ks)
    out = mgr.prepare_store(ks, r1)
    assert out is not None and out.keys_to_store == ks
    mgr.prepare_store(ks, r1)
    assert [mgr.admission_count(k) for k in ks] == [0] * 5
    assert mgr.stats()["stores_skipped"] == 0
    assert mgr.debug_state()["tracker_size"] == 0


# -- the threshold filters new candidates only -------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_resident_ready_key_offered_again_is_reuse_not_candidate(policy: str) -> None:
    mgr = OffloadManager(4, policy=policy, store_threshold=2, max_tracker_size=2)
    fill(mgr, [A])
    fill(mgr, [A])
    assert mgr.contains(A)
    mgr.prepare_store(keys(range(50, 52)), request("flood"))  # A leaves the tracker
    assert mgr.admission_count(A) == 0
    skipped = mgr.stats()["stores_skipped"]

    r = request("r", [A])
    out = mgr.prepare_store([A], r)
    assert out == ([], [], [])
    assert mgr.stats()["stores_skipped"] == skipped  # not a skipped store
    assert mgr.contains(A)
    mgr.on_request_finished(r)
    if policy == "arc":
        assert A in mgr.policy._t2  # reused by a request: moved to T2
