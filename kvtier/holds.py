"""What keeps a resident block from being evicted: a pending write, pins, leases.

A block may be evicted only when it is READY (its write has completed), no
reader has it pinned and no request holds a lease on it (DESIGN.md §6, "Leases and diagnostics").
The eviction policy learns that from one set, its ``blocked`` keys;
:class:`BlockHolds` keeps that set in step with the three kinds of hold, so
the manager never edits it by hand.
"""

from __future__ import annotations

from collections.abc import Iterable


class BlockHolds:
    """The holds on resident blocks, and the policy's view of them.

    Owns ``writing`` (keys whose store or promotion has not completed),
    ``pins`` (key -> readers that pinned it: request loads and internal
    readers), ``internal`` (key -> the internal readers' share of ``pins``,
    e.g. a lower tier's write-back) and ``leases`` (key -> requests that hold
    a lease on it). Invariant: ``blocked == writing | pins.keys() |
    leases.keys()``, where ``blocked`` is the eviction policy's set (rebound
    by :meth:`clear`, since a policy may replace it when cleared). A
    write-pending block is never pinned or leased (loads and lookups need a
    READY block), which :meth:`written` relies on.

    Bounds: every key held is resident, so each structure holds at most the
    manager's ``num_blocks`` keys. The containers are never rebound, so a
    caller may keep references to them.
    """

    __slots__ = ("writing", "pins", "internal", "leases", "blocked")

    def __init__(self, blocked: set[bytes]) -> None:
        self.writing: set[bytes] = set()
        self.pins: dict[bytes, int] = {}
        self.internal: dict[bytes, int] = {}
        self.leases: dict[bytes, int] = {}
        self.blocked = blocked

    # -- writes ----------------------------------------------------------------

    def write(self, keys: list[bytes]) -> None:
        """New blocks whose bytes are being written (distinct, not held yet)."""
        self.writing.update(keys)
        self.blocked.update(keys)

    def written(self, keys: Iterable[bytes]) -> None:
        """Writes ended (completed, failed or abandoned): the keys are held no more."""
        self.writing.difference_update(keys)
        self.blocked.difference_update(keys)

    # -- pins ------------------------------------------------------------------

    def pin(self, keys: list[bytes]) -> None:
        """One pin on each key (a key repeated is pinned that often)."""
        increment(self.pins, keys)
        self.blocked.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release one pin of each key (a key repeated is released that often)."""
        self._release(self.pins, self.leases, keys)

    def pin_internal(self, keys: list[bytes]) -> None:
        """A pin for an internal reader: counted in ``pins`` and in ``internal``."""
        increment(self.internal, keys)
        self.pin(keys)

    def unpin_internal(self, keys: Iterable[bytes]) -> None:
        """Undo :meth:`pin_internal`; keys without an internal pin (pinned before
        a ``clear``) are ignored."""
        internal = self.internal
        released: list[bytes] = []
        for key in keys:
            n = internal.get(key, 0)
            if not n:
                continue
            if n == 1:
                del internal[key]
            else:
                internal[key] = n - 1
            released.append(key)
        self.unpin(released)

    # -- leases ----------------------------------------------------------------

    def lease(self, keys: list[bytes]) -> None:
        """One more lease on each of the distinct ``keys``."""
        increment(self.leases, keys)
        self.blocked.update(keys)

    def unlease(self, keys: Iterable[bytes]) -> None:
        """One lease less on each key."""
        self._release(self.leases, self.pins, keys)

    def _release(self, counts: dict[bytes, int], other: dict[bytes, int],
                 keys: Iterable[bytes]) -> None:
        """One hold of ``counts``' kind less on each key; a key that neither kind
        holds any more (``other``: the other kind) may be evicted again. (Inline,
        not through :func:`decrement`: it runs for every loaded key.)"""
        blocked = self.blocked
        for key in keys:
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]
                if key not in other:
                    blocked.discard(key)

    # -- whole table -----------------------------------------------------------

    def clear(self, blocked: set[bytes]) -> None:
        """Drop every hold; ``blocked`` is the policy's (cleared) set from now on."""
        for table in (self.writing, self.pins, self.internal, self.leases):
            table.clear()
        self.blocked = blocked


def increment(counts: dict[bytes, int], keys: Iterable[bytes]) -> None:
    """Add one to the count of each key (a key repeated, that often)."""
    get = counts.get
    for key in keys:
        counts[key] = get(key, 0) + 1


def decrement(counts: dict[bytes, int], keys: Iterable[bytes]) -> None:
    """Take one off the count of each key (a key repeated, that often), dropping
    counts that reach zero. Every key must be counted."""
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
