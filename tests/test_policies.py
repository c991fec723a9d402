"""Policies: LRU, ARC and custom ones by ``module.path:ClassName``, DESIGN.md §5."""

from __future__ import annotations

import argparse
import random
from collections.abc import Container

import pytest
from conftest import evict_order, fill, keys, load, request, store
from helpers.custom_policy import NewestFirstPolicy
from helpers.policy_contract import drive_manager, exercise, random_ops

import kvtier
from kvtier import OffloadManager
from kvtier.policies import ARCPolicy, LRUPolicy, policy_class
from kvtier.policies.order import KeyOrder

CUSTOM = "helpers.custom_policy:NewestFirstPolicy"


def arc_lists(mgr: OffloadManager) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    p = mgr.policy
    assert isinstance(p, ARCPolicy)
    return list(p._t1), list(p._t2), list(p._b1), list(p._b2)


# -- built-in names ------------------------------------------------------------------


def test_builtin_policies_by_name() -> None:
    assert {"lru", "arc"} <= set(kvtier.POLICIES)
    assert isinstance(OffloadManager(4, policy="lru").policy, LRUPolicy)
    assert isinstance(OffloadManager(4, policy="arc").policy, ARCPolicy)
    assert OffloadManager(4, policy="arc").policy.capacity == 4


def test_unknown_policy_name_lists_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        OffloadManager(4, policy="lfu")
    message = str(err.value)
    assert "'lfu'" in message
    assert "lru" in message and "arc" in message


def test_policy_list_argument_names_the_policy_it_cannot_load() -> None:
    from kvtier.argtypes import policy_list

    assert policy_list("lru, default,lru,helpers.custom_policy:NewestFirstPolicy") == [
        "lru", "default", "helpers.custom_policy:NewestFirstPolicy"]
    for text, named in (("lru,lfu", "'lfu'"), ("lru,helpers.custom_policy:Missing", "Missing"),
                        ("lru,", "empty name")):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            policy_list(text)


@pytest.mark.parametrize(
    "name",
    [
        "no_such_module_kvtier_test:Policy",
        "helpers.custom_policy:Missing",
        "helpers.custom_policy:NotAPolicy",
    ],
)
def test_bad_custom_policy_path_is_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        OffloadManager(4, policy=name)


def test_policy_name_must_be_str() -> None:
    with pytest.raises(TypeError):
        OffloadManager(4, policy=LRUPolicy)  # type: ignore[arg-type]


# -- custom policies -----------------------------------------------------------------


def test_custom_policy_loads_from_module_path_and_decides_evictions() -> None:
    assert policy_class(CUSTOM) is NewestFirstPolicy
    mgr = OffloadManager(3, policy=CUSTOM)
    assert isinstance(mgr.policy, NewestFirstPolicy)
    assert mgr.policy.capacity == 3
    a, b, c, d = keys(range(4))
    for k in (a, b, c):
        fill(mgr, [k])
    out = mgr.prepare_store([d], request("r", [d]))
    assert out is not None
    assert out.evicted_keys == [c]  # LRU would have taken a


def test_custom_policy_sees_inserts_misses_blocking_removals_and_accesses() -> None:
    mgr = OffloadManager(4, policy=CUSTOM)
    policy = mgr.policy
    assert isinstance(policy, NewestFirstPolicy)
    a, b, c = keys(range(3))
    fill(mgr, [a])
    r = request("r", [a, b, c])
    load(mgr, [a], r)
    out = mgr.prepare_store([a, b, c], r)
    assert out is not None and out.keys_to_store == [b, c]
    assert {b, c} <= policy.blocked  # being written: not evictable
    mgr.complete_store([b], r)
    mgr.complete_store([c], r, success=False)
    assert b not in policy.blocked and c not in policy.blocked
    mgr.on_request_finished(r)
    calls = policy.calls
    inserted_bc = calls.index(("insert", [b, c]))
    assert calls.index(("store_miss", b)) < inserted_bc  # shown before insertion
    assert calls.index(("store_miss", c)) < inserted_bc
    assert ("remove", c) in calls
    last_access = [arg for name, arg in calls if name == "access"][-1]
    access_keys, reused = last_access
    assert [k for k in access_keys if k != c] == [a, b]  # head first (c left: may be absent)
    assert reused == {a}  # a was found ready; b is the request's own store
    assert len(policy) == 2


# -- LRU -----------------------------------------------------------------------------


def test_lru_evicts_least_recent_request_first() -> None:
    mgr = OffloadManager(4, policy="lru")
    ks = keys(range(4))
    for k in ks:
        fill(mgr, [k])
    r = request("r", [ks[0]])
    load(mgr, [ks[0]], r)
    mgr.on_request_finished(r)
    assert evict_order(mgr, ks, 4) == [ks[1], ks[2], ks[3], ks[0]]


# -- ARC -----------------------------------------------------------------------------


