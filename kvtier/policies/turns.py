"""Conversation turns: a request that goes on where an earlier request ended.

A chat's next turn sends the previous turn's whole prompt again, then its new
blocks (the reply and the next message), and the turn after that sends those
new blocks again as part of its prefix. A frequency policy keeps the
conversation's older blocks (a second request used them) but holds the new
ones in its recency window with every block used once, where they are often
gone when the conversation comes back. The first turn is known only in
hindsight, but a continuation shows itself: the first block the cache's
history has never seen follows the last block of an earlier request.

:class:`TurnTracker` recognises that; the default policy
(``kvtier.policies.adaptive``) places the new blocks of a continuation in its
main segment. docs/policy.md ("Conversation turns") has the measurements.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class TurnTracker:
    """Recognises requests that continue an earlier request.

    Owns ``ends``: the last block of each recent request, oldest first (an
    ``OrderedDict``; a block that ends a request again becomes the newest), at
    most ``limit`` keys: the oldest is dropped when a new one would pass the
    bound. An ``OrderedDict`` takes about 91 bytes per end where the policies'
    ``KeyOrder`` takes 42, and less time for the single-key moves this makes
    once for every request.
    """

    __slots__ = ("limit", "_ends")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"TurnTracker limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self._ends: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def continues(self, keys: Sequence[bytes], first_new: int, asked_from: int = 0) -> bool:
        """Whether ``keys[first_new:]``, blocks never seen, go on from the last
        block of a recent request.

        ``asked_from``: the keys before it were served by a cache in front
        (the engine's); a continuation counts only when its previous block was
        asked from this cache, because otherwise the conversation's blocks are
        in the cache in front, which keeps recent blocks itself.
        """
        return asked_from < first_new < len(keys) and keys[first_new - 1] in self._ends

    def ended(self, keys: Sequence[bytes]) -> None:
        """A request of ``keys`` was seen: its last block is now the newest end."""
        if not keys:
            return
        ends, last = self._ends, keys[-1]
        if last in ends:
            ends.move_to_end(last)
            return
        ends[last] = None
        if len(ends) > self.limit:
            ends.popitem(last=False)

    def clear(self) -> None:
        self._ends.clear()
