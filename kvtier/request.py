"""Per-request state carried between the caller and the manager."""

from __future__ import annotations

import itertools

from kvtier.keys import check_keys

MAX_ACCESS_LISTS = 64
"""Key lists a context logs before merging them (bounds retries and re-offers)."""


class RequestContext:
    """What one request has done with the cache, between its start and finish.

    Owns, for one request:

    * ``positions``: each key's end-token position, set by the caller;
    * ``access_log``: the key lists the request loaded, offered or touched, in
      call order (merged into the one access applied when it finishes; merged
      early once it holds ``MAX_ACCESS_LISTS`` lists, so retries cannot grow it);
    * ``inserted`` / ``reused``: keys it stored itself / found ready;
    * ``counted`` / ``skipped`` / ``ghost_checked``: keys already counted by
      admission, already reported as skipped, already shown to the policy as a
      store miss (each happens once per request);
    * ``tier_counted``: keys the tier cascade already counted as used by this
      request (its per-tier admission, ``kvtier.tiers.cascade``);
    * ``first_asked``: the first key it looked up (None before any lookup): the
      keys ahead of it were served by a cache in front, such as the engine's;
    * ``missed_at``: the keys at which its counted lookups missed (a lookup's
      first missing key), so that a request asking again for the same blocks
      while it waits is not counted again in the manager's misses, whatever
      order it asks them in;
    * ``leased``: keys leased to it by ``lookup`` (at most the manager's
      ``max_leases_per_request``); ``loading``: keys pinned by its loads, with
      counts; ``writing``: keys it was granted for storing and has not completed;
    * ``stale_loads`` / ``stale_stores``: completions it still owes for loads
      and stores from before a ``reset()``, with counts; they are consumed
      before current ones (completions of one key arrive in order).

    Every set is bounded by the number of distinct keys the request passes to
    the manager, that is by its prompt's block count. ``epoch`` ties the state
    to one ``reset()`` generation of one manager: a context from before a reset
    starts over, and completions it still owes for old blocks are ignored.
    """

    __slots__ = (
        "req_id",
        "positions",
        "access_log",
        "inserted",
        "reused",
        "counted",
        "tier_counted",
        "skipped",
        "ghost_checked",
        "first_asked",
        "missed_at",
        "leased",
        "loading",
        "writing",
        "stale_loads",
        "stale_stores",
        "owner",
        "epoch",
        "lease_deadline",
    )

    def __init__(self, req_id: str) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty str, got {req_id!r}")
        self.req_id = req_id
        self.positions: dict[bytes, int] = {}
        self.access_log: list[list[bytes]] = []
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()
        self.counted: set[bytes] = set()
        self.tier_counted: set[bytes] = set()
        self.skipped: set[bytes] = set()
        self.ghost_checked: set[bytes] = set()
        self.first_asked: bytes | None = None
        self.missed_at: set[bytes] = set()
        self.leased: set[bytes] = set()
        self.loading: dict[bytes, int] = {}
        self.writing: set[bytes] = set()
        self.stale_loads: dict[bytes, int] = {}
        self.stale_stores: dict[bytes, int] = {}
        self.owner: object | None = None
        self.epoch = -1
        self.lease_deadline = 0.0

    def set_position(self, key: bytes, end_token: int) -> None:
        """Record that ``key``'s block ends at token ``end_token`` of this request."""
        if type(key) is not bytes:
            raise TypeError(f"key must be bytes, not {type(key).__name__}")
        if isinstance(end_token, bool) or not isinstance(end_token, int) or end_token < 0:
            raise ValueError(f"end_token must be a non-negative int, got {end_token!r}")
        self.positions[key] = end_token

    def set_positions(self, keys: list[bytes], first_end: int, step: int) -> None:
        """Record positions ``first_end, first_end + step, ...`` for consecutive keys
        (``TypeError`` naming the first key that is not bytes; nothing is recorded then)."""
        if (isinstance(first_end, bool) or isinstance(step, bool)
                or not isinstance(first_end, int) or not isinstance(step, int)
                or step <= 0 or first_end < 0):
            raise ValueError(f"need int first_end >= 0 and step > 0, got {first_end!r}, "
                             f"{step!r}")
        keys = check_keys(keys)
        ends = range(first_end, first_end + step * len(keys), step)
        self.positions.update(zip(keys, ends, strict=True))

    def log_access(self, keys: list[bytes]) -> None:
        """Remember that the request used ``keys`` (a list the caller will not change)."""
        log = self.access_log
        log.append(keys)
        if len(log) > MAX_ACCESS_LISTS:
            merged = self.accessed_keys()
            log.clear()
            log.append(merged)

    def accessed_keys(self) -> list[bytes]:
        """Distinct keys of the access log, in first-seen order."""
        log = self.access_log
        if len(log) == 1:
            return list(dict.fromkeys(log[0]))
        return list(dict.fromkeys(itertools.chain.from_iterable(log)))

    def access_order(self) -> list[bytes]:
        """Every key the request used, head first (by position when all are
        known; in first-use order otherwise)."""
        keys = self.accessed_keys()
        positions = self.positions
        if positions and positions.keys() >= set(keys):
            keys.sort(key=positions.__getitem__)
        return keys

    def asked_from(self, keys: list[bytes]) -> int:
        """Index of the first of ``keys`` (an ``access_order``, head first) that
        the request asked the cache for: ``first_asked``, or failing that the
        first key at or past its position; 0 when it never looked up."""
        first = self.first_asked
        if first is None:
            return 0
        try:
            return keys.index(first)
        except ValueError:  # not held any more: place it by position
            pass
        positions = self.positions
        at = positions.get(first)
        if at is None:
            return 0
        for i, key in enumerate(keys):
            if positions.get(key, -1) >= at:
                return i
        return len(keys)

    def clear_request_state(self) -> None:
        """Forget everything but identity, owed completions and the epoch."""
        self.access_log.clear()
        self.inserted.clear()
        self.reused.clear()
        self.counted.clear()
        self.tier_counted.clear()
        self.skipped.clear()
        self.ghost_checked.clear()
        self.first_asked = None
        self.missed_at.clear()
        self.leased.clear()

    def __repr__(self) -> str:
        return (
            f"RequestContext({self.req_id!r}, accessed={len(self.accessed_keys())}, "
            f"leased={len(self.leased)}, loading={len(self.loading)}, "
            f"writing={len(self.writing)})"
        )