def test_arc_new_keys_enter_t1() -> None:
    mgr = OffloadManager(4, policy="arc")
    a, b = keys(range(2))
    r = request("r", [a, b])
    out = mgr.prepare_store([a, b], r)
    assert out is not None
    t1, t2, _, _ = arc_lists(mgr)
    assert set(t1) == {a, b} and t2 == []
    mgr.complete_store([a, b], r)
    mgr.touch([a, b], r)  # its own blocks: not a reuse
    mgr.on_request_finished(r)
    t1, t2, _, _ = arc_lists(mgr)
    assert set(t1) == {a, b} and t2 == []


def test_arc_reused_key_moves_to_t2_once_at_finish() -> None:
    mgr = OffloadManager(4, policy="arc")
    a, b, c = keys(range(3))
    fill(mgr, [a, b, c])
    r = request("r", [a, b])
    for _ in range(3):
        load(mgr, [a, b], r)
    mgr.touch([b], r)
    mgr.touch([b, b], r)
    assert mgr.prepare_store([a, b], r) == ([], [], [])
    t1, t2, _, _ = arc_lists(mgr)
    assert t2 == []  # applied when the request finishes
    mgr.on_request_finished(r)
    t1, t2, _, _ = arc_lists(mgr)
    assert t1 == [c]
    assert t2 == [b, a]  # one head-to-tail access: the head a is most recent
    # a later request reusing b moves it within T2
    r2 = request("r2", [b])
    load(mgr, [b], r2)
    mgr.on_request_finished(r2)
    t1, t2, _, _ = arc_lists(mgr)
    assert t1 == [c] and t2 == [a, b]


def test_arc_key_written_by_other_request_reused_only_when_ready() -> None:
    mgr = OffloadManager(4, policy="arc")
    a = keys([0])[0]
    writer = request("w", [a])
    assert mgr.prepare_store([a], writer) is not None
    r = request("r", [a])
    mgr.touch([a], r)  # still being written: not a reuse
    mgr.complete_store([a], writer)
    mgr.on_request_finished(writer)
    mgr.on_request_finished(r)
    t1, t2, _, _ = arc_lists(mgr)
    assert t1 == [a] and t2 == []


def _arc_with_ghost_in_b1() -> tuple[OffloadManager, list[bytes]]:
    """ARC of 4 full blocks: ``x`` in T2, ``b, c, d`` in T1, ``a`` (evicted) in B1."""
    mgr = OffloadManager(4, policy="arc", max_leased_blocks=4)
    a, b, c, d, x = ks = keys(range(5))
    fill(mgr, [x])
    r = request("reuse", [x])
    load(mgr, [x], r)
    mgr.on_request_finished(r)
    for k in (a, b, c, d):
        fill(mgr, [k])
    t1, t2, b1, b2 = arc_lists(mgr)
    assert (t1, t2, b1, b2) == ([b, c, d], [x], [a], [])
    assert mgr.policy.target == 0
    return mgr, ks


def test_arc_ghost_hit_adapts_target_before_insertion() -> None:
    mgr, (a, *_) = _arc_with_ghost_in_b1()
    r = request("r", [a])
    out = mgr.prepare_store([a], r)
    assert out is not None and out.keys_to_store == [a]
    assert mgr.policy.target == 1
    t1, _, b1, _ = arc_lists(mgr)
    assert a in t1 and a not in b1


def test_arc_ghost_hit_adapts_target_once_per_request() -> None:
    mgr, (a, b, c, d, x) = _arc_with_ghost_in_b1()
    holder = request("holder")
    assert mgr.lookup([b, c, d, x], holder) == 4  # no room for anyone
    r = request("r", [a])
    for _ in range(3):
        assert mgr.prepare_store([a], r) is None
    assert mgr.policy.target == 1
    mgr.release(holder)
    out = mgr.prepare_store([a], r)
    assert out is not None and out.keys_to_store == [a]
    assert mgr.policy.target == 1


def test_arc_ghost_hits_in_b1_and_b2_move_target_both_ways() -> None:
    mgr = OffloadManager(2, policy="arc")
    a, b, c = keys(range(3))
    fill(mgr, [a])
    r = request("r", [a])
    load(mgr, [a], r)
    mgr.on_request_finished(r)  # a: T2
    fill(mgr, [b])  # b: T1
    out = store(mgr, [c], request("rc", [c]))
    assert out.evicted_keys == [b]  # |T1| > target 0: from T1
    assert arc_lists(mgr)[2] == [b]
    out = store(mgr, [b], request("rb", [b]))  # B1 hit: target up
    assert mgr.policy.target == 1
    assert out.evicted_keys == [a]  # |T1| == target: from T2
    assert arc_lists(mgr)[3] == [a]
    out = store(mgr, [a], request("ra", [a]))  # B2 hit: target down
    assert mgr.policy.target == 0
    assert out.evicted_keys == [c]


