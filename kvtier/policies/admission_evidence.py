"""Admission's worth, measured on the real cache while admission is off.

The default policy (``kvtier.policies.adaptive``) chooses whether to decline
new blocks by miniature simulation: shadow caches over a sample of the keys,
fed each request whole at its end. With many requests in flight that is not
what the cache sees (hits are decided at a lookup, blocks stored at an offer,
uses applied at the end), and the shadows of the two choices can score alike
where the real caches differ by a fifth (docs/policy.md, "Admission measured
on the cache"). This module measures that one choice on the cache itself,
every key, in the order the requests ask.

While admission is off, an offer that it would have cut (the suffix the
history has never seen, when the offer does not fit without evicting) marks
the difference between the cache and the same cache with admission:

* ``stored``: blocks the cache stored that admission would have declined;
* ``displaced``: blocks the cache evicted that admission would have kept.
  Those are the oldest blocks of the cache with admission, so when it would
  have needed room itself (the offer's blocks admission lets in) it evicts
  them first: ``evicted`` drops that many displaced marks, oldest first,
  before marking the victims it still holds.

When a request asks for a marked key (``asked``), a stored one that is
resident is a hit admission would have lost (a vote against it), a
displaced one that is missing is a hit admission would have had (a vote for
it). Each mark is read once. The count is first order (it does not follow
what a kept block would have displaced in turn), so it serves as evidence
beside the shadows, tested against its own noise (``verdict``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence


class AdmissionEvidence:
    """Votes for and against admission, from marked keys of the real cache.

    Owns ``stored`` and ``displaced`` (insertion-ordered key sets of at most
    ``limit`` keys each, oldest dropped first), the eviction of the current
    offer it waits for (how many victims the cache with admission would
    have taken), this epoch's votes, and their decayed ``lead`` (votes for
    minus against) and ``spread`` (decayed sum of each ask's squared
    difference of votes, the noise ``verdict`` tests the lead against).

    Invariants: a key is in at most one of the two sets; each vote comes
    from a mark, which it removes. Memory: ``2 * limit`` keys.
    """

    __slots__ = ("limit", "stored", "displaced", "_room_taken", "_pending",
                 "votes_for", "votes_against", "lead", "spread", "_epoch_spread")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.stored: OrderedDict[bytes, None] = OrderedDict()
        self.displaced: OrderedDict[bytes, None] = OrderedDict()
        self._pending = False
        self._room_taken = 0
        self.votes_for = 0
        self.votes_against = 0
        self.lead = 0.0
        self.spread = 0.0
        self._epoch_spread = 0.0

    def offered(self, declined: Sequence[bytes], room_taken: int) -> None:
        """An offer that does not fit is stored whole: the keys admission
        would have ``declined`` (maybe none) are marked ``stored``;
        ``room_taken``: the evictions the cache with admission would have
        made for the rest, applied at the eviction that follows (``evicted``)."""
        displaced = self.displaced
        if displaced and not displaced.keys().isdisjoint(declined):
            for key in declined:
                displaced.pop(key, None)
        self.stored.update(dict.fromkeys(declined))  # at C speed
        _trim(self.stored, self.limit)
        self._pending = True
        self._room_taken = room_taken

    def fits(self) -> None:
        """An offer fits without eviction (in either cache)."""
        self._pending = False

    def evicted(self, victims: Sequence[bytes]) -> None:
        """The cache evicted ``victims``. The cache with admission would have
        evicted the pending offer's ``room_taken`` blocks (as many as the
        victims for an eviction no offer made, such as a promotion's): its
        displaced ones first, oldest first, then the leading victims; the
        victims it keeps are marked displaced."""
        room_taken = self._room_taken if self._pending else len(victims)
        self._pending = False
        displaced, stored = self.displaced, self.stored
        if room_taken >= len(displaced):
            room_taken -= len(displaced)
            displaced.clear()
        else:
            for _ in range(room_taken):
                displaced.popitem(last=False)
            room_taken = 0
        kept = victims[room_taken:]
        if stored and not stored.keys().isdisjoint(kept):  # not in the other cache either
            kept = [key for key in kept if stored.pop(key, _ABSENT) is _ABSENT]
        displaced.update(dict.fromkeys(kept))
        _trim(displaced, self.limit)

    def removed(self, key: bytes) -> None:
        """``key`` left the cache without eviction (its store failed)."""
        self.stored.pop(key, None)

    def forget_marks(self) -> None:
        """Drop the marks (admission came on: the two caches are one from
        now); the votes stay."""
        self.stored.clear()
        self.displaced.clear()
        self._pending = False

    def asked(self, keys: Collection[bytes], resident: Callable[[bytes], bool]) -> None:
        """A request asks for ``keys`` (``resident(key)``: the cache holds it now)."""
        stored, displaced = self.stored, self.displaced
        if not stored and not displaced:
            return
        votes_against = votes_for = 0
        for key in stored.keys() & keys:  # a key is in one set at most
            del stored[key]
            if resident(key):
                votes_against += 1
        for key in displaced.keys() & keys:
            del displaced[key]
            if not resident(key):
                votes_for += 1
        if votes_for or votes_against:
            self.votes_for += votes_for
            self.votes_against += votes_against
            net = votes_for - votes_against
            self._epoch_spread += net * net

    def end_epoch(self, decay: float) -> None:
        """Fold this epoch's votes into ``lead`` and ``spread`` (each decayed)."""
        self.lead = self.lead * decay + self.votes_for - self.votes_against
        self.spread = self.spread * decay + self._epoch_spread
        self.votes_for = self.votes_against = 0
        self._epoch_spread = 0.0

    def verdict(self, z: float) -> int:
        """1 when the lead for admission is beyond ``z`` standard deviations
        (less one vote, the shadows' continuity correction), -1 when the lead
        against it is, 0 otherwise."""
        lead = self.lead
        bound = z * z * self.spread
        if lead > 1.0 and (lead - 1.0) ** 2 > bound:
            return 1
        if lead < -1.0 and (lead + 1.0) ** 2 > bound:
            return -1
        return 0

    def clear(self) -> None:
        """Forget every mark and vote."""
        self.forget_marks()
        self.votes_for = self.votes_against = 0
        self.lead = self.spread = self._epoch_spread = 0.0

    def sizes(self) -> dict[str, int]:
        """Marked keys: ``evidence_stored`` and ``evidence_displaced``."""
        return {"evidence_stored": len(self.stored),
                "evidence_displaced": len(self.displaced)}


_ABSENT = object()


def _trim(marks: OrderedDict[bytes, None], limit: int) -> None:
    """Drop the oldest marks past ``limit``."""
    while len(marks) > limit:
        marks.popitem(last=False)
