"""The CPU tier's free slots: which slot ids the manager may hand out next."""

from __future__ import annotations

from collections.abc import Iterable


class FreeSlots:
    """The slot ids of ``num_slots`` that hold no block, and those held back.

    Owns ``free`` (ids to hand out, taken from the end: the most recently
    freed first) and ``held_back`` (ids that an I/O job outside the manager
    may still read or write after a reset: neither free nor holding a block
    until ``release``). Invariants: the two are disjoint, each id is in at
    most one of them once, so each holds at most ``num_slots`` ids.
    """

    __slots__ = ("num_slots", "free", "held_back")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.held_back: set[int] = set()

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
        ``ValueError`` for an id that is not a slot (nothing changed)."""
        busy = set(busy)
        bad = [s for s in busy if type(s) is not int or not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"busy_slots: not a slot of this manager: {bad[0]!r}")
        held = self.held_back
        held |= busy
        self.free = [s for s in range(self.num_slots - 1, -1, -1) if s not in held]

    def release(self, slots: Iterable[int]) -> None:
        """Free the held-back ones of ``slots`` (their I/O ended); others are ignored."""
        back = [s for s in dict.fromkeys(slots) if s in self.held_back]
        self.held_back.difference_update(back)
        self.free.extend(back)
