"""Belady's OPT and the infinite-cache bound (kvtier.replay.bounds) and their rows."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.replay.bounds import NEVER, belady, flatten, infinite, next_uses
from kvtier.replay.driver import bound_results, replay, trace_keys
from kvtier.replay.trace import BUNDLED_TRACE, TraceRequest, load_trace

README_OPT = {1_000: 0.1907, 4_000: 0.3223, 16_000: 0.3664}
"""Belady OPT column of data/mooncake/README.md."""


def _best_hits(seq: list[int], capacity: int) -> int:
    """Exhaustive optimum: every choice of what to keep after each miss (tiny inputs)."""
    best = 0

    def walk(t: int, cache: frozenset[int], hits: int) -> None:
        nonlocal best
        if t == len(seq):
            best = max(best, hits)
            return
        key = seq[t]
        if key in cache:
            walk(t + 1, cache, hits + 1)
            return
        walk(t + 1, cache, hits)  # bypass
        if len(cache) < capacity:
            walk(t + 1, cache | {key}, hits)
        else:
            for victim in cache:
                walk(t + 1, (cache - {victim}) | {key}, hits)

    walk(0, frozenset(), 0)
    return best


def test_next_uses() -> None:
    assert next_uses(["a", "b", "a", "c", "b", "a"]) == [2, 4, 5, NEVER, NEVER, NEVER]
    assert next_uses([]) == []


@pytest.mark.parametrize(
    ("seq", "capacity", "hits"),
    [
        ([1, 2, 1, 2], 1, 1),  # keep one of them; bypass the other
        ([1, 2, 3, 1, 2, 3], 2, 2),  # LRU gets 0 here
        ([1, 1, 1], 1, 2),
        ([1, 2, 3, 4], 2, 0),
        ([1, 2, 3, 2, 1, 3, 1], 2, 3),
    ],
)
def test_belady_small_cases(seq: list[int], capacity: int, hits: int) -> None:
    result = belady(seq, capacity)
    assert result.hits == hits == _best_hits(seq, capacity)
    assert result.accesses == len(seq)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=11), st.integers(1, 3))
def test_belady_is_the_optimum(seq: list[int], capacity: int) -> None:
    assert belady(seq, capacity).hits == _best_hits(seq, capacity)


def test_belady_bounds_every_cache_and_grows_with_capacity() -> None:
    rng = random.Random(3)
    seq = [int(rng.paretovariate(1.2)) for _ in range(3000)]
    previous = -1
    for capacity in (1, 2, 4, 8, 16, 64, 10_000):
        hits = belady(seq, capacity).hits
        assert hits >= previous
        previous = hits
    assert previous == infinite(seq).hits  # big enough: every reuse hits


def test_belady_rejects_bad_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        belady([1], 0)


def test_infinite() -> None:
    r = infinite(["a", "b", "a", "a", "c"])
    assert (r.accesses, r.hits, r.stores, r.evictions) == (5, 2, 3, 0)
    assert r.hit_ratio == pytest.approx(0.4)
    assert infinite([]).hit_ratio == 0.0


def test_flatten_keeps_request_order() -> None:
    assert flatten([[1, 2], [], [3]]) == [1, 2, 3]


def test_bound_rows_cap_every_policy_on_a_small_trace() -> None:
    chains = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [6, 7], [1, 5], [1, 2, 4, 8]]
    keys = trace_keys([TraceRequest(i, 1, 1, tuple(c)) for i, c in enumerate(chains)])
    rows = bound_results(keys, [2, 4], block_bytes=10)
    assert [(r.policy, r.capacity) for r in rows] == [("opt", 2), ("opt", 4), ("infinite", 8)]
    assert rows[-1].hit_blocks == sum(map(len, chains)) - 8
    for r in rows:
        assert r.driver == "bound" and r.us_per_key == 0.0
        assert r.bytes_written == 10 * r.stores
    for capacity, opt in zip((2, 4), rows, strict=False):
        for policy in ("lru", "arc", "plfu"):
            assert replay(keys, capacity, policy).hit_blocks <= opt.hit_blocks
    only_inf = bound_results(keys, [2], opt=False)
    assert [r.policy for r in only_inf] == ["infinite"]


def test_bundled_trace_reproduces_readme_opt() -> None:
    keys = trace_keys(load_trace(BUNDLED_TRACE))
    rows = bound_results(keys, sorted(README_OPT))
    for r in rows[:-1]:
        assert round(r.hit_ratio, 4) == README_OPT[r.capacity], r
    assert round(rows[-1].hit_ratio, 4) == 0.3664
    assert rows[-1].capacity == 182_790


def _naive_belady(seq: list[int], capacity: int) -> int:
    """Belady with a linear scan for the farthest next use (no heap)."""
    nxt = next_uses(seq)
    resident: dict[int, int] = {}
    hits = 0
    for t, key in enumerate(seq):
        if key in resident:
            hits += 1
            resident[key] = nxt[t]
            continue
        if nxt[t] == NEVER:
            continue
        if len(resident) >= capacity:
            victim = max(resident, key=resident.__getitem__)
            if resident[victim] <= nxt[t]:
                continue
            del resident[victim]
        resident[key] = nxt[t]
    return hits


@pytest.mark.parametrize("capacity", [1, 2, 5, 17])
def test_heap_with_lazy_deletion_matches_a_linear_scan(capacity: int) -> None:
    rng = random.Random(capacity)
    seq = [min(int(rng.paretovariate(1.1)), 60) for _ in range(4000)]  # many hits: rebuilds
    assert belady(seq, capacity).hits == _naive_belady(seq, capacity)
