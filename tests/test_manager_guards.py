"""The scheduler-side core (manager, leases, policies) against misuse and broken contracts:
each test failed on the code before its fix."""

from __future__ import annotations

from collections.abc import Container

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import OffloadManager, RequestContext
from kvtier.policies import POLICIES, LRUPolicy, PLFUPolicy


def _store(mgr: OffloadManager, keys: list[bytes], ctx: RequestContext) -> None:
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)


@pytest.mark.parametrize("policy", ["plfu", "adaptive"])
def test_history_aging_does_not_count_a_use_of_a_running_requests_new_blocks(
        policy: str) -> None:
    """PLFU ages its history (halves every count) while requests are in
    flight. It gave every fresh window key (stored by a running request, used
    by no request yet) a count of 1, so when that request finished its own
    use counted as a second one and its new blocks went to the main segment,
    as if two requests had used them."""
    mgr = OffloadManager(8, policy=policy)
    pol = mgr.policy
    assert isinstance(pol, PLFUPolicy)
    running = RequestContext("running")
    mine = [kvtier.block_key(10_000 + i) for i in range(3)]
    running.set_positions(mine, 16, 16)
    _store(mgr, mine, running)
    mgr.prepare_load(mine, running)  # pinned: resident while other requests come and go
    aged = False
    for i in range(10 * pol.history_limit):
        ctx = RequestContext(f"r{i}")
        _store(mgr, [kvtier.block_key(i)], ctx)
        before = pol.sizes()["history"]
        mgr.on_request_finished(ctx)
        if pol.sizes()["history"] < before:
            aged = True
            break
    assert aged
    mgr.complete_load(mine, running)
    mgr.on_request_finished(running)
    assert [pol.segment(k) for k in mine] == ["window"] * 3  # one request used them
    assert [pol.history[k] for k in mine] == [1, 1, 1]


@pytest.mark.parametrize("bad", ["5", 2.5, True])
def test_max_events_is_checked_and_named(bad: object) -> None:
    """A wrong ``max_events`` failed with ``'<' not supported between 'str' and
    'int'`` or ``an integer is required`` (naming no parameter), and ``True``
    was taken as 1."""
    with pytest.raises(ValueError, match="max_events must be an int >= 1"):
        OffloadManager(4, max_events=bad)  # type: ignore[arg-type]


class RogueLRU(LRUPolicy):
    """LRU whose ``evict`` ignores ``blocked``: the oldest keys, held or not."""

    name = "rogue-lru"

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        return self._order.take_oldest(n)


class TwiceLRU(LRUPolicy):
    """LRU whose ``evict`` names its oldest victim twice."""

    name = "twice-lru"

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        victims = super().evict(n, protected)
        return None if victims is None else [victims[0]] * n


def test_a_policy_that_names_a_victim_twice_is_refused() -> None:
    """Its slot went back to the free list twice: two new blocks shared it."""
    mgr = OffloadManager(2, policy=f"{__name__}:TwiceLRU")
    _store(mgr, [kvtier.block_key(1), kvtier.block_key(2)], RequestContext("a"))
    with pytest.raises(kvtier.ProtocolError, match=r"TwiceLRU\.evict\(2\) broke"):
        mgr.prepare_store([kvtier.block_key(3), kvtier.block_key(4)], RequestContext("b"))
    stats = mgr.stats()
    assert (stats["resident"], stats["free"]) == (2, 0)


def test_a_policy_that_evicts_a_pinned_block_is_refused() -> None:
    """The manager took whatever a (pluggable) policy's ``evict`` returned:
    a pinned block's slot was handed to a new block while a load read it,
    so the load would get another block's bytes."""
    mgr = OffloadManager(2, policy=f"{__name__}:RogueLRU")
    a = RequestContext("a")
    old = [kvtier.block_key(1), kvtier.block_key(2)]
    _store(mgr, old, a)
    mgr.on_request_finished(a)
    reader = RequestContext("reader")
    slots = mgr.prepare_load(old[1:], reader).block_ids  # the oldest, pinned: a load reads it
    with pytest.raises(kvtier.ProtocolError, match=r"RogueLRU\.evict\(1\) broke"):
        mgr.prepare_store([kvtier.block_key(3)], RequestContext("b"))
    assert mgr.contains(old[1])
    assert mgr.prepare_load(old[1:], RequestContext("again")).block_ids == slots
    stats = mgr.stats()
    assert stats["resident"] + stats["free"] == 2


# -- every manager call in random order: the block table, the holds, the leases
# -- and the policy agree after each one -------------------------------------------

_CALLS = 16


