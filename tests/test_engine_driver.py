"""The engine-faithful replay driver (kvtier.replay.engine)."""

from __future__ import annotations

import pytest

from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.engine import EngineConfig, EngineStats, replay_engine
from kvtier.replay.generate import generate
from kvtier.replay.trace import TraceRequest


def _keys(*chains: list[int]) -> list[list[bytes]]:
    return trace_keys([TraceRequest(i, 1, 1, tuple(c)) for i, c in enumerate(chains)])


@pytest.fixture(scope="module")
def chat() -> list[list[bytes]]:
    return trace_keys(generate("chat", seed=11, requests=1500))


@pytest.mark.parametrize("policy", ["lru", "arc", "plfu"])
def test_one_at_a_time_matches_the_sequential_driver(chat: list[list[bytes]],
                                                     policy: str) -> None:
    a = replay(chat, 300, policy)
    b = replay_engine(chat, 300, policy, EngineConfig(concurrency=1, max_delay=0))
    same = ("hit_blocks", "offered_blocks", "stores", "evictions", "allocation_failures")
    assert [getattr(a, f) for f in same] == [getattr(b, f) for f in same]
    assert (b.driver, b.concurrency, b.preemptions) == ("engine", 1, 0)


def test_concurrent_requests_with_late_out_of_order_completions(chat: list[list[bytes]]) -> None:
    stats = EngineStats()
    r = replay_engine(chat, 400, "plfu", EngineConfig(concurrency=8, max_delay=3, seed=1),
                      stats=stats, record_events=True)
    assert stats.max_in_flight == 8
    assert stats.late_store_completions > 0  # completions after their request finished
    finishes = [i for _, what, i in stats.events if what == "finish"]
    assert sorted(finishes) == list(range(len(chat)))
    assert finishes != sorted(finishes)  # requests finish out of order
    assert r.requests == len(chat) and 0 < r.hit_ratio < 1
    again = replay_engine(chat, 400, "plfu", EngineConfig(concurrency=8, max_delay=3, seed=1))
    assert (again.hit_blocks, again.stores) == (r.hit_blocks, r.stores)  # seeded


def test_allocation_failures_are_retried_then_abandoned() -> None:
    # 2-block cache, requests of 2 new blocks in flight together: a store finds every
    # slot being written by another request until those completions arrive
    keys = _keys(*([2 * i, 2 * i + 1] for i in range(60)))
    stats = EngineStats()
    patient = replay_engine(keys, 2, "lru", EngineConfig(concurrency=4, max_delay=3, seed=2),
                            stats=stats)
    assert patient.allocation_failures > 0 and stats.store_retries > 0
    assert patient.allocation_failures == stats.store_retries + patient.stores_abandoned
    impatient = replay_engine(keys, 2, "lru",
                              EngineConfig(concurrency=4, max_delay=3, seed=2,
                                           max_store_retries=0))
    assert impatient.stores_abandoned > patient.stores_abandoned
    assert impatient.stores < patient.stores


def test_preempted_requests_reoffer_without_counting_twice() -> None:
    # every block is offered by one request only; with store_threshold 2 nothing may
    # be stored, even though preempted requests offer their blocks a second time
    keys = _keys(*([3 * i, 3 * i + 1, 3 * i + 2] for i in range(80)))
    stats = EngineStats()
    r = replay_engine(keys, 50, "plfu", EngineConfig(concurrency=4, preempt=0.5, seed=3),
                      store_threshold=2, stats=stats, record_events=True)
    assert r.preemptions > 10
    assert r.stores == 0 and r.stores_skipped == 3 * 80
    preempted = {i for _, what, i in stats.events if what == "preempt"}
    offers: dict[int, int] = {}
    for _, what, i in stats.events:
        if what == "offer":
            offers[i] = offers.get(i, 0) + 1
    assert all(offers[i] == 2 for i in preempted)
    assert all(n == 1 for i, n in offers.items() if i not in preempted)


def test_preempted_request_counts_its_first_lookup_only() -> None:
    keys = _keys([1, 2], [1, 2, 3], [1, 2, 3, 4])
    plain = replay_engine(keys, 10, "lru", EngineConfig(concurrency=1, max_delay=0))
    preempted = replay_engine(keys, 10, "lru",
                              EngineConfig(concurrency=1, max_delay=0, preempt=0.99))
    assert preempted.preemptions == 3
    assert preempted.hit_blocks == plain.hit_blocks == 5
    assert preempted.stores == plain.stores == 4


def test_manager_is_idle_after_the_run(chat: list[list[bytes]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier import OffloadManager
    from kvtier.replay import engine

    seen: list[OffloadManager] = []
    original = engine._Engine.__init__

    def spy(self: engine._Engine, mgr: OffloadManager, *args: object) -> None:
        seen.append(mgr)
        original(self, mgr, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine._Engine, "__init__", spy)
    replay_engine(chat[:400], 200, "arc",
                  EngineConfig(concurrency=6, max_delay=4, preempt=0.2, seed=4))
    stats = seen[0].stats()
    assert stats["pinned"] == stats["leased"] == stats["write_pending"] == 0
    assert stats["resident"] + stats["free"] == 200


@pytest.mark.parametrize(
    "kwargs",
    [{"concurrency": 0}, {"max_delay": -1}, {"preempt": 1.0}, {"max_store_retries": -2},
     {"concurrency": True}],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_progress_counts_every_request(chat: list[list[bytes]]) -> None:
    seen: list[int] = []
    replay_engine(chat, 100, "lru", EngineConfig(concurrency=3), progress=seen.append)
    assert sum(seen) == len(chat)
