"""The eviction-policy contract under random use, shared by every policy's tests.

``exercise`` plays a sequence of operations (store with admission and
eviction, and ``keep_ahead`` as for a later chunk, ``end_run``; asks, access,
pin/unpin, failed store, explicit evict) against a policy
the way the manager would, and checks after each one what every policy owes:
atomic eviction (a failed ``evict`` leaves the policy as it was), never a
blocked or protected victim, ``len`` = resident blocks, admission declines
only a suffix, bounded ``sizes``. A policy's own invariants come in as
``invariants``. ``drive_manager`` does the same through a real manager.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Sequence

from hypothesis import strategies as st

import kvtier
from kvtier import OffloadManager, RequestContext
from kvtier.policies import EvictionPolicy, PLFUPolicy

Op = tuple[int, Sequence[int]]
"""(operation 0..5, hash ids of the request it works on)."""
OPERATIONS = 6
LONGEST = 8
"""Most keys one operation works on (``random_ops``, ``OPS``)."""
RUNS = ("run-0", "run-1", "run-2")
"""Tokens of the running requests whose blocks ``keep_ahead`` keeps ahead."""


def random_ops(rng: random.Random, steps: int, universe: int = 40,
               longest: int = LONGEST) -> list[Op]:
    """``steps`` operations over hash ids ``0..universe``."""
    return [(rng.randrange(OPERATIONS),
             [rng.randint(0, universe) for _ in range(rng.randint(1, longest))])
            for _ in range(steps)]


def exercise(pol: EvictionPolicy, ops: Iterable[Op], rng: random.Random,
             invariants: Callable[[EvictionPolicy, set[bytes]], None] | None = None,
             snapshot: Callable[[EvictionPolicy], object] | None = None) -> None:
    """Run ``ops`` against ``pol``; fail on the first broken promise.

    ``snapshot``: the state a failed ``evict`` must leave unchanged (default:
    a deep copy must then choose the same victims as the original).
    """
    capacity = pol.capacity
    resident: set[bytes] = set()
    for op, ids in ops:
        ks = list(dict.fromkeys(kvtier.block_key(i) for i in ids))
        if op <= 1:
            _store(pol, ks, resident, rng, snapshot)
        elif op == 2:
            _access(pol, ks, {key for key in ks if key in resident}, rng)
        elif op == 3 and resident:
            pol.blocked.symmetric_difference_update([rng.choice(sorted(resident))])
        elif op == 4 and resident:  # a failed store
            key = rng.choice(sorted(resident))
            pol.remove(key)
            pol.blocked.discard(key)
            resident.discard(key)
        elif op == 5:
            protected = set(rng.sample(sorted(resident), min(len(resident), 2)))
            victims = _evict_checked(pol, rng.randint(0, capacity + 1), protected, resident,
                                     snapshot)
            resident.difference_update(victims)
        assert len(pol) == len(resident)
        assert sum(pol.sizes().values()) <= 64 * capacity + 4096
        if invariants is not None:
            invariants(pol, resident)


def _access(pol: EvictionPolicy, ks: list[bytes], reused: set[bytes],
            rng: random.Random) -> None:
    """One request's access; for a policy that wants it, with a random start of
    the keys the request asked for (the rest were served by a cache in front)."""
    if pol.wants_running_order and rng.random() < 0.5:
        pol.end_run(rng.choice(RUNS))
    if pol.wants_asks:  # as the manager reports a lookup: a run of the request's keys
        pol.on_asked(ks[rng.randint(0, len(ks)):])
    if pol.wants_demand:
        pol.on_demand_access(ks, reused, rng.randint(0, len(ks)))
    else:
        pol.on_access(ks, reused)


def _store(pol: EvictionPolicy, ks: list[bytes], resident: set[bytes], rng: random.Random,
           snapshot: Callable[[EvictionPolicy], object] | None) -> None:
    """Store what is new, as the manager does: misses, admission, room, insert."""
    new = [key for key in ks if key not in resident][:pol.capacity]
    if pol.wants_asks and rng.random() < 0.5:  # asked as offered
        pol.on_asked(ks)
    if pol.wants_store_misses:
        pol.on_store_misses(new)
    n = pol.admit(new) if pol.wants_admission else len(new)
    assert 0 <= n <= len(new)
    new = new[:n]
    need = len(new) - (pol.capacity - len(resident))
    if need > 0:
        before = snapshot(pol) if snapshot is not None else None
        victims = pol.evict(need, set(ks))
        if victims is None:
            if snapshot is not None:
                assert snapshot(pol) == before
            return
        assert len(victims) == need == len(set(victims))
        assert set(victims) <= resident - pol.blocked - set(ks)
        resident.difference_update(victims)
    held = [key for key in ks if key in resident]
    pol.blocked.update(new)
    pol.insert(new)
    resident.update(new)
    if held and pol.wants_running_order and rng.random() < 0.5:
        # as for a later chunk of a running request (a shared run now and then)
        pol.keep_ahead(rng.choice(RUNS), ks, 0, set(new))
    pol.blocked.difference_update([key for key in new if rng.random() < 0.8])


def _evict_checked(pol: EvictionPolicy, n: int, protected: set[bytes], resident: set[bytes],
                   snapshot: Callable[[EvictionPolicy], object] | None) -> list[bytes]:
    """``evict(n)``; when it fails, show that it changed nothing."""
    evictable = resident - pol.blocked - protected
    twin = copy.deepcopy(pol)
    before = snapshot(pol) if snapshot is not None else None
    victims = pol.evict(n, protected)
    if victims is None:
        assert n > len(evictable)
        if snapshot is not None:
            assert snapshot(pol) == before
        m = len(evictable)  # the copy and the original choose alike
        victims = pol.evict(m, protected)
        assert victims is not None and victims == twin.evict(m, protected)
    assert len(victims) == len(set(victims)) and set(victims) <= evictable
    assert len(victims) in (n, len(evictable))
    return victims


def drive_manager(mgr: OffloadManager, rng: random.Random, steps: int,
                  prefixes: int = 4) -> None:
    """Requests through a manager with leases, loads, offers in one or two chunks
    and failed stores (10 %):
    the block table and the policy agree after each one, and what is stored
    is an ordered part of the request's keys."""
    capacity = mgr.stats()["resident"] + mgr.stats()["free"]
    for i in range(steps):
        base = rng.randrange(prefixes) * 10
        ks = [kvtier.block_key(j) for j in range(base, base + rng.randint(1, 8))]
        ctx = RequestContext(f"r{i}")
        ctx.set_positions(ks, 16, 16)
        n = mgr.lookup(ks, ctx)
        if n:
            mgr.prepare_load(ks[:n], ctx)
        cut = rng.randint(1, len(ks))  # offered in one or two chunks, as vLLM computes them
        for chunk in (ks[:cut], ks[cut:]):
            out = mgr.prepare_store(chunk, ctx) if chunk else None
            if out is not None and out.keys_to_store:
                assert out.keys_to_store == [key for key in chunk if key in out.keys_to_store]
                mgr.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.9)
        if n:
            mgr.complete_load(ks[:n], ctx)
        mgr.on_request_finished(ctx)
        stats = mgr.stats()
        assert stats["resident"] + stats["free"] == capacity
        assert mgr.debug_state()["policy_size"] == stats["resident"]


def plfu_invariants(pol: EvictionPolicy, resident: set[bytes]) -> None:
    """PLFU's own promises on top of the contract (adaptive keeps them too)."""
    assert isinstance(pol, PLFUPolicy)
    assert {key for key in resident if pol.segment(key) is None} == set()
    assert len(pol.history) <= pol.history_limit
    sizes, bounds = pol.sizes(), pol.size_bounds(LONGEST)
    assert sizes.keys() == bounds.keys()
    assert all(sizes[name] <= bounds[name] for name in sizes), (sizes, bounds)
    assert 0.0 <= pol.target <= pol.capacity
    assert pol.MIN_SHARE <= pol.lfu_share <= 1 - pol.MIN_SHARE
    # a window key one request used has an implied count of 1, never a stored one
    assert [key for key in pol._window if key not in pol._fresh and key in pol._counts] == []
    assert pol._multi >= sum(1 for c in pol._counts.values() if c > 1)  # its bound


OPS = st.lists(st.tuples(st.integers(0, OPERATIONS - 1), st.lists(
    st.integers(0, 30), min_size=1, max_size=LONGEST)), max_size=60)
"""Operations for hypothesis (``exercise``'s ``ops``)."""
