"""PLFU: a prefix-aware frequency policy with a learned recency window
(the base of the default policy, ``adaptive``).

docs/policy.md has the design and the measurements behind it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import compress, islice
from operator import countOf, not_

from kvtier.policies.base import EvictionPolicy
from kvtier.policies.order import KeyOrder, take

_Queue = OrderedDict[bytes, None]

_COUNT_CAP = 16
_CLASSES = _COUNT_CAP.bit_length()
_CLASS_OF = tuple(max(0, n.bit_length() - 1) for n in range(_COUNT_CAP + 1))
"""Count class of counts 0..COUNT_CAP: log2(count) rounded down."""
_ABSENT = object()
_ONE = 1
"""Its bound methods compare (``__lt__``) and halve (``__rrshift__``) counts in ``map``."""


def _settle_aged(keys: list[bytes], before: list[int], counts: dict[bytes, int],
                 main: dict[bytes, int]) -> tuple[int, int]:
    """Write into ``counts`` what one halving leaves of each key of ``keys``
    (``before``: their counts before it, in the same order) that ``counts``
    has not got: half the count, or 1 for a key of ``main`` (a main key keeps
    a count), or nothing. Return how many of the counts before were above 1,
    and how many written counts are above 1.

    A key that ``counts`` has got was read or written since the aging started,
    so its entry there is already what the aging left (``PLFUPolicy._age``).
    No object is made per key (``compress`` and ``map`` over the two lists,
    set operations): a (key, count) tuple per entry, thousands a step, would
    set off garbage collections in the caller's process (a server's).
    """
    above = list(map(_ONE.__lt__, before))
    halves = dict(zip(compress(keys, above), map(_ONE.__rrshift__, compress(before, above)),
                      strict=True))
    n_above = len(halves)
    for key in halves.keys() & counts.keys():  # iterates the smaller of the two
        del halves[key]
    counts.update(halves)
    # most keys have a count of 1 and are dropped: only the main keys among them stay
    ones = main.keys() & compress(keys, map(not_, above))
    counts.update(dict.fromkeys(ones.difference(counts), 1))
    return n_above, len(halves) - countOf(halves.values(), 1)


class PLFUPolicy(EvictionPolicy):
    """A recency window for new blocks, frequency for proven ones; both balances learned.

    State, every part bounded by ``capacity`` times a constant:

    * ``history``: key -> number of requests that used it, for resident and
      recently seen keys, at most ``history_factor * capacity`` entries; when
      it grows past that, every count is halved and zeros are dropped (aging:
      at once for a history of up to ``AGE_AT_ONCE`` entries, over several
      calls for a larger one, see :meth:`_age`; the counts every call reads are the
      same either way);
    * the *window* ``R``: resident keys that one request only has used (new
      blocks, one-off prompts), least recent first;
    * the *main* segment ``F``: resident keys that two or more requests used,
      in two orders: least recent first, and by priority ``base + log2(count)``
      (LFU with dynamic aging: ``base`` rises to the priority of each block the
      frequency order evicts, so stale counts fade without a tuned period);
    * ghosts ``G1`` / ``G2``: recent victims of ``R`` / of ``F`` (``G2``
      remembers whether the recency or the frequency order chose them), each
      in two generations of ``3/4 capacity`` keys: a full generation becomes
      the old one and the old one is dropped, so each list reaches back
      between ``3/4`` and ``3/2 capacity`` victims;
    * two learned numbers: ``target``, the room ``R`` may keep, between
      ``MIN_WINDOW`` and ``MAX_WINDOW`` of the cache, starting at
      ``START_WINDOW`` (ARC's rule, with steps
      that grow with the cache past ``STEP_SCALE`` blocks: a block that comes
      back from ``G1`` raises it, one from ``G2`` lowers it); and
      ``lfu_share``, the share of ``F``'s victims chosen by frequency (a
      block that comes back from ``G2`` moves it away from the order that
      evicted it).

    New blocks enter ``R``, tail first. A block moves to ``F`` when a second
    request uses it: one that found it resident, or one that stored it again
    after an eviction (its history remembers the first use); or earlier, when a
    caller foresees that use (``enter_main``: the default policy's
    conversation turns). Victims come
    from ``R`` while it holds more than ``target``, then from ``F`` (least
    recent or least frequent, mixed by ``lfu_share``), then from whatever is
    left; so one-off blocks leave first and cannot flush proven ones. A
    block's count never exceeds its parent's (a request that uses a block
    uses its whole prefix) and ties go head-first, so eviction takes tails
    before heads and leaves no orphaned tails. No parameter depends on the
    trace.

    In recency mode (``recency``, which the default policy sets while its LRU
    shadow leads) the cache runs as LRU: a used block moves to the window's
    most recent end (a main block is demoted there), none is promoted, and
    victims come from the main segment first, least recent first, then from
    the window's oldest. The history still counts blocks that are not
    resident; a resident block's count restarts at 1.

    Memory: every new block enters the window, so it is the compact list (a
    :class:`~kvtier.policies.order.KeyOrder`, one dict entry per key), and a
    window key that one request used has a count of 1 that is implied, not
    stored (``_counts`` holds the other counts, ``_fresh`` the window keys no
    request has used since they were stored); a main key costs an entry in
    ``_recent`` (with its priority, an int) and in its class queue (ordered
    dicts) and its count; every key in ``history`` or a ghost list keeps its
    key object alive. While a history is aged in steps, the counts before the
    aging (``history_aging`` in ``sizes()``, at most the history's bound) are
    held as well, until its last step.
    """

    name = "plfu"
    wants_reuse = False  # a reuse shows in the history: a second request's count
    wants_store_misses = False  # ghosts are looked up on insert
    wants_running_order = True
    reads_key_bytes = True  # a tie of priority goes to the lower key bytes

    COUNT_CAP = _COUNT_CAP
    """Counts above this add no priority (five classes: 1, 2-3, 4-7, 8-15, 16+)."""
    LEARNING_RATE = 0.02
    """Step of ``lfu_share`` for each main-segment ghost that comes back."""
    STEP_SCALE = 8192
    """ARC moves ``target`` one block per ghost hit; caches larger than this move
    ``capacity / STEP_SCALE`` blocks, so they adapt in as few hits as this size."""
    MIN_WINDOW = 1 / 16
    """The window may always keep this share of the cache."""
    MAX_WINDOW = 1 / 2
    """...and never more than this: blocks one request used never outnumber
    proven ones. Without the bound, on traffic whose popularity drifts
    (``kvtier generate drift``) ARC's rule gave the window up to 88 % of a
    1,000-block cache, and PLFU lost up to 4 % of LRU's hits (the default up
    to 7 %); with it both stay above LRU there (docs/policy.md, "Popularity
    drift")."""
    START_WINDOW = MIN_WINDOW
    """Share of the cache ``target`` starts at (and returns to at ``clear``)."""
    AGE_AT_ONCE = 65536
    """A history of up to this many entries is aged in one call (a few ms:
    about what growing the history's dict to that size takes in one call
    anyway)..."""
    AGE_STEP = 4096
    """...a larger one over several calls, this many entries a call (more for
    a request of many keys), while every call reads the counts that aging at
    once would have left. Aged at once, a 131,072-block cache's history held
    the scheduler for 100 ms (docs/policy.md, "Aging in steps")."""
    MIN_SHARE = 0.02
    """``lfu_share`` stays in [MIN_SHARE, 1 - MIN_SHARE], so both orders keep learning."""

    def __init__(self, capacity: int, history_factor: int = 8,
                 age_in_steps: bool = True) -> None:
        super().__init__(capacity)
        if (isinstance(history_factor, bool) or not isinstance(history_factor, int)
                or history_factor < 2):
            raise ValueError(f"history_factor must be an int >= 2, got {history_factor!r}")
        if not isinstance(age_in_steps, bool):
            raise ValueError(f"age_in_steps must be True or False, got {age_in_steps!r}")
        self.history_limit = history_factor * capacity
        self.age_in_steps = age_in_steps
        self._generation = max(1, 3 * capacity // 4)
        self._min_target = capacity * self.MIN_WINDOW
        self._max_target = capacity * self.MAX_WINDOW
        self._step = max(1.0, capacity / self.STEP_SCALE)
        self._init_state()

    def _init_state(self) -> None:
        # The history is _counts plus an implied count of 1 for each window key
        # not in _fresh (one request used it); _fresh: window keys no request
        # has used since they were stored (their count, if any, is in _counts).
        self._counts: dict[bytes, int] = {}
        self._fresh: set[bytes] = set()
        self._multi = 0  # at least the number of _counts entries above 1
        # An aging in steps (_age): the counts before it, read AGE_STEP a call
        # into _counts through two iterators in step (its keys, its counts),
        # how many are left to read, and at least how many of those are above 1.
        self._aging: dict[bytes, int] = {}
        self._aging_keys: Iterator[bytes] = iter(())
        self._aging_counts: Iterator[int] = iter(())
        self._aging_left = 0
        self._aging_multi = 0
        self._window = KeyOrder()
        # F, least recent first -> base when last used << 3 | c (see _classes)
        self._recent: OrderedDict[bytes, int] = OrderedDict()
        # F by count class c = log2(min(count, COUNT_CAP)), each least recent first;
        # a key's priority is (base when last used) + c + 1, so the head of each
        # class has that class's lowest priority
        self._classes: list[_Queue] = [OrderedDict() for _ in range(_CLASSES)]
        self._base = 0
        self._g1: dict[bytes, None] = {}  # G1, current generation
        self._g1_old: dict[bytes, None] = {}
        self._g2: dict[bytes, bool] = {}  # G2 -> chosen by the frequency order
        self._g2_old: dict[bytes, bool] = {}
        self.target = self.capacity * self.START_WINDOW
        self.lfu_share = 0.5
        self._carry = 0.0
        self.recency = False

    # -- introspection -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._window) + len(self._recent)

    @property
    def history(self) -> dict[bytes, int]:
        """Key -> number of requests that used it (a copy, built on each call)."""
        history = dict(self._counts)
        _settle_aged(list(self._aging), list(self._aging.values()), history, self._recent)
        fresh = self._fresh
        for key in self._window:
            if key not in fresh:
                history[key] = 1
        return history

    def _history_size(self) -> int:
        """``len(self.history)``, without building it; while an aging is in
        progress, at least that (:meth:`_aging_bound`)."""
        size = len(self._counts) + len(self._window) - len(self._fresh)
        return size + self._aging_bound() if self._aging else size

    def _aging_bound(self) -> int:
        """At most how many entries the rest of the aging in progress adds to
        the history: its counts above 1, and the main keys it keeps at 1."""
        return self._aging_multi + len(self._recent)

    def sizes(self) -> dict[str, int]:
        """Entries of each structure (for tests and diagnostics)."""
        return {
            "window": len(self._window),
            "main": len(self._recent),
            "history": self._history_size(),
            "history_aging": self._aging_left,
            "ghost_window": len(self._g1) + len(self._g1_old),
            "ghost_main": len(self._g2) + len(self._g2_old),
        }

    def size_bounds(self, batch: int) -> dict[str, int]:
        """Upper bound of each ``sizes()`` entry while no request offers or
        uses more than ``batch`` keys (what the class docstring promises)."""
        ghosts = 2 * self._generation + batch  # two generations, each one batch over
        return {"window": self.capacity, "main": self.capacity,
                "history": self.history_limit + batch,
                "history_aging": self.history_limit + batch,
                "ghost_window": ghosts, "ghost_main": ghosts}

    def is_resident(self, key: bytes) -> bool:
        """Whether ``key`` is resident (in either segment)."""
        return key in self._recent or key in self._window

    def segment(self, key: bytes) -> str | None:
        """``"window"``, ``"main"`` or None (not resident)."""
        if key in self._window:
            return "window"
        return "main" if key in self._recent else None

    # -- the contract --------------------------------------------------------

    def insert(self, keys: list[bytes]) -> None:
        # Every new block starts in the window, tail first so that its head is the
        # most recent; the request's access (``on_access``) moves a block that an
        # earlier request used to the main segment.
        self._fresh.update(keys)
        self._window.add_many(reversed(keys))

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        # the window's part of a running request stays ahead of its newer blocks;
        # main keys keep their rank (frequency protects them)
        self._window.keep_run_ahead(run, keys, start, new)

    def end_run(self, run: object) -> None:
        self._window.end_run(run)

    def _from_ghost(self, key: bytes) -> None:
        """A block came back: adapt ``target`` (and ``lfu_share``) if it was a ghost.

        A ghost of the window was used by one request; a ghost of the main
        segment by more. (Runs for every ghost that comes back, so it avoids
        the ``min`` / ``max`` builtins: a conditional costs less than a call.)
        """
        g1, g1_old, g2, g2_old = self._g1, self._g1_old, self._g2, self._g2_old
        if g1.pop(key, _ABSENT) is _ABSENT and g1_old.pop(key, _ABSENT) is _ABSENT:
            by_lfu = g2.pop(key, None)
            if by_lfu is None:
                by_lfu = g2_old.pop(key, None)
                if by_lfu is None:
                    return
            ratio = (len(g1) + len(g1_old)) / ((len(g2) + len(g2_old)) or 1)
            target = self.target - (ratio if ratio > 1.0 else 1.0) * self._step
            self.target = target if target > self._min_target else self._min_target
            share, rate = self.lfu_share, self.LEARNING_RATE
            share = share - rate * share if by_lfu else share + rate * (1.0 - share)
            low, high = self.MIN_SHARE, 1.0 - self.MIN_SHARE
            self.lfu_share = low if share < low else high if share > high else share
            return
        ratio = (len(g2) + len(g2_old)) / ((len(g1) + len(g1_old)) or 1)
        target = self.target + (ratio if ratio > 1.0 else 1.0) * self._step
        self.target = target if target < self._max_target else self._max_target

    def remove(self, key: bytes) -> None:
        if self._window.discard(key):
            self._left_window([key])
        elif key in self._recent:
            if self._aging:  # a main key's count of 1 is kept only while it is main
                self._age_keys((key,))
            self._drop_main(key)

    def _left_window(self, keys: list[bytes]) -> None:
        """Keys that left the window: an implied count of 1 becomes a stored one."""
        fresh, counts = self._fresh, self._counts
        if not fresh:
            for key in keys:
                counts[key] = 1
            return
        for key in keys:
            if key in fresh:
                fresh.discard(key)
            else:
                counts[key] = 1

    def _drop_main(self, key: bytes) -> int:
        """Forget a main key; return its priority."""
        meta = self._recent.pop(key)
        c = meta & 7
        del self._classes[c][key]
        return (meta >> 3) + c + 1

    def first_unseen(self, keys: Sequence[bytes]) -> int:
        """Where the suffix of ``keys`` that the history has never seen starts
        (``len(keys)`` when it knows the last key). Call it before the request's
        ``on_access``, which records its keys.

        A request uses a block's whole prefix, and no count exceeds its
        parent's, so the keys the history knows are a prefix of a request's
        keys: bisection finds the boundary in ``log2(len(keys))`` lookups,
        where a scan would look up every unseen key (most of an offer when
        admission declines it). Should the known keys not be a prefix, it
        returns one index where a known key is followed by an unseen one.
        """
        if self._aging:
            self._age_keys(keys)
        return self._first_unseen(keys)

    def _first_unseen(self, keys: Sequence[bytes]) -> int:
        """:meth:`first_unseen` once ``keys`` are out of any aging in progress."""
        counts, fresh, window = self._counts, self._fresh, self._window
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            key = keys[mid]
            # known: a stored count, or a window key one request used (implied 1)
            if key in counts or (key not in fresh and key in window):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def enter_main(self, keys: Sequence[bytes]) -> None:
        """Move the window keys among ``keys`` to the main segment with a count
        of 1, head last (its most recent), so that they outlive the window.
        For blocks one request used whose next use is foreseen (a conversation's
        new turn: ``kvtier.policies.turns``); call it after that request's
        ``on_access``."""
        moved = self._window.discard_many(list(keys))
        if not moved:
            return
        fresh, counts, recent = self._fresh, self._counts, self._recent
        first_class, base = self._classes[0], self._base << 3
        for key in reversed(moved):
            fresh.discard(key)
            counts[key] = 1
            first_class[key] = None
            recent[key] = base

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        self._apply(keys, self._access_starts(keys))

    def _apply(self, keys: Sequence[bytes], first_new: int) -> None:
        """Apply an access of ``keys`` in the cache's mode (``recency`` or not),
        ``first_new`` being what ``_access_starts(keys)`` returned."""
        if self.recency:
            self._apply_recency(keys)
        else:
            self._apply_access(keys, first_new)

    def _access_starts(self, keys: Sequence[bytes]) -> int:
        """What an access of ``keys`` needs first: their counts out of any aging
        in progress, and ``first_unseen(keys)`` (``len(keys)`` when no window
        key is fresh: only those can move, so the search is skipped)."""
        if self._aging:
            self._age_keys(keys)
        return self._first_unseen(keys) if self._fresh else len(keys)

    def _apply_access(self, keys: Sequence[bytes], first_new: int) -> None:
        """``on_access`` of ``keys`` (distinct, as the manager's access order is),
        given ``first_new = first_unseen(keys)`` found before any of it was applied
        (and, while an aging is in progress, ``_age_keys(keys)`` before both).

        The request's own new blocks, the unseen suffix that it stored, are
        most of the keys of most accesses (on the bundled trace at 16,000
        blocks); all their first use does is leave ``_fresh``,
        so they are applied as one set operation, and the loop takes the rest.
        """
        if first_new < len(keys):
            suffix = keys[first_new:]
            if self._counts.keys().isdisjoint(suffix) and self._fresh.issuperset(suffix):
                self._fresh.difference_update(suffix)  # the loop's first branch, at C speed
                keys = keys[:first_new]
        counts, fresh, window, recent = self._counts, self._fresh, self._window, self._recent
        classes, class_of = self._classes, _CLASS_OF
        get, rmove, mget = counts.get, recent.move_to_end, recent.get
        used = fresh.discard
        g1, g1_old, g2, g2_old = self._g1, self._g1_old, self._g2, self._g2_old
        base, cap, top = self._base << 3, _COUNT_CAP, _CLASSES - 1
        multi = 0  # counts that reach 2 (self._multi)
        promoted: list[bytes] = []  # leave the window once the loop is done
        for key in reversed(keys):  # tail first: the head ends most recent
            if key in fresh:  # the first request that uses it since it was stored
                used(key)
                if key not in counts:
                    continue  # a new block: stays in the window, its count of 1 implied
                count = counts[key] + 1
            else:
                meta = mget(key)
                if meta is not None:  # a main key
                    count = get(key, 0) + 1
                    counts[key] = count
                    if count == 2:
                        multi += 1
                    rmove(key)
                    c = class_of[count] if count < cap else top
                    old = meta & 7
                    new = base | c
                    if c == old:
                        classes[c].move_to_end(key)
                        if meta != new:
                            recent[key] = new
                    else:
                        del classes[old][key]
                        classes[c][key] = None
                        recent[key] = new
                    continue
                count = get(key, 0) + 1
                if count > 1 or key not in window:
                    counts[key] = count  # not resident (a window key's count of 1
                    if count == 2:  # is implied, never stored)
                        multi += 1
                    continue
                count = 2  # a window key one request used before
            # a second request uses a window key: to the main segment
            counts[key] = count
            if count == 2:
                multi += 1
            promoted.append(key)
            if key in g1 or key in g1_old or key in g2 or key in g2_old:
                self._from_ghost(key)
            c = class_of[count] if count < cap else top
            classes[c][key] = None
            recent[key] = base | c
        self._multi += multi
        if promoted:
            window.discard_many(promoted)
        self._check_history(len(keys))

    def _apply_recency(self, keys: Sequence[bytes]) -> None:
        """``on_access`` in recency mode (``recency``), once ``_access_starts(keys)``
        has run: the resident keys move to the window's most recent end, tail
        first, as LRU moves them; a main key used now leaves the main segment
        for the window (demoted), and no key is promoted.

        Each resident key the access leaves in the window has the implied
        count of 1 of a window key one request used (a stored count it had
        is dropped), so that PLFU's rules hold when the mode ends: a block
        proven before it earns the main segment again at its next use. Keys
        not resident are counted in the history as in PLFU.
        """
        counts, window, recent = self._counts, self._window, self._recent
        if recent:
            demoted = [key for key in keys if key in recent]
            for key in demoted:
                self._drop_main(key)
            window.add_many(demoted)
        held = window.present(keys)  # set operations: at C speed, as LRU's access
        self._fresh.difference_update(held)
        for key in counts.keys() & held:  # a fresh key stored again, or a demoted one
            self._forget_count(key)
        if len(held) < len(keys):
            get, multi = counts.get, 0  # multi: counts that reach 2 (self._multi)
            for key in keys:
                if key not in held:
                    count = counts[key] = get(key, 0) + 1
                    if count == 2:
                        multi += 1
            self._multi += multi
        window.move_present(reversed(keys))
        self._check_history(len(keys))

    def _forget_count(self, key: bytes) -> None:
        """Drop ``key``'s stored count, also the one an aging in progress would
        still move to it (the aging's entries are read, never deleted: a count
        of 0 leaves nothing)."""
        self._counts.pop(key, None)
        aging = self._aging
        if aging and key in aging:
            aging[key] = 0

    def _check_history(self, n_keys: int) -> None:
        """After an access of ``n_keys`` keys: move the next step of an aging in
        progress, and age the history if it passed its limit."""
        size = self._history_size()
        if self._aging:
            self._age_some(self.AGE_STEP + 4 * n_keys)
            size = self._history_size()
        if size > self.history_limit:
            self._age()

    def _evict_recency(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        """``evict`` in recency mode: the main segment's keys first, least
        recent first (none was used since the mode began, or it would have
        left it), then the window's oldest; atomic like ``evict``."""
        if n > len(self):
            return None
        by_lru = self._take(iter(self._recent), n, protected, ()) if self._recent else []
        from_window: list[bytes] = []
        if len(by_lru) < n:
            taken = self._window.take_oldest(n - len(by_lru), self.blocked, protected)
            if taken is None:
                return None
            from_window = taken
            self._left_window(from_window)
        self._retire(from_window, [], by_lru)
        return by_lru + from_window

    def _age(self) -> None:
        """Halve every count, dropping zeros, until the history is half its limit.

        Resident keys that a request used keep a count of at least 1, so
        their next use still counts as a second one (``on_access`` relies on
        it). A fresh key (stored by a request still running, so that no
        request has used it yet) keeps a count only if it had one: giving it
        one would make its own request's use count as a second, and move a
        block one request used into the main segment.

        A history of more than ``AGE_AT_ONCE`` entries that one halving brings
        to half its limit is aged in steps (:meth:`_age_in_steps`), others at once.
        """
        self._finish_aging()
        if self._history_size() <= self.history_limit:
            return
        if (self.age_in_steps and len(self._counts) > self.AGE_AT_ONCE
                and self._multi <= self.history_limit // 2):
            self._age_in_steps()
        else:
            self._age_at_once()

    def _age_at_once(self) -> None:
        """:meth:`_age` in one call."""
        before = counts = self._counts
        size = self._history_size()
        while size > self.history_limit // 2:
            # the implied counts of 1 drop out like any other count of 1
            counts = {k: c >> 1 for k, c in counts.items() if c > 1}
            size = len(counts)
        keep = counts.setdefault
        for key in self._fresh:  # other window keys keep their implied 1
            if key in before:
                keep(key, 1)
        for key in self._recent:
            keep(key, 1)
        self._counts = counts
        self._multi = sum(1 for c in counts.values() if c > 1)

    def _age_in_steps(self) -> None:
        """Start :meth:`_age` as one halving (``_multi``: it leaves at most
        half the limit) whose entries move to a new ``_counts`` later.

        The old counts go to ``_aging``; the fresh keys' kept counts are written
        now (the running requests' blocks, few). A later call moves a key's
        count before it reads it (:meth:`_age_keys`), and before a main key
        leaves the main segment; ``_age_some`` moves the rest, a step
        a call. A count of 1 is kept for a main key that was in the main
        segment when the aging started: one that entered it since was used, so
        it has its entry in ``_counts`` already.
        """
        old, counts = self._counts, {}
        for key in self._fresh:
            c = old.get(key)
            if c is not None:
                counts[key] = c >> 1 if c > 1 else 1
        self._counts, self._aging = counts, old
        self._aging_keys, self._aging_counts = iter(old), iter(old.values())
        self._aging_left = len(old)
        self._aging_multi, self._multi = self._multi, sum(1 for c in counts.values() if c > 1)

    def _age_keys(self, keys: Iterable[bytes]) -> None:
        """Move the counts of ``keys`` out of the aging in progress."""
        old = self._aging
        found = list(filter(old.__contains__, keys))
        before = list(map(old.__getitem__, found))
        self._multi += _settle_aged(found, before, self._counts, self._recent)[1]

    def _age_some(self, n: int) -> None:
        """Move ``n`` more counts out of the aging in progress (all when ``n``
        is at least what is left); forget the aging once none is left.

        ``_aging`` is read through two iterators (its keys, its counts) and
        never changed, so that a step takes its entries at C speed and makes
        no object per entry; it is let go, its keys with it, at the end.
        """
        keys = list(islice(self._aging_keys, n))
        before = list(islice(self._aging_counts, n))
        above, multi = _settle_aged(keys, before, self._counts, self._recent)
        self._multi += multi
        self._aging_multi -= above
        self._aging_left -= len(keys)
        if self._aging_left <= 0:
            self._aging, self._aging_keys, self._aging_counts = {}, iter(()), iter(())
            self._aging_left = self._aging_multi = 0

    def _finish_aging(self) -> None:
        """Complete the aging in progress, if any."""
        if self._aging:
            self._age_some(self._aging_left)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        if self.recency:
            return self._evict_recency(n, protected)
        window = self._window
        if len(window) - self.target >= n:  # the common case: the window alone pays
            out = window.take_oldest(n, self.blocked, protected)
            if out is not None:
                g1 = self._g1
                if self._fresh:
                    self._left_window(out)
                    for key in out:
                        g1[key] = None
                else:  # _left_window, inline: each count of 1 is stored now
                    counts = self._counts
                    for key in out:
                        g1[key] = None
                        counts[key] = 1
                if len(g1) >= self._generation:
                    self._g1_old, self._g1 = g1, {}
                return out
        if n > len(self):
            return None
        return self._evict_mixed(n, protected)

    def _evict_mixed(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        """``evict`` when the main segment must pay some of the ``n`` victims."""
        window_iter = iter(self._window)
        spare = math.ceil(len(self._window) - self.target)
        from_window = self._take(window_iter, n if n < spare else spare, protected, ())
        need = n - len(from_window)
        by_lfu: list[bytes] = []
        by_lru: list[bytes] = []
        carry = self._carry
        if need:
            share = need * self.lfu_share + carry
            n_lfu = int(share)
            carry = share - n_lfu
            by_lfu = self._take_lfu(n_lfu, protected, ())
            taken: Container[bytes] = set(by_lfu) if by_lfu else ()
            by_lru = self._take(iter(self._recent), need - len(by_lfu), protected, taken)
            if len(by_lfu) + len(by_lru) < need:  # short of evictable main keys
                taken = set(by_lfu).union(by_lru)
                by_lfu += self._take_lfu(need - len(by_lfu) - len(by_lru), protected, taken)
        short = n - len(from_window) - len(by_lfu) - len(by_lru)
        if short:
            from_window += self._take(window_iter, short, protected, ())
            if len(from_window) < n - len(by_lfu) - len(by_lru):
                return None
        self._carry = carry
        if from_window:
            self._window.evicted(from_window, self.blocked, protected)
            self._left_window(from_window)
        self._retire(from_window, by_lfu, by_lru)
        return from_window + by_lfu + by_lru

    def _take(self, keys: Iterator[bytes], k: int, protected: Container[bytes],
              taken: Container[bytes]) -> list[bytes]:
        """The next ``k`` evictable keys of ``keys`` not in ``taken`` (fewer if it runs out)."""
        if taken:
            return take(keys, k, self.blocked, protected, taken)
        return take(keys, k, self.blocked, protected)

    def _take_lfu(self, k: int, protected: Container[bytes],
                  taken: Container[bytes]) -> list[bytes]:
        """The ``k`` evictable main keys of lowest priority.

        Each class is in priority order already, so this merges the class queues:
        it takes from the best class while it stays ahead of the runner-up
        (lower class first on ties). Among the class heads, a tie of priority
        goes to the lower key bytes, a hash: in effect a random pick. Lower
        class first there too (tails before heads) was measured worse: on
        generated chat (seed 1) behind a 500-block engine cache, 0.6332
        against 0.6447 at 4,000 blocks (LRU 0.6480), the same elsewhere.
        """
        out: list[bytes] = []
        if k <= 0:
            return out
        recent, blocked = self._recent, self.blocked
        iters = [iter(keys) for keys in self._classes]
        heads: dict[int, tuple[int, bytes]] = {}
        for c, it in enumerate(iters):
            for key in it:
                if key not in blocked and key not in protected and key not in taken:
                    heads[c] = ((recent[key] >> 3) + c, key)
                    break
        while heads:
            # the head of least (priority, key), then the runner-up's (priority,
            # class): loops over at most five heads, cheaper than min() calls
            best, least = -1, None
            for c, head in heads.items():
                if least is None or head < least:
                    best, least = c, head
            key = heads.pop(best)[1]
            limit = (1 << 62, 0)  # above any priority: no runner-up
            for c, (p, _) in heads.items():
                if (p, c) < limit:
                    limit = (p, c)
            out.append(key)
            if len(out) == k:
                break
            for key in iters[best]:
                if key in blocked or key in protected or key in taken:
                    continue
                prio = (recent[key] >> 3) + best
                if (prio, best) > limit or len(out) == k:
                    heads[best] = (prio, key)
                    break
                out.append(key)
            if len(out) == k:
                break
        return out

    def _retire(self, from_window: list[bytes], by_lfu: list[bytes],
                by_lru: list[bytes]) -> None:
        """Remove the victims (the window's are removed already) and remember
        them as ghosts."""
        if self._aging:  # a main key's count of 1 is kept only while it is main
            self._age_keys(by_lfu)
            self._age_keys(by_lru)
        g1, g2 = self._g1, self._g2
        classes, recent = self._classes, self._recent
        for key in from_window:
            g1[key] = None
        base = self._base
        for key in by_lfu:
            meta = recent.pop(key)
            c = meta & 7
            del classes[c][key]
            prio = (meta >> 3) + c + 1
            if prio > base:
                base = prio
            g2[key] = True
        self._base = base
        for key in by_lru:
            del classes[recent.pop(key) & 7][key]
            g2[key] = False
        if len(g1) >= self._generation:
            self._g1_old, self._g1 = g1, {}
        if len(g2) >= self._generation:
            self._g2_old, self._g2 = g2, {}

    def clear(self) -> None:
        self._init_state()
        self.blocked.clear()
