"""The CPU tier's free slots: which slot ids the manager may hand out next."""

from __future__ import annotations

from collections.abc import Iterable


class FreeSlots:
    """The slot ids of ``num_slots`` that hold no block, and those held back.

    Owns ``free`` (ids to hand out, taken from the end: the most recently
    freed first) and ``held_back`` (ids that I/O jobs outside the manager may
    still read or write after a reset, each with the number of such jobs:
    neither free nor holding a block until every one of them is released).
    Invariants: the two are disjoint, an id is in ``free`` at most once, so
    each holds at most ``num_slots`` ids.
    """

    __slots__ = ("num_slots", "free", "held_back")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.held_back: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        """``n`` free slots (the caller checked there are), removed from ``free``."""
        free = self.free
        slots = free[-n:] if n else []
        del free[len(free) - n:]
        slots.reverse()
        return slots

    def give_back(self, slots: Iterable[int]) -> None:
        """Slots whose blocks are gone (evicted, failed): free again."""
        self.free.extend(slots)

    def reset(self, busy: Iterable[int] = ()) -> None:
        """Every slot free, but ``busy`` ones (and any still held back) held back;
        ``ValueError`` for an id that is not a slot (nothing changed).

        ``busy`` lists each abandoned job's slots: a slot two jobs use is in it
        twice and stays held back until both are released."""
        busy = list(busy)
        bad = [s for s in busy if type(s) is not int or not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"busy_slots: not a slot of this manager: {bad[0]!r}")
        held = self.held_back
        for s in busy:
            held[s] = held.get(s, 0) + 1
        self.free = [s for s in range(self.num_slots - 1, -1, -1) if s not in held]

    def release(self, slots: Iterable[int]) -> None:
        """One job's I/O on ``slots`` ended: a held-back slot no other job
        still uses is free again; slots not held back are ignored."""
        held = self.held_back
        for s in slots:
            users = held.get(s)
            if users is None:
                continue
            if users > 1:
                held[s] = users - 1
            else:
                del held[s]
                self.free.append(s)