def _agrees(mgr: OffloadManager, ctxs: list[RequestContext]) -> None:
    """The manager's structures agree with each other and with the contexts."""
    slots = list(mgr._slot.values())
    free = mgr._free.free
    held_back = set(mgr._free.held_back)
    assert len(set(slots)) == len(slots) and len(set(free)) == len(free)
    assert not set(free) & set(slots) and not held_back & set(free)
    assert len(slots) + len(free) + len(held_back - set(slots)) == mgr.num_blocks
    assert len(mgr.policy) == len(slots)
    holds = mgr._holds
    assert holds.blocked is mgr.policy.blocked
    assert holds.blocked == holds.writing | holds.pins.keys() | holds.leases.keys()
    assert holds.blocked <= mgr._slot.keys()
    leases: dict[bytes, int] = {}
    for ctx in ctxs:
        if ctx.owner is mgr and ctx.epoch == mgr._epoch:
            for k in ctx.leased:
                leases[k] = leases.get(k, 0) + 1
    assert leases == holds.leases
    assert mgr._leases.held == sum(leases.values())
    assert len(mgr._leases) <= mgr._leases.max_holders + 1
    assert leases.keys() <= {k for k in mgr._slot if k not in holds.writing}


def _play(mgr: OffloadManager, ops: list[tuple[int, int, list[int]]]) -> None:
    ctxs = [RequestContext(f"r{i}") for i in range(3)]
    promotions: list[tuple[int, list[bytes], list[int]]] = []  # (epoch, keys, slots)
    readers: list[tuple[int, list[bytes], list[int]]] = []
    for op, who, ids in ops:
        ctx = ctxs[who]
        ks = [kvtier.block_key(i % 7, i // 7) for i in ids]
        try:
            if op == 0:
                mgr.lookup(ks, ctx)
            elif op == 1 and ks:
                mgr.lookup_one(ks[0], ctx)
            elif op == 2:
                n = mgr.lookup(ks, ctx)
                if n:
                    mgr.prepare_load(ks[:n], ctx)
            elif op == 3 and ctx.loading:
                mgr.complete_load([sorted(ctx.loading)[0]], ctx)
            elif op == 4:
                mgr.prepare_store(ks, ctx)
            elif op == 5 and ctx.writing:
                mgr.complete_store([sorted(ctx.writing)[0]], ctx, success=len(ks) != 1)
            elif op == 6:
                mgr.on_request_finished(ctx)
            elif op == 7:
                mgr.release(ctx)
            elif op == 8:
                new = [k for k in dict.fromkeys(ks) if not mgr.contains(k)]
                got = mgr.reserve(new)
                if got:
                    promotions.append((mgr._epoch, new, got))
            elif op == 9 and promotions:
                epoch, new, got = promotions.pop(0)
                if epoch == mgr._epoch:
                    mgr.complete_reserve(new, success=len(ks) != 1)
                else:  # a reset outlived it: its slots are given back instead
                    mgr.release_slots(got)
            elif op == 10:
                ready = [k for k in ks if mgr.contains(k) and k not in mgr._holds.writing]
                if ready:
                    readers.append((mgr._epoch, ready, mgr.pin_internal(ready)))
            elif op == 11 and readers:
                epoch, ready, got = readers.pop(0)
                if epoch == mgr._epoch:
                    mgr.unpin_internal(ready)
                else:
                    mgr.release_slots(got)
            elif op == 12:
                # jobs of this epoch still use their slots; older ones are held back already
                busy = [s for epoch, _, got in promotions + readers if epoch == mgr._epoch
                        for s in got]
                mgr.reset(owed_completions=len(ks) % 2 == 0, busy_slots=busy)
            elif op == 13:
                mgr.touch(ks, ctx)
            elif op == 14:
                mgr.take_events()
            elif op == 15:
                mgr.debug_state()
        except (kvtier.MissingBlocksError, kvtier.ProtocolError):
            pass
        _agrees(mgr, ctxs)



_OPS = st.lists(st.tuples(st.integers(0, _CALLS - 1), st.integers(0, 2),
                          st.lists(st.integers(0, 13), max_size=5)), max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(sorted(POLICIES)), num_blocks=st.integers(1, 6),
       threshold=st.sampled_from([1, 2]), lapse=st.booleans(), holders=st.integers(1, 3),
       ops=_OPS)
def test_manager_structures_agree_under_any_call_order(
        policy: str, num_blocks: int, threshold: int, lapse: bool, holders: int,
        ops: list[tuple[int, int, list[int]]]) -> None:
    """Leases (lapsing at once, or never), promotions, internal pins, resets
    with slots held back and failed stores in any order, over a tiny cache."""
    mgr = OffloadManager(num_blocks, policy=policy, store_threshold=threshold,
                         max_tracker_size=4, eviction_history_size=3, enable_events=True,
                         max_events=2, max_leases_per_request=3, max_lease_holders=holders,
                         lease_timeout_s=1e-9 if lapse else 1e9)
    _play(mgr, ops)
