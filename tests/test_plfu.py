"""The PLFU policy (kvtier.policies.plfu): contract, behaviour, the bundled-trace target."""

from __future__ import annotations

import copy
import random
from collections.abc import Container, Sequence

import pytest
from helpers.policy_contract import OPS, exercise, plfu_invariants
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import OffloadManager, RequestContext
from kvtier.policies import (
    POLICIES,
    EvictionPolicy,
    PLFUPolicy,
    make_policy,
)
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.trace import BUNDLED_TRACE, load_trace


def k(i: int) -> bytes:
    return kvtier.block_key(i)


def ks(ids: range | list[int]) -> list[bytes]:
    return [k(i) for i in ids]


def _store(pol: PLFUPolicy, keys: list[bytes]) -> None:
    """What the manager does for a granted, completed store of ``keys``."""
    pol.blocked.update(keys)
    pol.insert(keys)
    pol.blocked.difference_update(keys)


def _request(pol: PLFUPolicy, keys: list[bytes], room: int | None = None) -> list[bytes]:
    """One request: evict room for its new keys, store them, apply its access."""
    new = [key for key in keys if pol.segment(key) is None]
    victims: list[bytes] = []
    free = (room if room is not None else pol.capacity) - len(pol)
    if len(new) > free:
        out = pol.evict(len(new) - free, set(keys))
        assert out is not None
        victims = out
    _store(pol, new)
    pol.on_access(keys, set())
    return victims


def _state(pol: EvictionPolicy) -> object:
    assert isinstance(pol, PLFUPolicy)
    """Everything a failed evict must leave unchanged."""
    state: dict[str, object] = {
        "window": list(pol._window), "recent": list(pol._recent.items()),
        "classes": [list(c) for c in pol._classes], "g1": (dict(pol._g1), dict(pol._g1_old)),
        "g2": (dict(pol._g2), dict(pol._g2_old)), "history": dict(pol.history),
        "numbers": (pol.target, pol.lfu_share, pol._carry, pol._base),
    }
    return copy.deepcopy(state)


# -- registration ------------------------------------------------------------------


def test_registered_under_its_name() -> None:
    assert POLICIES["plfu"] is PLFUPolicy
    assert type(make_policy("plfu", 3)) is PLFUPolicy
    assert "default" not in POLICIES  # an alias, not a second policy


def test_bad_history_factor() -> None:
    with pytest.raises(ValueError, match="history_factor"):
        PLFUPolicy(4, history_factor=0)


# -- behaviour ---------------------------------------------------------------------


def test_new_blocks_enter_window_and_reuse_promotes() -> None:
    pol = PLFUPolicy(8)
    _request(pol, ks(range(3)))
    assert [pol.segment(key) for key in ks(range(3))] == ["window"] * 3
    _request(pol, ks(range(2)))  # a second request uses the first two
    assert [pol.segment(key) for key in ks(range(3))] == ["main", "main", "window"]
    assert pol.history[k(0)] == 2 and pol.history[k(2)] == 1


def test_window_tail_leaves_before_head() -> None:
    pol = PLFUPolicy(4)
    _request(pol, ks(range(4)))  # one request: head 0 ... tail 3
    assert pol.evict(2, set()) == [k(3), k(2)]


def test_one_off_scan_does_not_flush_reused_blocks() -> None:
    pol = PLFUPolicy(10)
    hot = ks(range(4))
    _request(pol, hot)
    _request(pol, hot)  # reused: main segment
    for start in range(100, 400, 5):  # 60 one-off requests of 5 blocks
        _request(pol, ks(range(start, start + 5)))
    assert all(pol.segment(key) == "main" for key in hot)
    lru = OffloadManager(10, policy="lru")
    for i, keys in enumerate([hot, hot, *[ks(range(s, s + 5)) for s in range(100, 400, 5)]]):
        ctx = RequestContext(f"r{i}")
        out = lru.prepare_store(keys, ctx)
        assert out is not None
        lru.complete_store(out.keys_to_store, ctx)
        lru.on_request_finished(ctx)
    assert not any(lru.contains(key) for key in hot)  # LRU lost them


def test_seen_before_block_goes_to_main_when_stored_again() -> None:
    pol = PLFUPolicy(4)
    _request(pol, [k(1)])
    _request(pol, ks([2, 3, 4, 5]))  # evicts 1 (a window ghost)
    assert pol.segment(k(1)) is None
    target = pol.target
    _request(pol, [k(1)])  # offered again: its history says a request used it
    assert pol.segment(k(1)) == "main"
    assert pol.target == target + 1  # a window ghost came back: the window may keep more


def test_window_target_stops_at_max_window() -> None:
    """Window ghosts that keep coming back raise the target to half the cache, no further."""
    pol = PLFUPolicy(8)
    for round_ in range(6):
        old = ks(range(100 * round_, 100 * round_ + 8))
        _request(pol, old)
        _request(pol, ks(range(100 * round_ + 50, 100 * round_ + 58)))  # evicts them
        for key in old:
            _request(pol, [key])  # each comes back from the window's ghosts
    assert pol.target == 8 * PLFUPolicy.MAX_WINDOW


def test_main_ghost_lowers_target_and_teaches_share() -> None:
    pol = PLFUPolicy(4)
    pol.target = 3.0
    for _ in range(2):
        _request(pol, ks([1, 2]))  # main
    # fill with reused blocks so the main segment must pay
    for _ in range(2):
        _request(pol, ks([3, 4]))
    _request(pol, ks([5, 6]))  # window is empty: main pays two victims
    gone = [key for key in ks([1, 2, 3, 4]) if pol.segment(key) is None]
    assert len(gone) == 2
    share = pol.lfu_share
    _request(pol, gone[:1])
    assert pol.target < 3.0
    assert pol.lfu_share != share


