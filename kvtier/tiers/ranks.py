"""Lower tiers for a tensor-parallel engine: one block = one shard per rank.

Each worker rank of an engine copies its shard of a block into slot ``i`` of
its own slot region (``kvtier-<engine>-rank<r>.slots``); the scheduler's one
manager owns slot ``i`` in all of them. For the tier cascade, which runs in
the scheduler, the block is the set of those shards:

* :class:`RankRegions` gives, for a slot, a :class:`ShardedSlot` (one array
  per rank) where a single region would give one array;
* :class:`RankedTier` stores a block as one value per rank, each in its own
  per-rank tier (its namespace carries the rank), and holds the block only
  when every rank's value is there and readable. A block with a missing or
  corrupt shard is a miss as a whole, never a half-filled slot set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.slots.region import SlotRegion
from kvtier.tiers.base import (
    DEFAULT_MAX_TIER_EVENTS,
    Counters,
    Tier,
    TierConfigError,
    TierEvent,
    TierEventLog,
)
from kvtier.tiers.blockfile import BytesLike


class ShardedSlot:
    """The shards of one block, rank order; ``nbytes`` is their total."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.nbytes = sum(p.nbytes for p in self.parts)

    def copy(self) -> ShardedSlot:
        """Owned copies of every shard (for write-on-evict)."""
        return ShardedSlot([p.copy() for p in self.parts])


class RankRegions:
    """The slot regions of all ranks of one engine, same geometry, rank order.

    Owns nothing but the list; the regions are closed by ``close``.
    """

    def __init__(self, regions: Sequence[SlotRegion]) -> None:
        regions = list(regions)
        if not regions:
            raise ValueError("RankRegions needs at least one region")
        shapes = {(r.num_slots, r.slot_bytes) for r in regions}
        if len(shapes) != 1:
            raise ValueError(f"ranks' slot regions differ in geometry: {sorted(shapes)}")
        self.regions = regions
        self.num_slots, self.slot_bytes = shapes.pop()

    def slot_array(self, slot: int) -> ShardedSlot:
        return ShardedSlot([r.slot_array(slot) for r in self.regions])

    def close(self) -> None:
        for region in self.regions:
            region.close()


