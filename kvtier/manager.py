"""The scheduler-side offload manager: which blocks live in the CPU slots."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.argtypes import require_positive_int
from kvtier.errors import MissingBlocksError, ProtocolError
from kvtier.events import DEFAULT_MAX_EVENTS, Event, EventLog
from kvtier.free_slots import FreeSlots
from kvtier.history import DEFAULT_EVICTION_HISTORY_SIZE, EvictionHistory
from kvtier.holds import BlockHolds, decrement, increment
from kvtier.keys import check_keys, key_group
from kvtier.leases import (
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_MAX_LEASE_HOLDERS,
    DEFAULT_MAX_LEASES_PER_REQUEST,
    LeaseTable,
    leased_prefix,
)
from kvtier.lookup_counts import LookupCounts
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.request import RequestContext
from kvtier.results import LoadSpec, LookupResult, PrepareStoreOutput
from kvtier.store_gate import StoreGate

MAX_MISSING_DETAILS = 16
"""Missing keys described one by one in a ``MissingBlocksError``."""


class OffloadManager:
    """Decides which KV blocks occupy the ``num_blocks`` CPU slots; never touches bytes.

    Owns the block table (key -> slot), the holds on its blocks (writes,
    pins, leases: :class:`~kvtier.holds.BlockHolds`), the free slots, the
    eviction policy, the store gate (admission:
    :class:`~kvtier.store_gate.StoreGate`), the lease table, the eviction
    history, the event log and the counters. Invariants:

    * resident blocks + free slots == ``num_blocks``; slot ids are unique;
    * only READY blocks without pins or leases are evictable, and the policy's
      view of evictability always matches the table;
    * memory is bounded: the table by ``num_blocks``, the tracker by
      ``max_tracker_size``, the history by ``eviction_history_size``, leases by
      ``max_leases_per_request`` / ``max_leased_blocks`` (default half the
      cache) / ``lease_timeout_s``, the requests holding leases by
      ``max_lease_holders``, events by ``max_events``; per-request state lives
      in the caller's ``RequestContext``. ``debug_state()`` reports each size.

    Hits and misses count keys once per request (``kvtier.lookup_counts``):
    ``lookup`` of k keys with n hits adds the hits not yet leased to the
    request and k - n misses; ``lookup_one`` counts HIT and MISS, not
    HIT_PENDING.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: str = "lru",
        store_threshold: int = 1,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        enable_events: bool = False,
        eviction_history_size: int = DEFAULT_EVICTION_HISTORY_SIZE,
        *,
        max_leases_per_request: int = DEFAULT_MAX_LEASES_PER_REQUEST,
        max_leased_blocks: int | None = None,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_lease_holders: int = DEFAULT_MAX_LEASE_HOLDERS,
    ) -> None:
        self.num_blocks = require_positive_int("num_blocks", num_blocks)
        self.policy: EvictionPolicy = make_policy(policy, num_blocks)
        self.store_gate = StoreGate(self.policy, store_threshold, max_tracker_size)
        """Which new blocks of an offer are stored (offer count, then the policy)."""
        self.store_threshold = store_threshold
        self._history = EvictionHistory(eviction_history_size)
        self._events = EventLog(bool(enable_events), max_events)
        total = max(1, num_blocks // 2) if max_leased_blocks is None else max_leased_blocks
        self._leases = LeaseTable(max_leases_per_request, total, lease_timeout_s,
                                  max_lease_holders)
        # The block table: every resident key has a slot; what holds a block
        # from eviction (writes, pins, leases) is in ``_holds``, whose
        # containers are aliased here for the hot paths (never rebound).
        self._slot: dict[bytes, int] = {}
        self._holds = BlockHolds(self.policy.blocked)
        self._writing = self._holds.writing
        self._lease_count = self._holds.leases
        self._wants_reuse = self.policy.wants_reuse
        self._wants_demand = self.policy.wants_demand
        self._wants_asks = self.policy.wants_asks
        self._wants_running_order = self.policy.wants_running_order
        self._free = FreeSlots(num_blocks)
        # Promotions in flight (also in ``_writing``): see ``reserve``.
        self._reserved: set[bytes] = set()
        self._evict_listener: Callable[[list[bytes], list[int]], None] | None = None
        self._epoch = 0
        # Contexts from before this epoch owe no completions (see ``reset``).
        self._void_before = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.lookups = LookupCounts()
        self.stores = self.evictions = 0
        self.allocation_failures = 0

    # -- request state -------------------------------------------------------

    def bind(self, ctx: RequestContext) -> None:
        """Bind ``ctx`` to this manager's current epoch, as every call taking it
        does: a context from before a ``reset()`` starts its per-request state
        over. Public for a caller that reads that state before its first
        manager call (the tier cascade counts a request's uses once per request)."""
        try:
            if ctx.owner is self and ctx.epoch == self._epoch:
                return
        except AttributeError:
            raise TypeError(
                f"expected a kvtier.RequestContext, got {type(ctx).__name__}"
            ) from None
        if ctx.owner is not None and ctx.owner is not self:
            raise ProtocolError(
                f"RequestContext {ctx.req_id!r} belongs to another OffloadManager"
            )
        if ctx.owner is self:  # from before a reset: owed completions are void
            if ctx.epoch < self._void_before:  # ...and will never arrive
                ctx.stale_loads.clear()
                ctx.stale_stores.clear()
            else:  # ...and are absorbed when they arrive
                for key, n in ctx.loading.items():
                    ctx.stale_loads[key] = ctx.stale_loads.get(key, 0) + n
                for key in ctx.writing:
                    ctx.stale_stores[key] = ctx.stale_stores.get(key, 0) + 1
            ctx.loading.clear()
            ctx.writing.clear()
            ctx.clear_request_state()
        ctx.owner = self
        ctx.epoch = self._epoch

    # -- lookups and leases --------------------------------------------------

    def _is_ready(self, key: bytes) -> bool:
        return key in self._slot and key not in self._writing

    def lookup(self, keys: Iterable[bytes], ctx: RequestContext) -> int:
        """Return the length of the leading run of ready keys, leasing them to ``ctx``.

        Leased keys cannot be evicted by other requests' stores until ``ctx``
        loads them, releases them or finishes. When ``ctx`` or the cache has no
        lease budget left, the run ends early (a shorter hit, never a bad one).
        """
        self.bind(ctx)
        keys = check_keys(keys)
        if keys and ctx.first_asked is None:
            ctx.first_asked = keys[0]
        now = self._expire_leases()
        slot, writing = self._slot, self._writing
        hits = 0
        for key in keys:
            if key not in slot or key in writing:
                break
            hits += 1
        leased_before = len(ctx.leased)
        if hits:
            hits = self._lease_run(keys, hits, ctx, now)
        if self._wants_asks:
            self.policy.on_asked(keys[:hits + 1])
        self.lookups.count(ctx, len(ctx.leased) - leased_before,
                           keys[hits] if hits < len(keys) else None, len(keys) - hits)
        return hits

    def _lease_run(self, keys: list[bytes], hits: int, ctx: RequestContext, now: float) -> int:
        """Lease ``keys[:hits]`` to ``ctx`` within its budget; return the leased run.

        The request's budget counts its leases; the cache-wide one counts
        distinct leased blocks, so requests sharing a prefix share its cost.
        """
        leased = ctx.leased
        run = keys[:hits]
        new = [k for k in run if k not in leased] if leased else run
        if len(new) > 1 and len(set(new)) != len(new):
            new = list(dict.fromkeys(new))
        if new:
            mine, blocks = self._leases.budgets(ctx, len(self._lease_count))
            counted = self._lease_count
            over_blocks = len(new) > blocks and sum(1 for k in new if k not in counted) > blocks
            if len(new) > mine or over_blocks:
                hits = leased_prefix(run, leased, counted, mine, blocks)
                new = list(dict.fromkeys(k for k in run[:hits] if k not in leased))
        if new:
            leased.update(new)
            self._holds.lease(new)
        if leased:  # a new grant, or asked again for what it holds: its leases last from now
            self._leases.granted(ctx, len(new), now)
        return hits

    def lookup_one(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """Classify one key; a HIT is leased to ``ctx`` (MISS when out of lease budget)."""
        self.bind(ctx)
        check_keys((key,))
        if ctx.first_asked is None:
            ctx.first_asked = key
        if self._wants_asks:
            self.policy.on_asked((key,))
        if key in self._writing:
            return LookupResult.HIT_PENDING
        now = self._expire_leases()
        fresh = key not in ctx.leased
        if key not in self._slot or self._lease_run([key], 1, ctx, now) == 0:
            self.lookups.count(ctx, 0, key, 1)
            return LookupResult.MISS
        self.lookups.count(ctx, int(fresh), None, 0)
        return LookupResult.HIT

    def release(self, ctx: RequestContext) -> None:
        """Drop the leases ``ctx`` still holds (keys it looked up but will not load)."""
        self.bind(ctx)
        self._drop_leases(ctx)

    def _drop_leases(self, ctx: RequestContext) -> None:
        if not ctx.leased:
            return
        n = len(ctx.leased)
        self._holds.unlease(ctx.leased)
        ctx.leased.clear()
        self._leases.dropped(ctx, n)

    def _expire_leases(self) -> float:
        """Drop leases that outlived ``lease_timeout_s``; return the time now."""
        now = time.monotonic()
        if self._leases.has_holders():
            for ctx in self._leases.expired(now):
                self._drop_leases(ctx)
        return now

    def _expire_leases_dropped(self) -> bool:
        """``_expire_leases``; whether it dropped a lease (else nothing changed)."""
        held = self._leases.held
        self._expire_leases()
        return self._leases.held != held

    # -- loads -------------------------------------------------------------

    def prepare_load(self, keys: Iterable[bytes], ctx: RequestContext) -> LoadSpec:
        """Pin ready ``keys`` for reading until ``complete_load``; slots in key order.

        Raises ``MissingBlocksError`` (nothing changed) when a key is not
        resident and ready. A lease of ``ctx`` on a key becomes the pin.
        """
        self.bind(ctx)
        keys = check_keys(keys)
        slot, writing = self._slot, self._writing
        missing = [k for k in keys if k not in slot or k in writing]
        if missing:
            raise self._missing_error(keys, missing, ctx)
        leased = ctx.leased
        increment(ctx.loading, keys)
        self._holds.pin(keys)
        if leased:
            was_leased = leased.intersection(keys)
            if was_leased:
                leased.difference_update(was_leased)
                self._holds.unlease(was_leased)
                self._leases.dropped(ctx, len(was_leased))
        ctx.log_access(keys)
        if self._wants_reuse:
            ctx.reused.update(keys)
            if ctx.inserted:
                ctx.reused.difference_update(ctx.inserted)
        return LoadSpec([slot[k] for k in keys])

    def complete_load(self, keys: Iterable[bytes], ctx: RequestContext) -> None:
        """Unpin keys loaded by ``ctx``; loads from before a ``reset()`` are ignored.

        Raises ``ProtocolError`` (nothing changed) for a key ``ctx`` has no
        pending load of.
        """
        self.bind(ctx)
        keys = check_keys(keys)
        stale_left = None
        if ctx.stale_loads:
            keys, stale_left = _without_stale(keys, ctx.stale_loads)
        loading = ctx.loading
        distinct = set(keys)
        if len(distinct) != len(keys) or not loading.keys() >= distinct:
            self._check_owed_loads(keys, ctx)
        if stale_left is not None:
            ctx.stale_loads = stale_left
        decrement(loading, keys)
        self._holds.unpin(keys)

    @staticmethod
    def _check_owed_loads(keys: list[bytes], ctx: RequestContext) -> None:
        loading = ctx.loading
        owed = dict.fromkeys(keys, 0)
        for key in keys:
            owed[key] += 1
        for key, n in owed.items():
            if loading.get(key, 0) < n:
                raise ProtocolError(
                    f"complete_load without prepare_load: request {ctx.req_id!r} "
                    f"has {loading.get(key, 0)} pending load(s) of key {key!r}, "
                    f"completing {n}"
                )

    # -- stores --------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[bytes], ctx: RequestContext
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the new keys of an offer, evicting as needed.

        Returns None when no room can be made now (the caller may retry; keys
        of this offer, pinned, leased and write-pending blocks are never
        evicted). New keys pass admission first; ready resident keys are
        reuses. Granted keys are WRITING until ``complete_store``.
        ``ProtocolError`` when the policy's ``evict`` breaks its contract.
        """
        self.bind(ctx)
        keys = check_keys(keys)
        if self._wants_asks and ctx.first_asked is not None:
            self.policy.on_asked(keys[ctx.asked_from(keys):])
        candidates = self._record_offer(keys, ctx)
        if candidates:
            candidates = self.store_gate.admit(candidates, ctx)
        if not candidates:
            return PrepareStoreOutput([], [], [])
        if self.policy.wants_store_misses:
            self._show_store_misses(candidates, ctx)
        evicted = self._make_room(len(candidates), keys)
        if evicted is None:
            self.allocation_failures += 1
            return None
        return PrepareStoreOutput(candidates, self._allocate(candidates, ctx), evicted)

    def _record_offer(self, keys: list[bytes], ctx: RequestContext) -> list[bytes]:
        """Note the offer as accesses of ``ctx``; return its new keys, once each."""
        slot = self._slot
        ctx.log_access(keys)
        candidates = [k for k in keys if k not in slot]
        if len(candidates) < len(keys) and self._wants_reuse:
            self._note_reuses(keys, ctx)
        if len(candidates) > 1 and len(set(candidates)) != len(candidates):
            candidates = list(dict.fromkeys(candidates))
        return candidates

    def _note_reuses(self, keys: list[bytes], ctx: RequestContext) -> None:
        """Add the ready keys of ``keys`` that ``ctx`` did not store itself to its reuses."""
        ready = self._slot.keys() & keys  # a set, built at C speed
        if self._writing:
            ready = ready - self._writing  # linear in len(ready), however many are writing
        if ctx.inserted:
            ready = ready - ctx.inserted
        ctx.reused |= ready

    def _show_store_misses(self, candidates: list[bytes], ctx: RequestContext) -> None:
        checked = ctx.ghost_checked
        if checked:
            candidates = [k for k in candidates if k not in checked]
        checked.update(self.policy.on_store_misses(candidates))

    def _make_room(self, n: int, offer: list[bytes]) -> list[bytes] | None:
        """Free slots until ``n`` are free; return the victims, or None (no change)."""
        need = n - len(self._free)
        if need <= 0:
            return []
        if n > self.num_blocks:
            return None
        protected = set(offer)
        victims = self._evict(need, protected)
        if victims is None and self._leases.has_holders() and self._expire_leases_dropped():
            victims = self._evict(need, protected)  # only if a lease lapsed: else nothing changed
        if victims is None:
            return None
        freed = self._take_victims(victims, need, protected)
        try:
            if self._evict_listener is not None:
                self._evict_listener(victims, freed)
        finally:  # the victims are gone from the policy: their slots come back
            self._free.give_back(freed)
            self.evictions += len(victims)
            self._history.record(victims)
            self._events.emit(victims, "removed")
        return victims

    def _evict(self, need: int, protected: set[bytes]) -> list[bytes] | None:
        """The policy's ``need`` victims, or None when fewer than ``need``
        resident blocks are neither held nor ``protected``.

        Then the policy is not asked: it could only fail (its ``evict`` is
        atomic and never returns a held or protected key), after scanning
        every resident block for victims. A full cache of held blocks (loads,
        leases, writes in flight) made each refused offer cost that scan, and
        vLLM repeats a refused offer at every step. The count is O(offer).
        """
        evictable = len(self._slot) - len(self._holds.blocked)  # held blocks are resident
        if evictable - len(protected) < need:
            slot, blocked = self._slot, self._holds.blocked
            evictable -= sum(1 for k in protected if k in slot and k not in blocked)
            if evictable < need:
                return None
        return self.policy.evict(need, protected)

    def _take_victims(self, victims: list[bytes], need: int, protected: set[bytes]) -> list[int]:
        """Drop ``victims`` from the block table; return their slots.

        ``ProtocolError`` (the table unchanged) unless they are ``need``
        distinct resident keys, none held or protected: a policy (custom ones
        are pluggable) that broke its contract would otherwise free the slot of
        a block being written or read and hand it to another block. Linear in
        ``need``, at C speed.
        """
        slot = self._slot
        if (len(victims) == need and self._holds.blocked.isdisjoint(victims)
                and protected.isdisjoint(victims)):
            before = len(slot)
            freed = [slot.pop(k, -1) for k in victims]
            if len(slot) == before - need:  # each one resident, and once
                return freed
            for key, at in zip(victims, freed, strict=True):  # undo
                if at != -1:
                    slot[key] = at
        raise ProtocolError(
            f"{type(self.policy).__name__}.evict({need}) broke the EvictionPolicy contract: "
            f"it returned {len(victims)} keys, which must be {need} distinct resident keys, "
            "none write-pending, pinned, leased or in the current offer; the manager "
            "freed no slot")

    def _allocate(self, keys: list[bytes], ctx: RequestContext) -> list[int]:
        slots = self._take_slots(keys)
        if ctx.inserted and self._wants_running_order:
            self._keep_ahead(keys, ctx)
        ctx.inserted.update(keys)
        ctx.writing.update(keys)
        return slots

    def _keep_ahead(self, new: list[bytes], ctx: RequestContext) -> None:
        """Ask the policy to keep a running request's other blocks ranked above
        ``new``, its keys just inserted: its access order and how much of it the
        policy saw at its previous offer (O(keys logged since) in the common
        case, ``RequestContext.running_order``)."""
        keys, start = ctx.running_order()
        self.policy.keep_ahead(ctx, keys, start, set(new))

    def _take_slots(self, keys: list[bytes]) -> list[int]:
        """Give distinct new ``keys`` free slots, WRITING (room was made already)."""
        slots = self._free.take(len(keys))
        self._slot.update(zip(keys, slots, strict=True))
        self._holds.write(keys)
        self.policy.insert(keys)
        return slots

    def complete_store(
        self, keys: Iterable[bytes], ctx: RequestContext, success: bool = True
    ) -> None:
        """Finish stores granted to ``ctx``: READY on success, slot freed on failure.

        Raises ``ProtocolError`` (nothing changed) for a key ``ctx`` was not
        granted or already completed; stores from before a ``reset()`` are ignored.
        """
        self.bind(ctx)
        keys = check_keys(keys)
        stale_left = None
        if ctx.stale_stores:
            keys, stale_left = _without_stale(keys, ctx.stale_stores)
        writing = ctx.writing
        if not writing.issuperset(keys):
            bad = next(k for k in keys if k not in writing)
            raise ProtocolError(
                f"complete_store for key {bad!r} that request {ctx.req_id!r} "
                "was not granted by prepare_store (unknown or already completed)"
            )
        if stale_left is not None:
            ctx.stale_stores = stale_left
        if len(keys) > 1 and len(set(keys)) != len(keys):
            keys = list(dict.fromkeys(keys))
        writing.difference_update(keys)
        self._holds.written(keys)
        if success:
            self.stores += len(keys)
            self._events.emit(keys, "stored")
        else:
            self._free_slots(keys)
            ctx.inserted.difference_update(keys)

    # -- promotions and internal pins (the tier cascade) ----------------------

    def reserve(self, keys: Iterable[bytes]) -> list[int] | None:
        """Reserve WRITING slots for blocks promoted from a lower tier.

        Like ``prepare_store`` (evicts to make room; never evicts pinned,
        leased or write-pending blocks) but with no request: no admission, no
        request access, no store-miss signal. Keys already resident are an
        error (``ProtocolError``): a caller promotes only misses. Returns the
        slots in key order, or None (nothing changed) when no room can be made.
        Until ``complete_reserve`` the keys look up as HIT_PENDING.
        """
        keys = check_keys(keys)
        unique = list(dict.fromkeys(keys))
        resident = [k for k in unique if k in self._slot]
        if resident:
            raise ProtocolError(f"reserve of resident key {resident[0]!r}")
        if not unique:
            return []
        evicted = self._make_room(len(unique), unique)
        if evicted is None:
            self.allocation_failures += 1
            return None
        slots = self._take_slots(unique)
        self._reserved.update(unique)
        by_key = dict(zip(unique, slots, strict=True))
        return [by_key[k] for k in keys]

    def complete_reserve(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish ``reserve``: READY on success, slot freed on failure.

        Keys not reserved (completed already, or reserved before a ``reset()``)
        are ignored. A reservation a ``reset()`` outlived must not be
        completed: the key may be reserved again since, and the completion
        would apply to that newer reservation; its caller gives the slots back
        with ``release_slots`` instead (as the tier cascade does).
        """
        keys = [k for k in dict.fromkeys(check_keys(keys)) if k in self._reserved]
        if not keys:
            return
        self._reserved.difference_update(keys)
        self._holds.written(keys)
        if success:
            self._events.emit(keys, "stored")
        else:
            self._free_slots(keys)

    def _free_slots(self, keys: list[bytes]) -> None:
        """Forget resident ``keys`` that hold nothing (a failed write): slots freed."""
        slot, remove = self._slot, self.policy.remove
        self._free.give_back([slot.pop(k) for k in keys])
        for key in keys:
            remove(key)

    def pin_internal(self, keys: Iterable[bytes]) -> list[int]:
        """Pin READY ``keys`` for an internal reader (a lower tier's write).

        Not a request access: recency, leases and counters are unchanged.
        Raises ``MissingBlocksError`` (nothing changed) when a key is not
        ready. Each pin is undone by one ``unpin_internal``; slots in key order.
        """
        keys = check_keys(keys)
        slot, writing = self._slot, self._writing
        missing = [k for k in keys if k not in slot or k in writing]
        if missing:
            raise MissingBlocksError(
                f"pin_internal: {len(missing)} of {len(keys)} keys not ready, "
                f"first {missing[0]!r}"
            )
        self._holds.pin_internal(keys)
        return [slot[k] for k in keys]

    def set_eviction_listener(
        self, listener: Callable[[list[bytes], list[int]], None] | None
    ) -> None:
        """Call ``listener(keys, slots)`` for each batch of blocks evicted to make
        room (by ``prepare_store`` or ``reserve``; not by ``reset()``), while their
        slots still hold their bytes: a slot is handed out again only after the
        listener returns. If it raises, the exception propagates and the
        eviction stands (the slots are free). None removes it. For the tier
        cascade's write-on-evict.
        """
        self._evict_listener = listener

    def unpin_internal(self, keys: Iterable[bytes]) -> None:
        """Undo ``pin_internal``; keys without an internal pin (e.g. after a
        ``reset()``) are ignored. A pin taken before a ``reset()`` must not be
        undone after it (the key may be pinned again since): its caller gives
        the slots back with ``release_slots`` instead."""
        self._holds.unpin_internal(check_keys(keys))

    # -- recency -----------------------------------------------------------

    def touch(self, keys: Iterable[bytes], ctx: RequestContext) -> None:
        """Count ``keys`` in ``ctx``'s access (applied at finish), as reuses if ready.

        Recency does not need it: loads and offers are recorded already. It
        serves callers with other hits to report, such as GPU prefix-cache hits.
        """
        self.bind(ctx)
        keys = check_keys(keys)
        ctx.log_access(keys)
        if self._wants_reuse:
            ready = self._is_ready
            ctx.reused.update(k for k in keys if ready(k) and k not in ctx.inserted)

    def on_request_finished(self, ctx: RequestContext) -> None:
        """Apply ``ctx``'s single head-to-tail access and drop its leases.

        The access holds every key the request loaded or offered, resident or
        not: a block evicted while its request was still running (many requests
        in flight), or declined by admission, was used all the same, and a
        policy that keeps a history must count that use. Completions of its
        loads and stores may still arrive afterwards.
        """
        self.bind(ctx)
        self._drop_leases(ctx)
        if self._wants_running_order:
            self.policy.end_run(ctx)
        if ctx.access_log:
            keys = ctx.access_order()
            if self._wants_demand:
                self.policy.on_demand_access(keys, ctx.reused, ctx.asked_from(keys))
            else:
                self.policy.on_access(keys, ctx.reused)
        ctx.clear_request_state()
        ctx.positions = {}  # rebind: the dict may be shared with the engine

    # -- whole cache ---------------------------------------------------------

    def reset(self, *, owed_completions: bool = True, busy_slots: Iterable[int] = ()) -> None:
        """Forget every block; contexts start counting anew.

        ``owed_completions``: whether the caller will still call
        ``complete_load`` / ``complete_store`` for what it was granted before
        the reset. If so (the default), each such call is absorbed, never
        applied; if not (vLLM discards those jobs: its adapter passes False),
        they are forgotten, and a request's next completion of a key is that of
        its next grant. ``busy_slots``: slots an I/O job outside the manager
        may still read or write (the tier cascade's, when its drain timed
        out), each job's slots once (a slot two jobs use, twice); they are
        handed out again only after ``release_slots`` of every such job.
        Emits a ``removed`` event for the blocks that were ready.
        """
        self._free.reset(busy_slots)  # first: it checks them
        self._events.emit([k for k in self._slot if k not in self._writing], "removed")
        self._epoch += 1
        if not owed_completions:
            self._void_before = self._epoch
        self._slot.clear()
        self._reserved.clear()
        self.policy.clear()
        self._holds.clear(self.policy.blocked)  # a policy may rebind it in clear()
        self.store_gate.clear()
        self._leases.clear()
        self._history.clear()

    def release_slots(self, slots: Iterable[int]) -> None:
        """One job's I/O on ``slots``, held back by ``reset(busy_slots=...)``,
        ended: those no other such job uses are handed out again; any other
        slot is ignored."""
        self._free.release(slots)

    def take_events(self) -> list[Event]:
        """Return and forget the events since the last call (empty when disabled)."""
        return self._events.take()

    def stats(self) -> dict[str, int]:
        """Gauges and counters; see the README's table for each field. The
        policy's own gauges (``EvictionPolicy.gauges``) follow as ``policy_*``."""
        resident = len(self._slot)
        stats = {
            "resident": resident,
            "ready": resident - len(self._writing),
            "pinned": len(self._holds.pins),
            "leased": len(self._lease_count),
            "write_pending": len(self._writing),
            "unevictable": len(self._holds.blocked),
            "free": len(self._free),
            "hits": self.lookups.hits,
            "misses": self.lookups.misses,
            "stores": self.stores,
            "evictions": self.evictions,
            "stores_skipped": self.store_gate.skipped,
            "stores_below_threshold": self.store_gate.below_threshold,
            "allocation_failures": self.allocation_failures,
            "events_dropped": self._events.dropped,
        }
        for name, value in self.policy.gauges().items():
            stats["policy_" + name] = value
        return stats

    def admission_count(self, key: bytes) -> int:
        """How many requests offered ``key`` (0 when untracked or threshold < 2)."""
        check_keys((key,))
        return self.store_gate.offers(key)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is resident (ready or write-pending)."""
        check_keys((key,))
        return key in self._slot

    def debug_state(self) -> dict[str, Any]:
        """Sizes of internal structures (entries; cheap: ``len`` of each), for
        tests, diagnostics and the soak (``kvtier.replay.soak``).

        Bounds: ``table``, ``free``, ``writing``, ``pinned``, ``leased``,
        ``reserved``, ``internal_pins``, ``unevictable`` and ``policy_size`` by
        ``num_blocks``; ``held_back`` (slots held back by a reset) by
        ``num_blocks``; ``tracker_size`` by ``max_tracker_size``;
        ``history_size`` by ``eviction_history_size``; ``lease_holders`` by
        ``max_lease_holders`` (+ 1 between lookups); ``leases_held`` by
        ``lease_holders * max_leases_per_request``; ``events`` by ``max_events``;
        ``policy``: the policy's ``sizes()`` (its docstring states the bounds).
        """
        state: dict[str, Any] = {
            "tracker_size": len(self.store_gate),
            "history_size": len(self._history),
            "leases_held": self._leases.held,
            "lease_holders": len(self._leases),
            "policy_size": len(self.policy),
            "table": len(self._slot),
            "free": len(self._free),
            "writing": len(self._writing),
            "pinned": len(self._holds.pins),
            "leased": len(self._lease_count),
            "reserved": len(self._reserved),
            "held_back": len(self._free.held_back),
            "internal_pins": len(self._holds.internal),
            "unevictable": len(self._holds.blocked),
            "events": len(self._events),
        }
        state["policy"] = dict(self.policy.sizes())
        return state

    # -- diagnostics ---------------------------------------------------------

    def _missing_error(
        self, keys: list[bytes], missing: list[bytes], ctx: RequestContext
    ) -> MissingBlocksError:
        """Explain a failed load; built only on failure."""
        now = time.monotonic()
        positions = ctx.positions
        groups = sorted({key_group(k) for k in missing})
        details = []
        for key in missing[:MAX_MISSING_DETAILS]:
            when = self._history.evicted_at(key)
            ago = None if when is None else round(now - when, 3)
            details.append((positions.get(key), ago))
        known = [positions[k] for k in keys if k in positions]
        span = f"{min(known)}..{max(known)}" if known else "unknown (no positions set)"
        group_txt = ", ".join(str(g) for g in groups)
        return MissingBlocksError(
            f"request {ctx.req_id!r}, KV group {group_txt}: {len(missing)} of "
            f"{len(keys)} keys missing (not resident or still being written); "
            f"(end_token, seconds since eviction or None) for the first "
            f"{len(details)}: {details}; load end-token range {span}; eviction "
            f"history spans {self._history.span_seconds(now):.3f} s over "
            f"{len(self._history)} keys"
        )


def _without_stale(
    keys: list[bytes], stale: dict[bytes, int]
) -> tuple[list[bytes], dict[bytes, int]]:
    """Split off completions owed from before a reset: (current keys, stale left).

    Each occurrence of a key consumes one stale completion first. ``stale`` is
    not changed; the caller commits the returned copy once the rest is valid.
    """
    left = dict(stale)
    current: list[bytes] = []
    for key in keys:
        n = left.get(key, 0)
        if n:
            if n == 1:
                del left[key]
            else:
                left[key] = n - 1
        else:
            current.append(key)
    return current, left
