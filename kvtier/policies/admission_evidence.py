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

A large cache's evidence may be drawn from a key sample (``rate`` below 1):
only sampled keys are marked, the other cache's evictions drop the
sample's share of its displaced marks, and the votes, fewer, are tested
against their own (larger) noise as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvtier.policies.key_sample import KeySample


class AdmissionEvidence:
    """Votes for and against admission, from marked keys of the real cache.

    Owns ``sample`` (a :class:`KeySample` of ``rate``: only its keys are
    marked), ``stored`` and ``displaced`` (insertion-ordered key sets of at
    most ``limit`` = ``rate * capacity`` keys each, oldest dropped first),
    the eviction of the current
    offer it waits for (how many victims the cache with admission would
    have taken), this epoch's votes, and their decayed ``lead`` (votes for
    minus against) and ``spread`` (decayed sum of each ask's squared
    difference of votes, the noise ``verdict`` tests the lead against).

    Invariants: a key is in at most one of the two sets; each vote comes
    from a mark, which it removes. Memory: ``2 * limit`` keys.
    """

    __slots__ = ("limit", "sample", "stored", "displaced", "_room_taken", "_pending",
                 "_drops_owed", "votes_for", "votes_against", "lead", "spread",
                 "_epoch_spread")

    def __init__(self, capacity: int, rate: float = 1.0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.sample = KeySample(rate)
        self.limit = max(1, round(capacity * rate))
        self.stored: OrderedDict[bytes, None] = OrderedDict()
        self.displaced: OrderedDict[bytes, None] = OrderedDict()
        self._pending = False
        self._room_taken = 0
        self._drops_owed = 0.0  # sampled displaced marks owed to evictions, below one
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
        if declined:
            self._mark_stored(self.sample.keys(declined))
        self._pending = True
        self._room_taken = room_taken

    def _mark_stored(self, keys: list[bytes]) -> None:
        """Mark sampled ``keys`` stored (they leave ``displaced`` if there)."""
        if not keys:
            return
        displaced = self.displaced
        if displaced and not displaced.keys().isdisjoint(keys):
            for key in keys:
                displaced.pop(key, None)
        stored = self.stored
        stored.update(dict.fromkeys(keys))  # at C speed
        if len(stored) > self.limit:
            _trim(stored, self.limit)

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
        kept = self.sample.keys(victims[self._drop_displaced(room_taken):])
        if not kept:
            return
        stored = self.stored
        if stored and not stored.keys().isdisjoint(kept):  # not in the other cache either
            kept = [key for key in kept if stored.pop(key, _ABSENT) is _ABSENT]
        displaced = self.displaced
        displaced.update(dict.fromkeys(kept))
        if len(displaced) > self.limit:
            _trim(displaced, self.limit)

    def _drop_displaced(self, room_taken: int) -> int:
        """The other cache evicts ``room_taken`` blocks, its displaced ones
        first, oldest first: drop their marks (the sample's share of them,
        the fraction carried to the next eviction); return how many of
        them were not displaced ones (the leading victims it evicts too)."""
        displaced = self.displaced
        rate = self.sample.rate
        drops = room_taken * rate + self._drops_owed
        if drops >= len(displaced):
            left = round((drops - len(displaced)) / rate)
            displaced.clear()
            self._drops_owed = 0.0
            return left
        whole = int(drops)
        self._drops_owed = drops - whole
        for _ in range(whole):
            displaced.popitem(last=False)
        return 0

    def removed(self, key: bytes) -> None:
        """``key`` left the cache without eviction (its store failed)."""
        self.stored.pop(key, None)

    def forget_marks(self) -> None:
        """Drop the marks (admission came on: the two caches are one from
        now); the votes stay."""
        self.stored.clear()
        self.displaced.clear()
        self._pending = False
        self._drops_owed = 0.0

    def asked(self, keys: Collection[bytes], resident: Callable[[bytes], bool]) -> None:
        """A request asks for ``keys`` (``resident(key)``: the cache holds it now)."""
        votes_against = votes_for = 0
        stored = self.stored
        if stored:
            for key in stored.keys() & keys:  # a key is in one set at most
                del stored[key]
                if resident(key):
                    votes_against += 1
        displaced = self.displaced
        if displaced:
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