class RankedTier(Tier):
    """One tier per rank behind the ``Tier`` interface; buffers and payloads
    are :class:`ShardedSlot` (one part per rank).

    Invariants: ``contains`` is True only when every rank holds the key;
    ``get_into`` returns the total size only when every rank's shard was read
    whole, else None (the caller must not use any part); ``put`` is True only
    when every rank stored its shard.

    Owns block counters (``BLOCK_COUNTERS``, counted here once per block:
    ranks are asked in turn and the later ones not after a miss, so the sum
    of the ranks' own counts would count a hit once per rank and a miss once),
    and the block events (a bounded ``TierEventLog``): ``stored`` once a block
    is whole, ``removed`` (or ``corrupt``) once when its first shard leaves,
    which takes the other ranks' shards with it (no orphan shards; each rank
    would otherwise report the same eviction). A block that a read finds on
    some ranks only, the next one being local, loses those shards too, and one
    with a shard of another length than the slot's loses them all. Puts of a
    key run one at a time, and a read deletes no shard of a key a put writes.
    """

    BLOCK_COUNTERS = ("hits", "misses", "stores", "dropped_stores")
    """``stats()`` entries that count blocks, whatever the number of ranks."""

    def __init__(self, tiers: Sequence[Tier], enable_events: bool = False,
                 max_events: int = DEFAULT_MAX_TIER_EVENTS) -> None:
        self.ranks = list(tiers)
        if not self.ranks:
            raise TierConfigError("RankedTier needs one tier per rank, got none")
        self.name = self.ranks[0].name
        self.namespace = self.ranks[0].namespace
        self.remote = any(t.remote for t in self.ranks)
        self._blocks = Counters()
        self._events = TierEventLog(self.name, enable_events, max_events)
        self._events_lock = threading.RLock()
        # rank -> keys it deleted as orphans, with events only: emptied by the
        # next ``_settle_events`` (at most the keys of the puts since then)
        self._quiet: dict[int, set[bytes]] = {}
        # Keys of the puts running and keys whose shards a read is deleting
        # (``_begin_put``, ``_begin_drop``): at most the keys of the puts and
        # reads running, one call per I/O thread.
        self._keys_cond = threading.Condition()
        self._claimed: set[bytes] = set()

    def _parts(self, buffers: Sequence[Any], rank: int) -> list[BytesLike]:
        n = len(self.ranks)
        out = []
        for buf in buffers:
            if not isinstance(buf, ShardedSlot) or len(buf.parts) != n:
                raise TypeError(f"RankedTier needs ShardedSlot buffers of {n} parts")
            out.append(buf.parts[rank])
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self._held_by_all([tier.contains for tier in self.ranks], keys)

    def contains_waiting(self, keys: Sequence[bytes]) -> list[bool]:
        return self._held_by_all([tier.contains_waiting for tier in self.ranks], keys)

    @staticmethod
    def _held_by_all(asks: list[Callable[[Sequence[bytes]], list[bool]]],
                     keys: Sequence[bytes]) -> list[bool]:
        """Whether every rank holds each key: each rank is asked in turn, and
        only for the keys all ranks before it hold. So a lookup that gives up
        at a deadline (a disk tier's on a hung network file system) makes the
        caller wait that deadline once, not once per rank."""
        held = [True] * len(keys)
        todo = list(range(len(keys)))
        for ask in asks:
            if not todo:
                break
            for i, h in zip(todo, ask([keys[i] for i in todo]), strict=True):
                held[i] = bool(h)
            todo = [i for i in todo if held[i]]
        return held

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int | None]:
        total: list[int | None] = [0] * len(keys)
        for rank, tier in enumerate(self.ranks):
            parts = self._parts(buffers, rank)
            todo = [i for i, t in enumerate(total) if t is not None]
            if not todo:
                break
            sizes = tier.get_into([keys[i] for i in todo], [parts[i] for i in todo])
            for i, n in zip(todo, sizes, strict=True):
                prev = total[i]
                if prev is not None and n is not None and n == memoryview(parts[i]).nbytes:
                    total[i] = prev + n
                    continue
                total[i] = None
                if n is not None:  # a valid shard of another length: no read will ever do
                    self._drop_block(keys[i])
                elif rank and not tier.remote:
                    self._drop_shards(keys[i], rank)
        found = sum(t is not None for t in total)
        self._blocks.add("hits", found)
        self._blocks.add("misses", len(total) - found)
        self._settle_events()  # a bad shard found here takes its block's others now
        return total

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Each key's shards concatenated in rank order (tools, tests)."""
        per_rank = [tier.get(keys) for tier in self.ranks]
        out: list[memoryview | None] = []
        for values in zip(*per_rank, strict=True):
            out.append(None if any(v is None for v in values)
                       else memoryview(b"".join(bytes(v) for v in values if v is not None)))
        return out

    def put(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """Store every rank's shard; a block some rank dropped is removed from
        the ranks that stored it (no orphan shards taking room). With events,
        puts run one at a time, so that each put's evictions and stores are
        reported in the order they happened (``_put_and_report``)."""
        if not self._events.enabled:
            return self._put(items)
        with self._events_lock:
            return self._put_and_report(items)

    def _put_and_report(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        """``_put``, then its block events: the blocks it evicted leave, then
        the ones it stored come, but for those it evicted again itself (stored
        and gone within the put: neither is reported)."""
        self._settle_events()  # what left before is gone before these are stored
        ok = self._put(items)
        whole = [k for (k, _), done in zip(items, ok, strict=True) if done]
        again = self._settle_events(fresh=set(whole))
        self._events.emit("stored", [k for k in whole if k not in again])
        return ok

    def _put(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        keys = [k for k, _ in items]
        claim = set(keys)
        self._begin_put(claim)
        try:
            return self._put_ranks(keys, items)
        finally:
            self._release(claim)

    def _put_ranks(self, keys: list[bytes], items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        stored_by = [tier.put(list(zip(keys, self._parts([p for _, p in items], rank),
                                       strict=True)))
                     for rank, tier in enumerate(self.ranks)]
        ok = [all(column) for column in zip(*stored_by, strict=True)]
        for rank, stored in enumerate(stored_by):
            orphans = [k for k, s, whole in zip(keys, stored, ok, strict=True) if s and not whole]
            if orphans:
                self._delete_orphans(rank, orphans)
        self._blocks.add("stores", sum(ok))
        self._blocks.add("dropped_stores", len(ok) - sum(ok))
        return ok

    def _drop_shards(self, key: bytes, ranks: int) -> None:
        """After rank ``ranks`` missed ``key`` that the ranks before it read
        whole: when that rank does not hold the shard (not a passing read
        error), delete the earlier shards, since the block can never be read;
        its removal is reported. Not after a remote rank's miss (a timeout?),
        nor while a put of ``key`` runs (``_begin_drop``)."""
        if not self._begin_drop(key):
            return
        try:
            if self.ranks[ranks].contains_waiting([key]) == [True]:
                return
            for tier in self.ranks[:ranks]:
                tier.delete([key])
        finally:
            self._release({key})

    def _drop_block(self, key: bytes) -> None:
        """Delete every rank's shard of ``key``, one of which was read whole
        and valid but of another length than the slot's: the namespace fixes
        a shard's length, so the block can never be read, and kept it would
        be found and fail at every lookup. Its removal is reported."""
        if not self._begin_drop(key):
            return
        try:
            for tier in self.ranks:
                tier.delete([key])
        finally:
            self._release({key})

    def _begin_drop(self, key: bytes) -> bool:
        """Claim ``key`` for deleting shards found bad; False while a put of
        it runs (the shards it writes are not the ones read: its block ends
        whole, or the put removes its orphans itself) or another drop has it."""
        with self._keys_cond:
            if key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def _begin_put(self, keys: set[bytes]) -> None:
        """Wait until no put or drop has a key of ``keys``, then claim them.
        A drop that checked a rank before a put wrote there would delete the
        shards the put wrote to the ranks before it, and a put that failed on
        a rank would delete as orphans the shards another put of the key
        found there (its duplicates): either put would then report a block
        that can never be read."""
        with self._keys_cond:
            self._keys_cond.wait_for(lambda: self._claimed.isdisjoint(keys))
            self._claimed.update(keys)

    def _release(self, keys: set[bytes]) -> None:
        """End the claim of ``_begin_drop`` or ``_begin_put`` on ``keys``."""
        with self._keys_cond:
            self._claimed.difference_update(keys)
            self._keys_cond.notify_all()

    def _delete_orphans(self, rank: int, keys: list[bytes]) -> None:
        """Delete shards of blocks that are not whole on ``rank``; their removal
        is not a block's (the rank that lacks the shard reports one, if any)."""
        with self._events_lock:
            self.ranks[rank].delete(keys)
            # Only read back (and emptied) by ``_settle_events``, which runs
            # with events only: kept without them, this set grew by every
            # orphan deleted, for the life of the engine.
            if self._events.enabled:
                self._quiet.setdefault(rank, set()).update(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        counts = [tier.delete(keys) for tier in self.ranks]
        return max(counts)

    def stats(self) -> dict[str, int | float | str]:
        """``BLOCK_COUNTERS`` per block; ``evictions`` the most of any rank
        (ranks of equal shares, given the same blocks, evict the same ones,
        and a block one rank evicts leaves the others too); other integers
        (bytes, milliseconds, errors) summed over ranks, ``events_dropped``
        also counting this tier's own event log; the rest from rank 0."""
        out = dict(self.ranks[0].stats())
        for tier in self.ranks[1:]:
            for name, value in tier.stats().items():
                if isinstance(value, int) and isinstance(out.get(name), int):
                    old = int(out[name])
                    out[name] = max(old, value) if name == "evictions" else old + value
        blocks = self._blocks.snapshot()
        out.update({name: blocks[name] for name in self.BLOCK_COUNTERS})
        # the block events this tier's own log dropped, besides the ranks' (the
        # ranks' events are read into it; either drop loses a block's event)
        dropped = out.get("events_dropped", 0)
        out["events_dropped"] = (dropped if isinstance(dropped, int) else 0) + self._events.dropped
        out["ranks"] = len(self.ranks)
        return out

    def take_events(self) -> list[TierEvent]:
        """The block events since the last call (class doc).

        vLLM's scheduler calls this every step on its own thread. An I/O
        thread's ``put`` holds the events lock for as long as its ranks take
        (up to their timeouts on a hung server), so when the lock is taken
        this returns the events settled so far without waiting: the put
        settles the ranks' events itself, and they come with a later call.
        """
        if self._events_lock.acquire(blocking=False):
            try:
                self._settle_events()
            finally:
                self._events_lock.release()
        return self._events.take()

    def _settle_events(self, fresh: set[bytes] | None = None) -> set[bytes]:
        """Turn the ranks' events into block events: a shard that left reports
        its block once and takes the block's other shards with it; rank 0's
        breaker events pass; the ranks' ``stored`` events are dropped (``put``
        reports whole blocks). Events of the deletes it makes itself are read
        back in the next pass and not reported again. Blocks of ``fresh``
        (stored by the put that asks, not reported yet) that left are not
        reported but returned."""
        left_fresh: set[bytes] = set()
        if not self._events.enabled:  # the ranks report nothing either (same setting)
            return left_fresh
        with self._events_lock:
            reported: set[bytes] = set()
            while True:
                gone: dict[bytes, tuple[str, str]] = {}
                for rank, tier in enumerate(self.ranks):
                    quiet = self._quiet.get(rank, ())
                    for event in tier.take_events():
                        if event.kind in ("removed", "corrupt"):
                            for key in event.keys:
                                if key not in reported and key not in quiet:
                                    gone.setdefault(key, (event.kind, event.detail))
                        elif event.kind != "stored" and rank == 0:
                            self._events.emit(event.kind, event.keys, event.detail)
                self._quiet.clear()  # their deletes' events were in this pass
                if not gone:
                    return left_fresh
                reported.update(gone)
                if fresh:
                    left_fresh.update(k for k in gone if k in fresh)
                self._emit_gone({k: why for k, why in gone.items() if k not in left_fresh})
                for tier in self.ranks:
                    tier.delete(list(gone))

    def _emit_gone(self, gone: dict[bytes, tuple[str, str]]) -> None:
        """One event per (kind, detail) of the blocks in ``gone``."""
        groups: dict[tuple[str, str], list[bytes]] = {}
        for key, why in gone.items():
            groups.setdefault(why, []).append(key)
        for (kind, detail), keys in groups.items():
            self._events.emit("corrupt" if kind == "corrupt" else "removed", keys, detail)

    def debug_state(self) -> dict[str, int]:
        """Each rank's ``debug_state()`` entries, summed over ranks."""
        out: dict[str, int] = {}
        for tier in self.ranks:
            for name, value in tier.debug_state().items():
                out[name] = out.get(name, 0) + value
        return out

    @property
    def available(self) -> bool:
        return all(t.available for t in self.ranks)

    @property
    def serving(self) -> bool:
        return all(t.serving for t in self.ranks)

    def close(self) -> None:
        for tier in self.ranks:
            tier.close()
