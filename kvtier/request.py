"""Per-request state carried between the caller and the manager."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

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
      before current ones (completions of one key arrive in order);
    * the access order kept up to date (``access_order_view``): the access
      log's distinct keys in first-seen order and, once every one has a
      position, in position order, extended by each call with the keys logged
      since the one before (at most four references per distinct key); and
      what ``running_order`` returned last (that list, its length, its edit
      count), so that the policy is handed only the keys logged since.

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
        "_order_lists",
        "_order_positions",
        "_order_seen",
        "_order_first",
        "_order_unplaced",
        "_order_sorted",
        "_order_edits",
        "_run_view",
        "_run_edits",
        "_run_seen",
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
        self._order_lists: list[list[bytes]] = []
        """The access log's lists the order below was built from (at most
        ``MAX_ACCESS_LISTS + 1``: the log's own bound)."""
        self._order_positions: dict[bytes, int] | None = None
        """The ``positions`` dict it was built with (rebinding it rebuilds)."""
        self._order_seen: set[bytes] = set()
        self._order_first: list[bytes] = []
        """The distinct keys of those lists, in first-seen order."""
        self._order_unplaced: set[bytes] = set()
        """Keys of ``_order_first`` that had no position when last looked at."""
        self._order_sorted: list[bytes] | None = None
        """The first ``len(_order_sorted)`` keys of ``_order_first`` by position
        (ties in first-seen order), as of the last call when all had one; None
        before, or since a position changed."""
        self._order_edits = 0
        """Changes of the access order other than growth at its end (a rebuild,
        a sort that placed keys among earlier ones)."""
        self._run_view: Sequence[bytes] | None = None
        self._run_edits = 0
        self._run_seen = 0
        """The order ``running_order`` returned last, its edit count then and its length."""

    def set_position(self, key: bytes, end_token: int) -> None:
        """Record that ``key``'s block ends at token ``end_token`` of this request."""
        if type(key) is not bytes:
            raise TypeError(f"key must be bytes, not {type(key).__name__}")
        if isinstance(end_token, bool) or not isinstance(end_token, int) or end_token < 0:
            raise ValueError(f"end_token must be a non-negative int, got {end_token!r}")
        positions = self.positions
        if positions.get(key, end_token) != end_token:
            self._order_sorted = None  # a key's place may move: sort again
        positions[key] = end_token

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
        positions = self.positions
        if self._order_sorted is not None and positions and any(
                map(operator.ne, map(positions.get, keys, ends), ends)):
            self._order_sorted = None  # a key's place may move: sort again
        positions.update(zip(keys, ends, strict=True))

    def log_access(self, keys: list[bytes]) -> None:
        """Remember that the request used ``keys`` (a list the caller will not change)."""
        log = self.access_log
        log.append(keys)
        if len(log) > MAX_ACCESS_LISTS:
            self._update_first_seen()
            merged = self._order_first.copy()  # the same keys: the order stands
            log.clear()
            log.append(merged)
            self._order_lists = [merged]

    def accessed_keys(self) -> list[bytes]:
        """Distinct keys of the access log, in first-seen order."""
        log = self.access_log
        if len(log) == 1:
            return list(dict.fromkeys(log[0]))
        return list(dict.fromkeys(itertools.chain.from_iterable(log)))

    def access_order(self) -> list[bytes]:
        """Every key the request used, head first (by position when all are
        known; in first-use order otherwise). A new list."""
        return list(self.access_order_view())

    def access_order_view(self) -> Sequence[bytes]:
        """``access_order()`` without the copy: the context's own list, valid
        until its next call; the caller must not change it.

        Kept up to date rather than rebuilt: a call costs O(keys logged since
        the call before) in the common case of keys placed past all earlier
        ones (chunked prefill); keys placed among earlier ones cost a merge,
        O(keys); a first call, a rebound ``positions`` dict, an access log
        changed other than by ``log_access``, or a position changed through
        ``set_position(s)`` cost a rebuild. Exact as long as a key's position,
        once set, is neither changed other than through ``set_position(s)``
        nor removed from ``positions`` (vLLM's scheduler sets each key's end
        token once, from its block index).
        """
        self._update_first_seen()
        if not self._all_placed():
            return self._order_first
        return self._sorted_order()

    def running_order(self) -> tuple[Sequence[bytes], int]:
        """``access_order_view()`` and how many of its leading keys are those the
        previous call returned, unchanged: 0 at the first call, or when the
        order changed other than by growing at its end. So that the policy
        keeps a running request's blocks ahead in O(keys logged since)."""
        view = self.access_order_view()
        start = self._run_seen
        if (view is not self._run_view or self._order_edits != self._run_edits
                or start > len(view)):
            start = 0
        self._run_view, self._run_edits, self._run_seen = view, self._order_edits, len(view)
        return view, start

    def _update_first_seen(self) -> None:
        """Bring the first-seen keys up to date with the access log: add the
        keys of lists logged since, or start over when the log or the
        positions dict is not the one they were built from (O(log lists))."""
        log, positions = self.access_log, self.positions
        built = self._order_lists
        if (positions is not self._order_positions or len(log) < len(built)
                or not all(map(operator.is_, log, built))):
            self._forget_order()
            self._order_positions = positions
            new = self.accessed_keys() if log else []
        elif len(log) > len(built):
            more = log[len(built):]
            seen = self._order_seen
            new = [k for k in dict.fromkeys(itertools.chain.from_iterable(more))
                   if k not in seen]
        else:
            return
        self._order_lists = list(log)
        if new:
            self._order_seen.update(new)
            self._order_first.extend(new)
            self._order_unplaced.update(k for k in new if k not in positions)

    def _forget_order(self) -> None:
        self._order_edits += 1
        self._order_lists = []
        self._order_positions = None
        self._order_seen = set()
        self._order_first = []
        self._order_unplaced = set()
        self._order_sorted = None

    def _all_placed(self) -> bool:
        """Whether every first-seen key has a position. Drops the keys that got
        one since (positions are only added) and stops at the first still
        missing: O(1 + keys placed since) a call."""
        unplaced = self._order_unplaced
        if unplaced:
            positions = self.positions
            placed = []
            for key in unplaced:
                if key not in positions:
                    break
                placed.append(key)
            unplaced.difference_update(placed)
        return not unplaced

    def _sorted_order(self) -> list[bytes]:
        """The first-seen keys (all placed) by position, ties in first-seen
        order. ``_order_sorted`` holds the first ``len(_order_sorted)`` of them
        sorted; the rest are new since."""
        by_position = self.positions.__getitem__
        order = self._order_sorted
        if order is None:  # the first sort, or a position changed
            self._order_edits += 1
            order = self._order_sorted = sorted(self._order_first, key=by_position)
            return order
        if len(order) < len(self._order_first):
            new = sorted(self._order_first[len(order):], key=by_position)  # stable
            tail_before = by_position(order[-1]) if order else None
            order.extend(new)
            if tail_before is not None and by_position(new[0]) < tail_before:
                # placed among earlier keys: a stable sort merges the two sorted
                # runs, earlier keys first on ties (as first seen)
                order.sort(key=by_position)
                self._order_edits += 1
        return order

    def asked_from(self, keys: list[bytes]) -> int:
        """Index of the first of ``keys`` (an ``access_order``, head first) that
        the request asked the cache for: ``first_asked``, or failing that the
        first key at or past its position; ``len(keys)`` when it never looked
        up (a request the engine's cache served whole asked this cache for
        nothing: its keys reached it only as offers)."""
        first = self.first_asked
        if first is None:
            return len(keys)
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
        self._forget_order()
        self.inserted.clear()
        self.reused.clear()
        self.counted.clear()
        self.tier_counted.clear()
        self.skipped.clear()
        self.ghost_checked.clear()
        self.first_asked = None
        self.missed_at.clear()
        self.leased.clear()
        self._run_view = None
        self._run_seen = 0

    def __repr__(self) -> str:
        return (
            f"RequestContext({self.req_id!r}, accessed={len(self.accessed_keys())}, "
            f"leased={len(self.leased)}, loading={len(self.loading)}, "
            f"writing={len(self.writing)})"
        )
