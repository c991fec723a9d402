"""Random sequences of every manager call against a simple reference model.

The model is fed the manager's outputs (granted keys, slots, victims) and checks
consistency and safety after every step: capacity, unique slots, nothing
pinned/leased/write-pending evicted, leased hits loadable, counters, bounds.
It does not re-implement the eviction policy or the admission tracker.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier import (
    LookupResult,
    MissingBlocksError,
    OffloadManager,
    ProtocolError,
    RequestContext,
    block_key,
)
from kvtier.policies import POLICIES, ARCPolicy

KEYS = [block_key(i, g) for i in range(3) for g in (0, 1)]
POSITION = {block_key(i, g): 16 * (i + 1) for i in range(3) for g in (0, 1)}
N_REQUESTS = 3

req = st.integers(0, N_REQUESTS - 1)
key_st = st.sampled_from(KEYS)
key_lists = st.lists(key_st, max_size=6)
unique_key_lists = st.lists(key_st, max_size=6, unique=True)
COUNTERS = ("hits", "misses", "stores", "evictions", "stores_skipped", "allocation_failures")


class ManagerMachine(RuleBasedStateMachine):
    # -- setup -------------------------------------------------------------------------

    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        num_blocks=st.integers(1, 5),
        threshold=st.sampled_from([1, 1, 2, 3]),
        tracker_size=st.integers(1, 6),
        history_size=st.integers(0, 6),
        per_request=st.integers(1, 6),
        total=st.none() | st.integers(1, 8),
        events=st.booleans(),
        warm=st.lists(st.tuples(req, key_lists), max_size=6),
    )
    def setup(
        self,
        policy: str,
        num_blocks: int,
        threshold: int,
        tracker_size: int,
        history_size: int,
        per_request: int,
        total: int | None,
        events: bool,
        warm: list[tuple[int, list[bytes]]],
    ) -> None:
        self.mgr = OffloadManager(
            num_blocks,
            policy=policy,
            store_threshold=threshold,
            max_tracker_size=tracker_size,
            enable_events=events,
            eviction_history_size=history_size,
            max_leases_per_request=per_request,
            max_leased_blocks=total,
            lease_timeout_s=1e9,  # no lease lapses during a run: the model has no clock
        )
        self.num_blocks = num_blocks
        self.threshold = threshold
        self.tracker_size = tracker_size
        self.history_size = history_size
        self.per_request = per_request
        self.total = max(1, num_blocks // 2) if total is None else total
        self.events_on = events
        self.ctxs = [RequestContext(f"r{i}") for i in range(N_REQUESTS)]
        for ctx in self.ctxs:
            self._positions(ctx)
        # the model
        self.slot: dict[bytes, int] = {}
        self.writing: set[bytes] = set()
        self.pins: Counter[bytes] = Counter()
        self.leased: list[set[bytes]] = [set() for _ in range(N_REQUESTS)]
        self.missed_at: list[set[bytes]] = [set() for _ in range(N_REQUESTS)]
        self.counted: list[set[bytes]] = [set() for _ in range(N_REQUESTS)]
        self.skipped: list[set[bytes]] = [set() for _ in range(N_REQUESTS)]
        self.owed_loads: list[list[tuple[bytes, int]]] = [[] for _ in range(N_REQUESTS)]
        self.owed_stores: list[list[tuple[bytes, int]]] = [[] for _ in range(N_REQUESTS)]
        self.last_offer: list[list[bytes] | None] = [None] * N_REQUESTS
        self.epoch = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.pending_events: list[tuple[tuple[bytes, ...], str]] = []
        for i, ks in warm:  # start from a used cache: finished requests that stored
            self.store_and_complete(i, ks, success=True)
            self.finish(i)

    @staticmethod
    def _positions(ctx: RequestContext) -> None:
        for k in KEYS:
            ctx.set_position(k, POSITION[k])

    # -- model helpers -----------------------------------------------------------------

    def _ready(self, k: bytes) -> bool:
        return k in self.slot and k not in self.writing

    def _all_leased(self) -> set[bytes]:
        return set().union(*self.leased)

    def _blocked(self) -> set[bytes]:
        return self.writing | {k for k, n in self.pins.items() if n} | self._all_leased()

    def _budget(self, i: int) -> int:
        """New leases ``i`` can surely get: the total bound counted per lease.

        (Counted per distinct block the bound is looser: the model accepts both.)
        """
        held = sum(map(len, self.leased))
        return min(self.per_request - len(self.leased[i]), self.total - held)

    def _emit(self, keys: list[bytes], kind: str) -> None:
        if self.events_on and keys:
            self.pending_events.append((tuple(keys), kind))

    # -- lookups -----------------------------------------------------------------------

    def _ready_first(self, data: st.DataObject) -> list[bytes]:
        """Distinct keys, often starting with ready ones (so lookups can hit)."""
        ready = sorted(k for k in self.slot if k not in self.writing)
        head = data.draw(st.lists(st.sampled_from(ready), unique=True)) if ready else []
        return list(dict.fromkeys(head + data.draw(unique_key_lists)))

    @rule(i=req, data=st.data(), one=st.booleans())
    def lookup(self, i: int, data: st.DataObject, one: bool) -> None:
        ks = self._ready_first(data)
        if not one:
            self._lookup(i, ks)
            return
        k = ks[0] if ks else KEYS[0]
        r = self.mgr.lookup_one(k, self.ctxs[i])
        if k in self.writing:
            assert r is LookupResult.HIT_PENDING
            return
        if self._ready(k) and (k in self.leased[i] or self._budget(i) >= 1):
            assert r is LookupResult.HIT
        elif not self._ready(k):
            assert r is LookupResult.MISS
        if r is LookupResult.HIT:  # out of lease budget, a MISS is also right
            self.counters["hits"] += k not in self.leased[i]  # once per request
            self.leased[i].add(k)
        else:
            assert r is LookupResult.MISS
            self._count_misses(i, k, 1)

    def _count_misses(self, i: int, first_missed: bytes, misses: int) -> None:
        """Misses count unless a counted lookup of the request missed at the
        same key before (a waiting request asking again)."""
        if first_missed not in self.missed_at[i]:
            self.counters["misses"] += misses
            self.missed_at[i].add(first_missed)

    def _lookup(self, i: int, ks: list[bytes]) -> int:
        n = self.mgr.lookup(ks, self.ctxs[i])
        run = 0
        while run < len(ks) and self._ready(ks[run]):
            run += 1
        new = [k for k in ks[:run] if k not in self.leased[i]]
        if len(new) <= self._budget(i):
            assert n == run
        else:
            assert n <= run
        held = len(self.leased[i])
        self.leased[i].update(ks[:n])
        self.counters["hits"] += len(self.leased[i]) - held
        if n < len(ks):
            self._count_misses(i, ks[n], len(ks) - n)
        return n

    # -- loads -------------------------------------------------------------------------

    def _load(self, i: int, ks: list[bytes]) -> None:
        ctx = self.ctxs[i]
        if all(self._ready(k) for k in ks):
            spec = self.mgr.prepare_load(ks, ctx)
            assert spec.block_ids == [self.slot[k] for k in ks]
            for k in ks:
                self.pins[k] += 1
                self.owed_loads[i].append((k, self.epoch))
            self.leased[i].difference_update(ks)
        else:
            try:
                self.mgr.prepare_load(ks, ctx)
            except MissingBlocksError as err:
                missing = sum(1 for k in ks if not self._ready(k))
                assert f"{missing} of {len(ks)} keys missing" in str(err)
            else:
                raise AssertionError("prepare_load of a key that is not ready succeeded")

    @rule(i=req, data=st.data(), source=st.sampled_from(["leased", "ready", "any"]))
    def prepare_load(self, i: int, data: st.DataObject, source: str) -> None:
        """Load keys ``i`` leased (must succeed), ready keys, or any keys."""
        ready = sorted(k for k in self.slot if k not in self.writing)
        pool = {"leased": sorted(self.leased[i]), "ready": ready, "any": KEYS}[source]
        if not pool:
            pool = KEYS
        ks = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
        if source == "leased" and self.leased[i]:
            assert all(self._ready(k) for k in ks), "a leased key is not ready"
        self._load(i, ks)

    @rule(i=req, data=st.data())
    def lookup_and_load(self, i: int, data: st.DataObject) -> None:
        """The common path: lookup, load the hits, complete the load."""
        ks = self._ready_first(data)
        n = self._lookup(i, ks)
        if n:
            self._load(i, ks[:n])
            self._complete_loads(i, ks[:n])

    @precondition(lambda self: any(self.owed_loads))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i in range(N_REQUESTS) if self.owed_loads[i]]))
        owed = sorted({k for k, _ in self.owed_loads[i]})
        ks = data.draw(st.lists(st.sampled_from(owed), min_size=1, unique=True))
        self._complete_loads(i, ks)

    def _complete_loads(self, i: int, ks: list[bytes]) -> None:
        self.mgr.complete_load(ks, self.ctxs[i])
        for k in ks:  # completions arrive in the order of their loads
            j = next(j for j, (kk, _) in enumerate(self.owed_loads[i]) if kk == k)
            _, epoch = self.owed_loads[i].pop(j)
            if epoch == self.epoch:
                self.pins[k] -= 1
                if not self.pins[k]:
                    del self.pins[k]

    # -- stores ------------------------------------------------------------------------

    def _offer(self, i: int, ks: list[bytes]) -> list[bytes]:
        """prepare_store, checked against the model; returns the granted keys."""
        mgr, ctx = self.mgr, self.ctxs[i]
        before = {k: mgr.admission_count(k) for k in KEYS}
        free_before = self.num_blocks - len(self.slot)
        out = mgr.prepare_store(ks, ctx)
        self.last_offer[i] = ks
        candidates = list(dict.fromkeys(k for k in ks if k not in self.slot))
        if self.threshold >= 2:
            after = {k: mgr.admission_count(k) for k in KEYS}
            for k in KEYS:
                if k not in candidates:
                    assert after[k] in (0, before[k]), "a non-candidate was counted"
                elif before[k] and k in self.counted[i]:
                    assert after[k] == before[k], "a request counted a key twice"
                elif before[k]:
                    assert after[k] == before[k] + 1, "a tracked key of the offer was lost"
                else:
                    assert after[k] in (0, 1)
            if len(candidates) <= self.tracker_size:
                assert all(after[k] >= 1 for k in candidates), "offer made no progress"
            self.counted[i].update(k for k in candidates if after[k] >= 1)
            admitted = [k for k in candidates if after[k] >= self.threshold]
            new_skips = [k for k in candidates if k not in admitted and k not in self.skipped[i]]
            self.skipped[i].update(new_skips)
            self.counters["stores_skipped"] += len(new_skips)
        else:
            admitted = candidates
        if not admitted:
            assert out == ([], [], [])
            return []
        blocked = self._blocked()
        evictable = {k for k in self.slot if k not in blocked and k not in ks}
        need = len(admitted) - free_before
        possible = len(admitted) <= self.num_blocks and need <= len(evictable)
        if out is None:
            assert not possible, "prepare_store found no room though there was some"
            self.counters["allocation_failures"] += 1
            return []
        assert possible
        assert out.keys_to_store == admitted
        victims = out.evicted_keys
        assert len(victims) == max(0, need)
        assert len(set(victims)) == len(victims)
        assert set(victims) <= evictable, "evicted a pinned/leased/write-pending/offered key"
        for k in victims:
            del self.slot[k]
        self.counters["evictions"] += len(victims)
        self._emit(victims, "removed")
        used = set(self.slot.values())
        assert len(out.block_ids) == len(admitted)
        assert len(set(out.block_ids)) == len(admitted)
        assert all(0 <= b < self.num_blocks and b not in used for b in out.block_ids)
        for k, b in zip(admitted, out.block_ids, strict=True):
            self.slot[k] = b
            self.writing.add(k)
            self.owed_stores[i].append((k, self.epoch))
        return admitted

    @rule(i=req, ks=st.lists(key_st, max_size=3), retry=st.booleans())
    def prepare_store(self, i: int, ks: list[bytes], retry: bool) -> None:
        """Offer new keys, or retry the request's last offer (after None, preemption...)."""
        last = self.last_offer[i]
        self._offer(i, last if retry and last is not None else ks)

    @precondition(lambda self: any(self.owed_stores))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        i = data.draw(st.sampled_from([i for i in range(N_REQUESTS) if self.owed_stores[i]]))
        owed = sorted({k for k, _ in self.owed_stores[i]})
        ks = data.draw(st.lists(st.sampled_from(owed), min_size=1, unique=True))
        self._complete_stores(i, ks, success)

    @rule(i=req, ks=key_lists, success=st.sampled_from([True, True, True, False]))
    def store_and_complete(self, i: int, ks: list[bytes], success: bool) -> None:
        """The common path: offer, then complete whatever was granted."""
        granted = self._offer(i, ks)
        if granted:
            self._complete_stores(i, granted, success)

    def _complete_stores(self, i: int, ks: list[bytes], success: bool) -> None:
        self.mgr.complete_store(ks, self.ctxs[i], success=success)
        done = []
        for k in ks:  # completions arrive in the order of their grants
            j = next(j for j, (kk, _) in enumerate(self.owed_stores[i]) if kk == k)
            _, epoch = self.owed_stores[i].pop(j)
            if epoch != self.epoch:
                continue
            self.writing.discard(k)
            if success:
                done.append(k)
            else:
                del self.slot[k]
        if success:
            self.counters["stores"] += len(done)
            self._emit(done, "stored")

    @rule(i=req, k=key_st, load=st.booleans())
    def complete_not_owed(self, i: int, k: bytes, load: bool) -> None:
        owed = self.owed_loads[i] if load else self.owed_stores[i]
        if any(kk == k for kk, _ in owed):
            return
        call = self.mgr.complete_load if load else self.mgr.complete_store
        try:
            call([k], self.ctxs[i])
        except ProtocolError:
            return
        raise AssertionError(f"{call.__name__} of a key not owed was accepted")

    # -- requests and the whole cache ----------------------------------------------------

    @rule(i=req)
    def release(self, i: int) -> None:
        self.mgr.release(self.ctxs[i])
        self.leased[i].clear()

    @rule(i=req, ks=key_lists)
    def touch(self, i: int, ks: list[bytes]) -> None:
        self.mgr.touch(ks, self.ctxs[i])

    @rule(i=req)
    def finish(self, i: int) -> None:
        ctx = self.ctxs[i]
        self.mgr.on_request_finished(ctx)
        self._positions(ctx)
        self.leased[i].clear()
        self.missed_at[i].clear()
        self.counted[i].clear()
        self.skipped[i].clear()
        self.last_offer[i] = None

    @rule(really=st.sampled_from([False, False, False, True]))
    def reset(self, really: bool) -> None:
        if not really:  # a reset wipes everything: keep it rarer than other calls
            return
        ready = {k for k in self.slot if k not in self.writing}
        self.mgr.reset()
        events = self.mgr.take_events()
        # Announcing the blocks that left is allowed; nothing else is.
        assert all(e.kind == "removed" for e in events)
        announced = [k for e in events for k in e.keys]
        assert not announced or sorted(announced) == sorted(ready)
        self.epoch += 1
        self.slot.clear()
        self.writing.clear()
        self.pins.clear()
        for s in (*self.leased, *self.counted, *self.skipped, *self.missed_at):
            s.clear()

    @invariant()
    def events_match(self) -> None:
        """take_events() after every step returns exactly the model's events."""
        events = self.mgr.take_events()
        assert [(e.keys, e.kind) for e in events] == self.pending_events
        assert all(e.medium == "CPU" for e in events)
        self.pending_events = []

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        mgr = self.mgr
        s = mgr.stats()
        assert s["resident"] == len(self.slot) <= self.num_blocks
        assert s["write_pending"] == len(self.writing)
        assert s["ready"] == len(self.slot) - len(self.writing)
        assert s["free"] == self.num_blocks - len(self.slot)
        assert s["pinned"] == sum(1 for n in self.pins.values() if n)
        assert s["leased"] == len(self._all_leased())
        assert {c: s[c] for c in COUNTERS} == self.counters
        assert len(set(self.slot.values())) == len(self.slot)
        assert all(0 <= b < self.num_blocks for b in self.slot.values())
        for k in KEYS:
            assert mgr.contains(k) == (k in self.slot)
        assert mgr.policy.blocked == self._blocked()
        assert all(self._ready(k) for k in self._all_leased())
        assert all(k in self.slot and k not in self.writing for k, n in self.pins.items() if n)

    @invariant()
    def within_bounds(self) -> None:
        d = self.mgr.debug_state()
        assert d["tracker_size"] <= self.tracker_size
        assert d["history_size"] <= self.history_size
        assert len(self._all_leased()) <= d["leases_held"] <= sum(map(len, self.leased))
        assert len(self._all_leased()) <= self.total
        assert all(len(s) <= self.per_request for s in self.leased)
        assert d["policy_size"] == len(self.slot)
        policy = self.mgr.policy
        if isinstance(policy, ARCPolicy):
            b1, b2 = policy.ghost_sizes()
            assert b1 <= self.num_blocks and b2 <= self.num_blocks
            assert set(policy._t1) | set(policy._t2) == set(self.slot)
            assert 0 <= policy.target <= self.num_blocks


ManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerStateMachine = ManagerMachine.TestCase