def test_arc_ghost_lists_bounded_by_capacity() -> None:
    cap = 4
    mgr = OffloadManager(cap, policy="arc", max_leased_blocks=cap)
    rng = random.Random(7)
    universe = keys(range(40))
    for i in range(600):
        ks = rng.sample(universe, rng.randint(1, 3))
        r = request(f"r{i}", ks)
        n = mgr.lookup(ks, r)
        if n:
            mgr.prepare_load(ks[:n], r)
            mgr.complete_load(ks[:n], r)
        out = mgr.prepare_store(ks, r)
        if out is not None and out.keys_to_store:
            mgr.complete_store(out.keys_to_store, r)
        mgr.on_request_finished(r)
        t1, t2, b1, b2 = arc_lists(mgr)
        assert len(b1) <= cap and len(b2) <= cap
        assert not set(t1) & set(t2)
        assert set(t1) | set(t2) == {k for k in universe if mgr.contains(k)}
        assert not (set(b1) | set(b2)) & (set(t1) | set(t2))
        assert 0 <= mgr.policy.target <= cap
    assert arc_lists(mgr)[3], "the workload never filled B2"


def test_custom_policy_that_rebinds_blocked_on_clear_stays_safe() -> None:
    # Nothing in EvictionPolicy forbids clear() from binding a new ``blocked``
    # set; the manager must still keep the policy's view of evictability right.
    mgr = OffloadManager(2, policy="helpers.custom_policy:RebindingPolicy")
    a, b, c = keys(range(3))
    fill(mgr, [a])
    mgr.reset()
    writer = request("w", [b])
    out = mgr.prepare_store([b], writer)  # b: WRITING, must not be evictable
    assert out is not None and out.keys_to_store == [b]
    assert b in mgr.policy.blocked
    fill(mgr, [c])
    out = mgr.prepare_store(keys([7]), request("r", keys([7])))
    assert out is None or b not in out.evicted_keys
    assert mgr.contains(b)


def test_arc_t1_plus_b1_within_capacity_after_insert() -> None:
    # ARCPolicy documents len(B1) + len(T1) <= capacity (ARC's |L1| <= c).
    mgr = OffloadManager(2, policy="arc")
    a, b, c = keys(range(3))
    fill(mgr, [a])
    fill(mgr, [b])
    fill(mgr, [c])  # evicts a (into B1 or not at all), then inserts c into T1
    t1, _, b1, _ = arc_lists(mgr)
    assert t1 == [b, c]
    assert len(t1) + len(b1) <= 2


# -- every registered policy keeps the contract ------------------------------------


@pytest.mark.parametrize("name", sorted(kvtier.POLICIES))
@pytest.mark.parametrize("seed", range(6))
def test_every_policy_keeps_the_contract_under_random_use(name: str, seed: int) -> None:
    """Atomic eviction, never a blocked or protected victim, ``len`` = resident
    blocks, admission declines only a suffix, ``sizes`` stays bounded
    (``helpers.policy_contract``)."""
    rng = random.Random(f"{name}-{seed}")
    pol = policy_class(name)(rng.randint(1, 12))
    exercise(pol, random_ops(rng, 400), rng)


@pytest.mark.parametrize("name", sorted(kvtier.POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_every_policy_keeps_the_contract_with_every_request_as_a_run(
        name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same, with each keep-ahead made a run (kvtier.policies.runs)
    monkeypatch.setattr(KeyOrder, "RUN_MIN", 0)
    rng = random.Random(f"{name}-{seed}-runs")
    pol = policy_class(name)(rng.randint(1, 12))
    exercise(pol, random_ops(rng, 400), rng)


class _EvictsProtected(LRUPolicy):
    """Broken on purpose: ignores ``protected``."""

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        return super().evict(n, ())


def test_the_contract_check_catches_a_policy_that_breaks_it() -> None:
    rng = random.Random(1)
    with pytest.raises(AssertionError):
        exercise(_EvictsProtected(4), random_ops(rng, 400), rng)


@pytest.mark.parametrize("name", sorted(kvtier.POLICIES))
def test_every_policy_agrees_with_the_manager_under_leases_and_failures(name: str) -> None:
    mgr = OffloadManager(16, policy=name, max_leases_per_request=16, max_leased_blocks=16)
    drive_manager(mgr, random.Random(f"{name}-manager"), 400)


def test_an_abstract_custom_policy_is_refused_when_named() -> None:
    # Fault: an abstract class (the base itself, or one missing evict) passed
    # policy_class, so the vLLM settings accepted it and the engine failed later
    # at its first cache with a TypeError from the instantiation.
    from kvtier.policies import policy_class

    with pytest.raises(ValueError, match=r"is abstract: it does not implement .*evict"):
        policy_class("kvtier.policies:EvictionPolicy")


class _OldKeepAhead(LRUPolicy):
    """A custom policy written to the contract before runs: ``keep_ahead(keys)``."""

    def keep_ahead(self, keys: list[bytes]) -> None:  # type: ignore[override]
        self._order.move_present(reversed(keys))


def test_a_custom_policy_with_the_former_keep_ahead_is_refused_when_named() -> None:
    # it would fail with a TypeError at a running request's second offer
    from kvtier.policies import policy_class

    with pytest.raises(ValueError, match=r"keep_ahead does not take \(run, keys, start, new\)"):
        policy_class("test_policies:_OldKeepAhead")
    assert policy_class("test_recency:RecordingRunningOrder").wants_running_order  # control
