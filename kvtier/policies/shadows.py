"""The default policy's shadows: miniature caches over a hash-sampled share of
the keys, each scoring one candidate configuration (SHARDS-style miniature
simulation, ``kvtier.policies.adaptive``).

A shadow takes a request's sampled keys (``access``, or ``access_all`` for an
epoch's requests), counts its hits among those the request asked for (its
``last`` and ``hits``), and keeps the scores the adaptive policy reads and
decays (``score``, ``spread``). :class:`PLFUShadow` runs a PLFU
configuration; :class:`LRUShadow` runs LRU, the candidate the real cache
follows in its recency mode (``PLFUPolicy.recency``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.policies.plfu import PLFUPolicy


class Shadow:
    """What every shadow owns: its configuration for the real cache
    (``history_factor``, ``admission``, ``recency``), its ``capacity`` in
    blocks, and its scores: ``hits`` since the last decision, ``score`` (decayed
    hits), ``last`` (the hits of the latest request) and ``spread`` (a decayed
    sum of squared per-request differences to the active shadow's hits).
    """

    __slots__ = ("capacity", "history_factor", "hits", "score", "spread", "last")

    admission: bool
    recency: bool
    resident: Container[bytes]

    def __init__(self, capacity: int, history_factor: int) -> None:
        self.capacity = capacity
        self.history_factor = history_factor
        self.hits = 0
        self.score = 0.0
        self.last = 0
        self.spread = 0.0

    def access(self, keys: list[bytes], asked_from: int = 0) -> None:
        """One request's sampled keys, head first: count the hits among those
        it asked for (``keys[asked_from:]``), then store and apply them."""
        raise NotImplementedError

    def _score(self, keys: list[bytes], asked_from: int) -> list[bytes]:
        """Count a request's hits (``last``, ``hits``) among the keys it asked
        for; return its keys that are not resident, in order."""
        resident = self.resident
        missing = [k for k in keys if k not in resident]
        if asked_from:
            self.last = sum(1 for k in keys[asked_from:] if k in resident)
        else:
            self.last = len(keys) - len(missing)
        self.hits += self.last
        return missing

    def access_all(self, requests: list[tuple[list[bytes], int]]) -> list[int]:
        """:meth:`access` each of ``requests`` (sampled keys, ``asked_from``)
        in turn; return the hits of each."""
        access, hits = self.access, []
        for keys, asked_from in requests:
            access(keys, asked_from)
            hits.append(self.last)
        return hits

    def sizes(self) -> dict[str, int]:
        """Entries of its structures: ``resident``, ``history`` and ``ghosts``."""
        raise NotImplementedError

    def size_bounds(self, batch: int, history_factor: int) -> dict[str, int]:
        """Upper bound of each ``sizes()`` entry while no request brings more
        than ``batch`` keys and no history is longer than ``history_factor``
        times the capacity."""
        raise NotImplementedError


class PLFUShadow(Shadow):
    """A miniature PLFU over the sampled keys: one candidate configuration.

    Owns a :class:`PLFUPolicy` of ``capacity`` blocks (nothing is ever blocked
    or protected in it), the set of its resident keys (a membership test that
    costs less than the policy's), and its scores.
    ``admission``: a new key is stored only if the history knows it, or if
    there is room without evicting (the rule ``AdaptivePolicy.admit`` applies
    to the real cache).
    """

    __slots__ = ("policy", "resident", "admission")

    recency = False

    def __init__(self, capacity: int, history_factor: int, admission: bool) -> None:
        super().__init__(capacity, history_factor)
        # aged at once: access() reads the history's counts directly
        self.policy = PLFUPolicy(capacity, history_factor=history_factor, age_in_steps=False)
        self.resident: set[bytes] = set()  # the policy's keys (it evicts only when told)
        self.admission = admission

    def access(self, keys: list[bytes], asked_from: int = 0) -> None:
        p, resident = self.policy, self.resident
        missing = self._score(keys, asked_from)
        if missing:
            room = self.capacity - len(resident)
            if self.admission and len(missing) > room:
                counts = p._counts
                n = 0
                for key in missing:
                    if key not in counts:
                        break
                    n += 1
                missing = missing[:n if n > room else room]
            if len(missing) > self.capacity:  # an offer larger than the shadow: its head
                missing = missing[:self.capacity]
            if missing:
                over = len(resident) + len(missing) - self.capacity
                if over > 0:
                    victims = p.evict(over, ())
                    if victims:
                        resident.difference_update(victims)
                p.insert(missing)
                resident.update(missing)
        p.on_access(keys, ())

    def sizes(self) -> dict[str, int]:
        inner = self.policy.sizes()
        return {"resident": inner["window"] + inner["main"], "history": inner["history"],
                "ghosts": inner["ghost_window"] + inner["ghost_main"]}

    def size_bounds(self, batch: int, history_factor: int) -> dict[str, int]:
        inner = self.policy.size_bounds(batch)
        return {"resident": self.capacity, "history": history_factor * self.capacity + batch,
                "ghosts": inner["ghost_window"] + inner["ghost_main"]}


class LRUShadow(Shadow):
    """A miniature LRU over the sampled keys: the candidate that runs the real
    cache as LRU (``recency``).

    Owns ``resident``, its keys least recent first (an ``OrderedDict`` of at
    most ``capacity`` keys), and its scores. A request's missing keys are
    stored in offer order (its head first when the offer is larger than the
    shadow), the least recent keys making room, and then all its keys move
    to the most recent end tail first, so that its head ends most recent: the
    order :class:`~kvtier.policies.lru.LRUPolicy` keeps through a manager.
    ``history_factor`` and ``admission`` are the configuration the real
    cache keeps while it follows this shadow (no admission: LRU stores every
    block).
    """

    __slots__ = ("resident",)

    admission = False
    recency = True

    def __init__(self, capacity: int, history_factor: int) -> None:
        super().__init__(capacity, history_factor)
        self.resident: OrderedDict[bytes, None] = OrderedDict()

    def access(self, keys: list[bytes], asked_from: int = 0) -> None:
        resident = self.resident
        missing = self._score(keys, asked_from)
        if len(missing) > self.capacity:  # an offer larger than the shadow: its head
            missing = missing[:self.capacity]
        over = len(resident) + len(missing) - self.capacity
        for _ in range(over):
            resident.popitem(last=False)
        resident.update(dict.fromkeys(missing))
        to_end = resident.move_to_end
        for key in reversed(keys):
            if key in resident:
                to_end(key)

    def size_bounds(self, batch: int, history_factor: int) -> dict[str, int]:
        return {"resident": self.capacity, "history": 0, "ghosts": 0}

    def sizes(self) -> dict[str, int]:  # no history, no ghosts
        return {"resident": len(self.resident), "history": 0, "ghosts": 0}