def test_evict_skips_blocked_and_protected_or_fails_atomically() -> None:
    pol = PLFUPolicy(6)
    _request(pol, ks(range(3)))
    _request(pol, ks(range(3)))  # main
    _request(pol, ks(range(10, 13)))  # window
    pol.blocked.update([k(10), k(0)])
    before = _state(pol)
    assert pol.evict(5, {k(11)}) is None  # only 3 evictable
    assert _state(pol) == before
    victims = pol.evict(3, {k(11)})
    assert victims is not None and len(set(victims)) == 3
    assert not {k(10), k(0), k(11)} & set(victims)
    assert len(pol) == 3
    assert pol.evict(0, set()) == []


def test_remove_and_clear() -> None:
    pol = PLFUPolicy(4)
    _request(pol, ks([1, 2]))
    _request(pol, ks([1]))
    pol.remove(k(1))
    pol.remove(k(2))
    pol.remove(k(9))  # unknown: ignored
    assert len(pol) == 0
    _request(pol, ks([3]))
    pol.blocked.add(k(3))
    pol.clear()
    assert len(pol) == 0 and not pol.blocked and not pol.history
    assert pol.sizes()["ghost_window"] == 0


def test_history_is_aged_and_bounded() -> None:
    pol = PLFUPolicy(4, history_factor=2)  # at most 8 entries
    for i in range(200):
        _request(pol, [k(i)])
        assert len(pol.history) <= 8
    sizes = pol.sizes()
    assert sizes["window"] + sizes["main"] == len(pol) <= 4
    assert sizes["ghost_window"] <= 2 * 4 and sizes["ghost_main"] <= 2 * 4


# -- the contract under random use ---------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), OPS, st.integers(0, 2**32))
def test_random_operations_keep_the_contract(capacity: int, ops: list, seed: int) -> None:
    exercise(PLFUPolicy(capacity, history_factor=2), ops, random.Random(seed),
             invariants=plfu_invariants, snapshot=_state)


# -- the bundled trace -----------------------------------------------------------------


def test_beats_lru_by_half_again_on_bundled_trace_at_1000() -> None:
    keys = trace_keys(load_trace(BUNDLED_TRACE))
    lru = replay(keys, 1_000, "lru")
    mine = replay(keys, 1_000, "default")
    assert mine.hit_ratio >= 1.5 * lru.hit_ratio, (mine.hit_ratio, lru.hit_ratio)
    assert mine.hit_ratio >= 0.067
    assert mine.allocation_failures == 0


def test_aging_keeps_resident_blocks_counted() -> None:
    pol = PLFUPolicy(4, history_factor=2)  # history of at most 8 keys
    _request(pol, [k(1)])
    pol.on_access(ks(range(100, 120)), set())  # 20 keys seen elsewhere: aging drops 1s
    assert pol.history.get(k(1)) == 1 and len(pol.history) <= 8
    pol.on_access([k(1)], set())  # its second use still promotes it
    assert pol.segment(k(1)) == "main"


def test_main_segment_evicts_tails_before_heads() -> None:
    pol = PLFUPolicy(6)
    pol.target = 0.0
    chain = ks(range(6))
    _request(pol, chain)
    _request(pol, chain)  # all six in main, head most recent
    pol.lfu_share = 1.0 - pol.MIN_SHARE
    assert pol.evict(3, set()) == chain[:2:-1]  # 5, 4, 3: the tail
    pol.lfu_share = pol.MIN_SHARE
    assert pol.evict(2, set()) == [k(2), k(1)]


def test_first_unseen_and_enter_main() -> None:
    pol = PLFUPolicy(16)
    keys = [kvtier.block_key(i) for i in range(6)]
    pol.insert(keys[:4])
    pol.on_access(keys[:4], set())
    assert pol.first_unseen(keys) == 4
    assert pol.first_unseen(keys[:4]) == 4
    assert pol.first_unseen(keys[4:]) == 0
    pol.insert(keys[4:])
    assert pol.first_unseen(keys) == 4  # stored, still never used
    pol.on_access(keys, set())  # blocks 0-3: a second use, to main
    assert [pol.segment(key) for key in keys] == ["main"] * 4 + ["window"] * 2
    history = len(pol.history)
    pol.enter_main([*keys[4:], kvtier.block_key(99)])  # 99: not resident, ignored
    assert [pol.segment(key) for key in keys] == ["main"] * 6
    assert len(pol.history) == history and pol.history[keys[5]] == 1
    assert pol.evict(1, set(keys[:4])) == [keys[5]]  # the tail goes first


class _LoopOnly(PLFUPolicy):
    """PLFU that applies every access key by key (no set operation for new blocks)."""

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        self._apply_access(keys, len(keys))


@pytest.mark.parametrize("seed", range(6))
def test_new_blocks_set_operation_applies_what_the_loop_would(seed: int) -> None:
    # Requests of prefix chains, and shuffled ones whose known keys are not a
    # prefix (so first_unseen's bisection can be wrong and the checks must catch it)
    rng = random.Random(seed)
    fast, loop = PLFUPolicy(24), _LoopOnly(24)
    for _ in range(1500):
        start, length = rng.randrange(60), rng.randrange(1, 12)
        ids = list(range(start, start + length))
        if rng.random() < 0.3:
            rng.shuffle(ids)
        keys = ks(ids)
        room = rng.choice([None, 20])
        assert _request(fast, keys, room) == _request(loop, keys, room)
        assert _state(fast) == _state(loop)
        assert fast._fresh == loop._fresh and fast._counts == loop._counts
